"""Large tensors through a client that keeps gRPC's 4 MiB message limit: a 1 GiB
activation captured by a hook, and a large Infer input and output (InferStream).

    .venv/bin/python tests/bench/bench_large.py [--gib 1.0] [--infer-mib 512]

Checks that the data arrives intact and prints the time taken and the peak memory
(VmHWM) of the server process and of this client process, next to the tensor sizes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import subprocess
import sys
import time

import torch

import hookwire

HERE = pathlib.Path(__file__).resolve().parent
MIB = 1 << 20


def peak_rss(pid: int) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def rss(pid: int) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def run(target: str, gib: float, infer_mib: int, server_pid: int) -> None:
    options = hookwire.ConnectOptions(max_message_bytes=4 * MIB)  # gRPC's default
    async with hookwire.connect(target, options=options) as client:
        model = client.model("producer")
        base_server, base_client = rss(server_pid), rss(os.getpid())
        async with model.hook("inner", posthook=hookwire.capture("output")) as hook:
            started = time.perf_counter()
            await model(torch.tensor([gib * 1024 / 4, 3.0]))
            event = await hook.events().__anext__()
            elapsed = time.perf_counter() - started
        t = event.output
        ok = t.dtype == torch.float32 and t.numel() == int(gib * 1024 / 4) * MIB and bool((t == 3.0).all())
        size = t.numel() * 4
        print(f"captured activation: {size / MIB:.0f} MiB in {elapsed:.2f} s ({size / MIB / elapsed:.0f} MiB/s), intact: {ok}")
        print(f"  server peak {peak_rss(server_pid) / MIB:.0f} MiB (baseline {base_server / MIB:.0f} MiB; "
              f"the model's own activation and the hook's snapshot are {2 * size / MIB:.0f} MiB)")
        print(f"  client peak {peak_rss(os.getpid()) / MIB:.0f} MiB (baseline {base_client / MIB:.0f} MiB; the event is {size / MIB:.0f} MiB)")
        del t, event

        x = torch.rand(infer_mib * MIB // 4)
        started = time.perf_counter()
        out = await client.model("scale")(x)
        elapsed = time.perf_counter() - started
        print(f"InferStream: {infer_mib} MiB in and out in {elapsed:.2f} s, intact: {bool(torch.equal(out, x * 2))}")
        print(f"  server peak {peak_rss(server_pid) / MIB:.0f} MiB, client peak {peak_rss(os.getpid()) / MIB:.0f} MiB")
        if not ok or not torch.equal(out, x * 2):
            raise SystemExit("data corrupted")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--infer-mib", type=int, default=512)
    ns = parser.parse_args()
    torch.set_num_threads(1)
    # torch at one intra-op thread on both sides, as in every benchmark here
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    server = subprocess.Popen(
        [sys.executable, "-m", "hookwire._cli", "serve", "--port", "0", "--log-level", "warning",
         "--model", "producer=bench_models:producer", "--model", "scale=bench_models:scale"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        target = server.stdout.readline().rsplit(" ", 1)[-1].strip()  # type: ignore[union-attr]
        asyncio.run(run(target, ns.gib, ns.infer_mib, server.pid))
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
