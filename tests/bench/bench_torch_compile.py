"""Would ``torch.compile`` pay on the torch engine? (issue 36: "the torch engine too, where
it is cheap"). A transformers Llama (the serving benchmark's: hidden 512, 6 layers, 8
heads, vocabulary 32,000, float32) with hookwire's taps at every decoder layer
(runtime/taps.py, as a compiled torch engine would need them), eager against
``torch.compile`` (inductor, dynamic shapes, as the engine's varying batches and lengths
would need), in this process, torch threads equal:

- P: a prompt pass (Infer): 8 sequences x 64 tokens, logits of every position;
- D: one decoding step (Generate): 8 sequences, one token each, on a DynamicCache that
  holds 64 positions (cropped back to them after every run);
- each also with a forward hook on every decoder layer (the taps firing it), capturing
  the last position (what the serving benchmark's S2 observer does).

Variants interleaved (eager, compiled, eager, ...), medians and min-max of ``--repeats``
runs of ``--iterations`` calls each; the compile's own time (first call) is printed.

    .venv/bin/python tests/bench/bench_torch_compile.py [--repeats 7] [--iterations 20]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import torch

from hookwire_server.runtime import taps


def model() -> Any:
    import transformers

    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=6,
                                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config).eval()


def timed(fn: Callable[[], Any], iterations: int) -> float:
    start = time.perf_counter()
    for _ in range(iterations):
        fn()
    return (time.perf_counter() - start) / iterations


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--iterations", type=int, default=20)
    args = ap.parse_args()
    lm = model()
    layers = [f"model.layers.{i}" for i in range(len(lm.model.layers))]
    taps.install("bench", lm, layers)
    fast = torch.compile(lm, dynamic=True)
    ids = torch.randint(0, 32000, (8, 64), generator=torch.Generator().manual_seed(1))
    prompt = lm(ids, use_cache=True)
    cache = prompt.past_key_values
    step = torch.randint(0, 32000, (8, 1), generator=torch.Generator().manual_seed(2))
    positions = torch.full((8, 1), 64)

    def prompt_pass(m: Any) -> Callable[[], Any]:
        return lambda: m(ids, use_cache=False)

    def decode_step(m: Any) -> Callable[[], Any]:
        def run() -> Any:
            out = m(step, past_key_values=cache, position_ids=positions, use_cache=True)
            cache.crop(-1)  # the step's position off again: the prompt's 64 for the next run
            return out
        return run

    seen: list[torch.Tensor] = []

    def observe() -> list[Any]:
        return [lm.model.layers[i].register_forward_hook(
            lambda mod, a, out: seen.append((out[0] if isinstance(out, tuple) else out)[:, -1].clone()))
            for i in range(len(layers))]

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name, make in (("P", prompt_pass), ("D", decode_step)):
        started = time.perf_counter()
        make(fast)()
        first = time.perf_counter() - started
        make(fast)()
        print(f"{name}: compiling took {first:.1f} s (first call)")
        for hooked in (False, True):
            handles = observe() if hooked else []
            try:
                eager_fn, fast_fn = make(lm), make(fast)
                torch.testing.assert_close(fast_fn().logits, eager_fn().logits, rtol=1e-4, atol=1e-4)
                rates: dict[str, list[float]] = {"eager": [], "compiled": []}
                for repeat in range(args.repeats):
                    order = (("eager", eager_fn), ("compiled", fast_fn))
                    for label, fn in order if repeat % 2 == 0 else order[::-1]:
                        seen.clear()
                        rates[label].append(timed(fn, args.iterations))
            finally:
                for h in handles:
                    h.remove()
            med = {k: statistics.median(v) for k, v in rates.items()}
            spread = {k: f"{min(v) * 1e3:.2f}-{max(v) * 1e3:.2f}" for k, v in rates.items()}
            print(f"{name}{' with a capture at every layer' if hooked else ''}: eager {med['eager'] * 1e3:.2f} ms "
                  f"({spread['eager']}), compiled {med['compiled'] * 1e3:.2f} ms ({spread['compiled']}); "
                  f"compiled / eager time {med['compiled'] / med['eager']:.2f}x")


if __name__ == "__main__":
    main()
