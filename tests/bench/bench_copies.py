"""Benchmark (#12, copies): captured tensors through the SDK vs a raw gRPC bytes stream,
and request-scoped captures of growing size, as ratios measured in one run.

    .venv/bin/python tests/bench/bench_copies.py [--repeats 3] [--stream-mib 256]
        [--tree NAME=PATH ...]

Every variant runs in its own client process against a server process (torch at one
intra-op thread in every process), variants interleaved in a random order in each
repeat, after one warm-up round. Variants:

- ``stream``: a session hook capturing a 4 MiB float32 activation (tests/bench's
  ``producer`` model), events read with ``hook.events()`` as torch tensors while a
  second task drives Infer calls; MiB/s of captured data received.
- ``raw``: a raw grpc.aio server streaming 4 MiB messages, each the bytes of a fresh
  ``torch.full`` tensor (one copy on the server), each read into a fresh torch tensor
  (one copy on the client): what the wire alone costs. The baseline of ``stream``.
- ``req S``: ``model.infer(x, hooks=[capture output])`` with a request-scoped capture
  of S MiB (S = 1, 4, 16, 64), calls back to back; MiB/s of captured data.

Besides MiB/s, the CPU seconds per MiB of the client process and of the server
process (from /proc) are printed. With several ``--tree`` options (e.g.
``--tree main=/work/main --tree this=.``) each tree's SDK talks to its own server,
and the cross-tree ratios are printed too. Only ratios count on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
MIB = 1 << 20
REQUEST_SIZES = (1, 4, 16, 64)


def _cpu_of(pid: int) -> float:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------ client side (subprocess)


async def _stream(target: str, total_mib: int, *, mark: bool = True) -> int:
    import torch

    import hookwire

    n = total_mib // 4
    async with hookwire.connect(target) as client:
        model = client.model("producer")
        async with model.hook("inner", posthook=hookwire.capture("output")) as hook:
            events = hook.events()
            x = torch.tensor([1.0, 1.0])  # 2**20 float32: 4 MiB
            await model(x)
            await events.__anext__()  # warm

            async def drive() -> None:
                for _ in range(n):
                    await model(x)

            if mark:
                _mark()
            driver = asyncio.ensure_future(drive())
            received = 0
            for _ in range(n):
                event = await events.__anext__()
                received += event.output.numel() * 4
            await driver
    return received


async def _request(target: str, mib: float, total_mib: int, streamed: bool) -> int:
    import torch

    import hookwire

    n = max(4, int(total_mib / mib))
    spec = hookwire.HookSpec(module="inner", posthook=hookwire.capture("output"))
    # A message limit under 64 MiB makes the SDK call InferStream (chunks both ways).
    options = hookwire.ConnectOptions(max_message_bytes=32 * MIB) if streamed else None
    async with hookwire.connect(target, options=options) as client:
        model = client.model("producer")
        x = torch.tensor([mib / 4, 1.0])
        await model.infer(x, hooks=[spec], use_session=False)  # warm
        _mark()
        received = 0
        for _ in range(n):
            result = await model.infer(x, hooks=[spec], use_session=False)
            received += result.events[0].output.numel() * 4
    return received


async def _probe(target: str, seconds: float) -> dict[str, float]:
    """Latencies of bare Infer calls (a 4-element forward, no hooks) for ``seconds``."""
    import torch

    import hookwire

    async with hookwire.connect(target) as client:
        model = client.model("producer")
        x = torch.tensor([4 / (1 << 20), 1.0])
        for _ in range(20):
            await model(x)
        _mark()
        times: list[float] = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            started = time.perf_counter()
            await model(x)
            times.append(time.perf_counter() - started)
    times.sort()
    return {"p50_ms": times[len(times) // 2] * 1e3, "p99_ms": times[int(len(times) * 0.99)] * 1e3}


async def _busy(target: str, seconds: float) -> dict[str, float]:
    """_probe's latencies, from another process, while this one streams 4 MiB captures."""
    probe = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--client", "probe", "--target", target, "--server-pid", "0",
        "--seconds", str(seconds), stdout=asyncio.subprocess.PIPE)

    async def stream() -> None:
        while True:
            await _stream(target, 64, mark=False)

    streaming = asyncio.ensure_future(stream())
    _mark()
    out, _ = await probe.communicate()
    streaming.cancel()
    await asyncio.gather(streaming, return_exceptions=True)
    return json.loads(out.decode().strip().splitlines()[-1])


