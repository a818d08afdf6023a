"""Dynamic batching of Infer calls (#11): exactness and per-call isolation.

Batches are formed deterministically, never by timing: the model's scheduler is held,
the calls are queued one after the other (so the order of their rows in the pass is
known), then released together. Every test checks, through the batch metrics, that the
passes it expects really formed, so it fails if batching silently stops (or starts
joining calls that must run alone).

The oracle is in-process torch with real torch hooks (``run_oracle``):

- *batched*: the calls' inputs joined exactly as the server joins them (stacked along
  dimension 0; token inputs of different lengths padded on the right to
  ``batching.padded_length(lengths, batch_settings.model_dimensions(model), positions)`` with
  the pad token, and with 0 for the attention mask and token type ids), one forward
  pass, and torch hooks that, for each call, take its rows (and cut every dimension >= 1
  of the padded size back to the call's own length), apply the call's edits there and
  record what its remote hooks must send. Every output and every event of a batched call
  is bit-identical (``torch.equal``) to it.
- *alone*: each call's own forward pass. A batched call is ``allclose`` to it within
  ``TOLERANCES`` (batching changes the floating-point reduction order, so in general it
  is not bit-identical); a call that runs alone is bit-identical to it.

``TOLERANCES`` (atol, rtol), float32, CPU: measured on this file's inputs as the largest
absolute difference between a batched call and its unbatched in-process run, over every
output and every tensor the hooks see (torch 2.13, transformers 5.x): tiny-transformer
6.0e-8 (values up to ~5), tiny-lm 7.2e-7 (values up to ~4), MiniLM with its real weights
1.1e-5 (hidden states up to ~30). The bounds leave a margin of 4x or more over those
figures (other CPUs pick other kernels), and stay far below what a wrong row, a token
cut at the wrong length or a leaked edit changes (>= 1e-2 here).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import pathlib
import time
from typing import Any, Awaitable, Callable, Iterator, Mapping

import grpc
import pytest
import torch
from torch import nn

import hookwire
from hookwire import HookSpec, Sampling, capture, rules
from hookwire.wire import codec
from hookwire._session import CallEnded, stream_items
from hookwire.v1 import hook_pb2, hook_service_pb2, hook_service_pb2_grpc, model_service_pb2, model_service_pb2_grpc
from hookwire_server import ModelConfig, ModelHost, ModelRegistry, ServerSettings, build_registry
from hookwire_server.engine import batching
from hookwire_server.models import batch_settings
from hookwire_server.models.batch_settings import LIMIT_MAX_BATCH_DELAY_MS
from hookwire_server.demo_models import tiny_lm, tiny_transformer
from hookwire_server.models.model_loading import ConfigError, build_host, load_config_file
from hookwire_server.models.model_registry import BatchConfig
from support import CACHE, LIVENESS, ServerThread, assert_same, held, minilm_folder, queue_held, serving, until
from packed_engine import PackedEngine
from hookwire_server.engine.torch_engine import TorchEngine

#: (atol, rtol) of a batched call against its unbatched in-process run (see the module docstring).
TOLERANCES: dict[str, tuple[float, float]] = {
    "tiny-transformer": (1e-6, 1e-6),
    "tiny-lm": (5e-6, 1e-5),
    "minilm": (5e-5, 1e-5),
}


# ---------------------------------------------------------------------------- test models


class Transposed(nn.Module):
    """Lays its input out as [features, rows]: dimension 0 is not the row count."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.t().contiguous()


class Transposer(nn.Module):
    """A model whose forward keeps rows apart but has a submodule (``flip``) whose output
    cannot be split per call: a hook on it fails the shared pass."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(5, 5)
        self.flip = Transposed()
        self.out = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.flip(self.proj(x)).t())


class Widen(nn.Module):
    """Repeats each row 16384 times: 4 MiB per row for a 64-wide float32 input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.repeat(1, 16384)


class Wide(nn.Module):
    """Small inputs and outputs ([rows, 64]) but twelve large activations per row: a hook on
    ``layers.*`` sends 48 MiB per row, far more than gRPC's transport buffers absorb (on
    loopback they took about 8 MiB of an unread stream when this was measured)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Widen() for _ in range(12))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(layer(x)[:, :64] for layer in self.layers)  # type: ignore[return-value]


class Unsendable(nn.Module):
    """Returns its layer's output with a value that has no wire form (a torch.device):
    every call fails with UNIMPLEMENTED after its pass ran (and its hooks fired)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        return {"y": self.inner(x), "device": x.device}


def _seeded(build: Callable[[], nn.Module], seed: int) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build().eval()


# ---------------------------------------------------------------------------- fixtures


@dataclasses.dataclass
class Local:
    """In-process copies of the hosted models (the oracle runs on them)."""

    tt: nn.Module
    lm: nn.Module
    transposer: nn.Module
    bert: nn.Module | None
    tokenizer: Any


@pytest.fixture(scope="module")
def local() -> Local:
    import transformers

    folder = minilm_folder()
    bert = transformers.BertModel.from_pretrained(str(folder), local_files_only=True).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    return Local(tiny_transformer(), tiny_lm(), _seeded(Transposer, 3), bert, tokenizer)


@pytest.fixture(scope="module")
def server(local: Local) -> Iterator[ServerThread]:
    """A server of this module's own: the demo models (copies of ``local``'s), MiniLM when
    installed, variants with other batching settings, and the test models above."""
    registry = ModelRegistry([
        ModelHost("tiny-transformer", copy.deepcopy(local.tt)),
        ModelHost("tiny-lm", copy.deepcopy(local.lm)),  # pad token 0, from its config
        ModelHost("tt-solo", copy.deepcopy(local.tt), batching=BatchConfig(batching=False)),
        ModelHost("tt-max3", copy.deepcopy(local.tt), batching=BatchConfig(max_batch_size=3)),
        ModelHost("transposer", copy.deepcopy(local.transposer)),
        ModelHost("wide", Wide()),
        ModelHost("unsendable", Unsendable()),
        # The longest wait for company the settings allow: a call that waits for it is seen waiting.
        ModelHost("tt-patient", copy.deepcopy(local.tt), batching=BatchConfig(max_batch_delay_ms=LIMIT_MAX_BATCH_DELAY_MS)),
    ])
    # As an operator hosts it: the folder, with its tokenizer (pad id 0).
    registry.add(build_host(ModelConfig(name="minilm", transformers=str(minilm_folder()))))
    # tiny-lm again, on an engine that packs its calls' tokens into one sequence (as vLLM
    # does): the isolation test holds behind the engine seam whatever the layout.
    registry.add(ModelHost("tiny-lm-packed", copy.deepcopy(local.lm)))
    with serving(registry) as srv:
        srv.call(lambda: srv.server.engines.use(
            lambda host: PackedEngine(host) if host.name == "tiny-lm-packed" else TorchEngine(host)))
        yield srv


# ---------------------------------------------------------------------------- helpers


@dataclasses.dataclass(frozen=True)
class Passes:
    """What the hookwire_batch_calls / hookwire_batch_rows histograms of a model hold."""

    passes: float
    calls: float
    rows: float
    buckets: tuple[float, ...]  # passes of at most 1, 2, 3, ... calls

    def __sub__(self, other: Passes) -> Passes:
        return Passes(self.passes - other.passes, self.calls - other.calls, self.rows - other.rows,
                      tuple(a - b for a, b in zip(self.buckets, other.buckets)))


def _passes(srv: ServerThread, model: str) -> Passes:
    registry = srv.server.metrics.registry
    labels = {"model": model, "kind": "infer"}

    def value(name: str, **extra: str) -> float:
        return registry.get_sample_value(name, {**labels, **extra}) or 0.0

    return Passes(
        value("hookwire_batch_calls_count"), value("hookwire_batch_calls_sum"), value("hookwire_batch_rows_sum"),
        tuple(value("hookwire_batch_calls_bucket", le=f"{n}.0") for n in (1, 2, 3, 4)),
    )


@contextlib.contextmanager
def _one_pass(srv: ServerThread, model: str, calls: int, rows: int | None = None) -> Iterator[None]:
    """Asserts that the block ran exactly one pass on ``model``, of ``calls`` calls (and
    ``rows`` rows, where given)."""
    before = _passes(srv, model)
    yield
    got = _passes(srv, model) - before
    if rows is None:
        assert (got.passes, got.calls) == (1, calls), f"expected one pass of {calls} calls, got {got}"
    else:
        assert (got.passes, got.calls, got.rows) == (1, calls, rows), f"expected one pass of {calls} calls, got {got}"


@contextlib.contextmanager
def _alone(srv: ServerThread, model: str, calls: int) -> Iterator[None]:
    """Asserts that the block ran ``calls`` passes of one call each on ``model``."""
    before = _passes(srv, model)
    yield
    got = _passes(srv, model) - before
    assert (got.passes, got.calls) == (calls, calls), f"expected {calls} passes of 1 call, got {got}"


