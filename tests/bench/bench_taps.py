"""What the taps cost inside vLLM itself (issue 36), without hookwire's front: vLLM's
``LLM.generate`` in-process on the serving benchmark's model (a seeded Llama, hidden 512,
6 layers, 8 heads, vocabulary 32,000, float32), 8 prompts x 64 greedy tokens a round,
each configuration in a process of its own, configurations alternated per repeat:

- ``eager``: ``enforce_eager`` (what hookwire ran before compiled mode);
- ``compiled``: vLLM's compiled default (torch.compile, inductor), no taps;
- ``taps``: compiled with hookwire's taps at the default points (engine/vllm_taps.py's
  ``TappedWorker``), no hook registered: what a request no hook touches pays;
- ``taps+hook`` and ``eager+hook``: a plain torch forward hook on every decoder layer
  copying each step's last position to a list (the cost of firing through a tap against
  firing through ``nn.Module.__call__``).

Medians and min-max of tokens/s over ``--repeats``; ratios against ``compiled`` and
``eager`` of the same run. Each child keeps its compilation caches in the run's folder
(the first start-up of a configuration compiles cold; its time is printed).

    .venv-vllm/bin/python tests/bench/bench_taps.py [--repeats 5] [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

CONFIGS = ("eager", "compiled", "taps", "taps+hook", "eager+hook")


def child(folder: str, config: str, rounds: int) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    extra: dict[str, object] = {}
    if config.startswith("taps"):
        extra = {"worker_cls": "hookwire_server.engine.vllm_taps.TappedWorker",
                 "additional_config": {"hookwire": {"model": "bench", "tap_points": "default"}}}
    llm = LLM(model=folder, dtype="float32", max_model_len=512, max_num_seqs=32, kv_cache_memory_bytes=512 << 20,
              enforce_eager=config.startswith("eager"), seed=0, **extra)
    startup = time.perf_counter() - started
    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    kept: list[torch.Tensor] = []
    if config.endswith("+hook"):
        for layer in model.model.layers:
            layer.register_forward_hook(lambda m, a, out: kept.append(out[0][-1:].clone()))
    prompts = [{"prompt_token_ids": [1 + (7 * i + j) % 31000 for j in range(16)]} for i in range(8)]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate(prompts, params, use_tqdm=False)  # warm
    begin = time.perf_counter()
    tokens = 0
    for _ in range(rounds):
        kept.clear()
        for out in llm.generate(prompts, params, use_tqdm=False):
            tokens += len(out.outputs[0].token_ids)
    elapsed = time.perf_counter() - begin
    print(json.dumps({"rate": tokens / elapsed, "startup": startup, "threads": torch.get_num_threads()}), flush=True)
    os._exit(0)  # vLLM's in-process engine has no quick shutdown


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--child", nargs=2, metavar=("FOLDER", "CONFIG"))
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.rounds)
        return
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from bench_serving import save_model

    work = pathlib.Path(tempfile.mkdtemp(prefix="bench_taps_"))
    folder = work / "llama"
    save_model(folder)
    env = dict(os.environ, VLLM_CACHE_ROOT=str(work / "vllm-cache"), TORCHINDUCTOR_CACHE_DIR=str(work / "inductor"))
    rates: dict[str, list[float]] = {c: [] for c in CONFIGS}
    startups: dict[str, list[float]] = {c: [] for c in CONFIGS}
    for repeat in range(args.repeats):
        for config in CONFIGS if repeat % 2 == 0 else CONFIGS[::-1]:
            out = subprocess.run([sys.executable, __file__, "--rounds", str(args.rounds), "--child", str(folder), config],
                                 env=env, capture_output=True, text=True)
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith("{")), None)
            if line is None:
                raise SystemExit(f"{config} failed:\n{out.stderr[-3000:]}")
            got = json.loads(line)
            rates[config].append(got["rate"])
            startups[config].append(got["startup"])
            print(f"  repeat {repeat + 1} {config:10s} {got['rate']:7.1f} tokens/s  start-up {got['startup']:.1f} s  "
                  f"threads {got['threads']}", flush=True)
    med = {c: statistics.median(v) for c, v in rates.items()}
    print(f"\n{args.repeats} repeats, {args.rounds} rounds of 8 x 64 tokens a run")
    for c in CONFIGS:
        later = startups[c][1:] or startups[c]
        print(f"  {c:10s} {med[c]:7.1f} tokens/s ({min(rates[c]):.1f}-{max(rates[c]):.1f}); start-up first "
              f"{startups[c][0]:.1f} s, then {statistics.median(later):.1f} s")
    print(f"  taps / compiled (no hook): {med['taps'] / med['compiled']:.3f}x")
    print(f"  compiled / eager: {med['compiled'] / med['eager']:.3f}x; taps / eager: {med['taps'] / med['eager']:.3f}x")
    print(f"  taps+hook / eager+hook: {med['taps+hook'] / med['eager+hook']:.3f}x")


if __name__ == "__main__":
    main()
