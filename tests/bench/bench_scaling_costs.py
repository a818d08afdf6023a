"""Cost model for docs/scaling.md: bytes per step that captures and the engine move, and
(with --measure) what hookwire's capture path costs per event and per MiB here.

    .venv/bin/python tests/bench/bench_scaling_costs.py             # the tables (arithmetic, instant)
    .venv/bin/python tests/bench/bench_scaling_costs.py --measure   # plus a loopback measurement (~1 min)

The tables are arithmetic on the formulas of docs/scaling.md ("A cost model"); link
rates are nominal line rates, except hookwire's loopback rates, which are measured
figures quoted from docs/benchmarks.md.

--measure starts ``hookwire serve`` as a separate process on loopback hosting ``stack``
(below: 32 layers that each return ``x * 1``, on an activation the model makes itself
from a 3-int input, so no input bytes travel) and times request-scoped Infer calls with
captures shaped like a Llama-8B step (hidden 4096, bfloat16): a decode step of 8 tokens
and a 256-token prefill, each with no hooks (the baseline), every layer captured, and
the reductions the doc recommends (4 layers only, summaries, the last position only).
Variants are interleaved in a random order within each block (bench_hotpath's
``interleaved``); torch at one intra-op thread in both processes; ratios are per-repeat
medians against the no-hook variant of the same shape.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
MIB = 1 << 20
GIB = 1 << 30


# ---------------------------------------------------------------- the model served by --measure


def stack(layers: int = 32) -> Any:
    """A model of ``layers`` layers, each ``x * 1`` (a new tensor per layer, as a real
    layer makes). forward(x: int64 [3] = batch, tokens, hidden) -> float32 scalar: the
    activation is ``full((batch, tokens, hidden), 0.5, bfloat16)``, made on the server."""
    import torch
    from torch import nn

    class Layer(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 1

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(layers))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, h = (int(v) for v in x.tolist())
            y = torch.full((b, t, h), 0.5, dtype=torch.bfloat16)
            for layer in self.layers:
                y = layer(y)
            return y[:, -1].float().sum()

    return Stack()


# ---------------------------------------------------------------- the cost model (arithmetic)

MODELS = {  # name: (hidden, layers, bytes per element of the activations)
    "Llama-8B-like": (4096, 32, 2),
    "Llama-70B-like": (8192, 80, 2),
}
CASES = {  # name: tokens in the step
    "decode, batch 1": 1,
    "decode, batch 64": 64,
    "prefill, 2048 tokens": 2048,
}
#: bytes per second. Nominal line rates, except the two hookwire figures (docs/benchmarks.md).
LINKS = {
    "hookwire loopback, session stream (P2, 317 MiB/s)": 317 * MIB,
    "hookwire loopback, request-scoped 16 MiB (P6, 387 MiB/s)": 387 * MIB,
    "25 Gb/s NIC (nominal)": 25e9 / 8,
    "100 Gb/s NIC (nominal)": 100e9 / 8,
    "400 Gb/s NIC (nominal)": 400e9 / 8,
    "PCIe 5.0 x16, one direction (nominal ~63 GB/s)": 63e9,
    "NVLink 4, H100 SXM, one direction (nominal 450 GB/s)": 450e9,
}


def human(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def seconds(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def capture_bytes(tokens: int, hidden: int, layers: int, elem: int) -> int:
    """Every hooked layer's [tokens, hidden] output: tokens x hidden x bytes x layers."""
    return tokens * hidden * elem * layers


def tp_allreduce_bytes(tokens: int, hidden: int, layers: int, elem: int) -> int:
    """Two all-reduces per layer (attention out, MLP down) of [tokens, hidden]: the
    message size summed over a step (each rank sends and receives about 2(N-1)/N of it)."""
    return 2 * layers * tokens * hidden * elem


def pp_boundary_bytes(tokens: int, hidden: int, elem: int) -> int:
    """What vLLM sends across one pipeline boundary per step: hidden_states and residual."""
    return 2 * tokens * hidden * elem


