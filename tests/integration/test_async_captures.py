"""Asynchronous captures (#15, deferred.py). On a GPU a capture starts its copy to the host
and the event is encoded after the copy completes; without one, ``async_captures = "on"``
runs the same queue on CPU tensors (cloned at the hook, encoded later), which is what
these tests exercise: every event is bit-identical to the same capture made inside the
hook ("off") and to in-process torch hooks, keeps its order and numbering, arrives
before its call's response and CallEnded, survives a later in-place kernel, stays with
its call in a shared pass, and fails as before. The CUDA test runs where a GPU is."""

from __future__ import annotations

import copy
import datetime
import re
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

import hookwire
from hookwire import rules
from hookwire._generation import generate_request
from hookwire_server.hooks import deferred
from hookwire_server.hooks.deferred import DeferredCaptures, HostCopies, wants_deferral
from hookwire_server.demo_models import tiny_lm, tiny_lm_tokenizer, tiny_transformer
from hookwire_server.models.model_loading import ConfigError, ModelConfig, build_host
from hookwire_server.models.model_registry import ModelHost, ModelRegistry
from support import LIVENESS, ServerThread, held, serving


class InPlace(nn.Module):
    """``inner``'s output is doubled in place after its hooks ran: a capture that read the
    tensor later than its hook would see the doubled values."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        y.mul_(2.0)
        return self.out(y)


def _inplace() -> nn.Module:
    torch.manual_seed(5)
    return InPlace().eval()


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    tt, lm, inplace = tiny_transformer(), tiny_lm(), _inplace()
    registry = ModelRegistry([
        ModelHost("tt-async", copy.deepcopy(tt), async_captures="on"),
        ModelHost("tt-sync", copy.deepcopy(tt), async_captures="off"),
        ModelHost("lm-async", copy.deepcopy(lm), tokenizer=tiny_lm_tokenizer(), async_captures="on"),
        ModelHost("lm-sync", copy.deepcopy(lm), tokenizer=tiny_lm_tokenizer(), async_captures="off"),
        ModelHost("inplace-async", copy.deepcopy(inplace), async_captures="on"),
        ModelHost("inplace-auto", copy.deepcopy(inplace)),  # on the CPU, "auto" captures inside the hook
    ])
    with serving(registry) as srv:
        yield srv


def _deferred(srv: ServerThread, model: str) -> int:
    """How many captures ``model`` made asynchronously so far."""
    return int(srv.call(lambda: srv.server.registry.get(model).deferred_captures))


def _ids(seed: int, rows: int = 2, length: int = 8) -> torch.Tensor:
    return torch.randint(0, 64, (rows, length), generator=torch.Generator().manual_seed(seed))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def _key(e: hookwire.InterceptEvent) -> tuple[Any, ...]:
    return (e.module, e.phase, e.call_index, e.seq, e.step, e.devices)


def _assert_same_events(a: list[hookwire.InterceptEvent], b: list[hookwire.InterceptEvent]) -> None:
    assert [_key(e) for e in a] == [_key(e) for e in b]
    for x, y in zip(a, b):
        for part in ("args", "kwargs", "output", "grad_input", "grad_output"):
            assert _same(getattr(x, part), getattr(y, part)), (x.module, part)


SPECS = [
    hookwire.HookSpec("encoder.layers.*", prehook=hookwire.capture("args"),
                      posthook=hookwire.capture("output", select="[:, -1]", cast="bfloat16")),
    hookwire.HookSpec("encoder.layers.0.attn", posthook=hookwire.edit(
        rules.scale("output.0", 0.5), capture=("output",), capture_before_rules=True)),
    hookwire.HookSpec("head", posthook=hookwire.capture("output", summarize=True, histogram_bins=8)),
]


async def test_request_scoped_captures_equal_captures_made_in_the_hook_and_in_process(server: ServerThread) -> None:
    ids = _ids(0)
    before = _deferred(server, "tt-async"), _deferred(server, "tt-sync")
    async with hookwire.connect(server.target) as client:
        deferred = await client.model("tt-async").infer(ids, hooks=SPECS)
        inline = await client.model("tt-sync").infer(ids, hooks=SPECS)
    # Every capture of "on" went through the queue, none of "off" did.
    assert (_deferred(server, "tt-async") - before[0], _deferred(server, "tt-sync") - before[1]) == (6, 0)
    assert _same(deferred.output, inline.output)
    _assert_same_events(deferred.events, inline.events)
    assert len(deferred.events) == 2 * 2 + 1 + 1
    assert all(e.devices == ("cpu",) for e in deferred.events)
    # In-process: layer 1's pre-hook input and the attention output before the rule.
    model = tiny_transformer()
    seen: dict[str, Any] = {}
    model.encoder.layers[1].register_forward_pre_hook(lambda m, a: seen.__setitem__("in1", a[0].clone()))
    def attn(m: Any, a: Any, o: Any) -> Any:
        seen["attn"] = o[0].clone()  # captured before the rule
        return (o[0] * 0.5,) + tuple(o[1:])

    model.encoder.layers[0].attn.register_forward_hook(attn)
    with torch.no_grad():
        model(ids)
    by_module = {(e.module, e.phase): e for e in deferred.events}
    assert torch.equal(by_module[("encoder.layers.1", "forward_pre")].args[0], seen["in1"])
    assert torch.equal(by_module[("encoder.layers.0.attn", "forward")].output[0], seen["attn"])


async def test_a_later_in_place_kernel_does_not_change_what_was_captured(server: ServerThread) -> None:
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    model = _inplace()
    seen: list[torch.Tensor] = []
    model.inner.register_forward_hook(lambda m, a, o: seen.append(o.clone()))
    with torch.no_grad():
        expected = model(x)
    before = _deferred(server, "inplace-async"), _deferred(server, "inplace-auto")
    async with hookwire.connect(server.target) as client:
        for name in ("inplace-async", "inplace-auto"):
            result = await client.model(name).infer(x, hooks=[hookwire.HookSpec("inner", posthook=hookwire.capture("output"))])
            assert torch.equal(result.output, expected), name
            assert torch.equal(result.events[0].output, seen[0]), name  # the value before mul_
    assert (_deferred(server, "inplace-async") - before[0], _deferred(server, "inplace-auto") - before[1]) == (1, 0)


async def test_session_events_keep_order_numbering_and_precede_call_ended(server: ServerThread) -> None:
    ids = [_ids(i) for i in range(3)]
    got: dict[str, list[hookwire.InterceptEvent]] = {}
    async with hookwire.connect(server.target) as client:
        for name in ("tt-async", "tt-sync"):
            session = await client.session()
            model = client.model(name)
            handle = await model.hook("encoder.layers.*", posthook=hookwire.capture("output"))
            results = [await model.infer(i) for i in ids]
            events = [e async for e in handle.events(until=results[-1].request_id, timeout=LIVENESS)]
            await handle.remove()
            await session.close()
            got[name] = events
    assert [e.seq for e in got["tt-async"]] == list(range(1, 7))  # 2 layers x 3 calls, in order
    assert [e.module for e in got["tt-async"]] == ["encoder.layers.0", "encoder.layers.1"] * 3
    _assert_same_events(got["tt-async"], got["tt-sync"])


async def test_calls_sharing_a_pass_get_their_own_rows_and_a_bad_capture_fails_alone(server: ServerThread) -> None:
    ids = [_ids(10 + i, rows=1 + i) for i in range(3)]
    spec = hookwire.HookSpec("encoder.layers.1", posthook=hookwire.capture("output"))
    bad = hookwire.HookSpec("encoder.layers.1", posthook=hookwire.capture("output", select="[:, :, 999]"))
    async with hookwire.connect(server.target) as client:
        model, alone = client.model("tt-async"), client.model("tt-sync")
        results = await held(server, "tt-async", [
            lambda: model.infer(ids[0], hooks=[spec]), lambda: model.infer(ids[1], hooks=[bad]),
            lambda: model.infer(ids[2], hooks=[spec]),
        ])
        expected = [await alone.infer(ids[i], hooks=[spec]) for i in (0, 2)]
        with pytest.raises(hookwire.InvalidArgumentError) as inline_failure:
            await alone.infer(ids[1], hooks=[bad])
    assert isinstance(results[1], hookwire.InvalidArgumentError)
    # The same message as a capture made inside the hook gives (hook ids aside).
    assert re.sub("hk_[0-9a-f]+", "", results[1].details) == re.sub("hk_[0-9a-f]+", "", inline_failure.value.details)
    for got, want in zip((results[0], results[2]), expected):
        assert not isinstance(got, BaseException)
        assert torch.allclose(got.events[0].output, want.events[0].output, atol=1e-6)  # batched: within batching tolerance
        assert got.events[0].output.shape == want.events[0].output.shape


async def test_a_session_hook_whose_capture_fails_is_disabled(server: ServerThread) -> None:
    async with hookwire.connect(server.target) as client:
        model = client.model("tt-async")
        handle = await model.hook("encoder.layers.0", posthook=hookwire.capture("output", select="[:, :, 999]"))
        await model.infer(_ids(3))
        hooks = {h.hook_id: h for h in await client.list_hooks()}
        assert "could not capture" in hooks[handle.id].disabled_reason
        assert "IndexError: index 999 is out of bounds" in hooks[handle.id].disabled_reason


async def test_generation_events_equal_captures_made_in_the_hook(server: ServerThread) -> None:
    spec = hookwire.HookSpec("model.layers.*", posthook=hookwire.capture("output"))
    async with hookwire.connect(server.target) as client:
        deferred = await client.model("lm-async").generate("Once upon a time", 6, do_sample=False, hooks=[spec])
        inline = await client.model("lm-sync").generate("Once upon a time", 6, do_sample=False, hooks=[spec])
    assert list(deferred.token_ids[0]) == list(inline.token_ids[0])
    _assert_same_events(list(deferred.events), list(inline.events))
    assert _deferred(server, "lm-async") >= len(deferred.events) > 0 and _deferred(server, "lm-sync") == 0


def test_the_queue_finishes_in_order_and_raises_the_first_error_after_the_rest() -> None:
    queue, done = DeferredCaptures(), []

    def fail() -> None:
        done.append("bad")
        raise ValueError("no")

    queue.add([], [], lambda: done.append(1))
    queue.add([], [], fail)
    queue.add([], [], lambda: done.append(3))
    with pytest.raises(ValueError, match="no"):
        queue.finish()
    assert done == [1, "bad", 3] and not queue
    queue.add([], [], lambda: done.append(4))
    queue.poll()  # nothing in flight: finished at once
    assert done[-1] == 4
    queue.add([], [], lambda: done.append(5))
    queue.drop()
    queue.finish()
    assert done[-1] == 4


def test_host_copies_and_the_modes() -> None:
    t = torch.arange(6.0).view(2, 3)
    copies = HostCopies()
    value = copies.copy({"a": (t, 3), "b": [t.t()]})
    assert torch.equal(value["a"][0], t) and value["a"][0].data_ptr() != t.data_ptr() and value["a"][1] == 3
    assert torch.equal(value["b"][0], t.t())
    assert copies.events() == [] and copies.keep == []  # CPU tensors are cloned: nothing in flight
    assert wants_deferral("on", (t,)) and not wants_deferral("auto", (t,)) and not wants_deferral("off", (t,))
    assert not wants_deferral("on", (None, 3))


def test_the_config_key() -> None:
    with pytest.raises(ConfigError, match="async_captures must be one of auto, on, off, not 'yes'"):
        build_host(ModelConfig(name="m", factory="hookwire_server.demo_models:mlp", async_captures="yes"))
    assert build_host(ModelConfig(name="m", factory="hookwire_server.demo_models:mlp",
                                  async_captures="on")).async_captures == "on"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
async def test_on_a_gpu_asynchronous_captures_equal_in_process_hooks() -> None:
    """The real path: CUDA tensors copied into pinned memory after an event, encoded later."""
    tt = tiny_transformer().cuda()
    registry = ModelRegistry([
        ModelHost("tt", copy.deepcopy(tt)),  # auto: deferred on the GPU
        ModelHost("inplace", _inplace().cuda()),
    ])
    srv = ServerThread(registry).start()
    try:
        ids = _ids(0)
        seen: list[torch.Tensor] = []
        tt.encoder.layers[1].register_forward_hook(lambda m, a, o: seen.append(o.cpu()))
        with torch.no_grad():
            expected = tt(ids.cuda())
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
        local = _inplace().cuda()
        inner: list[torch.Tensor] = []
        local.inner.register_forward_hook(lambda m, a, o: inner.append(o.cpu()))
        with torch.no_grad():
            local(x.cuda())
        async with hookwire.connect(srv.target) as client:
            result = await client.model("tt").infer(ids, hooks=[
                hookwire.HookSpec("encoder.layers.1", posthook=hookwire.capture("output"))])
            edited = await client.model("inplace").infer(x, hooks=[
                hookwire.HookSpec("inner", posthook=hookwire.capture("output"))])
        assert torch.equal(result.output["logits"], expected["logits"].cpu())
        assert torch.equal(result.events[0].output, seen[0]) and result.events[0].devices == ("cuda:0",)
        assert torch.equal(edited.events[0].output, inner[0])
    finally:
        srv.stop()


# ------------------------------------------------ "on" equals "off": outputs, failures, order, time


class Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


class PairInner(nn.Module):
    """Returns a NamedTuple (as torch.return_types and many user modules do)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> Pair:
        y = self.lin(x)
        return Pair(y, y + 1.0)


