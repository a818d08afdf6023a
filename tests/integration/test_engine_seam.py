"""The engine seam proven before vLLM arrives: an engine of the tests' own, behind
``hookwire_server.engine.seam``, that packs the tokens of the calls it runs together into
one ``[tokens, hidden]`` layout (as vLLM's model runner does: no batch dimension, no
padding, attention confined to each call's own tokens), runs behind a real server, and
passes hookwire's hook-semantics and batching-isolation checks: in a shared pass every
call's hooks see exactly its own rows, as that call alone sees them, and a rule edits
only its own call's rows. Nothing outside the engine knows how it lays a pass out: the
calls, hooks, rules and delivery are the server's own.
"""

from __future__ import annotations

import asyncio
from typing import Any, Iterator

import pytest
import torch
from torch import nn

import hookwire
from hookwire import HookSpec, capture, rules
from hookwire_server import ModelHost, ModelRegistry
from hookwire_server.engine import infer_pass
from hookwire_server.engine.batching import Batch, Segment, Shape
from hookwire_server.engine.pass_runner import call_model, run_joined, running
from hookwire_server.engine.seam import INFER, Plan
from hookwire_server.engine.torch_engine import TorchEngine
from hookwire_server.errors import InvalidArgument, Unimplemented
from hookwire_server.hooks.hook_record import HookRecord
from hookwire.wire import codec
from support import LIVENESS, ServerThread


VOCAB, HIDDEN = 40, 16


class Block(nn.Module):
    """Causal self-attention within each call's own tokens, then an MLP (pre-norm residual)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.out = nn.Linear(HIDDEN, HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        scores = (q @ k.T) / HIDDEN ** 0.5
        x = x + self.out(torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v)
        return x + self.mlp(x)


class PackedLM(nn.Module):
    """A small LM over packed tokens: ``forward(tokens [T], starts)`` with ``starts`` the
    first token of each sequence (and T at the end); every module's output is ``[T, ...]``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor, starts: list[int]) -> torch.Tensor:
        seq = torch.zeros(len(tokens), dtype=torch.long)
        for i, (a, b) in enumerate(zip(starts, starts[1:])):
            seq[a:b] = i
        position = torch.arange(len(tokens))
        allowed = (seq[:, None] == seq[None, :]) & (position[None, :] <= position[:, None])
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, allowed)
        return self.head(x)


def _packed_lm() -> PackedLM:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        return PackedLM().eval()


class PackedEngine:
    """An engine behind the seam that packs its calls' tokens (see the module docstring).
    It runs Infer calls whose one argument is a ``[1, L]`` int64 token matrix, and refuses
    the rest (backward, train mode, Generate) with UNIMPLEMENTED naming itself."""

    name = "packed"
    refused = {"backward": "a packed engine runs in inference mode", "generate": "not in this test engine"}

    def __init__(self, host: ModelHost) -> None:
        self.host = host
        #: The calls of each pass it ran (their request ids), in order.
        self.passes: list[list[str]] = []

    def infer_shape(self, request: Any) -> Shape | None:
        """Any one-sequence token call joins any other: packing needs no common length."""
        if len(request.args) != 1 or len(request.kwargs) or request.args[0].WhichOneof("kind") != "tensor":
            return None
        shape = list(request.args[0].tensor.shape)
        return Shape(("packed",), 1, None, frozenset()) if len(shape) == 2 and shape[0] == 1 else None

    def execute(self, plan: Plan) -> list[Any]:
        if plan.kind != INFER:
            return [Unimplemented(f"the {self.name} engine does not run {plan.kind}")] * len(plan.items)
        return run_joined(self.host, plan.items, self._pass, lambda call: self._pass([call])[0], what="packed pass")

    def _pass(self, calls: list[infer_pass.InferCall]) -> list[Any]:
        tokens = [self._tokens(call) for call in calls]
        starts = [0]
        for t in tokens:
            starts.append(starts[-1] + len(t))
        # Each call's rows are its own token range of the packed tensors (one segment: unsliced).
        batch = Batch([Segment(c.p, a, b) for c, a, b in zip(calls, starts, starts[1:])] if len(calls) > 1
                      else [Segment(calls[0].p, 0, 0)])
        self.passes.append([c.p.request_id for c in calls])
        records: list[HookRecord] = [r for c in calls for r in c.records]
        with running(self.host, batch, records), torch.no_grad():
            logits = call_model(self.host, "forward", lambda: self.host.module(torch.cat(tokens), starts))
            mine = batch.split(logits, "the logits") if batch.shared else [logits]
        results: list[Any] = []
        for call, out in zip(calls, mine):
            codec.encode_value_into(out.contiguous(), call.p.response.output)
            results.append(infer_pass.delivered(call, call.p.response))
        return results

    def _tokens(self, call: infer_pass.InferCall) -> torch.Tensor:
        if call.backward is not None or call.train or len(call.request.args) != 1:
            raise Unimplemented(f"the {self.name} engine runs eval-mode calls with one [1, L] token matrix only")
        ids = codec.decode_value(call.request.args[0])
        return ids.reshape(-1).to(torch.long)