def print_tables() -> None:
    print("1. Captured bytes per step, every decoder layer's output (tokens x hidden x bytes x layers)")
    print(f"   {'model':<16} {'case':<22} {'all layers':>11} {'4 layers':>10} {'last pos.':>10} {'summaries':>10}")
    for name, (hidden, layers, elem) in MODELS.items():
        for case, tokens in CASES.items():
            full = capture_bytes(tokens, hidden, layers, elem)
            four = capture_bytes(tokens, hidden, 4, elem)
            last = capture_bytes(tokens if case.startswith("decode") else 1, hidden, layers, elem)
            summ = 150 * layers  # an event carrying a TensorSummary (no histogram): about 150 bytes
            print(f"   {name:<16} {case:<22} {human(full):>11} {human(four):>10} {human(last):>10} {human(summ):>10}")
    print("   (last pos.: the prefill reduced to its last position with select='[:, -1]'; decode rows are"
          " already one position each. summaries: ~150 B per layer per step (a 57-byte TensorSummary and the event's header), whatever the size)")
    print()
    print("2. Time to move the all-layer capture of one step over a link (bytes / rate; no overlap)")
    header = "   " + f"{'link':<55}" + "".join(f"{m.split('-')[1] + ' ' + c.split(',')[0][:3] + str(t):>14}"
                                             for m in MODELS for c, t in CASES.items())
    print(header)
    for link, rate in LINKS.items():
        cells = "".join(f"{seconds(capture_bytes(t, *MODELS[m]) / rate):>14}" for m in MODELS for t in CASES.values())
        print(f"   {link:<55}{cells}")
    print("   (columns: model size, dec = decode or pre = prefill, tokens in the step)")
    print()
    print("3. The engine's own traffic per step against the all-layer capture")
    print(f"   {'model':<16} {'case':<22} {'capture':>10} {'TP all-reduce':>14} {'TP=8, per rank':>14}"
          f" {'PP boundary':>12} {'capture/PP':>11}")
    for name, (hidden, layers, elem) in MODELS.items():
        for case, tokens in CASES.items():
            cap = capture_bytes(tokens, hidden, layers, elem)
            ar = tp_allreduce_bytes(tokens, hidden, layers, elem)
            per_rank = ar * 2 * 7 / 8
            pp = pp_boundary_bytes(tokens, hidden, elem)
            print(f"   {name:<16} {case:<22} {human(cap):>10} {human(ar):>14} {human(per_rank):>14}"
                  f" {human(pp):>12} {cap / pp:>10.0f}x")
    print("   (TP all-reduce: message bytes summed over the step; a ring all-reduce moves 2(N-1)/N of it"
          " in and out of each rank, on NVLink inside a node. PP boundary: one boundary's hidden_states"
          " + residual; the all-layer capture is layers/2 times one boundary's bytes)")


# ---------------------------------------------------------------- the measurement (--measure)

DECODE = (8, 1, 4096)
PREFILL = (1, 256, 4096)


