"""Benchmark: forward latency with a `scale` rule on every layer, remote vs the same edit
as in-process torch hooks.

    .venv/bin/python tests/bench/bench_rules.py [--iters 300]

Starts `hookwire serve` as a separate process on loopback and measures, in one run,
on the demo transformer (batch 8, seq 32, torch threads 1):
  local bare / local rules     in-process forward, without and with forward hooks
                               returning ``output * 0.5`` on each hooked module;
  remote bare / remote rules   Infer without hooks, and with a session hook carrying
                               ``rules.scale("output", 0.5)`` on the same modules.
Two module sets: every encoder layer (2), and every Linear (9).
Prints p50/p99 and ratios; absolute times are noise on shared machines.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time

import torch

import hookwire
from hookwire import rules
from hookwire_server.demo_models import tiny_transformer
from hookwire_server.module_patterns import match_paths

SETS = {
    "layers": ["encoder.layers.*"],
    "linears": ["**.qkv", "**.proj", "**.ff.0", "**.ff.2", "head"],
}


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))] * 1e3


def timed_local(model: torch.nn.Module, ids: torch.Tensor, iters: int) -> list[float]:
    times = []
    with torch.no_grad():
        for i in range(iters + 20):
            t0 = time.perf_counter()
            model(ids)
            if i >= 20:
                times.append(time.perf_counter() - t0)
    return times


async def remote(target: str, ids: torch.Tensor, iters: int) -> dict[str, list[float]]:
    out = {}
    async with hookwire.connect(target) as client:
        model = client.model("tiny-transformer")

        async def timed(key: str) -> None:
            for _ in range(20):
                await model(ids)
            samples = []
            for _ in range(iters):
                t0 = time.perf_counter()
                await model(ids)
                samples.append(time.perf_counter() - t0)
            out[key] = samples

        await client.session()
        await timed("bare")
        for name, patterns in SETS.items():
            handles = [await model.hook(p, posthook=[rules.scale("output", 0.5)]) for p in patterns]
            await timed(name)
            for h in handles:
                await h.remove()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=300)
    ns = parser.parse_args()
    torch.set_num_threads(1)
    ids = torch.randint(0, 64, (8, 32), generator=torch.Generator().manual_seed(0))
    proc = subprocess.Popen([sys.executable, "-m", "hookwire._cli", "serve", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        target = proc.stdout.readline().rsplit(" ", 1)[-1].strip()  # type: ignore[union-attr]
        loc = {"bare": timed_local(tiny_transformer(), ids, ns.iters)}
        paths = [p for p, _ in tiny_transformer().named_modules()]
        for name, patterns in SETS.items():
            # The same modules the server's globs resolve to, with the same edit as a torch hook.
            chosen = {p for pattern in patterns for p in match_paths(pattern, paths)}
            m = tiny_transformer()
            for p, module in m.named_modules():
                if p in chosen:
                    module.register_forward_hook(lambda mod, a, out: out * 0.5)
            loc[name] = timed_local(m, ids, ns.iters)
        rem = asyncio.run(remote(target, ids, ns.iters))
    finally:
        proc.terminate()
        proc.wait(30)
    print(f"tiny-transformer, batch 8, seq 32, {ns.iters} iterations, torch threads 1")
    print(f"{'variant':<16}{'p50 ms':>9}{'p99 ms':>9}")
    for side, res in (("local", loc), ("remote", rem)):
        for key, samples in res.items():
            print(f"{side + ' ' + key:<16}{pct(samples, .5):>9.3f}{pct(samples, .99):>9.3f}")
    for name in SETS:
        print(f"ratio remote/local with rules on {name}: {pct(rem[name], .5) / pct(loc[name], .5):.2f}"
              f"   (bare: {pct(rem['bare'], .5) / pct(loc['bare'], .5):.2f}); "
              f"rule overhead remote {pct(rem[name], .5) - pct(rem['bare'], .5):+.3f} ms, "
              f"local {pct(loc[name], .5) - pct(loc['bare'], .5):+.3f} ms")


if __name__ == "__main__":
    main()
