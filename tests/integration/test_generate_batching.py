"""Generate calls sharing decoding passes (issue #11, docs/batching.md): concurrent calls
on the demo tiny-lm over a real server and the SDK, against in-process oracles on the
same seeded weights.

Two oracles:

- *alone*: transformers' own ``generate()`` for each call by itself (lm_oracle). A joined
  step reorders float reductions, so tokens equal it only where the greedy choice is not
  a near tie: see MARGIN_BOUND.
- *batched*: transformers' own ``generate()`` of the prompts of calls that arrived
  together, as one batch: the server runs their prompt pass as one (padded on the left as
  generate() pads a batch) and keeps their KV caches in one decoding batch
  (engine/decode_batch.py), where a call that leaves frees its rows without moving the
  others'. Tokens and captures of those calls must ``torch.equal`` their rows of it, also
  while others leave and a late call takes a freed row.

Batches are formed with the scheduler's ``hold()``/``release()``, never by timing. The
test server's model records which calls' steps each ``run_step_batch`` ran, in row order
(``Passes``): a shared prompt pass's rows follow the order the calls reached the queue,
which the tests make one at a time.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Callable, Iterator

import pytest
import torch

import hookwire
import lm_oracle as oracle
from hookwire import rules
from hookwire_server import build_registry
from hookwire_server import demo_configs
from hookwire_server.engine import decoding
from support import ServerThread, assert_same, until

MARGIN_BOUND = 1e-5
"""The smallest top-2 logit margin (of the alone run, at a step) at which a batched greedy
call must choose the alone run's token. A joined step sums in another order than a step
alone: measured on tiny-lm (logits of magnitude ~0.5), batched and alone logits differ by
at most 2.4e-7 (a few float32 ulps). A different choice needs the top two logits to move
past each other, i.e. the margin to be under twice that; 1e-5 leaves a factor 20. Where
the alone run's margin at a step is below it, only the steps before are compared."""

#: A liveness bound for waits that end on a condition, never a speed test.
EOS, PAD = oracle.EOS, oracle.PAD
MODEL = "tiny-lm"


# --------------------------------------------------------------------------- the test server


@dataclasses.dataclass(frozen=True)
class Run:
    """One ``run_step_batch`` of the test server: one pass (or a shared pass that failed,
    and its calls' steps run again alone)."""

    #: Its calls' (request_id, step), in row order.
    calls: tuple[tuple[str, int], ...]
    #: Whether several calls shared one pass (none of them ran again alone).
    shared: bool
    #: The exceptions it returned for its calls (their names).
    errors: tuple[str, ...]

    @property
    def ids(self) -> set[str]:
        return {rid for rid, _ in self.calls}


