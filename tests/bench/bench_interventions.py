"""Benchmark (issue 25): expressive interventions during Generate, remote vs in-process.

    .venv/bin/python tests/bench/bench_interventions.py [--repeats 7] [--new-tokens 32] [--features 16384]

Model: gpt2-26m (bench_generate.py's seeded GPT-2, 8 blocks of width 512), served by
`hookwire serve` in a process of its own on loopback and loaded here with the same
`from_pretrained`; torch runs one intra-op thread on both sides. Greedy decoding of
--new-tokens tokens from one prompt. Variants, interleaved (one of each per repeat, after
a warm-up):

- SAE clamp: an SAE of --features features on block 4's output (seeded weights, ReLU),
  two features clamped to 8.0 at every step with the reconstruction error kept.
  In process: a torch forward hook computing ``decode(f') + (x - decode(f))``. Remote: a
  session hook with ``rules.sae`` registered once (the SAE travels once, at
  registration), then Generate calls in that session. Goal: remote / local <= 1.15 (time).
- probe readout: 4 linear probes read on every block at every step. In process: forward
  hooks computing ``out @ W.T`` and keeping the scores. Remote: a request hook on every
  block with ``capture("output", readout=rules.probe_scores(W, compact=True))`` (one
  event per step for the 8 blocks, expanded by the SDK), every event decoded.
  Goal: no worse than G1's ratio for raw captures (docs/benchmarks.md), and the bytes of
  its events at least 100 times fewer than capturing the blocks' outputs (measured on one
  call each: the events' protobuf sizes, each wire event once; the same readout without
  ``compact``, an event per block and step, printed too).

Prints medians with the min-max spread, and the ratios of medians; tokens are checked
equal between remote and local (greedy, the same edit).
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import torch
import transformers

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import hookwire  # noqa: E402
from bench_generate import PROMPT, serve_gpt2  # noqa: E402
from hookwire import rules  # noqa: E402
from hookwire.rules import Sae  # noqa: E402

BLOCK = "transformer.h.4"
FEATURES = [10, 200]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--features", type=int, default=16384)
    ns = parser.parse_args()
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="hookwire-bench-interventions-") as tmp:
        folder = pathlib.Path(tmp) / "gpt2-26m"
        server, target = serve_gpt2(pathlib.Path(tmp), demo=False)
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True).eval()
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
            asyncio.run(bench(target, model, tokenizer, ns))
        finally:
            server.terminate()
            server.wait(30)


async def bench(target: str, model: Any, tokenizer: Any, ns: argparse.Namespace) -> None:
    g = torch.Generator().manual_seed(0)
    d, n = 512, ns.features
    w_enc, b_enc = torch.randn(d, n, generator=g) * 0.05, torch.zeros(n)
    w_dec, b_dec = torch.randn(n, d, generator=g) * 0.05, torch.zeros(d)
    probes = torch.randn(4, d, generator=g)
    enc = tokenizer(PROMPT, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    blocks = [f"transformer.h.{i}" for i in range(8)]
    modules = dict(model.named_modules())

    def sae_hook(module: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
        x = out
        f = torch.relu((x - b_dec) @ w_enc + b_enc)
        edited = f.clone()
        edited[..., FEATURES] = 8.0
        return (edited @ w_dec + b_dec) + (x - (f @ w_dec + b_dec))

    def local(hooks: list[tuple[str, Callable[..., Any]]]) -> tuple[float, list[int]]:
        handles = [modules[path].register_forward_hook(fn) for path, fn in hooks]
        try:
            t = time.perf_counter()
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=ns.new_tokens, do_sample=False)
            return time.perf_counter() - t, out[0, ids.shape[1]:].tolist()
        finally:
            for h in handles:
                h.remove()

    kept: list[torch.Tensor] = []
    probe_hooks = [(path, lambda m, a, out: kept.append((out @ probes.T).detach())) for path in blocks]
    sae = Sae.of(w_enc, b_enc, w_dec, b_dec)
    async with hookwire.connect(target) as sae_client, hookwire.connect(target) as client:
        gpt = client.model("gpt2-26m")
        await sae_client.model("gpt2-26m").hook(BLOCK, posthook=[
            rules.sae("output", sae, FEATURES, edit="clamp", value=8.0)])  # registered once: the SAE travels once
        steered = sae_client.model("gpt2-26m")
        readout = [hookwire.HookSpec("transformer.h.*", posthook=hookwire.capture(
            "output", readout=rules.probe_scores(probes, compact=True)))]
        per_module = [hookwire.HookSpec("transformer.h.*", posthook=hookwire.capture(
            "output", readout=rules.probe_scores(probes)))]

        async def remote(m: Any, hooks: list[Any]) -> tuple[float, list[int]]:
            t = time.perf_counter()
            result = await m.generate(ids, ns.new_tokens, do_sample=False, hooks=hooks)
            return time.perf_counter() - t, list(result.token_ids[0])

        variants: dict[str, Callable[[], Any]] = {
            "local bare": lambda: local([]),
            "remote bare": lambda: remote(gpt, []),
            "local SAE clamp": lambda: local([(BLOCK, sae_hook)]),
            "remote SAE clamp": lambda: remote(steered, []),
            "local probes": lambda: local(probe_hooks),
            "remote probe readout": lambda: remote(gpt, readout),
        }

        async def run(fn: Callable[[], Any]) -> tuple[float, list[int]]:
            value = fn()
            return await value if asyncio.iscoroutine(value) else value

        tokens: dict[str, list[int]] = {}
        for name, fn in variants.items():  # warm-up, and the same work on both sides
            _, tokens[name] = await run(fn)
        assert tokens["remote SAE clamp"] == tokens["local SAE clamp"] != tokens["local bare"], "SAE tokens differ"
        assert tokens["remote probe readout"] == tokens["local probes"] == tokens["local bare"]
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(ns.repeats):
            for name, fn in variants.items():
                kept.clear()
                times[name].append((await run(fn))[0])
        small = await gpt.generate(ids, ns.new_tokens, do_sample=False, hooks=readout)
        each = await gpt.generate(ids, ns.new_tokens, do_sample=False, hooks=per_module)
        assert [(e.step, e.module) for e in small.events] == [(e.step, e.module) for e in each.events]
        assert all(torch.equal(a.output, b.output) for a, b in zip(small.events, each.events))
        full = await gpt.generate(ids, ns.new_tokens, do_sample=False, hooks=[
            hookwire.HookSpec("transformer.h.*", posthook=hookwire.capture("output"))])
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"gpt2-26m, {ns.new_tokens} new tokens, batch 1, torch threads 1 both sides, {ns.repeats} repeats "
          f"interleaved; SAE of {n} features on {BLOCK}; 4 probes on 8 blocks")
    for name, v in times.items():
        print(f"  {name:22s} median {med[name] * 1e3:8.1f} ms  (spread {min(v) * 1e3:.1f}-{max(v) * 1e3:.1f})")
    print(f"bare:          remote / local {med['remote bare'] / med['local bare']:.2f}x")
    print(f"SAE clamp:     remote / local {med['remote SAE clamp'] / med['local SAE clamp']:.2f}x (goal <= 1.15)")
    print(f"probe readout: remote / local {med['remote probe readout'] / med['local probes']:.2f}x "
          "(goal: no worse than G1's raw-capture ratio)")
    def wire(events: Any) -> int:  # each wire event once (a compact one stands for 8 SDK events)
        return sum(raw.ByteSize() for raw in {id(e.raw): e.raw for e in events}.values())

    small_bytes, each_bytes, full_bytes = wire(small.events), wire(each.events), wire(full.events)
    print(f"probe readout events, compact: {small_bytes} bytes vs captured blocks {full_bytes} bytes: "
          f"{full_bytes / small_bytes:.0f}x fewer (goal >= 100x); an event per block: {each_bytes} bytes, "
          f"{full_bytes / each_bytes:.0f}x fewer")


if __name__ == "__main__":
    main()
