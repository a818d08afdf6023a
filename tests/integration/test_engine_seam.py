"""The engine seam proven before vLLM arrives: the demo causal LM (tiny-lm, a
transformers Llama) served by an engine of the tests' own (tests/packed_engine.py) that
packs the tokens of the calls it runs together into one sequence, as vLLM's model
runner does (no batch dimension, no padding, attention confined to each sequence's own
tokens), behind a real server. Hook semantics hold as on the torch engine: in a packed
pass every call's hooks see exactly its own rows in the layout the call alone has,
every scope reaches exactly the calls it names, a rule edits only its own call's rows,
and what the engine refuses fails with UNIMPLEMENTED naming it. Nothing outside the
engine knows how it lays a pass out: the calls, hooks, rules and delivery are the
server's own. (The batching-isolation test of 8 callers with rules and slots runs on it
too: test_batching.py, "tiny-lm-packed".)
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
from hookwire_server.demo_models import tiny_lm
from hookwire_server.engine.packed import PackedBatch, PackedSegment
from hookwire_server.engine.seam import FEATURES, Plan
from hookwire_server.engine.torch_engine import TorchEngine
from hookwire_server.errors import InvalidArgument
from packed_engine import PackedEngine
from support import LIVENESS, ServerThread

#: Packed and alone reduce in other orders: measured 1.8e-7 on the logits (values up to ~4).
TOL = dict(rtol=1e-5, atol=2e-6)
LAYERS = ("model.layers.0", "model.layers.1", "model.norm", "lm_head")


@pytest.fixture(scope="module")
def packed() -> Iterator[tuple[ServerThread, PackedEngine]]:
    """A real server whose model "packed" (tiny-lm) runs on the packed engine, beside
    "mlp" on the torch engine."""
    registry = ModelRegistry()
    registry.add(ModelHost("packed", tiny_lm()))
    registry.add(ModelHost("mlp", nn.Sequential(nn.Linear(4, 4))))
    srv = ServerThread(registry).start()
    engine = PackedEngine(registry.get("packed"))
    srv.call(lambda: srv.server.engines.use(lambda host: engine if host.name == "packed" else TorchEngine(host)))
    yield srv, engine
    srv.stop()


def _ids(rows: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 200, (rows, length), generator=torch.Generator().manual_seed(seed))


def _alone(ids: torch.Tensor, edits: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """In-process oracle: tiny-lm on this call's tokens alone, with torch hooks that record
    each path's output (and args) and add ``edits[path]`` to its output."""
    model = tiny_lm()
    seen: dict[str, Any] = {}
    handles = []
    for path in LAYERS:
        def hook(module: nn.Module, args: Any, output: torch.Tensor, path: str = path) -> torch.Tensor:
            if edits and path in edits:
                output = output + edits[path]
            seen[path] = output.detach().clone()
            seen[path + ":args"] = args[0].detach().clone()
            return output
        handles.append(model.get_submodule(path).register_forward_hook(hook))
    with torch.no_grad():
        logits = model(ids).logits
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
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), LIVENESS)
    assert [len(p) for p in engine.passes[before:]] == (passes or [len(calls)]), engine.passes[before:]
    return results


async def test_each_call_in_a_packed_pass_sees_exactly_its_own_rows(packed) -> None:
    """Three calls of different lengths and row counts share one packed pass: each call's
    captures (args and output) of both decoder layers, the final norm and lm_head, and its
    logits are its own rows in the layout the call alone has ([rows, length, ...]), equal
    to the model on that call alone; call index, step and request id are the call's."""
    srv, engine = packed
    inputs = [_ids(1, 3, 1), _ids(2, 7, 2), _ids(1, 5, 3)]
    async with hookwire.connect(srv.target) as client:
        model = client.model("packed")
        hooks = [HookSpec("model.layers.*", posthook=capture("args", "output")),
                 HookSpec("model.norm", posthook=capture("args", "output")), HookSpec("lm_head", posthook=capture("output"))]
        results = await _together(srv, engine, [model.infer(ids, hooks=hooks) for ids in inputs])
    for ids, result in zip(inputs, results):
        logits, seen = _alone(ids)
        torch.testing.assert_close(torch.as_tensor(result.output["logits"]), logits, **TOL)
        events = {e.module: e for e in result.events}
        assert sorted(events) == sorted(LAYERS)
        for path in LAYERS:
            event = events[path]
            assert (event.call_index, event.step, event.request_id) == (0, 0, result.request_id)
            got = torch.as_tensor(event.output)
            assert list(got.shape) == list(seen[path].shape) and got.shape[:2] == ids.shape
            torch.testing.assert_close(got, seen[path], **TOL)
            if path != "lm_head":
                torch.testing.assert_close(torch.as_tensor(event.args[0]), seen[path + ":args"], **TOL)


