"""Benchmark: remote Infer that captures every layer's output vs the same forward with in-process hooks.

    .venv/bin/python tests/bench/bench_capture.py [--quick] [--repeats 5] [--seed 0]

Starts `hookwire serve` (demo models) as a separate process on a free loopback
port, with torch at one intra-op thread there (OMP_NUM_THREADS=1,
MKL_NUM_THREADS=1) and here (torch.set_num_threads(1)), and measures, on the demo
tiny-transformer (batch 8, seq 32):
  local      forward with torch forward hooks cloning the output of every encoder
             layer (the in-process baseline);
  local+all  the same with hooks cloning the output of every module;
  remote     Infer of the same input with a session hook capturing the output of
             every encoder layer, until the response and all its events arrived
             (decoded to torch);
  remote+all the same with a session hook on every module ("**", root included),
             in a second client's session;
  request    the layer captures as request-scoped hooks (events in the response);
  bare       Infer without hooks and without a session.
The six variants are interleaved (tests/bench/bench_hotpath.py's `interleaved`):
per repeat, several blocks each running a short round of every variant in a random
order, after a warm-up round of each. Prints per variant the median latency (min-max
over repeats) and CPU per call (this process plus the server), and each ratio as the
median (min-max) of its per-repeat ratios. Absolute times on shared machines are
noisy; the ratios are what to compare. The figures of issue #12 (P1-P6) are
bench_hotpath.py's; this script keeps the per-event view on the small demo model.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
from typing import Any

import torch

import hookwire
from bench_hotpath import (SINGLE_THREAD_ENV, Round, RoundResult, Variant, clone, details, interleaved, latency,
                           latency_round, spread, tiny_inputs)
from hookwire_server.demo_models import tiny_transformer



def local_round(every_module: bool, calls: int) -> tuple[Round, int]:
    """A round of in-process forwards with cloning hooks, and the captures per pass."""
    model = tiny_transformer()
    ids, mask = tiny_inputs()
    captured: list[Any] = []
    for path, module in model.named_modules():
        if every_module or (path.startswith("encoder.layers.") and path.count(".") == 2):
            module.register_forward_hook(lambda mod, a, out: captured.append(clone(out)))

    async def forward() -> None:
        captured.clear()
        with torch.no_grad():
            model(ids, attention_mask=mask)

    with torch.no_grad():
        model(ids, attention_mask=mask)
    return latency_round(calls, forward, ()), len(captured)


async def run(target: str, server_pid: int, ns: argparse.Namespace) -> tuple[dict[str, list[RoundResult]], dict[str, int]]:
    ids, mask = tiny_inputs()
    pids = (server_pid,)
    local, per_layer = local_round(False, ns.calls)
    local_all, per_all = local_round(True, ns.calls)
    async with hookwire.connect(target) as plain, hookwire.connect(target) as layers, \
            hookwire.connect(target) as every:
        await plain.wait_ready(models=["tiny-transformer"], timeout=300)
        model = plain.model("tiny-transformer")
        spec = hookwire.HookSpec("encoder.layers.*", posthook=hookwire.capture("output"))
        variants = [Variant("local", local), Variant("local+all", local_all)]

        async def bare() -> None:
            await model.infer(ids, attention_mask=mask, use_session=False)

        async def request() -> None:
            result = await model.infer(ids, attention_mask=mask, hooks=[spec], use_session=False)
            assert len([e.output for e in result.events]) == per_layer

        variants += [Variant("bare", latency_round(ns.calls, bare, pids)),
                     Variant("request", latency_round(ns.calls, request, pids))]
        for name, client, pattern, count in (("remote", layers, "encoder.layers.*", per_layer),
                                             ("remote+all", every, "**", per_all)):
            hook = await client.model("tiny-transformer").hook(pattern, posthook=hookwire.capture("output"))
            events = hook.events().__aiter__()

            async def session_call(client: hookwire.Client = client, events: Any = events, count: int = count) -> None:
                await client.model("tiny-transformer").infer(ids, attention_mask=mask)
                for _ in range(count):  # every event of this pass, decoded to torch
                    (await events.__anext__()).output

            variants.append(Variant(name, latency_round(ns.calls, session_call, pids)))
        res = await interleaved(variants, ns.repeats, ns.blocks, random.Random(ns.seed))
    return res, {"layers": per_layer, "every module": per_all}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 repeats of shorter rounds")
    parser.add_argument("--repeats", type=int, help="repeats (default 5; 3 with --quick)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the variant orders")
    ns = parser.parse_args()
    ns.repeats = ns.repeats or (3 if ns.quick else 5)
    ns.blocks, ns.calls = (6, 5) if ns.quick else (12, 5)
    torch.set_num_threads(1)
    env = {**os.environ, **SINGLE_THREAD_ENV}
    proc = subprocess.Popen([sys.executable, "-m", "hookwire._cli", "serve", "--port", "0", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        assert proc.stdout is not None
        target = proc.stdout.readline().rsplit(" ", 1)[-1].strip()
        res, per_pass = asyncio.run(run(target, proc.pid, ns))
    finally:
        proc.terminate()
        proc.wait(30)

    print(f"tiny-transformer, batch 8, seq 32, {ns.repeats} repeats x {ns.blocks} blocks x {ns.calls} calls per "
          f"variant, interleaved (seed {ns.seed}); torch threads 1 here and in the server; captures per pass: "
          f"{per_pass['layers']} (layers), {per_pass['every module']} (every module); load average "
          f"{os.getloadavg()[0]:.2f}")
    print("\n".join(details("median ms/call (min-max over repeats), CPU per call, CPU vs local:", res, "time", "local")))

    def ratio(a: str, b: str) -> str:
        return spread([latency(x) / latency(y) for x, y in zip(res[a], res[b])])

    print(f"ratio remote/local (layers, session stream): {ratio('remote', 'local')}")
    print(f"ratio request/local (layers, in response):   {ratio('request', 'local')}")
    print(f"ratio remote+all/local+all (every module):   {ratio('remote+all', 'local+all')}")
    print(f"ratio bare/local (no hooks vs hooks):        {ratio('bare', 'local')}")
    print(f"capture overhead over bare Infer (layers):   {ratio('remote', 'bare')}")


if __name__ == "__main__":
    main()