class PairModel(nn.Module):
    """``inner``'s output is doubled in place after its hooks ran."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = PairInner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.inner(x)
        p.a.mul_(2.0)
        return p.a + p.b


class Nothing(nn.Module):
    """A module whose output holds no tensor (a probe, a logger, a counter)."""

    def forward(self, x: torch.Tensor) -> None:
        return None


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.act = nn.ReLU()
        self.probe = Nothing()
        self.fc2 = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.fc1(x))
        self.probe(y)
        return self.fc2(y)


#: time.time_ns() when each Stamped model's middle ran (server side, in-process).
STAMPS: list[int] = []


class Stamp(nn.Module):
    """Records when it ran, then lets the clock move on by a millisecond."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        now = time.time_ns()
        STAMPS.append(now)
        while time.time_ns() < now + 1_000_000:
            pass
        return x


class Stamped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.stamp = Stamp()
        self.fc2 = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.stamp(self.fc1(x)))


def _seeded(factory: Any, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return factory().eval()


def _hosts(name: str, model: nn.Module, **kwargs: Any) -> list[ModelHost]:
    return [ModelHost(f"{name}-async", copy.deepcopy(model), async_captures="on", **kwargs),
            ModelHost(f"{name}-sync", copy.deepcopy(model), async_captures="off", **kwargs)]


@pytest.fixture(scope="module")
def paired() -> Iterator[ServerThread]:
    """Each model twice, as NAME-async (``async_captures = "on"``) and NAME-sync (``"off"``,
    captures made inside the hook): the tests below compare the two."""
    lm = tiny_lm()
    registry = ModelRegistry(
        _hosts("pair", _seeded(PairModel, 3)) + _hosts("chain", _seeded(Chain, 4))
        + _hosts("lm", lm, tokenizer=tiny_lm_tokenizer()) + _hosts("stamped", _seeded(Stamped, 5))
    )
    # At most 4 request-scoped events per call (max_events_per_call).
    with serving(registry, max_events_per_call=4) as srv:
        yield srv


X = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))