async def measure(target: str, server_pid: int, repeats: int, blocks: int, seed: int) -> list[str]:
    import torch

    import hookwire
    from bench_hotpath import Variant, cpu_per_unit, interleaved, latency, latency_round, spread

    lines: list[str] = []
    pids = (server_pid,)
    def spec(pattern: str, **capture: Any) -> Any:
        return hookwire.HookSpec(pattern, posthook=hookwire.capture("output", **capture))

    async with hookwire.connect(target) as client:
        await client.wait_ready(models=["stack"], timeout=120)
        model = client.model("stack")

        def call(shape: tuple[int, int, int], hooks: list[Any], expect: int, nbytes: int | None) -> Any:
            x = torch.tensor(shape)

            async def run() -> None:
                result = await model.infer(x, hooks=hooks)
                if len(result.events) != expect:
                    raise AssertionError(f"{len(result.events)} events, expected {expect}")
                if nbytes is not None:
                    got = sum(e.output.numel() * e.output.element_size() for e in result.events)
                    if got != nbytes:
                        raise AssertionError(f"{got} bytes captured, expected {nbytes}")
            return run

        b, t, h = DECODE
        per_layer_decode = b * t * h * 2
        b, t, h = PREFILL
        per_layer_prefill = b * t * h * 2
        # name: (shape, hooks, events, captured bytes (None: summaries), calls per round)
        table: dict[str, tuple[tuple[int, int, int], list[Any], int, int | None, int]] = {
            "decode: no hooks": (DECODE, [], 0, 0, 10),
            "decode: 32 layers": (DECODE, [spec("layers.*")], 32, 32 * per_layer_decode, 10),
            "decode: 32 layers, 2 bytes each": (DECODE, [spec("layers.*", select="[0, 0, :1]")], 32, 32 * 2, 10),
            "decode: 10 layers (layers.?)": (DECODE, [spec("layers.?")], 10, 10 * per_layer_decode, 10),
            "decode: 32 summaries": (DECODE, [spec("layers.*", summarize=True)], 32, None, 10),
            "prefill: no hooks": (PREFILL, [], 0, 0, 2),
            "prefill: 32 layers": (PREFILL, [spec("layers.*")], 32, 32 * per_layer_prefill, 2),
            "prefill: 32 layers, last position": (PREFILL, [spec("layers.*", select="[:, -1]")], 32, 32 * h * 2, 2),
        }
        variants = [Variant(name, latency_round(calls, call(shape, hooks, events, nbytes), pids))
                    for name, (shape, hooks, events, nbytes, calls) in table.items()]
        res = await interleaved(variants, repeats, blocks, random.Random(seed))

    def added(name: str) -> list[float]:
        base = "decode: no hooks" if name.startswith("decode") else "prefill: no hooks"
        return [latency(a) - latency(z) for a, z in zip(res[name], res[base])]

    lines.append("median ms per call (min-max over repeats); CPU = this process + the server; ratio and added ms"
                 " against no hooks of the same shape:")
    for name, (_, _, events, nbytes, _) in table.items():
        base = "decode: no hooks" if name.startswith("decode") else "prefill: no hooks"
        ms = [latency(r) * 1e3 for r in res[name]]
        ratios = [latency(a) / latency(z) for a, z in zip(res[name], res[base])]
        cpu = [cpu_per_unit(r) * 1e3 for r in res[name]]
        what = f"{events} events, {human(nbytes)}" if nbytes is not None else f"{events} events, summaries"
        lines.append(f"  {name:<36}{spread(ms):>22} ms  CPU {spread(cpu):>20} ms  x{spread(ratios):<18}"
                     f" +{spread([a * 1e3 for a in added(name)])} ms  ({what})")
    per_event = [a / 32 for a in added("decode: 32 layers, 2 bytes each")]
    per_mib_decode = [(a - z) / (32 * per_layer_decode / MIB)
                      for a, z in zip(added("decode: 32 layers"), added("decode: 32 layers, 2 bytes each"))]
    per_mib_prefill = [(a - z) / ((32 * per_layer_prefill - 32 * h * 2) / MIB)
                       for a, z in zip(added("prefill: 32 layers"), added("prefill: 32 layers, last position"))]
    per_summary = [(a - z) / 32 for a, z in zip(added("decode: 32 summaries"), added("decode: 32 layers, 2 bytes each"))]
    lines.append(f"  per event (32 events of 2 bytes): {spread([x * 1e6 for x in per_event], '{:.0f}')} us")
    lines.append(f"  per MiB, decode (32 x 64 KiB minus 32 x 2 B): {spread([x * 1e3 for x in per_mib_decode])} ms"
                 f" = {spread([1 / x for x in per_mib_decode], '{:.0f}')} MiB/s")
    lines.append(f"  per MiB, prefill (32 x 2 MiB minus 32 x 8 KiB): {spread([x * 1e3 for x in per_mib_prefill])} ms"
                 f" = {spread([1 / x for x in per_mib_prefill], '{:.0f}')} MiB/s")
    lines.append(f"  a summary of [8, 1, 4096] bfloat16 over a 2-byte capture: "
                 f"{spread([x * 1e6 for x in per_summary], '{:.0f}')} us per event (CPU torch)")
    lines.append(summary_costs(repeats, statistics.median(per_mib_decode + per_mib_prefill)))
    lines.append(f"  (decode: {DECODE[0]} tokens x hidden {DECODE[2]} bf16 = {human(per_layer_decode)} per layer, "
                 f"{human(32 * per_layer_decode)} per step; prefill: {PREFILL[1]} tokens = {human(per_layer_prefill)} "
                 f"per layer, {human(32 * per_layer_prefill)} per call)")
    return lines