class Passes:
    """What the test server's model ran: ``runs``, in order. ``observed`` counts the
    scheduler's passes (of any kind) that ended; while ``stepping``, the scheduler is held
    after each of them, so that the test releases every pass itself."""

    def __init__(self) -> None:
        self.runs: list[Run] = []
        self.observed = 0
        self.stepping = False
        self._alone = 0

    def reset(self) -> None:
        self.runs.clear()

    def wrap_batch(self, original: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
        def run_step_batch(host: Any, calls: list[Any]) -> list[Any]:
            alone_before = self._alone
            steps = tuple((c.p.request_id, c.step) for c in calls)  # before: a step run counts on
            results = original(host, calls)
            self.runs.append(Run(
                steps, len(calls) > 1 and self._alone == alone_before,
                tuple(type(r).__name__ for r in results if isinstance(r, BaseException)),
            ))
            return results

        return run_step_batch

    def wrap_alone(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def run_step(host: Any, call: Any) -> Any:
            self._alone += 1
            return original(host, call)

        return run_step

    def wrap_observe(self, original: Callable[..., None], scheduler: Any) -> Callable[..., None]:
        def observe(*args: Any) -> None:  # on the server's loop, right after a pass
            original(*args)
            self.observed += 1
            if self.stepping:
                scheduler.hold()

        return observe

    def of(self, request_id: str) -> list[Run]:
        """The runs of ``request_id``'s steps, in order."""
        return [run for run in self.runs if request_id in run.ids]

    def ran(self, request_id: str, step: int) -> bool:
        return any((request_id, step) in run.calls for run in self.runs)


@dataclasses.dataclass
class Lab:
    srv: ServerThread
    passes: Passes

    def queued(self) -> int:
        return int(self.srv.call(lambda: self.srv.server.engines.scheduler(self.srv.server.registry.get(MODEL)).queued))

    def hold(self) -> None:
        self.srv.call(lambda: self.srv.server.engines.scheduler(self.srv.server.registry.get(MODEL)).hold())

    def release(self) -> None:
        self.srv.call(lambda: self.srv.server.engines.scheduler(self.srv.server.registry.get(MODEL)).release())

    def sample(self, name: str, labels: dict[str, str]) -> float:
        registry = self.srv.server.metrics.registry
        return float(self.srv.call(lambda: registry.get_sample_value(name, labels) or 0.0))

    def joined_passes(self) -> float:
        """Generate passes that held more than one call, from hookwire_batch_calls."""
        labels = {"model": MODEL, "kind": "generate"}
        return self.sample("hookwire_batch_calls_count", labels) - self.sample(
            "hookwire_batch_calls_bucket", {**labels, "le": "1.0"})

    def ended_calls(self) -> float:
        return self.sample("hookwire_generate_seconds_count", {"model": MODEL, "front": "grpc"})


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    """A server of tiny-lm alone (its scheduler is held and released by these tests), its
    Generate passes recorded."""
    passes = Passes()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decoding, "run_step_batch", passes.wrap_batch(decoding.run_step_batch))
        mp.setattr(decoding, "_run_step", passes.wrap_alone(decoding._run_step))
        srv = ServerThread(build_registry([c for c in demo_configs() if c.name == MODEL])).start()
        try:
            host = srv.server.registry.get(MODEL)
            host.observe_batch = passes.wrap_observe(host.observe_batch, srv.call(lambda: srv.server.engines.scheduler(host)))
            yield Lab(srv, passes)
        finally:
            srv.stop()


@pytest.fixture
async def client(lab: Lab) -> Any:
    async with hookwire.connect(lab.srv.target) as c:
        yield c


async def started(lab: Lab, streams: list[hookwire.GenerateStream]) -> list[asyncio.Future[hookwire.GenerateResult]]:
    """Sends the calls one after the other while the scheduler is held (each call queued,
    to be started by its first pass, before the next call is sent) and returns the tasks
    awaiting their results. (A call's ``started`` comes from the engine when that pass
    runs: the held scheduler holds it too.)"""
    tasks: list[asyncio.Future[hookwire.GenerateResult]] = []
    for stream in streams:
        before = lab.queued()
        tasks.append(asyncio.ensure_future(stream.result()))
        await until(lambda: lab.queued() == before + 1, "the call to be queued")
    return tasks


async def lockstep(lab: Lab, tasks: list[asyncio.Future[Any]], stop: Callable[[], bool] = lambda: False) -> None:
    """Releases the held scheduler one pass at a time, each time once every running call
    (a task not done) has its next step queued, until the calls are done or ``stop()``.
    So every pass holds a call's prefill alone, or the decoding steps of all the calls
    running past their prefill. (Read in this order, ``queued`` equals the running calls
    only when each of them has a step waiting: a call that is done queues nothing.)"""
    while True:
        await until(lambda: lab.queued() == sum(not t.done() for t in tasks), "every running call's next step")
        if all(t.done() for t in tasks) or stop():
            return
        seen = lab.passes.observed
        lab.release()
        await until(lambda: lab.passes.observed > seen, "the released pass")


@pytest.fixture
def stepping(lab: Lab) -> Iterator[None]:
    """The scheduler held, and held again after every pass, for the test; free after it."""
    lab.passes.reset()
    lab.passes.stepping = True
    lab.hold()
    try:
        yield
    finally:
        lab.passes.stepping = False
        lab.release()


@pytest.fixture
def held(lab: Lab) -> Iterator[None]:
    """The scheduler held until the test releases it (then passes form by themselves)."""
    lab.passes.reset()
    lab.hold()
    try:
        yield
    finally:
        lab.release()


# --------------------------------------------------------------------------- the alone oracle


@dataclasses.dataclass
class Alone:
    """One call run alone in-process: each sequence's tokens (up to its EOS) and the top-2
    margin of the scores its greedy choice took at each step."""

    tokens: list[list[int]]
    margins: list[list[float]]

    def checked(self, row: int) -> int:
        """How many of the row's tokens a batched run must reproduce: those before the
        first step whose margin is under MARGIN_BOUND."""
        low = [s for s, m in enumerate(self.margins[row]) if m < MARGIN_BOUND]
        return min([len(self.tokens[row]), *low])

    def assert_matches(self, got: tuple[tuple[int, ...], ...], what: str) -> int:
        """Checks ``got`` against the tokens where the margins allow; returns how many
        tokens were compared."""
        assert len(got) == len(self.tokens), what
        compared = 0
        for row, want in enumerate(self.tokens):
            n = self.checked(row)
            assert list(got[row][:n]) == want[:n], f"{what}, sequence {row}: first {n} tokens differ"
            if n == len(want):
                assert list(got[row]) == want, f"{what}, sequence {row}"
            compared += n
        return compared


def alone(prompts: list[str], max_new_tokens: int, *, steer: torch.Tensor | None = None, **settings: Any) -> Alone:
    """transformers' generate() on the prompts alone (greedy unless ``settings`` say
    otherwise); ``steer`` is added to model.layers.0's output at every step, as the add rule
    does remotely."""
    ids, mask = oracle.batch(prompts)
    settings = {"do_sample": False, **settings}
    seed = settings.pop("seed", None)
    hook = None
    if steer is not None:
        hook = oracle.model().get_submodule("model.layers.0").register_forward_hook(lambda m, a, out: out + steer)
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            if seed is not None:
                torch.manual_seed(seed)
            out = oracle.model().generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                          output_scores=True, return_dict_in_generate=True, **settings)
    finally:
        if hook is not None:
            hook.remove()
    tokens, margins = [], []
    scores = torch.stack(out.scores, 1)  # [rows, steps, vocab]
    top = scores.topk(2, dim=-1).values
    for row, seq in enumerate(out.sequences[:, ids.shape[1]:].tolist()):
        seq = seq[: seq.index(EOS) + 1] if EOS in seq else seq
        tokens.append(seq)
        margins.append((top[row, : len(seq), 0] - top[row, : len(seq), 1]).tolist())
    return Alone(tokens, margins)