async def _raw(target: str, total_mib: int) -> int:
    import grpc
    import torch

    async with grpc.aio.insecure_channel(target, options=[("grpc.max_receive_message_length", 64 * MIB)]) as ch:
        call = ch.unary_stream("/bench.Raw/Stream")(str(total_mib // 4).encode())
        first = True
        received = 0
        async for message in call:
            t = torch.frombuffer(bytearray(message), dtype=torch.float32)  # a fresh tensor: one copy
            if first:
                _mark()  # the first message is the warm-up
                first = False
                continue
            received += t.numel() * 4
    return received


_T0: list[float] = []


def _mark() -> None:
    _T0[:] = [time.perf_counter(), sum(os.times()[:2])]


def client_main(ns: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    server_pid = int(ns.server_pid)
    if ns.client in ("probe", "busy"):
        fn = _probe if ns.client == "probe" else _busy
        print(json.dumps(asyncio.run(fn(ns.target, ns.seconds))))
        return
    coro = {
        "stream": lambda: _stream(ns.target, ns.stream_mib),
        "raw": lambda: _raw(ns.target, ns.stream_mib),
    }.get(ns.client, lambda: _request(
        ns.target, float(ns.client.split()[1]), ns.stream_mib, streamed=ns.client.startswith("reqstream")))

    async def run() -> tuple[int, float, float, float]:
        task = asyncio.ensure_future(coro())
        while not _T0:
            await asyncio.sleep(0.001)
        server_cpu = _cpu_of(server_pid)
        received = await task
        return received, time.perf_counter() - _T0[0], sum(os.times()[:2]) - _T0[1], _cpu_of(server_pid) - server_cpu

    received, elapsed, cpu, server_cpu = asyncio.run(run())
    print(json.dumps({"mib_s": received / MIB / elapsed, "client_cpu_per_mib": cpu / (received / MIB),
                      "server_cpu_per_mib": server_cpu / (received / MIB)}))


# ------------------------------------------------------------------ raw server (subprocess)


def raw_server(port_file: str) -> None:
    import grpc
    import torch

    torch.set_num_threads(1)

    async def main() -> None:
        async def stream(request: bytes, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
            for i in range(int(request) + 1):
                yield torch.full((MIB,), float(i)).numpy().tobytes()  # a fresh tensor's bytes: one copy

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


# ------------------------------------------------------------------ driver


def _env(tree: pathlib.Path) -> dict[str, str]:
    path = os.pathsep.join([str(tree / "client"), str(tree / "service"), str(HERE)])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stream-mib", type=int, default=256)
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                        help="a source tree whose SDK and server to measure (default: this one)")
    parser.add_argument("--sizes", default=",".join(map(str, REQUEST_SIZES)), help="request-scoped capture sizes, MiB")
    parser.add_argument("--streamed", action="store_true",
                        help="also time each request size over InferStream (a client message limit under 64 MiB)")
    parser.add_argument("--latency", action="store_true",
                        help="also time bare Infer calls from another process, idle and while 4 MiB captures stream")
    parser.add_argument("--seconds", type=float, default=8.0, help=argparse.SUPPRESS)
    parser.add_argument("--client", help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--server-pid", help=argparse.SUPPRESS)
    parser.add_argument("--raw-server", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.raw_server:
        raw_server(ns.raw_server)
        return
    if ns.client:
        client_main(ns)
        return
    trees = dict(t.split("=", 1) for t in ns.tree) or {"this": str(ROOT)}
    sizes = [float(s) if "." in s else int(s) for s in ns.sizes.split(",") if s]
    procs: list[subprocess.Popen[str]] = []
    servers: dict[str, tuple[str, int, pathlib.Path]] = {}
    port_file = pathlib.Path(f"/tmp/hookwire-bench-copies-{os.getpid()}")
    try:
        for name, path in trees.items():
            tree = pathlib.Path(path).resolve()
            proc = subprocess.Popen(
                [sys.executable, "-m", "hookwire._cli", "serve", "--port", "0", "--log-level", "warning",
                 "--no-batching", "--model", "producer=bench_models:producer"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=_env(tree))
            procs.append(proc)
            target = proc.stdout.readline().rsplit(" ", 1)[-1].strip()  # type: ignore[union-attr]
            servers[name] = (target, proc.pid, tree)
        raw = subprocess.Popen([sys.executable, __file__, "--raw-server", str(port_file)], env=_env(ROOT))
        procs.append(raw)
        while not port_file.exists() or not port_file.read_text():
            time.sleep(0.05)
        raw_target = f"127.0.0.1:{port_file.read_text()}"

        variants: list[tuple[str, str, str, int, pathlib.Path]] = [("raw", "raw", raw_target, raw.pid, ROOT)]
        for name, (target, pid, tree) in servers.items():
            variants.append((f"stream/{name}", "stream", target, pid, tree))
            variants += [(f"req {s}/{name}", f"req {s}", target, pid, tree) for s in sizes]
            if ns.streamed:
                variants += [(f"reqstream {s}/{name}", f"reqstream {s}", target, pid, tree) for s in sizes]
            if ns.latency:
                variants += [(f"{kind}/{name}", kind, target, pid, tree) for kind in ("probe", "busy")]

        def once(variant: tuple[str, str, str, int, pathlib.Path]) -> dict[str, float]:
            _, kind, target, pid, tree = variant
            out = subprocess.run(
                [sys.executable, __file__, "--client", kind, "--target", target, "--server-pid", str(pid),
                 "--stream-mib", str(ns.stream_mib), "--seconds", str(ns.seconds)],
                env=_env(tree), check=True, capture_output=True, text=True)
            return json.loads(out.stdout.strip().splitlines()[-1])

        rng = random.Random(12)
        for variant in variants:  # warm-up round, not counted
            once(variant)
        results: dict[str, list[dict[str, float]]] = {v[0]: [] for v in variants}
        for r in range(ns.repeats):
            order = variants[:]
            rng.shuffle(order)
            for variant in order:
                results[variant[0]].append(once(variant))
            print(f"repeat {r + 1}/{ns.repeats} done", file=sys.stderr)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)
        port_file.unlink(missing_ok=True)

    def med(name: str, key: str = "mib_s") -> float:
        return statistics.median(x[key] for x in results[name])

    def spread(name: str, key: str = "mib_s") -> str:
        xs = [x[key] for x in results[name]]
        return f"{min(xs):.0f}-{max(xs):.0f}"

    print(f"{ns.repeats} repeats, median (min-max); {ns.stream_mib} MiB per run; torch 1 thread everywhere")
    print(f"{'variant':<18}{'MiB/s':>8}{'range':>12}{'client ms CPU/MiB':>19}{'server ms CPU/MiB':>19}")
    for name in results:
        if "mib_s" in results[name][0]:
            print(f"{name:<18}{med(name):>8.0f}{spread(name):>12}{med(name, 'client_cpu_per_mib') * 1e3:>19.2f}"
                  f"{med(name, 'server_cpu_per_mib') * 1e3:>19.2f}")
    for name in results:
        if "p50_ms" in results[name][0]:
            print(f"{name:<18}bare Infer p50 {med(name, 'p50_ms'):.2f} ms, p99 {med(name, 'p99_ms'):.2f} ms")

    def ratio(a: str, b: str, key: str = "mib_s") -> str:
        rs = [x[key] / y[key] for x, y in zip(results[a], results[b])]  # per repeat (same round)
        return f"{statistics.median(rs):.2f} ({min(rs):.2f}-{max(rs):.2f})"

    print("ratios (median of per-repeat ratios, min-max):")
    for name in servers:
        print(f"  P2 {name}: SDK stream / raw stream: {ratio(f'stream/{name}', 'raw')}")
        if 4 in sizes:
            for s in sizes:
                if s != 4:
                    print(f"  P6 {name}: request-scoped {s} MiB / 4 MiB rate: {ratio(f'req {s}/{name}', f'req 4/{name}')}")
        if ns.latency:
            print(f"  {name}: bare Infer p50 while 4 MiB captures stream / idle: {ratio(f'busy/{name}', f'probe/{name}', 'p50_ms')}")
    names = list(servers)
    for other in names[1:]:
        base = names[0]
        print(f"  {other} / {base}: stream {ratio(f'stream/{other}', f'stream/{base}')}; " + "; ".join(
            f"req {s} {ratio(f'req {s}/{other}', f'req {s}/{base}')}" for s in sizes))
        if ns.latency:
            print(f"  {other} / {base}: bare Infer p50 while streaming "
                  f"{ratio(f'busy/{other}', f'busy/{base}', 'p50_ms')}")


if __name__ == "__main__":
    main()