async def _session_events(handle: hookwire.HookHandle, result: hookwire.InferResult) -> list[hookwire.InterceptEvent]:
    """The events of a session hook up to ``result``'s call's end marker."""

    async def take() -> list[hookwire.InterceptEvent]:
        return [event async for event in handle.events(until=result)]

    return await asyncio.wait_for(take(), LIVENESS)


async def _unread_wide_session(stack: contextlib.AsyncExitStack, srv: ServerThread, x: torch.Tensor) -> tuple[
        Any, str, model_service_pb2_grpc.ModelServiceStub, model_service_pb2.InferRequest]:
    """Caller A on raw stubs (nothing reads its session stream until the test does): a
    BLOCK session of one event, a session hook capturing every layer of "wide", and the
    Infer request of ``x`` in that session. The session stream, its id, the model stub
    (on a channel of its own) and the request."""
    stream_channel = await stack.enter_async_context(grpc.aio.insecure_channel(srv.target))
    call_channel = await stack.enter_async_context(grpc.aio.insecure_channel(srv.target))
    hooks_stub = hook_service_pb2_grpc.HookServiceStub(stream_channel)
    session = hooks_stub.OpenSession(hook_service_pb2.OpenSessionRequest(delivery=hook_service_pb2.DeliveryOptions(
        policy=hook_service_pb2.DELIVERY_POLICY_BLOCK, max_events=1)))
    stack.callback(session.cancel)
    session_id = (await session.read()).opened.session_id
    await hooks_stub.RegisterHook(hook_service_pb2.RegisterHookRequest(session_id=session_id, spec=hook_pb2.HookSpec(
        model="wide", module="layers.*", posthook=hook_pb2.HookAction(capture=[hook_pb2.PART_OUTPUT]))))
    request = model_service_pb2.InferRequest(model="wide", session_id=session_id)
    request.args.add().CopyFrom(codec.encode_value(x))
    return session, session_id, model_service_pb2_grpc.ModelServiceStub(call_channel), request


def _request_events(result: hookwire.InferResult, position: int) -> list[hookwire.InterceptEvent]:
    """The events of the call's ``position``-th request-scoped hook."""
    hook_id = result.hook_ids[position]
    return [e for e in result.events if e.hook_id == hook_id]


def _map(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple):
        return tuple(_map(v, fn) for v in value)
    if isinstance(value, list):
        return [_map(v, fn) for v in value]
    if isinstance(value, Mapping):
        return {k: _map(v, fn) for k, v in value.items()}
    return value


def _clone(value: Any) -> Any:
    return _map(value, lambda t: t.detach().clone())


def assert_close(remote: Any, local: Any, tol: tuple[float, float], where: str = "value") -> None:
    """Same structure, tensors of the same dtype and shape, ``allclose`` within ``tol``."""
    atol, rtol = tol
    if isinstance(local, torch.Tensor):
        assert isinstance(remote, torch.Tensor), f"{where}: expected a tensor, got {type(remote).__name__}"
        assert remote.dtype == local.dtype and remote.shape == local.shape, (
            f"{where}: {remote.dtype}{tuple(remote.shape)} vs {local.dtype}{tuple(local.shape)}")
        if remote.is_floating_point():
            worst = float((remote - local).abs().max()) if remote.numel() else 0.0
            assert torch.allclose(remote, local, atol=atol, rtol=rtol), f"{where}: differs by up to {worst:.3g}"
        else:
            assert torch.equal(remote, local), f"{where}: differs"
    elif isinstance(local, (tuple, list)):
        assert type(remote) is type(local) and len(remote) == len(local), f"{where}: {remote!r:.80} vs {local!r:.80}"
        for i, (r, l) in enumerate(zip(remote, local)):
            assert_close(r, l, tol, f"{where}[{i}]")
    elif isinstance(local, Mapping):
        assert isinstance(remote, Mapping) and list(remote) == list(local), f"{where}: keys differ"
        for k in local:
            assert_close(remote[k], local[k], tol, f"{where}[{k!r}]")
    else:
        assert remote == local, f"{where}: {remote!r} vs {local!r}"


# ---------------------------------------------------------------------------- the oracle


#: One call's inputs: positional and keyword arguments (tensors).
Call = tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]
#: An edit of a call's rows of a module's output: (call, module path, rows) -> new rows.
Edit = Callable[[int, str, torch.Tensor], torch.Tensor]


@dataclasses.dataclass
class Tap:
    """The in-process stand-in for one remote hook: forward hooks on ``modules`` that, for
    each of ``calls`` (the calls the remote hook fires for), apply ``edit`` to the call's
    rows of the output (as the hook's rules would) and record the call's rows of
    ``parts`` (with ``select`` applied to each captured tensor), as its event holds them."""

    modules: tuple[str, ...]
    calls: tuple[int, ...]
    parts: tuple[str, ...] = ("output",)
    edit: Edit | None = None
    select: Callable[[torch.Tensor], torch.Tensor] | None = None


@dataclasses.dataclass
class Oracle:
    """Per call: its output, and per tap the events (module, call_index, parts) in firing order."""

    outputs: list[Any]
    events: list[list[list[dict[str, Any]]]]


@dataclasses.dataclass(frozen=True)
class _Segment:
    call: int
    start: int
    stop: int | None  # None: the call runs alone, nothing is cut
    length: int | None  # the call's own token length when the batch is padded past it


def _token_ids(call: Call) -> torch.Tensor:
    args, kwargs = call
    return kwargs["input_ids"] if "input_ids" in kwargs else args[0]


def _rows(call: Call) -> int:
    args, kwargs = call
    return int([*args, *kwargs.values()][0].shape[0])


def _join(model: nn.Module, calls: list[Call], pad_id: int | None) -> tuple[Call, list[_Segment], int | None]:
    """The calls' inputs as the server joins them, their segments, and the padded length."""
    lengths = [int(_token_ids(c).shape[1]) for c in calls] if pad_id is not None else [None] * len(calls)
    padded = None
    if pad_id is not None and len(set(lengths)) > 1:
        config = getattr(model, "config", None)
        rows = sum(_rows(c) for c in calls)  # the server avoids the pass's row count too
        padded = batching.padded_length(
            [n for n in lengths if n is not None], batch_settings.model_dimensions(model) | {rows},
            getattr(config, "max_position_embeddings", None))
        assert padded is not None

    def pad(x: torch.Tensor, length: int | None, value: int) -> torch.Tensor:
        if padded is None or length is None or x.dim() != 2 or x.shape[1] != length or length == padded:
            return x
        return torch.cat([x, x.new_full((x.shape[0], padded - length), value)], dim=1)

    ids_kw = "input_ids" in calls[0][1]
    args = tuple(
        torch.cat([pad(c[0][i], n, pad_id if i == 0 and not ids_kw and pad_id is not None else 0)
                   for c, n in zip(calls, lengths)])
        for i in range(len(calls[0][0]))
    )
    kwargs = {
        key: torch.cat([pad(c[1][key], n, pad_id if key == "input_ids" and pad_id is not None else 0)
                        for c, n in zip(calls, lengths)])
        for key in calls[0][1]
    }
    segments, start = [], 0
    for i, (call, n) in enumerate(zip(calls, lengths)):
        rows = _rows(call)
        segments.append(_Segment(i, start, start + rows, n if padded is not None else None))
        start += rows
    return (args, kwargs), segments, padded


def _index(x: torch.Tensor, seg: _Segment, padded: int | None) -> tuple[slice, ...]:
    """The call's rows of ``x`` and, in a padded batch, its own length in every dimension >= 1
    of the padded size."""
    index = [slice(None)] * x.dim()
    if seg.stop is None:
        return tuple(index)
    index[0] = slice(seg.start, seg.stop)
    if padded is not None and seg.length is not None and seg.length < padded:
        for d in range(1, x.dim()):
            if x.shape[d] == padded:
                index[d] = slice(0, seg.length)
    return tuple(index)


def _cut(value: Any, seg: _Segment, padded: int | None) -> Any:
    return _map(value, lambda t: t[_index(t, seg, padded)])