# --------------------------------------------------------------------------- the batched oracle


@dataclasses.dataclass
class Rows:
    """One call's share of an in-process batched generate(): its sequences' tokens (up to
    its own max_new_tokens and EOS) and, per step, what each hooked module returned for
    its rows, positions and keys."""

    tokens: list[list[int]]
    captures: list[tuple[int, str, Any]]


def batched(plan: dict[str, tuple[list[str], int]], paths: tuple[str, ...]) -> dict[str, Rows]:
    """transformers' own generate() over all the plan's prompts as one batch (left-padded
    together, in plan order: the rows a shared prompt pass gives the calls), greedy, for
    the longest max_new_tokens, with torch hooks on ``paths``; cut per call."""
    prompts = [p for prompts, _ in plan.values() for p in prompts]
    ids, mask = oracle.batch(prompts)
    width = ids.shape[1]
    steps = max(n for _, n in plan.values())
    seen: dict[str, list[Any]] = {path: [] for path in paths}
    handles = [oracle.model().get_submodule(path).register_forward_hook(
        lambda m, args, output, path=path: seen[path].append(_cut(output, slice(None), width, None))) for path in paths]
    try:
        with torch.no_grad():
            out = oracle.model().generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, do_sample=False)
    finally:
        for handle in handles:
            handle.remove()
    out = out[:, width:].tolist()
    shares, row = {}, 0
    for name, (mine, n) in plan.items():
        rows = slice(row, row + len(mine))
        own = int(oracle.batch(mine)[0].shape[1])  # its prompt as it is tokenized alone
        tokens = [seq[:n] for seq in out[rows]]
        tokens = [seq[: seq.index(EOS) + 1] if EOS in seq else seq for seq in tokens]
        last = max(len(t) for t in tokens)  # the steps it ran
        # Its hooks see its own positions and keys (its history without the others' padding):
        # at each step, the last own + step of every dimension of the batch's width + step.
        captures = [(step, path, _cut(seen[path][step], rows, width + step, own + step))
                    for step in range(last) for path in paths]
        shares[name] = Rows(tokens, captures)
        row += len(mine)
    return shares


