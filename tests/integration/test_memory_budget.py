"""The memory budget (memory_budget.py, docs/security.md "Memory budget"), against a real
``hookwire serve`` process on the demo models whose address space is capped (RLIMIT_AS,
set on the running process with prlimit): a regression that lets a call allocate what it
asks for fails the call there instead of taking this machine down.

- The request that killed the server (tiny-lm, 4096 × 512 tokens: ~17 GiB of attention
  scores per layer with eager attention) is refused with RESOURCE_EXHAUSTED naming its
  estimate and memory_budget_bytes, and the server goes on serving.
- Calls that each fit the budget but together would not are all answered, with the
  in-process model's results, while another tenant's small calls are answered too.
- A Generate call whose prompt pass and KV cache can never fit is refused before it
  starts; a harvest job whose batch can never fit is refused at its start, and one whose
  batches fit runs with each batch claiming and giving back its estimate.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import resource
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

import hookwire
from hookwire.v1 import harvest_service_pb2 as hv
from hookwire.v1 import harvest_service_pb2_grpc as hv_grpc
from hookwire.wire.codec import encode_tensor
from hookwire_server.demo_models import tiny_lm, tiny_transformer
from support import PROCESS_LIVENESS, serve_process, until

GIB = 1 << 30
BUDGET = 3 * GIB // 2
#: Address space the server may add to what it has once it serves: the budget, and room
#: for threads' stacks, malloc arenas and gRPC's buffers.
HEADROOM = 6 * GIB


def _vm_size(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmSize")


@pytest.fixture(scope="module")
def capped_server() -> Iterator[str]:
    tests = str(pathlib.Path(__file__).resolve().parents[1])  # support.py's hungry model
    env = {"HOOKWIRE_MEMORY_BUDGET_BYTES": str(BUDGET),
           "PYTHONPATH": os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH", "")) if p)}
    with serve_process("--demo", "--model", "hungry=support:hungry_factory", env=env) as (proc, target):
        ceiling = _vm_size(proc.pid) + HEADROOM
        resource.prlimit(proc.pid, resource.RLIMIT_AS, (ceiling, ceiling))
        yield target


async def _healthy(target: str) -> None:
    async with grpc.aio.insecure_channel(target) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    async with hookwire.connect(target) as client:
        ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(1))
        out = await client.model("tiny-transformer")(ids)
        with torch.no_grad():
            want = tiny_transformer()(ids)
        assert torch.equal(out["logits"], want["logits"])


async def test_the_request_that_killed_the_server_is_refused_naming_its_estimate(capped_server: str) -> None:
    async with hookwire.connect(capped_server) as client:
        with pytest.raises(hookwire.ResourceExhaustedError) as info:
            await client.model("tiny-lm")(torch.ones(4096, 512, dtype=torch.long))
    message = str(info.value)
    assert "Infer on 'tiny-lm'" in message and "estimated peak" in message, message
    assert "attention scores" in message and "GiB" in message, message
    assert "memory_budget_bytes" in message, message
    await _healthy(capped_server)


async def test_calls_that_fit_alone_but_not_together_are_all_answered(capped_server: str) -> None:
    # Each ~0.4 GiB by the estimate: three fit the 1.5 GiB budget at once, eight do not.
    g = torch.Generator().manual_seed(3)
    inputs = [torch.randint(0, 300, (24, 512), generator=g) for _ in range(8)]
    small = torch.randint(0, 64, (1, 5), generator=g)
    clients = [await hookwire.connect(capped_server).__aenter__() for _ in range(len(inputs) + 1)]
    try:
        big = [asyncio.ensure_future(c.model("tiny-lm")(x)) for c, x in zip(clients, inputs)]
        # Another tenant's small calls while the large ones wait for each other.
        for _ in range(3):
            out = await clients[-1].model("tiny-transformer")(small)
            assert out["logits"].shape == (1, 4) or out["logits"].shape[0] == 1
        results = await asyncio.wait_for(asyncio.gather(*big), PROCESS_LIVENESS)
    finally:
        for c in clients:
            await c.__aexit__(None, None, None)
    model = tiny_lm()
    with torch.no_grad():
        for x, got in zip(inputs[:2], results[:2]):
            assert torch.equal(got["logits"], model(x).logits)
    assert all(r["logits"].shape == (24, 512, model.config.vocab_size) for r in results)
    await _healthy(capped_server)


async def test_a_generate_call_that_can_never_fit_is_refused_before_it_starts(capped_server: str) -> None:
    ids = torch.randint(0, 300, (256, 500), generator=torch.Generator().manual_seed(4))
    async with hookwire.connect(capped_server) as client:
        with pytest.raises(hookwire.ResourceExhaustedError) as info:
            await client.model("tiny-lm").generate(ids, 4)
    message = str(info.value)
    assert "Generate on 'tiny-lm'" in message and "memory_budget_bytes" in message, message
    await _healthy(capped_server)


async def test_a_harvest_whose_batch_can_never_fit_is_refused_and_one_that_fits_runs(
    make_server: Any, tmp_path: pathlib.Path,
) -> None:
    # In-process, with a budget far below a batch of 32 × 512 tokens (nothing is allocated:
    # the estimate refuses it), and above a batch of 2 × 8.
    srv = make_server(memory_budget_bytes=64 << 20, harvest_output_root=str(tmp_path))
    ids = torch.randint(0, 300, (32, 512), generator=torch.Generator().manual_seed(5))
    tokens = hv.HarvestSource(tokens=hv.TokenSource(input_ids=encode_tensor(ids)))
    async with grpc.aio.insecure_channel(srv.target) as channel:
        stub = hv_grpc.HarvestServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.StartHarvest(hv.StartHarvestRequest(
                model="tiny-lm", modules=["model.layers.*"], source=tokens,
                contexts=hv.HarvestContexts(length=512, batch_size=32), output=hv.HarvestOutput(path="big"),
            ))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "memory_budget_bytes" in (info.value.details() or ""), info.value.details()
        small = hv.HarvestSource(tokens=hv.TokenSource(input_ids=encode_tensor(ids[:4, :8])))
        job = await stub.StartHarvest(hv.StartHarvestRequest(
            model="tiny-lm", modules=["model.layers.*"], source=small,
            contexts=hv.HarvestContexts(length=8, batch_size=2), output=hv.HarvestOutput(path="small"),
        ))
        last = job
        async for last in stub.WatchHarvest(hv.WatchHarvestRequest(job_id=job.job_id, interval_ms=50)):
            pass
        assert last.state == hv.HARVEST_STATE_SUCCEEDED, last
    budget = srv.call(lambda: srv.server.state.budget)
    assert budget.claimed == 0 and 0 < budget.peak <= 64 << 20
    metrics = srv.server.metrics.registry
    assert metrics.get_sample_value("hookwire_memory_refused_total") == 1
    assert metrics.get_sample_value("hookwire_memory_budget_bytes") == 64 << 20
    assert metrics.get_sample_value("hookwire_memory_claimed_bytes") == 0
    assert metrics.get_sample_value("hookwire_memory_resident_bytes") > 0  # tiny-lm's weights


async def test_a_call_whose_caller_left_keeps_its_claim_until_its_pass_is_back(make_server: Any) -> None:
    # The sleeper model sleeps x seconds in its forward: the client stops waiting while the
    # pass runs; the memory the pass uses stays claimed until the pass is back.
    srv = make_server()
    budget = srv.call(lambda: srv.server.state.budget)
    async with hookwire.connect(srv.target) as client:
        task = asyncio.ensure_future(client.model("sleeper")(torch.tensor(3.0)))
        scheduler = srv.call(lambda: srv.server.engines.scheduler(srv.server.registry.get("sleeper")))
        await until(lambda: srv.call(lambda: scheduler._host._executor.busy), "the pass running")
        assert srv.call(lambda: budget.claimed) > 0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: not srv.call(lambda: srv.server.inference._queued.get("sleeper", 0)), "the call ended")
        # (read together on the server's loop: while the pass runs, its claim must still be held)
        running, claimed = srv.call(lambda: (scheduler._host._executor.busy, budget.claimed))
        assert claimed > 0 or not running, "given back while its pass still runs"
        await until(lambda: srv.call(lambda: budget.claimed) == 0, "given back once the pass is back")
        assert (await client.model("sleeper")(torch.tensor(0.0))).item() == 0.0


async def test_an_allocation_no_estimate_foresaw_fails_its_call_as_out_of_memory(capped_server: str) -> None:
    # The hungry model allocates what its input's value says (100 GiB here): the address-
    # space ceiling refuses it inside the pass; the call is RESOURCE_EXHAUSTED naming the
    # model (not INVALID_ARGUMENT blaming a module), and the server goes on.
    async with hookwire.connect(capped_server) as client:
        with pytest.raises(hookwire.ResourceExhaustedError) as info:
            await client.model("hungry")(torch.tensor(100.0 * GIB))
        assert "ran out of memory" in str(info.value) and "'hungry'" in str(info.value), str(info.value)
        assert (await client.model("hungry")(torch.tensor(8.0))).item() == 8.0
    await _healthy(capped_server)


async def test_a_generate_call_whose_caller_left_keeps_its_claim_until_its_engine_ends_it(make_server: Any) -> None:
    # The caller closes the stream after its first tokens; the model's scheduler is held,
    # so the engine cannot end the call yet: its KV cache (and any step in flight) lives
    # on, and so must its claim in the budget, given back once the engine has ended it.
    srv = make_server()
    budget = srv.call(lambda: srv.server.state.budget)
    scheduler = srv.call(lambda: srv.server.engines.scheduler(srv.server.registry.get("tiny-lm")))
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(6))
    async with hookwire.connect(srv.target) as client:
        stream = client.model("tiny-lm").generate(ids, 40)
        async for item in stream:
            if isinstance(item, hookwire.GeneratedTokens):
                break
        assert srv.call(lambda: budget.claimed) > 0
        srv.call(scheduler.hold)
        try:
            await stream.aclose()
            await until(lambda: not srv.call(lambda: srv.server.generation._active.get("tiny-lm", 0)),
                        "the call ended on the server")
            assert srv.call(lambda: budget.claimed) > 0, "given back before its engine ended the call"
        finally:
            srv.call(scheduler.release)
        await until(lambda: srv.call(lambda: budget.claimed) == 0, "given back once the engine ended it")
        assert (await client.model("tiny-lm").generate(ids, 2)).steps >= 1


async def test_a_call_on_an_engine_that_sizes_its_own_memory_that_ran_past_its_deadline_says_so(
    make_server: Any,
) -> None:
    # An engine without an estimator (vLLM's: its KV cache is sized when it loads) claims
    # nothing; a call whose pass ran past infer_timeout never waited for memory.
    srv = make_server(infer_timeout=0.5)
    host = srv.call(lambda: srv.server.registry.get("sleeper"))
    srv.call(lambda: setattr(srv.server.engines.engine(host), "estimator", None))
    async with hookwire.connect(srv.target) as client:
        with pytest.raises(hookwire.DeadlineExceededError) as info:
            await client.model("sleeper")(torch.tensor(1.2))
        assert "ran past" in str(info.value) and "memory budget" not in str(info.value), str(info.value)
        await until(lambda: not srv.call(lambda: host._executor.busy), "the stray pass ended")
