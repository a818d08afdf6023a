"""Benchmark: remote Infer that captures every layer's output vs the same forward with in-process hooks.

    .venv/bin/python tests/bench/bench_capture.py [--iters 300] [--batch 8] [--seq 32]

Starts `hookwire serve` (demo models) as a separate process on a free loopback
port, and measures in the same run:
  local      forward of the demo transformer with torch forward hooks cloning
             the output of every encoder layer (the in-process baseline);
  local+all  the same with hooks cloning the output of every module;
  remote     Infer of the same input with a session hook capturing the output of
             every encoder layer, until the response and all its events arrived;
  remote+all the same with a hook on every module ("**", root included);
  request    the same capture as request-scoped hooks (events in the response);
  bare       Infer without hooks.
Prints p50/p99 per variant and the ratio of each remote p50 to its local baseline.
Absolute times on shared machines are noisy; the ratios are what to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from typing import Awaitable, Callable

import torch

import hookwire
from hookwire_server.demo_models import tiny_transformer


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _selected(model: torch.nn.Module, every_module: bool) -> list[torch.nn.Module]:
    return [m for p, m in model.named_modules()
            if every_module or (p.startswith("encoder.layers.") and p.count(".") == 2)]


def local_baseline(ids: torch.Tensor, mask: torch.Tensor, iters: int, every_module: bool) -> tuple[list[float], int]:
    """Times the in-process forward with cloning hooks; also returns the captures per pass."""
    model = tiny_transformer()
    captured: list[object] = []
    handles = [m.register_forward_hook(lambda mod, a, out: captured.append(_clone(out)))
               for m in _selected(model, every_module)]
    times = []
    with torch.no_grad():
        for i in range(iters + 20):
            captured.clear()
            t0 = time.perf_counter()
            model(ids, attention_mask=mask)
            dt = time.perf_counter() - t0
            if i >= 20:
                times.append(dt)
    for h in handles:
        h.remove()
    return times, len(captured)


def _clone(value):  # type: ignore[no-untyped-def]
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_clone(v) for v in value)
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value


async def timed(fn: Callable[[], Awaitable[object]], iters: int) -> list[float]:
    for _ in range(20):
        await fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - t0)
    return times


async def remote(target: str, ids: torch.Tensor, mask: torch.Tensor, iters: int,
                 per_pass: dict[str, int]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    async with hookwire.connect(target) as client:
        model = client.model("tiny-transformer")
        out["bare"] = await timed(lambda: model.infer(ids, attention_mask=mask, use_session=False), iters)
        for name, pattern in (("remote", "encoder.layers.*"), ("remote+all", "**")):
            async with model.hook(pattern, posthook=hookwire.capture("output")) as hook:
                events = hook.events()
                count = per_pass[name]

                async def one() -> None:
                    await model.infer(ids, attention_mask=mask)
                    for _ in range(count):  # every event of this pass, decoded to torch
                        await events.__anext__()

                out[name] = await timed(one, iters)
        spec = hookwire.HookSpec("encoder.layers.*", posthook=hookwire.capture("output"))
        out["request"] = await timed(lambda: model.infer(ids, attention_mask=mask, hooks=[spec]), iters)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32)
    ns = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (ns.batch, ns.seq), generator=g)
    mask = torch.ones(ns.batch, ns.seq, dtype=torch.bool)

    proc = subprocess.Popen([sys.executable, "-m", "hookwire._cli", "serve", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        banner = proc.stdout.readline()  # type: ignore[union-attr]
        target = banner.rsplit(" ", 1)[-1].strip()
        local, per_layer = local_baseline(ids, mask, ns.iters, every_module=False)
        local_all, per_all = local_baseline(ids, mask, ns.iters, every_module=True)
        results = {"local": local, "local+all": local_all}
        results.update(asyncio.run(remote(target, ids, mask, ns.iters, {"remote": per_layer, "remote+all": per_all})))
    finally:
        proc.terminate()
        proc.wait(30)

    print(f"tiny-transformer, batch {ns.batch}, seq {ns.seq}, {ns.iters} iterations, torch threads 1; "
          f"captures per pass: {per_layer} (layers), {per_all} (every module)")
    print(f"{'variant':<12}{'p50 ms':>10}{'p99 ms':>10}{'mean ms':>10}")
    for name, samples in results.items():
        print(f"{name:<12}{percentile(samples, .5) * 1e3:>10.3f}{percentile(samples, .99) * 1e3:>10.3f}"
              f"{statistics.fmean(samples) * 1e3:>10.3f}")
    p50 = {k: percentile(v, .5) for k, v in results.items()}
    print(f"ratio remote/local (layers, session stream): {p50['remote'] / p50['local']:.2f}")
    print(f"ratio request/local (layers, in response):   {p50['request'] / p50['local']:.2f}")
    print(f"ratio remote+all/local+all (every module):   {p50['remote+all'] / p50['local+all']:.2f}")
    print(f"ratio bare/local (no hooks vs hooks):       {p50['bare'] / p50['local']:.2f}")
    print(f"capture overhead over bare Infer (layers):  {p50['remote'] / p50['bare']:.2f}")


if __name__ == "__main__":
    main()