def _cut(value: Any, rows: slice, width: int, own: int | None) -> Any:
    """``rows`` of ``value``, and with ``own``, the last ``own`` of every dimension of size
    ``width`` (the padded tokens or keys of the pass: the cut hooks make for a call)."""
    if isinstance(value, torch.Tensor):
        index = [rows] + [slice(width - own, None) if own is not None and own < width and size == width else slice(None)
                          for size in value.shape[1:]]
        return value[tuple(index)].detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_cut(v, rows, width, own) for v in value)
    return value


def assert_captures_equal(events: tuple[hookwire.InterceptEvent, ...], want: Rows, what: str) -> None:
    """The call's events are the oracle's captures of its rows, in order, bit for bit."""
    assert [(e.step, e.module) for e in events] == [c[:2] for c in want.captures], what
    for event, (step, module, local) in zip(events, want.captures):
        assert_same(event.output, local, f"{what}: {module} at step {step}")


# --------------------------------------------------------------------------- the tests


#: What the calls capture on the server, and the same modules hooked in the oracle.
CAPTURES = [hookwire.HookSpec("model.layers.*.self_attn", posthook=hookwire.capture("output")),
            hookwire.HookSpec("lm_head", posthook=hookwire.capture("output"))]
CAPTURED = ("model.layers.0.self_attn", "model.layers.1.self_attn", "lm_head")


async def test_calls_that_arrive_together_decode_as_one_batched_generate_bit_for_bit(
    client: hookwire.Client, lab: Lab, stepping: None,
) -> None:
    # Three calls queued together (one of two sequences) share their prompt pass, padded on
    # the left as a batched generate() pads them, and then one decoding batch: tokens and
    # every capture equal in-process generate() of the three as one batch, bit for bit.
    # "b" leaves early (its max_new_tokens): its rows become a hole the others never see;
    # "late" arrives after that, runs its prompt pass alone and takes b's freed row while
    # the others go on; their tokens and captures stay those of the batched oracle.
    # (Prompt lengths 6, 3 and 15 tokens. Each call's hooks see its own keys only; where
    # the batch's key length is a dimension of tiny-lm (16, at step 1), the server's pass
    # attends over one more masked column than generate()'s, and its results still equal.)
    plan = {"a": (["Hello world, the model"], 9), "b": (["the cat", "the dog"], 4), "c": (["once upon a time"], 9)}
    model = client.model(MODEL)
    streams = {name: model.generate(prompts, n, do_sample=False, hooks=CAPTURES) for name, (prompts, n) in plan.items()}
    late = model.generate(["data"], 3, do_sample=False, hooks=CAPTURES)
    tasks = await started(lab, list(streams.values()))
    await lockstep(lab, tasks, stop=lambda: lab.passes.ran(streams["a"].request_id, 5))
    tasks += await started(lab, [late])
    await lockstep(lab, tasks)
    results = dict(zip([*plan, "late"], await asyncio.gather(*tasks)))
    ids = {name: r.request_id for name, r in results.items()}

    # The passes: one prompt pass of a, b and c, then decoding steps of the calls running.
    first = lab.passes.runs[0]
    assert first.shared and first.calls == tuple((ids[n], 0) for n in plan), lab.passes.runs
    assert not any(ids["b"] in run.ids for run in lab.passes.runs if any(step > 3 for _, step in run.calls))
    late_runs = lab.passes.of(ids["late"])
    assert late_runs[0].calls == ((ids["late"], 0),)  # its prompt pass alone
    assert all(run.shared and run.ids == {ids["a"], ids["c"], ids["late"]} for run in late_runs[1:]), late_runs

    want = batched(plan, CAPTURED)
    for name in plan:
        result = results[name]
        assert [list(t) for t in result.token_ids] == want[name].tokens, name
        assert result.steps == plan[name][1], name
        assert {e.request_id for e in result.events} == {ids[name]}
        assert_captures_equal(result.events, want[name], name)
    # The late call: its own tokens (as it decodes alone, up to rounding), and its hooks saw
    # its own row and its own keys only (its history is shorter than the others').
    alone(["data"], 3).assert_matches(results["late"].token_ids, "late")
    prompt = int(oracle.batch(["data"])[0].shape[1])
    for event in results["late"].events:
        if event.module != "lm_head":
            hidden, weights = event.output
            assert hidden.shape[0] == 1 and weights.shape[0] == 1, event
            assert weights.shape[-1] == prompt + event.step, (event.step, weights.shape)


