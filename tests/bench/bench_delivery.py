"""Benchmark: production delivery costs, as ratios measured in one run.

    .venv/bin/python tests/bench/bench_delivery.py [--iters 300] [--stream-mib 256]

Starts `hookwire serve` (demo models plus a bench model) as a separate process on
loopback, and prints:
  1. Infer latency p50/p99 of the demo transformer with a SCOPE_ALL hook capturing
     every layer's output: with one stalled drop-policy subscriber (never reads)
     vs with no subscriber, and vs no hook at all;
  2. forward latency with capture-only hooks on every module and no subscriber vs
     no hooks (what instrumentation nobody watches costs);
  3. streaming throughput of captured 4 MiB float32 tensors into the SDK (decoded
     to torch) vs a raw gRPC stream of 4 MiB `bytes` messages between two
     processes on the same machine (the wire's limit).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import subprocess
import sys
import time

import grpc
import torch

import hookwire
from hookwire.v1 import hook_service_pb2, hook_service_pb2_grpc

HERE = pathlib.Path(__file__).resolve().parent
MIB = 1 << 20


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))] * 1e3


async def latencies(model: hookwire.RemoteModel, ids: torch.Tensor, iters: int) -> list[float]:
    for _ in range(20):
        await model(ids)
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        await model(ids)
        out.append(time.perf_counter() - t0)
    return out


async def latency_part(target: str, iters: int) -> dict[str, list[float]]:
    ids = torch.randint(0, 64, (8, 32), generator=torch.Generator().manual_seed(0))
    res: dict[str, list[float]] = {}
    async with hookwire.connect(target) as operator, hookwire.connect(target) as caller:
        model = caller.model("tiny-transformer")
        res["no hook"] = await latencies(model, ids, iters)
        hook = await operator.model("tiny-transformer").hook(
            "encoder.layers.*", posthook=hookwire.capture("output"), scope="all", ttl_seconds=600)
        res["hook, no subscriber"] = await latencies(model, ids, iters)
        async with grpc.aio.insecure_channel(target) as channel:
            stalled = hook_service_pb2_grpc.HookServiceStub(channel).Subscribe(hook_service_pb2.SubscribeRequest(
                hook_ids=[hook.id], delivery=hook_service_pb2.DeliveryOptions(
                    policy=hook_service_pb2.DELIVERY_POLICY_DROP_OLDEST, max_events=64)))
            await stalled.read()  # subscribed; never read again
            res["hook, stalled subscriber"] = await latencies(model, ids, iters)
            stalled.cancel()
        await hook.remove()
        every = await operator.model("tiny-transformer").hook(
            "**", posthook=hookwire.capture("output"), scope="all", ttl_seconds=600)
        res["every module, no subscriber"] = await latencies(model, ids, iters)
        await every.remove()
    return res


async def sdk_throughput(target: str, total_mib: int) -> float:
    per_event_mib = 4
    n = total_mib // per_event_mib
    async with hookwire.connect(target) as client:
        model = client.model("producer")
        async with model.hook("inner", posthook=hookwire.capture("output")) as hook:
            events = hook.events()
            x = torch.tensor([float(per_event_mib) / 4, 1.0])
            await model(x)  # warm-up
            await events.__anext__()
            started = time.perf_counter()

            async def drive() -> None:
                for _ in range(n):
                    await model(x)

            driver = asyncio.ensure_future(drive())
            received = 0
            for _ in range(n):
                event = await events.__anext__()
                received += event.output.numel() * 4
            await driver
            elapsed = time.perf_counter() - started
    return received / elapsed / MIB


def raw_server(port_file: str, total_mib: int) -> None:
    """A raw gRPC server streaming 4 MiB bytes messages (run in its own process)."""

    async def main() -> None:
        payload = os.urandom(4 * MIB)

        async def stream(request: bytes, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
            for _ in range(total_mib // 4):
                yield payload

        handler = grpc.method_handlers_generic_handler("bench.Raw", {
            "Stream": grpc.unary_stream_rpc_method_handler(stream, request_deserializer=None, response_serializer=None),
        })
        server = grpc.aio.server(options=[("grpc.max_send_message_length", 64 * MIB)])
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        pathlib.Path(port_file).write_text(str(port))
        await server.wait_for_termination()

    asyncio.run(main())


async def raw_throughput(port: int) -> float:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 64 * MIB)]) as ch:
        call = ch.unary_stream("/bench.Raw/Stream")(b"")
        started = time.perf_counter()
        received = 0
        async for message in call:
            received += len(message)
        return received / (time.perf_counter() - started) / MIB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--stream-mib", type=int, default=256)
    parser.add_argument("--raw-server", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.raw_server:
        raw_server(ns.raw_server, ns.stream_mib)
        return
    torch.set_num_threads(1)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    server = subprocess.Popen(
        [sys.executable, "-m", "hookwire._cli", "serve", "--port", "0", "--demo", "--log-level", "warning",
         "--model", "producer=bench_models:producer"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    port_file = pathlib.Path(f"/tmp/hookwire-bench-raw-{os.getpid()}")
    raw = subprocess.Popen([sys.executable, __file__, "--raw-server", str(port_file), "--stream-mib", str(ns.stream_mib)])
    try:
        target = server.stdout.readline().rsplit(" ", 1)[-1].strip()  # type: ignore[union-attr]
        lat = asyncio.run(latency_part(target, ns.iters))
        sdk = asyncio.run(sdk_throughput(target, ns.stream_mib))
        while not port_file.exists():
            time.sleep(0.05)
        raw_rate = asyncio.run(raw_throughput(int(port_file.read_text())))
    finally:
        server.terminate()
        raw.terminate()
        server.wait(30)
        raw.wait(30)
        port_file.unlink(missing_ok=True)

    print(f"1-2. tiny-transformer Infer, batch 8, seq 32, {ns.iters} iterations")
    print(f"{'variant':<30}{'p50 ms':>9}{'p99 ms':>9}")
    for name, samples in lat.items():
        print(f"{name:<30}{pct(samples, .5):>9.3f}{pct(samples, .99):>9.3f}")
    base = lat["hook, no subscriber"]
    stalled = lat["hook, stalled subscriber"]
    print(f"ratio stalled subscriber / no subscriber: p50 {pct(stalled, .5) / pct(base, .5):.2f}, "
          f"p99 {pct(stalled, .99) / pct(base, .99):.2f}")
    print(f"ratio capture-only hooks on every module (no subscriber) / no hooks: p50 "
          f"{pct(lat['every module, no subscriber'], .5) / pct(lat['no hook'], .5):.2f}")
    print(f"3. streaming {ns.stream_mib} MiB as 4 MiB tensors: SDK {sdk:.0f} MiB/s, raw gRPC bytes {raw_rate:.0f} MiB/s, "
          f"ratio {sdk / raw_rate:.2f}")


if __name__ == "__main__":
    main()