def run_oracle(model: nn.Module, calls: list[Call], taps: list[Tap], *, alone: bool, pad_id: int | None = None) -> Oracle:
    """The in-process oracle (see the module docstring): ``calls`` joined in one forward
    pass, or (``alone``) each in its own."""
    oracle = Oracle([None] * len(calls), [[[] for _ in taps] for _ in calls])
    groups = [[i] for i in range(len(calls))] if alone else [list(range(len(calls)))]
    for group in groups:
        if alone:
            (i,) = group
            (args, kwargs), padded = calls[i], None
            segments = [_Segment(i, 0, None, None)]
        else:
            (args, kwargs), segments, padded = _join(model, calls, pad_id)
        counters: dict[tuple[int, str, int], int] = {}
        handles = []
        for t, tap in enumerate(taps):
            for path in tap.modules:
                def hook(module: nn.Module, hook_args: Any, output: Any, t: int = t, tap: Tap = tap, path: str = path) -> Any:
                    changed = False
                    for seg in segments:
                        if seg.call not in tap.calls:
                            continue
                        key = (t, path, seg.call)
                        call_index = counters.get(key, 0)
                        counters[key] = call_index + 1
                        mine = _cut(output, seg, padded)
                        if tap.edit is not None:
                            new = tap.edit(seg.call, path, mine)
                            if not changed:
                                output, changed = output.clone(), True
                            output[_index(output, seg, padded)] = new
                            mine = new
                        parts = {"args": _cut(hook_args, seg, padded), "output": mine}
                        event = {"module": path, "call_index": call_index}
                        for part in tap.parts:
                            value = parts[part] if tap.select is None else _map(parts[part], tap.select)
                            event[part] = _clone(value)
                        oracle.events[seg.call][t].append(event)
                    return output if changed else None

                handles.append(model.get_submodule(path).register_forward_hook(hook))
        try:
            with torch.no_grad():
                output = model(*args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()
        for seg in segments:
            plain = dict(output) if isinstance(output, Mapping) else output  # a ModelOutput: as the wire carries it
            oracle.outputs[seg.call] = _clone(_cut(plain, seg, padded))
    return oracle


def _check_events(
    got: list[hookwire.InterceptEvent], want: list[dict[str, Any]], *, request_id: str, exact: bool,
    tol: tuple[float, float], where: str, first_seq: int = 1,
) -> None:
    """``got`` are exactly the events ``want`` describes, of call ``request_id``, numbered
    from ``first_seq``: bit-identical (``exact``) or allclose within ``tol``."""
    assert [(e.module, e.call_index) for e in got] == [(w["module"], w["call_index"]) for w in want], where
    assert [e.seq for e in got] == list(range(first_seq, first_seq + len(got))), f"{where}: seq"
    assert all(e.request_id == request_id for e in got), f"{where}: an event of another call"
    for n, (event, expected) in enumerate(zip(got, want)):
        for part in ("args", "output"):
            if part in expected:
                label = f"{where}[{n}] {expected['module']}.{part}"
                if exact:
                    assert_same(getattr(event, part), expected[part], label)
                else:
                    assert_close(getattr(event, part), expected[part], tol, label)


def _check_output(got: Any, want: Mapping[str, Any], keys: tuple[str, ...], *, exact: bool, tol: tuple[float, float], where: str) -> None:
    for key in keys:
        if exact:
            assert_same(got[key], want[key], f"{where}[{key!r}]")
        else:
            assert_close(got[key], want[key], tol, f"{where}[{key!r}]")


# ---------------------------------------------------------------------------- (a), (b): exactness


@dataclasses.dataclass(frozen=True)
class Capture:
    """A capturing hook: its pattern for the server, and the modules it resolves to, in order."""

    pattern: str
    modules: tuple[str, ...]
    parts: tuple[str, ...] = ("output",)


async def _check_batch(
    srv: ServerThread, name: str, model: nn.Module, calls: list[Call], *, session: list[Capture],
    request: list[Capture], keys: tuple[str, ...], pad_id: int | None = None,
) -> list[hookwire.InferResult]:
    """Runs ``calls`` on ``name`` as one batch, from one session whose hooks are ``session``,
    each call with the request-scoped hooks ``request``; checks that one pass ran, that
    every output and event is bit-identical to the batched oracle and allclose to the
    unbatched one."""
    async with hookwire.connect(srv.target) as client:
        remote = client.model(name)
        handles = [await remote.hook(c.pattern, posthook=capture(*c.parts)) for c in session]
        specs = [HookSpec(c.pattern, posthook=capture(*c.parts)) for c in request]

        def infer(call: Call) -> Callable[[], Awaitable[hookwire.InferResult]]:
            return lambda: remote.infer(*call[0], hooks=specs, kwargs=call[1])

        with _one_pass(srv, name, len(calls), sum(_rows(c) for c in calls)):
            results = await held(srv, name, [infer(call) for call in calls])
        for result in results:
            if isinstance(result, BaseException):
                raise result
        session_events = [[await _session_events(h, result) for h in handles] for result in results]
    every = tuple(range(len(calls)))
    taps = [Tap(c.modules, every, c.parts) for c in (*session, *request)]
    batched = run_oracle(model, calls, taps, alone=False, pad_id=pad_id)
    alone = run_oracle(model, calls, taps, alone=True)
    tol = TOLERANCES[name]
    seqs = [1] * len(session)
    for i, result in enumerate(results):
        for exact, oracle in ((False, alone),) if batched is None else ((True, batched), (False, alone)):
            what = "batched" if exact else "alone"
            _check_output(result.output, oracle.outputs[i], keys, exact=exact, tol=tol, where=f"call {i} ({what}) output")
            for h in range(len(session)):
                _check_events(session_events[i][h], oracle.events[i][h], request_id=result.request_id, exact=exact,
                              tol=tol, where=f"call {i} ({what}) session hook {session[h].pattern}", first_seq=seqs[h])
            for k in range(len(request)):
                _check_events(_request_events(result, k), oracle.events[i][len(session) + k],
                              request_id=result.request_id, exact=exact, tol=tol,
                              where=f"call {i} ({what}) request hook {request[k].pattern}")
        for h in range(len(session)):
            seqs[h] += len(session_events[i][h])
    return results


async def test_tiny_transformer_batch_equals_the_batched_computation(server: ServerThread, local: Local) -> None:
    """Four calls of equal shapes (1, 2, 1 and 3 rows): outputs and the events of session and
    request-scoped hooks (a tuple output, args, a module called twice) are bit-identical to
    the batched in-process pass cut per call, and close to each call alone."""
    g = torch.Generator().manual_seed(11)
    calls: list[Call] = []
    for rows in (1, 2, 1, 3):
        ids = torch.randint(0, 64, (rows, 6), generator=g)
        mask = torch.ones(rows, 6, dtype=torch.long)
        mask[-1, 4:] = 0
        calls.append(((ids,), {"attention_mask": mask}))
    layers = ("encoder.layers.0", "encoder.layers.1")
    await _check_batch(
        server, "tiny-transformer", local.tt, calls,
        session=[Capture("encoder.layers.*", layers),
                 Capture("encoder.layers.*.attn", tuple(f"{p}.attn" for p in layers), ("args", "output")),
                 Capture("norm", ("norm",))],  # called twice per pass: call_index 0 and 1
        request=[Capture("head", ("head",), ("args", "output")), Capture("encoder.layers.1.ff", ("encoder.layers.1.ff",))],
        keys=("last_hidden_state", "logits"),
    )


async def test_tiny_lm_calls_of_different_lengths_equal_the_padded_batched_computation(
    server: ServerThread, local: Local,
) -> None:
    """Token inputs of lengths 3, 8 (two rows, one padded within the call), 6 and 7 join
    padded on the right to 9 (8 is a dimension of the model, so the length is raised past
    it); every output and event, cut back to the call's own length, is bit-identical to
    the same padded pass in-process, and close to each call alone. (The pass's 5 rows are
    none of the calls' lengths: a pass never has a row count that is also a size of its
    calls' other dimensions.)"""
    assert batching.padded_length([3, 8, 6, 7], batch_settings.model_dimensions(local.lm) | {5}, 512) == 9
    g = torch.Generator().manual_seed(12)
    calls: list[Call] = []
    for rows, length in ((1, 3), (2, 8), (1, 6), (1, 7)):
        ids = torch.randint(3, local.lm.config.vocab_size, (rows, length), generator=g)
        mask = torch.ones(rows, length, dtype=torch.long)
        if rows == 2:
            ids[1, 6:], mask[1, 6:] = 0, 0  # the call's own right padding
        calls.append(((ids,), {"attention_mask": mask}))  # input_ids as the first argument
    layers = ("model.layers.0", "model.layers.1")
    results = await _check_batch(
        server, "tiny-lm", local.lm, calls,
        session=[Capture("model.layers.*", layers),
                 Capture("model.layers.*.self_attn", tuple(f"{p}.self_attn" for p in layers)),  # (output, None)
                 Capture("model.layers.0.mlp", ("model.layers.0.mlp",), ("args", "output"))],
        request=[Capture("model.norm", ("model.norm",), ("args", "output")), Capture("lm_head", ("lm_head",))],
        keys=("logits",), pad_id=0,
    )
    for result in results:
        assert list(result.output) == ["logits", CACHE] and result.output[CACHE] is None


async def test_a_padded_length_never_equals_a_head_size(server: ServerThread, local: Local) -> None:
    """tiny-lm's head size (16) is no parameter's dimension, but the rotary embedding's
    output is [rows, tokens, 16]: lengths 10 and 16 (with explicit position_ids, so the
    rotary output has the batch's rows) must pad past 16, or the call of length 10 would
    get its head dimension cut to 10 as if it were a token dimension."""
    assert batching.padded_length([10, 16], batch_settings.model_dimensions(local.lm), 512) == 17
    g = torch.Generator().manual_seed(14)
    calls: list[Call] = []
    for length in (10, 16):
        ids = torch.randint(3, local.lm.config.vocab_size, (1, length), generator=g)
        calls.append(((ids,), {"attention_mask": torch.ones(1, length, dtype=torch.long),
                               "position_ids": torch.arange(length)[None]}))
    await _check_batch(
        server, "tiny-lm", local.lm, calls, session=[Capture("model.rotary_emb", ("model.rotary_emb",))],
        request=[Capture("model.layers.1", ("model.layers.1",))], keys=("logits",), pad_id=0,
    )


async def test_minilm_calls_of_different_lengths_equal_the_padded_batched_computation(
    server: ServerThread, local: Local,
) -> None:
    """MiniLM with its real weights: texts tokenized per call (lengths 5, 12 and 7; 12 is
    the head count, so the batch pads to 13) join padded with the tokenizer's pad id 0
    (input_ids as a keyword, token_type_ids padded with 0 too); outputs and events are
    bit-identical to the padded pass in-process and close to each call alone."""
    assert local.bert is not None
    tokenizer = local.tokenizer
    assert tokenizer.pad_token_id == 0
    info = await asyncio.wait_for(_model_info(server, "minilm"), LIVENESS)
    assert info.batching.pads_tokens
    texts = (["Hello world again"], ["The quick brown fox jumps over the lazy dog.", "Batching joins calls."],
             ["hookwire hooks every layer"])
    calls: list[Call] = [((), dict(tokenizer(t, padding=True, return_tensors="pt"))) for t in texts]
    assert [_token_ids(c).shape[1] for c in calls] == [5, 12, 7]
    assert batching.padded_length([5, 12, 7], batch_settings.model_dimensions(local.bert) | {4}, 512) == 13
    outputs = tuple(f"encoder.layer.{i}.output" for i in range(6))
    await _check_batch(
        server, "minilm", local.bert, calls,
        session=[Capture("encoder.layer.*.output", outputs), Capture("embeddings", ("embeddings",), ("output",))],
        request=[Capture("pooler", ("pooler",), ("args", "output")),
                 Capture("encoder.layer.5.attention.self", ("encoder.layer.5.attention.self",))],
        keys=("last_hidden_state", "pooler_output"), pad_id=0,
    )


async def _model_info(srv: ServerThread, name: str) -> model_service_pb2.Model:
    async with hookwire.connect(srv.target) as client:
        return (await client.model(name).info()).raw


# ---------------------------------------------------------------------------- (d): isolation


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the 8-caller test hooks a model, and its inputs."""

    layers: tuple[str, str]
    norm: str
    head: str
    keys: tuple[str, ...]
    pad_id: int | None


LAYOUTS = {
    "tiny-transformer": Layout(("encoder.layers.0", "encoder.layers.1"), "norm", "head", ("last_hidden_state", "logits"), None),
    "tiny-lm": Layout(("model.layers.0", "model.layers.1"), "model.norm", "lm_head", ("logits",), 0),
}
LAYOUTS["tiny-lm-packed"] = LAYOUTS["tiny-lm"]


def _caller_inputs(name: str, local: Local, callers: int) -> list[Call]:
    """Distinct inputs per caller: 1 or 2 rows; for tiny-lm, lengths 4 to 11."""
    g = torch.Generator().manual_seed(13)
    calls: list[Call] = []
    for c in range(callers):
        rows = 1 + c % 2
        if name == "tiny-transformer":
            ids = torch.randint(0, 64, (rows, 6), generator=g)
            mask = torch.ones(rows, 6, dtype=torch.long)
        else:
            ids = torch.randint(3, local.lm.config.vocab_size, (rows, 4 + c), generator=g)
            mask = torch.ones(rows, 4 + c, dtype=torch.long)
        calls.append(((ids,), {"attention_mask": mask}))
    return calls


@pytest.mark.parametrize("name", ["tiny-transformer", "tiny-lm", "tiny-lm-packed"])
async def test_eight_callers_with_rules_each_see_and_edit_only_their_own_rows(
    server: ServerThread, local: Local, name: str,
) -> None:
    """8 callers at once, each with its own client (session), distinct inputs and its own
    session hooks with rules: a per-caller scale on layer 0's output saved to a slot, that
    slot patched into layer 1's output at position 0 (``[:, 0]``) and a per-caller shift
    added to the call's own last row (``[-1, 1:3]``), a capture of the norm's last row
    (``select="[-1]"``), and a request-scoped capture. Every output and event equals the
    caller's own oracle: bit-identical to the batched pass with each caller's edits on its
    rows, close to the caller alone; request ids, call indices and seqs are those of a call
    alone; no caller ever receives another caller's event (a further call of each caller,
    alone, sees only its own events after the batch's).

    On the packed engine (tests/packed_engine.py: every call's tokens side by side in one
    sequence, as vLLM lays out a step) the batched layout is not the padded one, so each
    caller is checked against its own in-process run alone, within the tolerance, in the
    shared pass and alone."""
    layout, model = LAYOUTS[name], (local.tt if name == "tiny-transformer" else local.lm)
    packed = name == "tiny-lm-packed"
    callers = 8
    calls = _caller_inputs(name, local, callers)
    factors = [1.0 + (c + 1) / 8 for c in range(callers)]  # exact in binary: the rule and the oracle agree
    shifts = [(c + 1) / 4 for c in range(callers)]
    slots: dict[int, torch.Tensor] = {}

    def scale_and_save(c: int, path: str, x: torch.Tensor) -> torch.Tensor:
        y = x * factors[c]
        slots[c] = y.clone()
        return y

    def patch_and_shift(c: int, path: str, x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        y[:, 0] = slots[c][:, 0]
        z = y.clone()
        z[-1, 1:3] = y[-1, 1:3] + shifts[c]
        return z

    every = tuple(range(callers))
    norm_calls = 2 if name == "tiny-transformer" else 1
    taps = [
        Tap((layout.layers[0],), every, edit=scale_and_save),
        Tap((layout.layers[1],), every, edit=patch_and_shift),
        Tap((layout.norm,), every, select=lambda t: t[-1]),
        Tap((layout.head,), every, ("args",)),  # the request-scoped hook
    ]
    request = [HookSpec(layout.head, posthook=capture("args"))]
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(hookwire.connect(server.target)) for _ in range(callers)]
        hooks = []
        for c, client in enumerate(clients):
            remote = client.model(name)
            hooks.append([
                await remote.hook(layout.layers[0], posthook=hookwire.edit(
                    rules.scale("output", factors[c]), rules.save("output", slot="keep"), capture=("output",))),
                await remote.hook(layout.layers[1], posthook=hookwire.edit(
                    rules.patch("output", slot="keep", index="[:, 0]"), rules.add("output", shifts[c], index="[-1, 1:3]"),
                    capture=("output",))),
                await remote.hook(layout.norm, posthook=capture("output", select="[-1]")),
            ])

        def infer(c: int) -> Callable[[], Awaitable[hookwire.InferResult]]:
            return lambda: clients[c].model(name).infer(*calls[c][0], hooks=request, kwargs=calls[c][1])

        with _one_pass(server, name, callers, sum(_rows(c) for c in calls)):
            results = await held(server, name, [infer(c) for c in range(callers)])
        for result in results:
            if isinstance(result, BaseException):
                raise result
        events = [[await _session_events(h, results[c]) for h in hooks[c]] for c in range(callers)]
        # Each caller once more, alone: its stream holds its own events and nothing else.
        with _alone(server, name, callers):
            again = [await infer(c)() for c in range(callers)]
        events_again = [[await _session_events(h, again[c]) for h in hooks[c]] for c in range(callers)]
    batched = None if packed else run_oracle(model, calls, taps, alone=False, pad_id=layout.pad_id)
    alone = run_oracle(model, calls, taps, alone=True)
    tol = TOLERANCES["tiny-lm" if packed else name]
    for c, result in enumerate(results):
        assert [len(e) for e in events[c]] == [1, 1, norm_calls], f"caller {c}: events per hook"
        for exact, oracle in ((False, alone),) if batched is None else ((True, batched), (False, alone)):
            where = f"caller {c} ({'batched' if exact else 'alone'})"
            _check_output(result.output, oracle.outputs[c], layout.keys, exact=exact, tol=tol, where=f"{where} output")
            for h in range(3):
                _check_events(events[c][h], oracle.events[c][h], request_id=result.request_id, exact=exact, tol=tol,
                              where=f"{where} session hook {h}")
            _check_events(_request_events(result, 0), oracle.events[c][3], request_id=result.request_id, exact=exact,
                          tol=tol, where=f"{where} request hook")
        # Alone, the same call is bit-identical to the caller's in-process run.
        _check_output(again[c].output, alone.outputs[c], layout.keys, exact=not packed, tol=tol, where=f"caller {c} again")
        for h in range(3):
            _check_events(events_again[c][h], alone.events[c][h], request_id=again[c].request_id, exact=not packed, tol=tol,
                          where=f"caller {c} again, session hook {h}", first_seq=1 + len(events[c][h]))
    # The edits are large enough that a leaked or misplaced one shows far above the tolerance.
    unedited = run_oracle(model, calls, taps[2:], alone=True)
    assert not torch.allclose(alone.outputs[0][layout.keys[-1]], unedited.outputs[0][layout.keys[-1]], atol=1e-2)


# ---------------------------------------------------------------------------- failures inside a batch


def _tt_calls(seed: int, n: int, rows: int = 1) -> list[Call]:
    g = torch.Generator().manual_seed(seed)
    return [((torch.randint(0, 64, (rows, 6), generator=g),), {"attention_mask": torch.ones(rows, 6, dtype=torch.long)})
            for _ in range(n)]


async def test_a_call_whose_rule_fails_fails_alone_and_the_others_succeed(server: ServerThread, local: Local) -> None:
    """One of 8 batched calls has a request-scoped rule that fails (an index past the call's
    length, with on_error fail_call): it fails with INVALID_ARGUMENT naming the rule; the 7
    others succeed (the shared pass failed, so each ran again alone) with outputs and
    events bit-identical to their in-process runs alone, and the events the failed shared
    pass had produced are never delivered (exactly one set per call, contiguous seqs)."""
    calls = _tt_calls(21, 8)
    bad = 5
    capture_layer0 = HookSpec("encoder.layers.0", posthook=capture("output"))
    failing = HookSpec("encoder.layers.1", posthook=[rules.zero("output", index="[:, 40]")], on_error="fail_call")
    async with hookwire.connect(server.target) as client:
        remote = client.model("tiny-transformer")
        layers = await remote.hook("encoder.layers.*", posthook=capture("output"))

        def infer(i: int) -> Callable[[], Awaitable[hookwire.InferResult]]:
            hooks = [capture_layer0, failing] if i == bad else [capture_layer0]
            return lambda: remote.infer(*calls[i][0], hooks=hooks, kwargs=calls[i][1])

        with _one_pass(server, "tiny-transformer", 8, 8):
            results = await held(server, "tiny-transformer", [infer(i) for i in range(8)])
        error = results[bad]
        assert isinstance(error, hookwire.InvalidArgumentError), error
        assert "zero on output[:, 40]" in str(error) and "encoder.layers.1" in str(error), str(error)
        ok = [r for i, r in enumerate(results) if i != bad]
        assert all(isinstance(r, hookwire.InferResult) for r in ok), results
        stream = await _session_events(layers, ok[-1])
    alone = run_oracle(local.tt, calls, [Tap(("encoder.layers.0", "encoder.layers.1"), tuple(range(8)))], alone=True)
    request_oracle = run_oracle(local.tt, calls, [Tap(("encoder.layers.0",), tuple(range(8)))], alone=True)
    # The calls ran again alone, in their order: 2 events each (the failed call's too, as
    # alone: its session hook captured both layers before its own rule failed), seq 1..16.
    assert [e.seq for e in stream] == list(range(1, 17))
    by_call = [stream[2 * i: 2 * i + 2] for i in range(8)]
    for i, result in enumerate(results):
        request_id = by_call[i][0].request_id if i == bad else result.request_id
        _check_events(by_call[i], alone.events[i][0], request_id=request_id, exact=True, tol=(0, 0),
                      where=f"call {i} session hook", first_seq=1 + 2 * i)
        if i != bad:
            _check_output(result.output, alone.outputs[i], ("last_hidden_state", "logits"), exact=True, tol=(0, 0),
                          where=f"call {i} output")
            _check_events(_request_events(result, 0), request_oracle.events[i][0], request_id=result.request_id,
                          exact=True, tol=(0, 0), where=f"call {i} request hook")
    assert by_call[bad][0].request_id not in {r.request_id for r in ok}


async def test_a_tensor_that_cannot_be_split_makes_the_calls_run_alone(
    server: ServerThread, local: Local, caplog: pytest.LogCaptureFixture,
) -> None:
    """A hook on a submodule whose output is [features, rows] (dimension 0 is not the row
    count) cannot be cut per call: the shared pass fails with that reason and its calls run
    again alone, so the callers get correct outputs and events all the same."""
    g = torch.Generator().manual_seed(22)
    calls: list[Call] = [((torch.randn(1, 5, generator=g),), {}) for _ in range(3)]
    async with hookwire.connect(server.target) as client:
        remote = client.model("transposer")
        flip = await remote.hook("flip", posthook=capture("output"))

        def infer(call: Call) -> Callable[[], Awaitable[hookwire.InferResult]]:
            return lambda: remote.infer(*call[0])

        with caplog.at_level("INFO", logger="hookwire.infer"), _one_pass(server, "transposer", 3, 3):
            results = await held(server, "transposer", [infer(c) for c in calls])
        for result in results:
            if isinstance(result, BaseException):
                raise result
        events = [await _session_events(flip, r) for r in results]
    assert any("cannot be split per call" in r.getMessage() and "run again alone" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    alone = run_oracle(local.transposer, calls, [Tap(("flip",), (0, 1, 2))], alone=True)
    for i, result in enumerate(results):
        assert_same(result.output, alone.outputs[i], f"call {i} output")
        _check_events(events[i], alone.events[i][0], request_id=result.request_id, exact=True, tol=(0, 0),
                      where=f"call {i} flip", first_seq=1 + i)


# ---------------------------------------------------------------------------- calls that run alone


async def test_a_model_with_batching_off_runs_every_call_alone(server: ServerThread, local: Local) -> None:
    """ModelHost(batching=BatchConfig(batching=False)): held calls of equal shapes still
    run one pass each, bit-identical to their in-process runs."""
    calls = _tt_calls(31, 4, rows=2)
    async with hookwire.connect(server.target) as client:
        remote = client.model("tt-solo")
        with _alone(server, "tt-solo", 4):
            results = await held(server, "tt-solo", [lambda c=c: remote(*c[0], **c[1]) for c in calls])
    alone = run_oracle(local.tt, calls, [], alone=True)
    for i, output in enumerate(results):
        assert_same(output, alone.outputs[i], f"call {i}")


async def test_calls_with_a_reducing_input_run_alone(server: ServerThread, local: Local) -> None:
    """tiny-lm calls with ``labels`` (a loss averaged over the batch's rows) run alone even
    when their shapes match, and their losses equal the in-process ones exactly; calls
    without labels queued beside them still join each other."""
    g = torch.Generator().manual_seed(32)
    ids = [torch.randint(3, local.lm.config.vocab_size, (1, 7), generator=g) for _ in range(4)]
    mask = torch.ones(1, 7, dtype=torch.long)
    async with hookwire.connect(server.target) as client:
        remote = client.model("tiny-lm")
        before = _passes(server, "tiny-lm")
        results = await held(server, "tiny-lm", [
            lambda: remote(ids[0], attention_mask=mask, labels=ids[0]),
            lambda: remote(ids[1], attention_mask=mask),
            lambda: remote(ids[2], attention_mask=mask, labels=ids[2]),
            lambda: remote(ids[3], attention_mask=mask),
        ])
        got = _passes(server, "tiny-lm") - before
    assert (got.passes, got.calls, got.buckets[0]) == (3, 4, 2), got  # two alone, the two others joined
    for i in (0, 2):
        with torch.no_grad():
            want = local.lm(ids[i], attention_mask=mask, labels=ids[i])
        assert_same(results[i]["loss"], want.loss, f"call {i} loss")
        assert_same(results[i]["logits"], want.logits, f"call {i} logits")


async def test_seeded_train_and_backward_calls_run_alone(server: ServerThread, local: Local) -> None:
    """A call with a seed, a MODE_TRAIN call and a call with a backward pass each run alone
    (bit-identical to in-process torch), while two plain calls queued around them join."""
    (plain0, seeded, train, backward, plain1) = _tt_calls(33, 5)
    async with hookwire.connect(server.target) as client:
        remote = client.model("tiny-transformer")
        before = _passes(server, "tiny-transformer")
        results = await held(server, "tiny-transformer", [
            lambda: remote.infer(*plain0[0], kwargs=plain0[1]),
            lambda: remote.infer(*seeded[0], seed=3, kwargs=seeded[1]),
            lambda: remote.infer(*train[0], mode="train", seed=4, kwargs=train[1]),
            lambda: remote.infer(*backward[0], backward=hookwire.Backward("logits"),
                                 hooks=[HookSpec("head", backward_hook=capture("grad_input"))], kwargs=backward[1]),
            lambda: remote.infer(*plain1[0], kwargs=plain1[1]),
        ])
        got = _passes(server, "tiny-transformer") - before
    for result in results:
        if isinstance(result, BaseException):
            raise result
    assert (got.passes, got.calls, got.buckets[0]) == (4, 5, 3), got
    model = local.tt
    with torch.no_grad():
        assert_same(results[1].output, model(*seeded[0], **seeded[1]), "seeded call")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(4)
            model.train()
            try:
                want_train = model(*train[0], **train[1])
            finally:
                model.eval()
        assert_same(results[2].output, want_train, "train call")
    grads: list[Any] = []
    handle = model.head.register_full_backward_hook(lambda m, gi, go: grads.append(_clone(gi)))
    try:
        want = model(*backward[0], **backward[1])
        want["logits"].backward(torch.ones_like(want["logits"]))
    finally:
        handle.remove()
        model.zero_grad(set_to_none=True)
    assert_same(results[3].output, _map(want, lambda t: t.detach()), "backward call")
    (event,) = results[3].events
    assert_same(event.grad_input, grads[0], "backward call grad_input")
    assert not torch.equal(results[2].output["logits"], results[0].output["logits"])  # train mode really differed


async def test_max_batch_size_caps_the_rows_of_a_pass(server: ServerThread, local: Local) -> None:
    """max_batch_size 3: 8 held calls of one row run as passes of 3, 3 and 2 calls, in order."""
    calls = _tt_calls(34, 8)
    async with hookwire.connect(server.target) as client:
        remote = client.model("tt-max3")
        before = _passes(server, "tt-max3")
        results = await held(server, "tt-max3", [lambda c=c: remote(*c[0], **c[1]) for c in calls])
        got = _passes(server, "tt-max3") - before
    assert (got.passes, got.calls, got.rows) == (3, 8, 8), got
    assert got.buckets == (0, 1, 3, 3), got  # one pass of 2 calls, two of 3
    groups = [calls[0:3], calls[3:6], calls[6:8]]
    batched = [o for group in groups for o in run_oracle(local.tt, group, [], alone=False).outputs]
    for i, output in enumerate(results):
        assert_same(output, batched[i], f"call {i}")


# ---------------------------------------------------------------------------- backpressure per call


async def test_a_slow_reader_holds_only_its_own_call(server: ServerThread) -> None:
    """Caller A's session stream (BLOCK, a buffer of one event) is not read while A's call
    shares a pass with B, C and D, whose own session hooks capture too: A's hook sends
    12 events of 4 MiB, far more than the stream and gRPC's transport buffers hold. B, C
    and D complete while A waits (for room on its own stream, after the pass); once A
    reads, A's call completes and its stream holds all its events, in order, with
    contiguous seqs, followed by the call's end marker."""
    g = torch.Generator().manual_seed(41)
    xs = [torch.randn(1, 64, generator=g) for _ in range(4)]
    wide = Wide()
    async with contextlib.AsyncExitStack() as stack:
        # A: raw stubs, so that nothing reads its session stream until the test does.
        session, session_id, models_stub, request = await _unread_wide_session(stack, server, xs[0])
        others = [await stack.enter_async_context(hookwire.connect(server.target)) for _ in range(3)]
        handles = [await c.model("wide").hook("layers.11", posthook=capture("output", select="[:, :8]")) for c in others]
        stream = server.call(lambda: server.server.hooks._sessions[session_id].stream)
        with _one_pass(server, "wide", 4, 4):
            tasks = await queue_held(server, "wide", [
                lambda: models_stub.Infer(request),
                *[lambda c=c, x=x: c.model("wide").infer(x) for c, x in zip(others, xs[1:])],
            ])
            a_call, rest = tasks[0], tasks[1:]
            results = await asyncio.wait_for(asyncio.gather(*rest), LIVENESS)
        await until(lambda: a_call.done() or server.call(lambda: stream.waiting_producers) > 0, "A waits for its reader")
        assert not a_call.done(), "A's events fit the transport: make them larger, or the test proves nothing"
        for c, (handle, result) in enumerate(zip(handles, results)):
            assert_same(result.output, wide(xs[c + 1]), f"caller {c + 1} output")
            (event,) = await _session_events(handle, result)
            assert event.request_id == result.request_id and event.seq == 1
            assert_same(event.output, xs[c + 1][:, :8], f"caller {c + 1} event")
        # A reads now: its call completes, and nothing of its stream was lost.
        items: list[Any] = []

        async def read_until_call_ended() -> None:
            async for item in stream_items(session):
                items.append(item)
                if isinstance(item, CallEnded):
                    return

        await asyncio.wait_for(read_until_call_ended(), LIVENESS)
        response = await asyncio.wait_for(a_call, LIVENESS)
    *events, ended = items
    assert isinstance(ended, CallEnded) and ended.request_id == response.request_id
    decoded = [hookwire.InterceptEvent.from_proto(e, chunked) for e, chunked in events]
    assert [(e.module, e.seq, e.call_index) for e in decoded] == [(f"layers.{i}", i + 1, 0) for i in range(12)]
    assert all(e.request_id == response.request_id and e.dropped == 0 for e in decoded)
    for event in decoded:
        assert_same(event.output, xs[0].repeat(1, 16384), f"A's event {event.module}")
    assert_same(codec.decode_value(response.output), wide(xs[0]), "A's output")


# ---------------------------------------------------------------------------- settings


MODELS_TOML = """
[[models]]
name = "mlp-tuned"
factory = "hookwire_server.demo_models:mlp"
max_batch_size = 5
max_batch_delay_ms = 2.5
batch_reducing_inputs = ["labels", "weights"]
pad_token_id = 0

[[models]]
name = "mlp-off"
factory = "hookwire_server.demo_models:mlp"
batching = false

[[models]]
name = "mlp-default"
factory = "hookwire_server.demo_models:mlp"

[[models]]
name = "mlp-dim1"
factory = "hookwire_server.demo_models:mlp"
batch_dim = 1
pad_token_id = 0
"""


async def test_models_report_their_batching_settings_and_batching_false_runs_alone(tmp_path: pathlib.Path) -> None:
    """Batching keys from a TOML config, over the server's defaults (max_batch_size 7,
    max_batch_delay_ms 1.5), as ListModels and GetModel report them (Model.batching); the
    model configured with ``batching = false`` runs held calls one pass each."""
    path = tmp_path / "hookwire.toml"
    path.write_text(MODELS_TOML)
    _, configs = load_config_file(path)
    srv = ServerThread(build_registry(configs), ServerSettings(port=0, max_batch_size=7, max_batch_delay_ms=1.5)).start()
    B = model_service_pb2.Batching
    want = {
        "mlp-tuned": B(enabled=True, max_batch_size=5, max_batch_delay_ms=2.5, batch_dim=0,
                       reducing_inputs=["labels", "weights"], pads_tokens=True),
        "mlp-off": B(enabled=False, max_batch_size=7, max_batch_delay_ms=1.5, reducing_inputs=["labels"]),
        "mlp-default": B(enabled=True, max_batch_size=7, max_batch_delay_ms=1.5, reducing_inputs=["labels"]),
        "mlp-dim1": B(enabled=True, max_batch_size=7, max_batch_delay_ms=1.5, batch_dim=1, reducing_inputs=["labels"],
                      pads_tokens=False),  # padding joins only along dimension 0
    }
    try:
        async with hookwire.connect(srv.target) as client:
            listed = {m.name: m.raw.batching for m in await client.list_models()}
            got = {name: (await client.model(name).info()).raw.batching for name in want}
            assert listed == want
            assert got == want
            g = torch.Generator().manual_seed(51)
            xs = [torch.randn(2, 8, generator=g) for _ in range(3)]
            remote = client.model("mlp-off")
            with _alone(srv, "mlp-off", 3):
                outputs = await held(srv, "mlp-off", [lambda x=x: remote(x) for x in xs])
        local = build_registry(configs[1:2])  # the same factory: the same seeded weights
        for x, output in zip(xs, outputs):
            with torch.no_grad():
                assert_same(output, local.get("mlp-off").module(x))
        local.shutdown()
    finally:
        srv.stop()


@pytest.mark.parametrize("line, key", [
    ("max_batch_size = 0", "max_batch_size"),
    ("max_batch_size = 5000", "max_batch_size"),
    ("max_batch_size = 2.5", "max_batch_size"),
    ('max_batch_size = "8"', "max_batch_size"),
    ("max_batch_size = true", "max_batch_size"),
    ("max_batch_delay_ms = -1.0", "max_batch_delay_ms"),
    ('max_batch_delay_ms = "5"', "max_batch_delay_ms"),
    ("batch_dim = -1", "batch_dim"),
    ("batch_dim = 1.5", "batch_dim"),
    ('batching = "no"', "batching"),
    ('batch_reducing_inputs = "labels"', "batch_reducing_inputs"),
    ("batch_reducing_inputs = [1]", "batch_reducing_inputs"),
    ("pad_token_id = -1", "pad_token_id"),
    ('pad_token_id = "0"', "pad_token_id"),
])
def test_a_bad_batching_key_is_a_config_error_naming_the_model_and_key(
    tmp_path: pathlib.Path, line: str, key: str,
) -> None:
    path = tmp_path / "hookwire.toml"
    path.write_text(f'[[models]]\nname = "mine"\nfactory = "hookwire_server.demo_models:mlp"\n{line}\n')
    with pytest.raises(ConfigError) as failure:
        load_config_file(path)
    message = str(failure.value)
    assert "model 'mine'" in message and key in message, message


# ---------------------------------------------------------------------------------------------------
# Where a shared pass could differ from its calls running alone (or one after the other, as
# before batching): each test below pins one such way. Where the case needs a shared pass, the
# test checks through the batch metrics that it formed; where keeping the calls apart is also
# right, it checks only what each call gets.


def _tt_inputs(seed: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (1, 6), generator=g) for _ in range(n)]


#: A request-scoped hook whose rule fails (index 40 is past a 6-token call): with
#: on_error fail_call it fails its call, and so the shared pass its call is in.
FAILING = HookSpec("encoder.layers.1", posthook=[rules.zero("output", index="[:, 40]")], on_error="fail_call")


# ------------------------------------- isolation: a shape coincidence cuts a tensor shared by all rows


async def test_a_tensor_shared_by_all_rows_is_not_cut_when_its_size_equals_the_batchs_rows(
    server: ServerThread,
) -> None:
    """tiny-transformer adds ``position(arange(T))``, a [T, d] tensor shared by every row
    (broadcast over the batch). With 6 calls of one 6-token row, the pass has 6 rows, so
    that tensor's dimension 0 looks like the batch dimension: Batch.take cuts "call i's
    rows" out of it (position i only) and Batch.put writes a call's edit into row i of
    the tensor every call adds. Call 0's request-scoped rule zeroes the output of
    ``position``; alone, that zeroes call 0's position embeddings and nothing else. Bug:
    the shared pass zeroes position 0 of every call (the five others' outputs change)
    and leaves call 0's positions 1-5 unedited; its capture of ``position`` is [1, 32],
    not [6, 32]. A shape coincidence must never cut a tensor silently: e.g. the scheduler
    should not form a pass whose row count equals a non-batch dimension of its inputs
    (or of the model), as padded_length already avoids the model's dimensions."""
    xs = _tt_inputs(81, 6)
    model = tiny_transformer()
    zero_position = HookSpec("position", posthook=[rules.zero("output")], on_error="fail_call")
    capture_position = HookSpec("position", posthook=capture("output"))
    async with hookwire.connect(server.target) as client:
        remote = client.model("tiny-transformer")
        before = _passes(server, "tiny-transformer")
        results = await held(server, "tiny-transformer", [
            lambda x=x, i=i: remote.infer(x, hooks=[capture_position, zero_position] if i == 0 else [])
            for i, x in enumerate(xs)
        ])
        got = _passes(server, "tiny-transformer") - before
    # Calls shared passes (today one pass of 6; a fix may form other passes, e.g. 5 + 1).
    assert got.calls == 6 and got.passes < 6, got
    for result in results:
        if isinstance(result, BaseException):
            raise result
    with torch.no_grad():
        alone = [model(x) for x in xs]
        handle = model.position.register_forward_hook(lambda m, a, o: torch.zeros_like(o))
        try:
            zeroed = model(xs[0])
        finally:
            handle.remove()
    for i in (1, 2, 3, 4, 5, 0):  # the other callers first: call 0's edit leaking into them is the worst
        want = (zeroed if i == 0 else alone[i])["last_hidden_state"]
        got = results[i].output["last_hidden_state"]
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (
            f"call {i}: differs by up to {float((got - want).abs().max()):.3g} from its run alone")
    (event,) = results[0].events
    assert tuple(event.output.shape) == (6, 32), f"call 0's capture of position has shape {tuple(event.output.shape)}"


# -------------------------------------- right padding: what a model takes from the end of the sequence


async def test_a_padded_call_keeps_its_own_last_token_logits_with_logits_to_keep(server: ServerThread) -> None:
    """tiny-lm calls of 4 and 6 tokens with ``logits_to_keep=1`` (the next-token logits
    only, a common way to call a causal LM) join, padded on the right to a common length.
    The model keeps the logits of the *last position of the padded row*: for the 4-token
    call that is a pad position, and its [1, 1, vocab] output (no token dimension of the
    padded length, so nothing is cut back) is silently the logits after two pad tokens,
    not after its own last token. Anything a model takes from the end of the sequence
    (logits_to_keep, last-token pooling) breaks alike. Such calls must run alone (or join
    only calls of their own length)."""
    g = torch.Generator().manual_seed(101)
    model = tiny_lm()
    vocab = model.config.vocab_size
    ids = [torch.randint(3, vocab, (1, n), generator=g) for n in (4, 6)]
    masks = [torch.ones_like(i) for i in ids]
    async with hookwire.connect(server.target) as client:
        remote = client.model("tiny-lm")
        # Today they share one pass; a fix may run them alone instead.
        results = await held(server, "tiny-lm", [
            lambda i=i, m=m: remote.infer(i, attention_mask=m, logits_to_keep=1) for i, m in zip(ids, masks)
        ])
    for i, (result, x, m) in enumerate(zip(results, ids, masks)):
        if isinstance(result, BaseException):
            raise result
        with torch.no_grad():
            want = model(x, attention_mask=m, logits_to_keep=1).logits
        got = result.output["logits"]
        assert got.shape == want.shape, (got.shape, want.shape)
        assert torch.allclose(got, want, atol=5e-6, rtol=1e-5), (
            f"call {i} ({x.shape[1]} tokens): its next-token logits differ by up to {float((got - want).abs().max()):.3g}")


# ---------------------------- backpressure: a call that leaves while its shared pass runs


@contextlib.contextmanager
def _gate(srv: ServerThread, model: str) -> Iterator[tuple[Any, Any]]:
    """An in-process forward pre-hook on the hosted model's root that holds each pass
    until ``open`` is set; ``entered`` is set once a pass waits there."""
    import threading

    entered, open_ = threading.Event(), threading.Event()

    def wait(module: Any, args: Any) -> None:
        entered.set()
        open_.wait(LIVENESS)

    module = srv.call(lambda: srv.server.registry.get(model).module)
    handle = module.register_forward_pre_hook(wait)
    try:
        yield entered, open_
    finally:
        open_.set()
        handle.remove()


async def test_a_call_cancelled_during_its_shared_pass_still_delivers_its_backlog_and_end_marker(
    server: ServerThread,
) -> None:
    """Caller A (session stream BLOCK, a buffer of one event, not read yet) shares a pass
    with B; A's hook sends 12 events of 4 MiB. A's client cancels while the pass runs. A
    call alone that is cancelled mid-pass still delivers every event of its pass, then its
    CallEnded marker (the pass runs to its end, Pass.end in _run_pass's finally). In a
    shared pass, the events that did not fit are left in ``Pass.backlog`` for
    ``Inference.infer`` to flush and end, but A's infer coroutine is gone: the backlog is
    never delivered and no CallEnded marker ever follows A's events (a reader waiting for
    the end of A's call waits forever). Fails after LIVENESS seconds while the bug is there."""
    g = torch.Generator().manual_seed(71)
    xa, xb = torch.randn(1, 64, generator=g), torch.randn(1, 64, generator=g)
    async with contextlib.AsyncExitStack() as stack:
        session, session_id, models_stub, request = await _unread_wide_session(stack, server, xa)
        other = await stack.enter_async_context(hookwire.connect(server.target))
        queued = lambda: server.call(lambda: server.server.inference._queued.get("wide", 0))  # noqa: E731
        with _gate(server, "wide") as (entered, open_), _one_pass(server, "wide", 2):
            a_call, b_call = await queue_held(server, "wide", [
                lambda: models_stub.Infer(request), lambda: other.model("wide").infer(xb),
            ])
            await until(entered.is_set, "the shared pass runs")
            a_call.cancel()
            await until(lambda: queued() == 1, "the server saw A's cancellation")
            open_.set()
            await asyncio.wait_for(b_call, LIVENESS)
        items: list[Any] = []

        async def read_until_call_ended() -> None:
            async for item in stream_items(session):
                items.append(item)
                if isinstance(item, CallEnded):
                    return

        try:
            await asyncio.wait_for(read_until_call_ended(), LIVENESS)
        except asyncio.TimeoutError:
            pytest.fail(f"A's stream got {len(items)} items and no CallEnded marker: its backlog was never delivered")
    *events, ended = items
    decoded = [hookwire.InterceptEvent.from_proto(e, chunked) for e, chunked in events]
    assert [(e.module, e.seq) for e in decoded] == [(f"layers.{i}", i + 1) for i in range(12)]
    assert ended.request_id == decoded[0].request_id


# ------------------------------------------------- a failed shared pass: hook state is not rolled back


async def test_a_failed_shared_pass_does_not_spend_a_hooks_sampling_budget(server: ServerThread) -> None:
    """A session hook with ``sampling.max_events = 2`` fires for calls A and B in a shared
    pass that then fails (B's own rule): the pass's events are held and dropped, and the
    calls run again alone. As if the failed pass never happened, A's and B's reruns must
    each send their event (the budget of 2). Regression guard: the hook's Sampler counted the two
    firings of the failed pass (Sampler._sent), so the reruns send nothing."""
    a, b = _tt_inputs(61, 2)
    async with hookwire.connect(server.target) as client:
        remote = client.model("tiny-transformer")
        handle = await remote.hook("encoder.layers.0", posthook=capture("output"), sampling=Sampling(max_events=2))
        try:
            with _one_pass(server, "tiny-transformer", 2):
                ra, rb = await held(server, "tiny-transformer", [
                    lambda: remote.infer(a),
                    lambda: remote.infer(b, hooks=[FAILING]),
                ])
            assert isinstance(ra, hookwire.InferResult), ra
            assert isinstance(rb, hookwire.InvalidArgumentError), rb
            events = await _session_events(handle, ra)
        finally:
            await handle.remove()
    assert [e.request_id for e in events][:1] == [ra.request_id], (
        f"call A's event was not sent: {len(events)} events (the failed shared pass used up the sampling budget)")


async def test_a_failed_shared_pass_does_not_count_its_firings(server: ServerThread) -> None:
    """Hook.fire_count counts the firings of calls; a failed shared pass whose calls run
    again alone must count each call's firing once (as the docs say: as if the failed
    pass never happened). Regression guard: the firings of the failed pass are counted too (4, not 2)."""
    a, b = _tt_inputs(62, 2)
    async with hookwire.connect(server.target) as client:
        remote = client.model("tiny-transformer")
        handle = await remote.hook("encoder.layers.0", posthook=capture("output"))
        try:
            with _one_pass(server, "tiny-transformer", 2):
                ra, rb = await held(server, "tiny-transformer", [
                    lambda: remote.infer(a),
                    lambda: remote.infer(b, hooks=[FAILING]),
                ])
            assert isinstance(ra, hookwire.InferResult) and isinstance(rb, hookwire.InvalidArgumentError), (ra, rb)
            events = await _session_events(handle, ra)
            (info,) = [h for h in await client.list_hooks() if h.hook_id == handle.id]
        finally:
            await handle.remove()
    assert len(events) == 1  # A's (B's came after A's end marker)
    assert info.fire_count == 2, f"fire_count {info.fire_count}: the failed shared pass's firings were counted"


# ----------------------------------------------------- the scheduler: waiting for company


async def test_a_call_waiting_for_company_does_not_hold_up_a_call_that_cannot_join_it(server: ServerThread) -> None:
    """After a pass of 2 rows, call X (1 row) is first in the queue: fewer rows wait than
    the last pass held, so the scheduler waits for X's expected company, up to
    max_batch_delay_ms (10 s on this model, the most the settings allow). Call Y, queued
    behind X, cannot join X (another token length): the model is idle, yet Y waits behind
    X's wait (Scheduler._loop waits on the head of the queue whatever else waits). With
    Generate steps and Infer calls on one model, every decoding step stalls behind each
    Infer call that waits for company (up to 10 ms by default), and the other way round.

    Y must not wait for X's company: it completes before X's wait could have ended. (The
    bound is X's 10 s wait, not a speed requirement: with the bug Y cannot finish before
    it, and without it Y's pass of one tiny call takes milliseconds.)"""
    ids = _tt_inputs(91, 4)
    y_ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(92))
    async with hookwire.connect(server.target) as client:
        remote = client.model("tt-patient")
        with _one_pass(server, "tt-patient", 2):  # the model's last pass held 2 rows: company is expected
            await held(server, "tt-patient", [lambda: remote.infer(ids[0]), lambda: remote.infer(ids[1])])
        scheduler = server.call(lambda: server.server.engines.scheduler(server.server.registry.get("tt-patient")))
        x = asyncio.ensure_future(remote.infer(ids[2]))
        x_queued = time.monotonic()
        try:
            await until(lambda: server.call(lambda: scheduler.queued) == 1, "X queued")
            y = asyncio.ensure_future(remote.infer(y_ids))
            x_wait_ends = x_queued + LIMIT_MAX_BATCH_DELAY_MS / 1e3
            done, _ = await asyncio.wait({y}, timeout=max(0.0, x_wait_ends - time.monotonic()))
            assert y in done, "Y waited behind X's wait for company"
            await y
        finally:
            x.cancel()
            with contextlib.suppress(BaseException):
                await x


