"""Benchmark: forward latency with a `scale` rule on every layer, remote vs the same edit
as in-process torch hooks.

    .venv/bin/python tests/bench/bench_rules.py [--quick] [--repeats 5] [--seed 0]

Starts `hookwire serve` as a separate process on loopback, with torch at one intra-op
thread there (OMP_NUM_THREADS=1, MKL_NUM_THREADS=1) and here, and measures on the demo
transformer (batch 8, seq 32):
  local bare / local rules     in-process forward, without and with forward hooks
                               returning ``output * 0.5`` on each hooked module;
  remote bare / remote rules   Infer without hooks, and with a session hook carrying
                               ``rules.scale("output", 0.5)`` on the same modules (each
                               remote variant in its own client's session).
Two module sets: every encoder layer (2), and every Linear (9). The six variants are
interleaved (tests/bench/bench_hotpath.py's `interleaved`: per repeat, blocks of one
short round of each variant in a random order). Prints median latencies and ratios as
the median (min-max) of the per-repeat ratios; absolute times are noise on shared
machines.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys

import torch

import hookwire
from bench_hotpath import SINGLE_THREAD_ENV, RoundResult, Variant, details, interleaved, latency, latency_round, spread
from hookwire import rules
from hookwire_server.demo_models import tiny_transformer
from hookwire_server.models.module_patterns import match_paths

SETS = {
    "layers": ["encoder.layers.*"],
    "linears": ["**.qkv", "**.proj", "**.ff.0", "**.ff.2", "head"],
}


async def run(target: str, server_pid: int, ns: argparse.Namespace) -> dict[str, list[RoundResult]]:
    ids = torch.randint(0, 64, (8, 32), generator=torch.Generator().manual_seed(0))
    paths = [p for p, _ in tiny_transformer().named_modules()]
    variants = []
    for name in ("bare", *SETS):
        m = tiny_transformer()
        # The same modules the server's globs resolve to, with the same edit as a torch hook.
        chosen = {p for pattern in SETS.get(name, []) for p in match_paths(pattern, paths)}
        for p, module in m.named_modules():
            if p in chosen:
                module.register_forward_hook(lambda mod, a, out: out * 0.5)

        async def local(m: torch.nn.Module = m) -> None:
            with torch.no_grad():
                m(ids)

        variants.append(Variant(f"local {name}", latency_round(ns.calls, local, ())))
    clients = {name: hookwire.connect(target) for name in ("bare", *SETS)}
    try:
        await clients["bare"].wait_ready(models=["tiny-transformer"], timeout=300)
        for name, client in clients.items():
            model = client.model("tiny-transformer")
            for pattern in SETS.get(name, []):
                await model.hook(pattern, posthook=[rules.scale("output", 0.5)])

            async def remote(model: hookwire.RemoteModel = model) -> None:
                await model(ids)

            variants.append(Variant(f"remote {name}", latency_round(ns.calls, remote, (server_pid,))))
        return await interleaved(variants, ns.repeats, ns.blocks, random.Random(ns.seed))
    finally:
        for client in clients.values():
            await client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 repeats of shorter rounds")
    parser.add_argument("--repeats", type=int, help="repeats (default 5; 3 with --quick)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the variant orders")
    ns = parser.parse_args()
    ns.repeats = ns.repeats or (3 if ns.quick else 5)
    ns.blocks, ns.calls = (6, 5) if ns.quick else (12, 5)
    torch.set_num_threads(1)
    proc = subprocess.Popen([sys.executable, "-m", "hookwire._cli", "serve", "--port", "0", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, **SINGLE_THREAD_ENV})
    try:
        target = proc.stdout.readline().rsplit(" ", 1)[-1].strip()  # type: ignore[union-attr]
        res = asyncio.run(run(target, proc.pid, ns))
    finally:
        proc.terminate()
        proc.wait(30)
    print(f"tiny-transformer, batch 8, seq 32, {ns.repeats} repeats x {ns.blocks} blocks x {ns.calls} calls per "
          f"variant, interleaved (seed {ns.seed}); torch threads 1 here and in the server; load average "
          f"{os.getloadavg()[0]:.2f}")
    print("\n".join(details("median ms/call (min-max over repeats), CPU per call, CPU vs local bare:", res, "time",
                            "local bare")))

    def ratio(a: str, b: str) -> str:
        return spread([latency(x) / latency(y) for x, y in zip(res[a], res[b])])

    def diff(a: str, b: str) -> str:
        return spread([(latency(x) - latency(y)) * 1e3 for x, y in zip(res[a], res[b])], "{:+.3f}")

    for name in SETS:
        print(f"ratio remote/local with rules on {name}: {ratio(f'remote {name}', f'local {name}')}"
              f"   (bare: {ratio('remote bare', 'local bare')}); "
              f"rule overhead remote {diff(f'remote {name}', 'remote bare')} ms, "
              f"local {diff(f'local {name}', 'local bare')} ms")


if __name__ == "__main__":
    main()