class _InFlight:
    """A CUDA event whose copies have not completed yet (until someone waits for it)."""

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        return None


@pytest.fixture
def copies_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deferred.HostCopies, "events", lambda self: [_InFlight()])


# --------------------------------------------------------------------------- 1. aliasing


async def test_a_namedtuple_output_is_captured_as_it_was_when_the_hook_ran(paired: ServerThread) -> None:
    """A NamedTuple output (as torch.return_types) is copied when the hook fires, as an
    exact tuple is: the model's later in-place change to it is not what is sent ("off"
    snapshots it inside the hook; "on" must send the same)."""
    model = _seeded(PairModel, 3)
    seen: list[torch.Tensor] = []
    model.inner.register_forward_hook(lambda m, a, o: seen.append(o.a.detach().clone()))
    with torch.no_grad():
        model(X)
    spec = hookwire.HookSpec("inner", posthook=hookwire.capture("args", "output"))
    async with hookwire.connect(paired.target) as client:
        inline = await client.model("pair-sync").infer(X, hooks=[spec])
        deferred_ = await client.model("pair-async").infer(X, hooks=[spec])
    assert torch.equal(inline.events[0].output[0], seen[0])  # "off": the value the hook saw
    assert torch.equal(deferred_.events[0].output[0], seen[0]), "deferred capture read the tensor after mul_"