async def test_greedy_calls_batched_choose_the_tokens_they_choose_alone(
    client: hookwire.Client, lab: Lab, held: None,
) -> None:
    # Six calls of different prompt lengths, two of them of two sequences, ending at
    # different steps; after the prefills, passes form by themselves.
    plan = [(["Hello"], 10), (["the cat", "the dog"], 8), (["once upon a time"], 10),
            (["data", "hello there"], 6), (["the cat sat"], 9), (["is the"], 10)]
    model = client.model(MODEL)
    joined_before = lab.joined_passes()
    tasks = await started(lab, [model.generate(prompts, n, do_sample=False) for prompts, n in plan])
    lab.release()
    results = await asyncio.gather(*tasks)
    assert lab.joined_passes() > joined_before, "no Generate step was batched"
    assert any(run.shared for run in lab.passes.runs)
    wants = [alone(prompts, n) for prompts, n in plan]
    compared = 0
    for (prompts, n), want, result in zip(plan, wants, results):
        n = want.assert_matches(result.token_ids, f"{prompts}")
        if n == sum(len(t) for t in want.tokens):  # all compared: the call ran as many steps
            assert result.steps == max(len(t) for t in want.tokens), prompts
        compared += n
    # Not vacuous: the margins let (nearly) every token be compared.
    total = sum(len(t) for want in wants for t in want.tokens)
    assert compared >= 0.9 * total, (compared, total)


async def test_rules_sessions_and_step_ranges_stay_with_their_own_call(lab: Lab, stepping: None) -> None:
    # Three callers, each with its own session: one steers its own tokens with a request
    # hook's add rule; one has a session hook gated to steps 1..; one, started after the
    # others have decoded two steps (so its steps are not theirs), captures with request
    # hooks gated to some steps. They end at different steps.
    steer = torch.randn(64, generator=torch.Generator().manual_seed(5))
    plain = {"steered": (["the cat sat"], 8), "session": (["is the"], 10), "gated": (["Hello", "once upon a time"], 6)}
    async with hookwire.connect(lab.srv.target) as a, hookwire.connect(lab.srv.target) as b, \
            hookwire.connect(lab.srv.target) as c:
        async with c.model(MODEL).hook("model.layers.0", posthook=hookwire.capture("output"), steps=(1, None)) as hook:
            streams = {
                "steered": a.model(MODEL).generate(
                    *plain["steered"], do_sample=False,
                    hooks=[hookwire.HookSpec("model.layers.0", posthook=rules.add("output", steer))]),
                "session": c.model(MODEL).generate(*plain["session"], do_sample=False),
                "gated": b.model(MODEL).generate(*plain["gated"], do_sample=False, hooks=[
                    hookwire.HookSpec("model.norm", posthook=hookwire.capture("output"), steps=(2, 3)),
                    hookwire.HookSpec("model.layers.1", posthook=hookwire.capture("output"), steps=(0, 0))]),
            }
            tasks = await started(lab, [streams["steered"], streams["session"]])
            await lockstep(lab, tasks, stop=lambda: lab.passes.ran(streams["steered"].request_id, 2))
            tasks += await started(lab, [streams["gated"]])
            await lockstep(lab, tasks)
            results = dict(zip(streams, await asyncio.gather(*tasks)))
            session_events = [e async for e in hook.events(until=results["session"])]
    ids = {name: r.request_id for name, r in results.items()}
    assert len(set(ids.values())) == 3
    # The gated call's steps 2 and 3 shared passes with the others' later steps.
    for step in (2, 3):
        [run] = [run for run in lab.passes.runs if (ids["gated"], step) in run.calls]
        assert run.shared and run.ids == set(ids.values()), run
        assert all(s > step for rid, s in run.calls if rid != ids["gated"]), run

    # Tokens: the steered call as it runs alone with the same edit, the others as they run
    # alone unsteered; the edit did change the steered call's tokens.
    steered = alone(*plain["steered"], steer=steer)
    assert steered.tokens != alone(*plain["steered"]).tokens
    steered.assert_matches(results["steered"].token_ids, "steered")
    alone(*plain["gated"]).assert_matches(results["gated"].token_ids, "gated")
    alone(*plain["session"]).assert_matches(results["session"].token_ids, "session")
    assert results["steered"].events == ()

    # Events: each call's own, with its own request id and step numbers, in its own gated steps.
    gated = results["gated"]
    assert [(e.step, e.module) for e in gated.events] == [(0, "model.layers.1"), (2, "model.norm"), (3, "model.norm")]
    assert {e.request_id for e in gated.events} == {ids["gated"]}
    assert len(gated.events_by_step) == gated.steps == 6
    ids_b, mask_b = oracle.batch(plain["gated"][0])
    with oracle.recording("model.norm", "model.layers.1") as local:
        oracle.generate(ids_b, mask_b, 6, do_sample=False)
    assert torch.equal(gated.events[0].output, local["model.layers.1"][0])  # it came alone: its prompt pass ran alone, exact
    for event in gated.events[1:]:  # a joined step: its own rows, as alone up to rounding
        torch.testing.assert_close(event.output, local["model.norm"][event.step], rtol=1e-5, atol=1e-6)
    assert [(e.request_id, e.step) for e in session_events] == [(ids["session"], s) for s in range(1, 10)]
    assert all(e.output.shape == (1, 1, 64) for e in session_events)