# ------------------------------------------------ a call that fails after its shared pass


async def test_a_call_whose_output_cannot_be_sent_still_delivers_its_events_in_a_shared_pass(
    server: ServerThread,
) -> None:
    """A call whose output has no wire form fails with UNIMPLEMENTED after its pass. Alone,
    its session hook's events are delivered as they fire, then its CallEnded marker, as for
    any call that fails after its hooks fired (test_batching's failing-rule test relies on
    the same). In a shared pass, _run_shared rolls such a call back (Pass.rollback drops its
    held events) and then ends it: the stream gets the end markers of calls whose events
    were silently discarded."""
    xs = [torch.full((1, 4), float(i)) for i in range(2)]
    async with contextlib.AsyncExitStack() as stack:
        channel = await stack.enter_async_context(grpc.aio.insecure_channel(server.target))
        hooks_stub = hook_service_pb2_grpc.HookServiceStub(channel)
        models_stub = model_service_pb2_grpc.ModelServiceStub(channel)
        session = hooks_stub.OpenSession(hook_service_pb2.OpenSessionRequest())
        stack.callback(session.cancel)
        session_id = (await session.read()).opened.session_id
        await hooks_stub.RegisterHook(hook_service_pb2.RegisterHookRequest(session_id=session_id, spec=hook_pb2.HookSpec(
            model="unsendable", module="inner", posthook=hook_pb2.HookAction(capture=[hook_pb2.PART_OUTPUT]))))

        def infer(x: torch.Tensor) -> Callable[[], Awaitable[Any]]:
            request = model_service_pb2.InferRequest(model="unsendable", session_id=session_id)
            request.args.add().CopyFrom(codec.encode_value(x))
            return lambda: models_stub.Infer(request)

        with _one_pass(server, "unsendable", 2):
            results = await held(server, "unsendable", [infer(x) for x in xs])
        assert all(isinstance(r, grpc.aio.AioRpcError) and r.code() == grpc.StatusCode.UNIMPLEMENTED
                   for r in results), results
        items: list[Any] = []

        async def read_two_calls() -> None:
            ended = 0
            async for item in stream_items(session):
                items.append(item)
                ended += isinstance(item, CallEnded)
                if ended == 2:
                    return

        await asyncio.wait_for(read_two_calls(), LIVENESS)
    events = [hookwire.InterceptEvent.from_proto(*item) for item in items if isinstance(item, tuple)]
    ended = [item.request_id for item in items if isinstance(item, CallEnded)]
    assert sorted(e.request_id for e in events) == sorted(ended), (
        f"{len(events)} events for the {len(ended)} ended calls: their events were discarded")
    for event, x in zip(events, xs):
        assert torch.equal(event.output, server.call(lambda: server.server.registry.get("unsendable").module.inner)(x))