async def test_events_name_the_device_of_a_namedtuple_output(paired: ServerThread) -> None:
    """An output that is a NamedTuple of tensors names their device in
    InterceptEvent.devices, as a plain tuple does."""
    spec = hookwire.HookSpec("inner", posthook=hookwire.capture("output"))
    async with hookwire.connect(paired.target) as client:
        result = await client.model("pair-sync").infer(X, hooks=[spec])
    assert result.events[0].devices == ("cpu",)


# --------------------------------------------------------------------------- 2. failure point


async def test_a_request_capture_over_the_event_limit_stops_the_pass_where_it_did(paired: ServerThread) -> None:
    """A request-scoped capture that cannot be sent (over max_events_per_call) fails the
    call inside its hook, before the hook's rules run, in both modes: a deferred capture
    must not let that firing's save rule run, so the failed call leaves no slot saved."""
    specs = [
        *[hookwire.HookSpec(m, posthook=hookwire.capture("output")) for m in ("fc1", "act", "probe", "fc2")],
        hookwire.HookSpec("fc2", posthook=hookwire.edit(rules.save("output", slot="after"), capture=("output",),
                                                        capture_before_rules=True)),
    ]
    slots: dict[str, list[str]] = {}
    for name in ("chain-sync", "chain-async"):
        async with hookwire.connect(paired.target) as client:
            await client.session()
            with pytest.raises(hookwire.HookwireError, match="max_events_per_call"):
                await client.model(name).infer(X, hooks=specs)
            slots[name] = [s.name for s in await client.list_slots()]
    assert slots["chain-sync"] == []  # the fifth capture failed before its save rule ran
    assert slots["chain-async"] == slots["chain-sync"]