async def test_seeded_sampling_batched_draws_what_it_draws_alone(client: hookwire.Client, lab: Lab, held: None) -> None:
    # Each call samples from its own generator: joined with others (one of them with the
    # same seed and prompt, one greedy), it draws the tokens it draws alone.
    calls: list[tuple[list[str], dict[str, Any]]] = [
        (["the cat sat"], dict(seed=11, temperature=0.7, top_k=50)),
        (["the cat sat"], dict(seed=11, temperature=0.7, top_k=50)),
        (["Hello", "data"], dict(seed=99, top_p=0.9)),
        (["once upon a time"], dict(seed=3)),
    ]
    model = client.model(MODEL)
    tasks = await started(lab, [model.generate(p, 10, do_sample=True, **s) for p, s in calls]
                          + [model.generate("is the", 10, do_sample=False)])
    lab.release()
    results = await asyncio.gather(*tasks)
    assert any(len(run.calls) >= 4 and run.shared for run in lab.passes.runs), lab.passes.runs
    for (prompts, settings), result in zip(calls, results):
        want = alone(prompts, 10, do_sample=True, **settings)
        assert [list(t) for t in result.token_ids] == want.tokens, (prompts, settings)
        assert result.seed == settings["seed"] and result.do_sample
    assert results[0].token_ids == results[1].token_ids
    alone(["is the"], 10).assert_matches(results[4].token_ids, "greedy")


async def test_cancelling_one_call_leaves_the_calls_it_was_batched_with_undisturbed(
    client: hookwire.Client, lab: Lab, stepping: None,
) -> None:
    plan = {"cancelled": (["once upon a time"], 40), "b": (["the cat", "the dog"], 12), "c": (["Hello"], 12)}
    model = client.model(MODEL)
    streams = {name: model.generate(p, n, do_sample=False) for name, (p, n) in plan.items()}
    tasks = await started(lab, list(streams.values()))
    ended = lab.ended_calls()
    await lockstep(lab, tasks, stop=lambda: lab.passes.ran(streams["cancelled"].request_id, 3))
    gone = streams["cancelled"].request_id
    everyone = {stream.request_id for stream in streams.values()}
    tasks[0].cancel()  # the task awaiting its result: the RPC is cancelled
    with pytest.raises(asyncio.CancelledError):
        await tasks[0]
    with pytest.raises(hookwire.CancelledError):
        await streams["cancelled"]
    await until(lambda: lab.ended_calls() == ended + 1, "the cancelled call to end on the server")
    cancelled_at = len(lab.passes.runs)
    lab.passes.stepping = False
    lab.release()
    results = {name: await task for name, task in zip(["b", "c"], tasks[1:])}

    # It ran up to its step 3 with the others, and never again; they went on together.
    assert all(run.shared and run.ids == everyone for run in lab.passes.runs[3:cancelled_at]), lab.passes.runs
    assert max(step for run in lab.passes.runs for rid, step in run.calls if rid == gone) == 3
    assert not any(gone in run.ids for run in lab.passes.runs[cancelled_at:])
    assert any(run.shared for run in lab.passes.runs[cancelled_at:])
    # Their tokens: bit for bit those of the three calls as one in-process batched
    # generate() (the cancelled call's rows became a hole), and those of each alone.
    want = batched(plan, ())
    for name, result in results.items():
        assert [list(t) for t in result.token_ids] == want[name].tokens, name
        assert result.finish_reasons == ("length",) * len(plan[name][0]) and result.steps == 12
        alone(*plan[name]).assert_matches(result.token_ids, name)