# ---------------------------------------------------- order across calls: firings interleave by module


async def test_calls_of_one_session_see_each_others_slot_saves_in_their_order(server: ServerThread) -> None:
    """Activation patching across calls of one session: a session hook saves
    ``encoder.layers.1``'s output into slot "h", another patches ``encoder.layers.0``'s
    output from it. Calls A then B, run one after the other (as before batching, and as
    the docs promise for every hook: as if each call ran alone), B patches with what A
    saved. In a shared pass, firings interleave by module: B's layer 0 is patched before
    A's layer 1 saved, so B gets the slot as it was before A (a stale value, or none), and
    its output silently differs. Calls whose hooks save and patch slots of one session
    should not share a pass with each other (or the docs must say that slots are read and
    written in module order across the pass)."""
    p_ids, a_ids, b_ids = _tt_inputs(111, 3)
    model = tiny_transformer()
    async with hookwire.connect(server.target) as client:
        remote = client.model("tiny-transformer")
        save = await remote.hook("encoder.layers.1", posthook=[rules.save("output", slot="h")])
        patch = None
        try:
            await remote.infer(p_ids)  # fills the slot (no patch yet)
            patch = await remote.hook("encoder.layers.0", posthook=[rules.patch("output", slot="h")])
            # Today they share one pass; a fix may keep such calls apart.
            ra, rb = await held(server, "tiny-transformer", [lambda: remote.infer(a_ids), lambda: remote.infer(b_ids)])
        finally:
            if patch is not None:
                await patch.remove()
            await save.remove()
    slot: dict[str, torch.Tensor] = {}

    def run(x: torch.Tensor, patching: bool) -> Any:
        handles = [model.encoder.layers[1].register_forward_hook(lambda m, a, o: slot.__setitem__("h", o.detach().clone()))]
        if patching:
            handles.append(model.encoder.layers[0].register_forward_hook(lambda m, a, o: slot["h"].clone()))
        try:
            with torch.no_grad():
                return model(x)
        finally:
            for h in handles:
                h.remove()

    run(p_ids, False)
    want_a, want_b = run(a_ids, True), run(b_ids, True)
    for name, got, want in (("A", ra, want_a), ("B", rb, want_b)):
        assert not isinstance(got, BaseException), got
        diff = float((got.output["logits"] - want["logits"]).abs().max())
        assert torch.allclose(got.output["logits"], want["logits"], atol=1e-5, rtol=1e-5), (
            f"call {name}'s output differs by up to {diff:.3g} from A then B run one after the other")