@pytest.fixture(scope="module")
def packed() -> Iterator[tuple[ServerThread, PackedEngine]]:
    """A real server whose model "packed" runs on the packed engine (the others on torch)."""
    registry = ModelRegistry()
    registry.add(ModelHost("packed", _packed_lm()))
    srv = ServerThread(registry).start()
    engines = srv.server.engines
    engine = PackedEngine(registry.get("packed"))
    srv.call(lambda: engines.use(lambda host: engine if host.name == "packed" else TorchEngine(host)))
    yield srv, engine
    srv.stop()


def _ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def _alone(ids: torch.Tensor, edits: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """In-process oracle: the same model on this call's tokens alone, with torch hooks that
    record every layer's and the head's output and add ``edits[path]`` to that output."""
    model = _packed_lm()
    seen: dict[str, torch.Tensor] = {}
    handles = []
    for path, module in model.named_modules():
        if path in ("layers.0", "layers.1", "head"):
            def hook(module: nn.Module, args: Any, output: torch.Tensor, path: str = path) -> torch.Tensor:
                if edits and path in edits:
                    output = output + edits[path]
                seen[path] = output.detach().clone()
                return output
            handles.append(module.register_forward_hook(hook))
    with torch.no_grad():
        tokens = ids.reshape(-1)
        logits = model(tokens, [0, len(tokens)])
    for h in handles:
        h.remove()
    return logits, seen


async def _together(srv: ServerThread, engine: PackedEngine, calls: list[Any], passes: list[int] | None = None) -> list[Any]:
    """Runs the calls released together (the scheduler is held until all are queued) and
    asserts the engine's passes: one pass of them all unless ``passes`` says otherwise."""
    scheduler = srv.call(lambda: srv.server.engines.scheduler(srv.server.registry.get("packed")))
    before = len(engine.passes)
    srv.call(scheduler.hold)
    try:
        tasks = [asyncio.ensure_future(call) for call in calls]
        deadline = asyncio.get_running_loop().time() + LIVENESS
        while srv.call(lambda: scheduler.queued) < len(calls):
            assert asyncio.get_running_loop().time() < deadline, "calls not queued"
            await asyncio.sleep(0.01)
    finally:
        srv.call(scheduler.release)
    results = await asyncio.wait_for(asyncio.gather(*tasks), LIVENESS)
    assert [len(p) for p in engine.passes[before:]] == (passes or [len(calls)]), engine.passes[before:]
    return results


PATHS = ("layers.0", "layers.1", "head")


async def test_each_call_in_a_packed_pass_sees_exactly_its_own_rows(packed) -> None:
    """Three calls of different lengths share one packed pass: each call's captures of
    every layer and of the head, and its output, are its own rows, as the model computes
    them for that call alone (the shapes a call alone has: [L, ...], no padding)."""
    srv, engine = packed
    lengths = (3, 7, 5)
    inputs = [_ids(n, seed) for seed, n in enumerate(lengths)]
    async with hookwire.connect(srv.target) as client:
        model = client.model("packed")
        hooks = [HookSpec("layers.*", posthook=capture("output")), HookSpec("head", posthook=capture("output"))]
        results = await _together(srv, engine, [model.infer(ids, hooks=hooks) for ids in inputs])
    for ids, result in zip(inputs, results):
        logits, seen = _alone(ids)
        torch.testing.assert_close(torch.as_tensor(result.output), logits, rtol=1e-5, atol=1e-6)
        events = {e.module: e for e in result.events}
        assert sorted(events) == sorted(PATHS)
        for path in PATHS:
            event = events[path]
            assert event.call_index == 0 and event.request_id == result.request_id
            got = torch.as_tensor(event.output)
            assert list(got.shape) == list(seen[path].shape) and got.shape[0] == ids.shape[1]
            torch.testing.assert_close(got, seen[path], rtol=1e-5, atol=1e-6)


async def test_a_rule_in_a_packed_pass_edits_only_its_own_calls_rows(packed) -> None:
    """Four callers share one packed pass: three steer layer 0 with vectors of their own,
    one does not. Each output equals its own in-process edit (or none): no edit crossed
    into another call's tokens."""
    srv, engine = packed
    g = torch.Generator().manual_seed(5)
    vectors = [torch.randn(HIDDEN, generator=g) for _ in range(3)]
    inputs = [_ids(n, 20 + i) for i, n in enumerate((4, 6, 2, 5))]
    async with hookwire.connect(srv.target) as client:
        model = client.model("packed")
        calls = []
        for i, ids in enumerate(inputs):
            steer = [HookSpec("layers.0", posthook=[rules.add("output", vectors[i])])] if i < 3 else []
            calls.append(model.infer(ids, hooks=[*steer, HookSpec("layers.1", posthook=capture("output"))]))
        results = await _together(srv, engine, calls)
    for i, (ids, result) in enumerate(zip(inputs, results)):
        logits, seen = _alone(ids, {"layers.0": vectors[i]} if i < 3 else None)
        torch.testing.assert_close(torch.as_tensor(result.output), logits, rtol=1e-5, atol=1e-6)
        (event,) = [e for e in result.events if e.module == "layers.1"]
        torch.testing.assert_close(torch.as_tensor(event.output), seen["layers.1"], rtol=1e-5, atol=1e-6)


async def test_what_the_engine_refuses_fails_that_call_only(packed) -> None:
    """A call the engine cannot run (two arguments) fails with UNIMPLEMENTED naming the
    engine; the call it was to share a pass with runs again alone and gets its own result."""
    srv, engine = packed
    ok = _ids(4, 1)
    async with hookwire.connect(srv.target) as client:
        model = client.model("packed")
        bad, good = await _together(srv, engine, [
            asyncio.ensure_future(_outcome(model.infer(ok, ok))), asyncio.ensure_future(_outcome(model.infer(ok))),
        ], passes=[1])  # the shared pass failed before it ran; the good call ran alone (the bad one never reached the model)
    assert isinstance(bad, hookwire.UnimplementedError) and "packed engine" in str(bad), bad
    torch.testing.assert_close(torch.as_tensor(good.output), _alone(ok)[0], rtol=1e-5, atol=1e-6)


async def _outcome(call: Any) -> Any:
    try:
        return await call
    except hookwire.HookwireError as exc:
        return exc


def test_the_torch_engine_names_itself_and_refuses_nothing() -> None:
    """The seam's first engine: the torch engine refuses no feature, names itself, and
    refuses work of a kind it has no executor for."""
    engine = TorchEngine(ModelHost("m", nn.Linear(2, 2)))
    assert engine.name == "torch" and dict(engine.refused) == {}
    with pytest.raises(InvalidArgument, match="runs no work of kind 'no-such-kind'"):
        engine.execute(Plan("no-such-kind", [object()]))
