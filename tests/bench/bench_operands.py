"""Benchmark (issue 25): the server's memory for one named operand used by many callers.

    .venv/bin/python tests/bench/bench_operands.py [--repeats 3] [--features 65536] [--callers 8] [--inline]

Model: gpt2-26m (bench_generate.py's seeded GPT-2, 8 blocks of width 512), served by
`hookwire serve` in a process of its own on loopback. Each repeat starts a fresh server:

1. the same load without the operand (step 3 with a scale by 1 in place of the SAE rule):
   the model's buffers for 8 batched callers, their sessions and streams; RSS0;
2. one client uploads an SAE of --features features (W_enc [512, n] and W_dec [n, 512]
   float32: 256 MiB at 65536) as a named operand, in 1 MiB chunks; RSS1;
3. --callers clients, each in its own session, register a hook on block (i mod 8) with
   ``rules.sae("output", Sae.named(...), [i], clamp)`` and run two Generate calls of 8
   tokens, all at once; RSS2 with every hook still registered: right after the last call,
   and settled (3 s later: the model's worker gives the heap's freed memory back after
   2 s idle, memory.py); and the high-water mark. RSS0 is settled the same way.

Goal: RSS2 - RSS0 <= 1.2 x the operand's size. With --inline, a further server per
repeat where the callers send the same SAE inline (each hook holds its own copy): the
comparison the named operand exists for.

RSS is the server process's VmRSS (/proc/PID/status); the high-water mark VmHWM.
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import statistics
import sys
import tempfile
from typing import Any

import torch
import transformers

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import hookwire  # noqa: E402
from bench_generate import PROMPT, serve_gpt2  # noqa: E402
from hookwire import rules  # noqa: E402
from hookwire.rules import Sae  # noqa: E402
from hookwire_server.models.worker import IDLE_TRIM_SECONDS  # noqa: E402

MIB = 1024 * 1024


def memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of ``pid``, in bytes."""
    out = {}
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def make_sae(features: int) -> Sae:
    g = torch.Generator().manual_seed(0)
    d = 512
    return Sae.of(torch.randn(d, features, generator=g) * 0.05, torch.zeros(features),
                  torch.randn(features, d, generator=g) * 0.05, torch.zeros(d))


async def callers(target: str, n: int, rule: Any, pid: int) -> tuple[dict[str, int], dict[str, int]]:
    """``n`` clients at once, each with a session hook of ``rule(i)`` on block i mod 8 and
    two Generate calls of 8 tokens; the server's memory while every hook is registered:
    right after the last call, and settled (once the model's worker, idle for
    IDLE_TRIM_SECONDS, gave the heap's freed memory back)."""
    release = asyncio.Event()
    done: list[int] = []

    async def caller(i: int) -> None:
        async with hookwire.connect(target) as client:
            async with client.model("gpt2-26m").hook(f"transformer.h.{i % 8}", posthook=[rule(i)]):
                for _ in range(2):
                    await client.model("gpt2-26m").generate([PROMPT], 8, do_sample=False)
                done.append(i)  # its hook stays registered until every caller is here
                await release.wait()

    tasks = [asyncio.ensure_future(caller(i)) for i in range(n)]
    try:
        while len(done) < n:
            failed = [t for t in tasks if t.done() and t.exception() is not None]
            if failed:
                raise failed[0].exception()  # type: ignore[misc]
            await asyncio.sleep(0.05)
        right_after = memory(pid)
        await asyncio.sleep(IDLE_TRIM_SECONDS + 1.0)
        return right_after, memory(pid)
    finally:
        release.set()
        await asyncio.gather(*tasks, return_exceptions=True)


async def run_once(target: str, pid: int, sae: Sae, ns: argparse.Namespace, *, inline: bool) -> dict[str, float]:
    async with hookwire.connect(target) as owner:
        # The same load without the operand first (a scale by 1 in its place): the server's
        # memory for 8 concurrent batched callers is the baseline, not part of the operand's cost.
        _, settled = await callers(target, ns.callers, lambda i: rules.scale("output", 1.0), pid)
        before = settled["VmRSS"]
        if inline:
            operand: Sae = sae
            nbytes = sum(len(getattr(sae.message, f).data) for f in ("w_enc", "b_enc", "w_dec", "b_dec"))
        else:
            info = await owner.upload_operand("sae", sae, ttl=3600)
            operand, nbytes = Sae.named("sae"), info.nbytes
        uploaded = memory(pid)["VmRSS"]

        after, settled = await callers(
            target, ns.callers, lambda i: rules.sae("output", operand, [i], edit="clamp", value=8.0), pid)
    return {"operand_mib": nbytes / MIB, "upload_growth": (uploaded - before) / nbytes,
            "growth": (after["VmRSS"] - before) / nbytes, "settled": (settled["VmRSS"] - before) / nbytes,
            "peak": (after["VmHWM"] - before) / nbytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--features", type=int, default=65536)
    parser.add_argument("--callers", type=int, default=8)
    parser.add_argument("--inline", action="store_true", help="also measure callers sending the SAE inline")
    ns = parser.parse_args()
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    sae = make_sae(ns.features)
    variants = ["named"] + (["inline"] if ns.inline else [])
    results: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for repeat in range(ns.repeats):
        for variant in variants:  # interleaved: a fresh server for each
            with tempfile.TemporaryDirectory(prefix="hookwire-bench-operands-") as tmp:
                server, target = serve_gpt2(pathlib.Path(tmp), demo=False)
                try:
                    result = asyncio.run(run_once(target, server.pid, sae, ns, inline=variant == "inline"))
                finally:
                    server.terminate()
                    server.wait(30)
            results[variant].append(result)
            print(f"repeat {repeat + 1} {variant}: " + ", ".join(f"{k} {v:.2f}" for k, v in result.items()), flush=True)
    print(f"\n{ns.callers} callers, one SAE of {ns.features} features "
          f"({results['named'][0]['operand_mib']:.1f} MiB); server RSS growth / operand size, "
          f"median (min-max) of {ns.repeats}:")
    for variant in variants:
        for key, label in (("upload_growth", "after the upload"), ("growth", "right after the calls"),
                           ("settled", "settled, hooks registered"), ("peak", "high-water mark")):
            values = [r[key] for r in results[variant]]
            if variant == "inline" and key == "upload_growth":
                continue
            print(f"  {variant:6} {label:26} {statistics.median(values):6.2f} ({min(values):.2f}-{max(values):.2f})")
    print("goal: named, with every caller's hook registered <= 1.20")


if __name__ == "__main__":
    main()