async def test_select_and_cast_read_the_calls_own_layout(packed) -> None:
    """A capture's select counts positions in the call's own layout: ``[:, -1]`` is each
    sequence's last token, not the packed tensor's; a cast applies to those rows."""
    srv, engine = packed
    inputs = [_ids(2, 4, 5), _ids(1, 6, 6)]
    async with hookwire.connect(srv.target) as client:
        model = client.model("packed")
        hooks = [HookSpec("model.norm", posthook=capture("output", select="[:, -1]", cast="float16"))]
        results = await _together(srv, engine, [model.infer(ids, hooks=hooks) for ids in inputs])
    for ids, result in zip(inputs, results):
        _, seen = _alone(ids)
        (event,) = result.events
        got = torch.as_tensor(event.output)
        assert got.dtype == torch.float16 and list(got.shape) == [ids.shape[0], 64]
        torch.testing.assert_close(got.float(), seen["model.norm"][:, -1].half().float(), rtol=1e-3, atol=1e-3)


async def test_a_rule_in_a_packed_pass_edits_only_its_own_calls_rows(packed) -> None:
    """Four callers share one packed pass: three steer layer 0 with vectors of their own
    (one only at its last position, by index), one does not. Each output equals its own
    in-process edit (or none): no edit crossed into another call's tokens."""
    srv, engine = packed
    g = torch.Generator().manual_seed(5)
    vectors = [torch.randn(64, generator=g) for _ in range(3)]
    inputs = [_ids(1, 4, 20), _ids(2, 6, 21), _ids(1, 2, 22), _ids(1, 5, 23)]
    async with hookwire.connect(srv.target) as client:
        model = client.model("packed")
        calls = []
        for i, ids in enumerate(inputs):
            steer = []
            if i < 3:
                index = "[:, -1]" if i == 1 else None
                steer = [HookSpec("model.layers.0", posthook=[rules.add("output", vectors[i], index=index)])]
            calls.append(model.infer(ids, hooks=[*steer, HookSpec("model.layers.1", posthook=capture("output"))]))
        results = await _together(srv, engine, calls)
    for i, (ids, result) in enumerate(zip(inputs, results)):
        edit = None
        if i < 3:
            edit = torch.zeros(ids.shape[0], ids.shape[1], 64)
            if i == 1:
                edit[:, -1] = vectors[i]
            else:
                edit[:] = vectors[i]
        logits, seen = _alone(ids, {"model.layers.0": edit} if edit is not None else None)
        torch.testing.assert_close(torch.as_tensor(result.output["logits"]), logits, **TOL)
        (event,) = [e for e in result.events if e.module == "model.layers.1"]
        torch.testing.assert_close(torch.as_tensor(event.output), seen["model.layers.1"], **TOL)
    unsteered, _ = _alone(inputs[0])
    assert not torch.allclose(torch.as_tensor(results[0].output["logits"]), unsteered, atol=1e-3)


async def test_session_tagged_and_all_scopes_reach_exactly_their_calls_in_a_packed_pass(packed) -> None:
    """In one packed pass of four calls: a session hook fires for its session's call only,
    a tagged hook for the tagged call only, a SCOPE_ALL hook (another principal's
    session) once for every call, each with that call's own rows."""
    srv, engine = packed
    inputs = [_ids(1, 3, 30), _ids(1, 5, 31), _ids(2, 4, 32), _ids(1, 6, 33)]
    async with hookwire.connect(srv.target) as a, hookwire.connect(srv.target) as b, \
            hookwire.connect(srv.target) as watcher:
        mine = await a.model("packed").hook("model.norm", posthook=capture("output"))
        tagged = await watcher.model("packed").hook("model.layers.1", posthook=capture("output"), scope="tagged",
                                                     tags=["probe"])
        every = await watcher.model("packed").hook("lm_head", posthook=capture("output", select="[:, -1]"), scope="all")
        results = await _together(srv, engine, [
            a.model("packed").infer(inputs[0]), b.model("packed").infer(inputs[1]),
            b.model("packed").infer(inputs[2], tags=["probe"]), b.model("packed").infer(inputs[3]),
        ])
        session_events = await _events(mine, 1)
        tagged_events = await _events(tagged, 1)
        all_events = await _events(every, 4)
    assert [e.request_id for e in session_events] == [results[0].request_id]
    torch.testing.assert_close(torch.as_tensor(session_events[0].output), _alone(inputs[0])[1]["model.norm"], **TOL)
    assert [e.request_id for e in tagged_events] == [results[2].request_id]
    torch.testing.assert_close(torch.as_tensor(tagged_events[0].output), _alone(inputs[2])[1]["model.layers.1"], **TOL)
    by_request = {e.request_id: e for e in all_events}
    assert sorted(by_request) == sorted(r.request_id for r in results)
    for ids, result in zip(inputs, results):
        torch.testing.assert_close(torch.as_tensor(by_request[result.request_id].output),
                                   _alone(ids)[1]["lm_head"][:, -1], **TOL)


async def _events(handle: Any, n: int) -> list[Any]:
    out = []
    async for event in handle.events():
        out.append(event)
        if len(out) == n:
            return out
    return out