def summary_costs(repeats: int, capture_s_per_mib: float) -> str:
    """In this process (torch at one thread): the server's ``summarize`` on bfloat16
    tensors of 64 KiB, 2 MiB and 16 MiB, sizes interleaved (5 calls each per round); ms
    per MiB against the per-MiB cost of sending captures measured in the same run."""
    import torch
    from hookwire_server.hooks.capture import summarize

    sizes = {64 * 1024: [], 2 * MIB: [], 16 * MIB: []}  # type: dict[int, list[float]]
    tensors = {n: torch.randn(n // 2).bfloat16() for n in sizes}
    for t in tensors.values():
        summarize(t)
    order = list(sizes)
    rng = random.Random(1)
    for _ in range(max(3, repeats)):
        rng.shuffle(order)
        for n in order:
            for _ in range(5):
                t0 = time.perf_counter()
                summarize(tensors[n])
                sizes[n].append(time.perf_counter() - t0)
    parts = []
    for n, times in sizes.items():
        per_mib = statistics.median(times) / (n / MIB)
        parts.append(f"{human(n)} {statistics.median(times) * 1e3:.2f} ms ({per_mib * 1e3:.1f} ms/MiB, "
                     f"x{per_mib / capture_s_per_mib:.1f} the capture's per-MiB cost)")
    return "  summarize() in-process, bfloat16, medians: " + "; ".join(parts)


def run_measure(ns: argparse.Namespace) -> None:
    import torch

    sys.path.insert(0, str(HERE))
    from bench_hotpath import SINGLE_THREAD_ENV

    torch.set_num_threads(1)
    env = {**os.environ, **SINGLE_THREAD_ENV,
           "PYTHONPATH": os.pathsep.join(p for p in [str(HERE), os.environ.get("PYTHONPATH", "")] if p)}
    with tempfile.TemporaryDirectory(prefix="hookwire-bench-scaling-") as tmp:
        config = pathlib.Path(tmp) / "hookwire.toml"
        config.write_text('[[models]]\nname = "stack"\nfactory = "bench_scaling_costs:stack"\nbatching = false\n')
        log = open(pathlib.Path(tmp) / "server.log", "w")
        server = subprocess.Popen(
            [sys.executable, "-m", "hookwire._cli", "serve", "--port", "0", "--config", str(config),
             "--log-level", "warning"], stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        started = time.perf_counter()
        load = os.getloadavg()[0]
        try:
            assert server.stdout is not None
            first = server.stdout.readline()
            if " on " not in first:
                sys.exit(f"hookwire serve did not start: {first!r}; log in {log.name}")
            target = first.rsplit(" ", 1)[-1].strip()
            lines = asyncio.run(measure(target, server.pid, ns.repeats, ns.blocks, ns.seed))
        finally:
            server.terminate()
            server.wait(30)
            log.close()
    print(f"4. Measured here: request-scoped captures over loopback ({ns.repeats} repeats x {ns.blocks} blocks, "
          f"variants interleaved, seed {ns.seed}; {os.cpu_count()} CPUs, no GPU; load average {load:.2f} at the "
          f"start, {os.getloadavg()[0]:.2f} at the end; torch {torch.__version__}, 1 thread; "
          f"{time.perf_counter() - started:.0f} s)")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="also measure captures over loopback (~1 min)")
    parser.add_argument("--repeats", type=int, default=5, help="repeats of the measurement (default 5)")
    parser.add_argument("--blocks", type=int, default=4, help="blocks per repeat (default 4)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the variant orders")
    ns = parser.parse_args()
    print_tables()
    if ns.measure:
        print()
        run_measure(ns)


if __name__ == "__main__":
    main()