# --------------------------------------------------------------------------- 3. notice order


async def _generate_kinds(client: hookwire.Client, model: str, spec: hookwire.HookSpec) -> list[str]:
    request = generate_request(
        model, "Once upon a time", 3, attention_mask=None, hooks=[spec], do_sample=False, temperature=None,
        top_k=None, top_p=None, seed=None, stop=(), tags=(), session_id="", max_response_message_bytes=1 << 24,
    )
    kinds = []
    async for message in client.model_stub.Generate(request):
        kind = message.WhichOneof("kind")
        if kind == "batch":
            kinds.extend(["event"] * len(message.batch.events))
        elif kind != "chunk":
            kinds.append(kind)
    return kinds


async def test_a_capture_before_a_failing_rule_precedes_its_disable_notice(paired: ServerThread) -> None:
    """capture_before_rules with a rule that fails at step 1 (on_error disable_hook): the
    hook's event comes first, then the notice that disables it, in both modes (a deferred
    event must not arrive after the notice that says its hook was disabled)."""
    spec = hookwire.HookSpec("model.layers.0", on_error="disable_hook", posthook=hookwire.edit(
        rules.zero("output", index="[:, 1]"), capture=("output",), capture_before_rules=True))
    async with hookwire.connect(paired.target) as client:
        inline = await _generate_kinds(client, "lm-sync", spec)
        deferred_ = await _generate_kinds(client, "lm-async", spec)
    assert inline.index("notice") == inline.index("event", inline.index("tokens")) + 1  # step 1: event, notice
    assert deferred_ == inline


# --------------------------------------------------------------------------- 4. overtaking


async def test_a_capture_made_at_once_does_not_overtake_captures_in_flight(
    paired: ServerThread, copies_in_flight: None,
) -> None:
    """A capture with no tensor to copy (here a None output) is ready at once, while
    earlier captures of the pass still wait for their copies: it must not overtake them,
    the response keeps the events in firing order."""
    specs = [hookwire.HookSpec(m, posthook=hookwire.capture("output")) for m in ("fc1", "probe", "fc2")]
    async with hookwire.connect(paired.target) as client:
        inline = await client.model("chain-sync").infer(X, hooks=specs)
        deferred_ = await client.model("chain-async").infer(X, hooks=specs)
    assert [e.module for e in inline.events] == ["fc1", "probe", "fc2"]  # firing order
    assert [e.module for e in deferred_.events] == ["fc1", "probe", "fc2"]


# --------------------------------------------------------------------------- 5. event time


async def test_an_event_is_stamped_when_the_hook_fired(paired: ServerThread) -> None:
    """InterceptEvent.time is "when the hook fired (server clock)" (hook.proto), not when a
    deferred capture was encoded or delivered: fc1's hook fires before ``stamp`` runs, so
    its event's time must not be after it, in either mode."""
    spec = hookwire.HookSpec("fc*", posthook=hookwire.capture("output"))
    times: dict[str, int] = {}
    async with hookwire.connect(paired.target) as client:
        for name in ("stamped-sync", "stamped-async"):
            result = await client.model(name).infer(X, hooks=[spec])
            fc1 = [e for e in result.events if e.module == "fc1"][0]
            fired = (fc1.time - datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)) // datetime.timedelta(
                microseconds=1)
            times[name] = fired - STAMPS[-1] // 1000  # µs from fc1's event time to when stamp ran
    assert times["stamped-sync"] <= 0
    assert times["stamped-async"] <= 0, f"the deferred event is stamped {times['stamped-async']} µs after stamp ran"