async def test_a_tensor_not_laid_out_by_tokens_makes_the_calls_run_alone(packed) -> None:
    """Attention probabilities of a packed pass are [1, heads, tokens, tokens]: not one
    call's rows. Capturing them fails the shared pass, and each call runs again alone
    and gets its own capture and result."""
    srv, engine = packed
    inputs = [_ids(1, 3, 40), _ids(1, 4, 41)]
    async with hookwire.connect(srv.target) as client:
        model = client.model("packed")
        hooks = [HookSpec("model.layers.0.self_attn", posthook=capture("output"))]
        results = await _together(srv, engine, [model.infer(ids, hooks=hooks) for ids in inputs], passes=[2, 1, 1])
    for ids, result in zip(inputs, results):
        assert not isinstance(result, BaseException), result
        torch.testing.assert_close(torch.as_tensor(result.output["logits"]), _alone(ids)[0], **TOL)
        (event,) = result.events
        assert list(torch.as_tensor(event.output[1]).shape) == [1, 4, ids.shape[1], ids.shape[1]]


async def test_what_the_engine_refuses_is_named_and_fails_that_call_only(packed) -> None:
    """ListModels names each model's engine and what it refuses. A backward hook, a
    MODE_TRAIN call and Generate on the packed model answer UNIMPLEMENTED naming the
    engine and the feature, before anything runs; an input the engine cannot pack fails
    that call alone while the call it was to share a pass with gets its own result; the
    torch model beside it refuses nothing."""
    srv, engine = packed
    async with hookwire.connect(srv.target) as client:
        listed = {m.name: m for m in await client.list_models()}
        assert listed["packed"].engine == "packed" and listed["mlp"].engine == "torch"
        assert listed["packed"].refused_features == PackedEngine.refused
        assert listed["mlp"].refused_features == {}
        model = client.model("packed")
        with pytest.raises(hookwire.UnimplementedError, match="packed engine, which does not support backward"):
            await model.hook("model.layers.0", backward_hook=capture("grad_output"))
        with pytest.raises(hookwire.UnimplementedError, match="mode: MODE_TRAIN.*packed engine"):
            await model.infer(_ids(1, 3, 1), mode="train")
        with pytest.raises(hookwire.UnimplementedError, match="Generate.*packed engine.*generate"):
            await model.generate(_ids(1, 3, 1), 1)
        ok = _ids(1, 4, 1)
        bad, good = await _together(srv, engine, [
            _outcome(model.infer(ok, attention_mask=torch.zeros(1, 4, dtype=torch.long))), _outcome(model.infer(ok)),
        ], passes=[1])  # the shared pass failed before it ran; the good call ran alone
    assert isinstance(bad, hookwire.UnimplementedError) and "packed engine" in str(bad), bad
    torch.testing.assert_close(torch.as_tensor(good.output["logits"]), _alone(ok)[0], **TOL)


async def _outcome(call: Any) -> Any:
    try:
        return await call
    except hookwire.HookwireError as exc:
        return exc


def test_the_torch_engine_names_itself_and_refuses_nothing() -> None:
    """The seam's first engine: the torch engine refuses no feature, names itself, and
    refuses work of a kind it has no executor for; every feature an engine may refuse is
    one the seam names."""
    engine = TorchEngine(ModelHost("m", nn.Linear(2, 2)))
    assert engine.name == "torch" and dict(engine.refused) == {}
    assert set(PackedEngine.refused) <= set(FEATURES)
    with pytest.raises(InvalidArgument, match="runs no work of kind 'no-such-kind'"):
        engine.execute(Plan("no-such-kind", [object()]))


def test_a_packed_layout_pads_a_calls_shorter_sequences_on_the_left_and_writes_back_only_real_tokens() -> None:
    """A call whose sequences differ in length (a prompt step on a paged-KV engine) sees
    them left-padded with zeros to its longest; a rule's write lands on its own tokens
    only (pad positions are dropped), and another call's tokens are untouched."""
    x = torch.arange(9 * 2, dtype=torch.float32).view(9, 2)  # [tokens, hidden], dim 0 as in vLLM
    mine = PackedSegment.of(None, [(0, 2), (2, 5)])  # type: ignore[arg-type]
    other = PackedSegment.of(None, [(5, 9)])  # type: ignore[arg-type]
    batch = PackedBatch([mine, other], dim=0, tokens=9)
    view = batch.take(x, mine, "t")
    assert view.shape == (2, 3, 2)
    torch.testing.assert_close(view[0], torch.cat([torch.zeros(1, 2), x[0:2]]))
    torch.testing.assert_close(view[1], x[2:5])
    assert batch.take(x, other, "t").shape == (1, 4, 2)
    edited = view + 100
    out = batch.put(x, view, edited, mine, "t", set())
    torch.testing.assert_close(out[0:5], x[0:5] + 100)
    torch.testing.assert_close(out[5:], x[5:])
    with pytest.raises(InvalidArgument, match="cannot be split per call"):
        batch.take(torch.zeros(4, 2), mine, "t")
