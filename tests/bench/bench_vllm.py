"""hookwire on vLLM (issue 24's V1 and V2), interleaved, ratios, medians and spread.

Run in .venv-vllm (make test builds it), from the repository root:

    .venv-vllm/bin/python tests/bench/bench_vllm.py [--repeats 5] [--tokens 32] [--processes]

Model: a seeded Llama with hidden 512 and 6 layers (float32), tiny-lm's tokenizer (its
vocabulary is 357 tokens, not the issue's 32k: hookwire decodes every generated token to
text, which needs a tokenizer that knows it), saved as a folder. Torch threads are equal
on both sides (vLLM binds its own; transformers gets the same count).

- V2: 8 concurrent Generate callers x N tokens through hookwire on vLLM (in-process), no
  hooks, vs transformers' batched generate() of the same 8 prompts, in-process, greedy.
- V1: the same 8 callers with every decoder layer captured every step vs in-process vLLM
  (the same LLM object, LLM.generate) with torch hooks on every decoder layer copying
  each step's output to host memory.
- V3: the same 8 callers, each with a steering rule (add a vector to layer 2's residual
  stream) on every step, vs in-process vLLM without hooks (LLM.generate), both eager.
- V4: a harvest job (2 decoder layers, packed contexts of 64 tokens) on the vLLM model
  vs the same job on the torch engine's copy of the folder: recorded.
- ``--processes``: V1-V3's hookwire side again on a second vLLM engine of the same folder
  in worker processes (``worker_processes = true``), against the same in-process
  baselines; every variant then waits 1.5 s before it is timed (vLLM's engine process
  busy-polls for a second after its last message, which would take a core from the next
  variant).

The clients run in this process (as a notebook's would); vLLM's start-up time and the
process's peak RSS are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import hookwire  # noqa: E402
from hookwire import HookSpec, capture, rules  # noqa: E402
from hookwire_server import ModelRegistry, ServerSettings  # noqa: E402
from hookwire_server.demo_models import tiny_lm_tokenizer  # noqa: E402
from hookwire_server.engine.core import build_host  # noqa: E402
from hookwire_server.models.model_loading import ModelConfig  # noqa: E402
from support import ServerThread  # noqa: E402

PROMPTS = [f"prompt number {i} says hello" for i in range(8)]


def save_model(folder: pathlib.Path) -> None:
    import transformers

    tok = tiny_lm_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=512, intermediate_size=1376, num_hidden_layers=6, num_attention_heads=8,
        num_key_value_heads=8, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(str(folder))
    tok.save_pretrained(str(folder))


def compiled_run(folder: pathlib.Path, n: int) -> str:
    """LLM.generate of the 8 prompts in vLLM's default (compiled) mode, in a process of
    its own (a second engine here would compete for memory): the median of 3."""
    import subprocess

    code = f"""
import os, statistics, time
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
llm = LLM(model={str(folder)!r}, dtype="float32", max_model_len=256, max_num_seqs=8,
          kv_cache_memory_bytes=256 << 20, enable_prefix_caching=False)
p = SamplingParams(max_tokens={n}, min_tokens={n}, temperature=0)
llm.generate({PROMPTS!r}, p, use_tqdm=False)
times = []
for _ in range(3):
    t = time.perf_counter(); llm.generate({PROMPTS!r}, p, use_tqdm=False); times.append(time.perf_counter() - t)
print(statistics.median(times))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode:
        return f"failed: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}"
    seconds = float(out.stdout.strip().splitlines()[-1])
    return f"{len(PROMPTS) * n / seconds:.1f} tokens/s (median of 3: {seconds:.3f} s)"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--compiled", action="store_true",
                    help="also time LLM.generate in vLLM's compiled mode (its own process: minutes to compile)")
    ap.add_argument("--processes", action="store_true",
                    help="also run V1-V3 through hookwire on vLLM in worker processes (worker_processes = true)")
    args = ap.parse_args()
    folder = pathlib.Path(tempfile.mkdtemp())
    save_model(folder)
    started = time.perf_counter()
    host = build_host(ModelConfig(name="llama", transformers=str(folder), engine="vllm",
                                  vllm={"max_model_len": 256, "max_num_seqs": 8, "kv_cache_bytes": 256 << 20,
                                        "worker_processes": False}))
    startup = time.perf_counter() - started
    threads = torch.get_num_threads()  # what vLLM left this process
    import transformers

    hf = transformers.LlamaForCausalLM.from_pretrained(str(folder)).eval()
    tok = tiny_lm_tokenizer()
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    torch_host = build_host(ModelConfig(name="llama-torch", transformers=str(folder)))
    data, out = pathlib.Path(tempfile.mkdtemp()), pathlib.Path(tempfile.mkdtemp())
    (data / "corpus.txt").write_text("\n".join(
        f"document {i}: the model reads tokens and writes hidden states for each of them, layer by layer"
        for i in range(200)))
    hosts = [host, torch_host]
    if args.processes:
        started = time.perf_counter()
        hosts.append(build_host(ModelConfig(
            name="llama-mp", transformers=str(folder), engine="vllm",
            vllm={"max_model_len": 256, "max_num_seqs": 8, "kv_cache_bytes": 256 << 20, "worker_processes": True})))
        print(f"vLLM start-up in worker processes: {time.perf_counter() - started:.1f} s")
    srv = ServerThread(ModelRegistry(hosts), ServerSettings(
        port=0, harvest_data_root=str(data), harvest_output_root=str(out))).start()
    llm = host.loaded_engine.llm
    layers = [host.modules[f"model.layers.{i}"] for i in range(6)]
    n = args.tokens
    total = n * len(PROMPTS)

    async def hookwire_run(hooks: list[HookSpec], name: str = "llama") -> float:
        async with hookwire.connect(srv.target) as client:
            model = client.model(name)
            t = time.perf_counter()
            await asyncio.gather(*(model.generate([p], n, hooks=hooks) for p in PROMPTS))
            return time.perf_counter() - t

    def transformers_run() -> float:
        t = time.perf_counter()
        with torch.no_grad():
            hf.generate(**batch, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t

    def vllm_hooked_run() -> float:
        from vllm import SamplingParams

        kept: list[torch.Tensor] = []
        handles = [layer.register_forward_hook(lambda m, a, o: kept.append((o[0] + o[1]).to("cpu", copy=True)))
                   for layer in layers]
        try:
            t = time.perf_counter()
            llm.generate(PROMPTS, SamplingParams(max_tokens=n, min_tokens=n, temperature=0), use_tqdm=False)
            return time.perf_counter() - t
        finally:
            for h in handles:
                h.remove()

    def vllm_plain_run() -> float:
        from vllm import SamplingParams

        t = time.perf_counter()
        llm.generate(PROMPTS, SamplingParams(max_tokens=n, min_tokens=n, temperature=0), use_tqdm=False)
        return time.perf_counter() - t

    jobs = {"n": 0}

    async def harvest(model: str) -> float:
        import grpc

        from hookwire.v1 import harvest_service_pb2 as hv
        from hookwire.v1 import harvest_service_pb2_grpc as hv_grpc

        jobs["n"] += 1
        async with grpc.aio.insecure_channel(srv.target) as channel:
            stub = hv_grpc.HarvestServiceStub(channel)
            t = time.perf_counter()
            job = await stub.StartHarvest(hv.StartHarvestRequest(
                model=model, modules=["model.layers.2", "model.layers.5"],
                source=hv.HarvestSource(text=hv.TextSource(path="corpus.txt")),
                contexts=hv.HarvestContexts(length=64, batch_size=8, packing=hv.PACKING_PACK),
                output=hv.HarvestOutput(path=f"job{jobs['n']}", shard_tokens=4096)))
            last = job
            async for last in stub.WatchHarvest(hv.WatchHarvestRequest(job_id=job.job_id, interval_ms=50)):
                pass
            assert last.state == hv.HARVEST_STATE_SUCCEEDED, last.error
            return time.perf_counter() - t

    def on_worker(fn: Any) -> Any:
        """Runs an in-process vLLM baseline on the model's worker thread: the LLM object is
        the server's, and vLLM is not to be driven from two threads."""
        return lambda: host._executor.submit(fn).result()

    every_layer = [HookSpec("model.layers.*", posthook=capture("output"))]
    vector = torch.randn(512, generator=torch.Generator().manual_seed(1))
    steer = [HookSpec("model.layers.2", posthook=[rules.add("output", vector)])]
    variants = {
        "V2 hookwire+vLLM, no hooks": lambda: asyncio.run(hookwire_run([])),
        "V2 transformers generate()": transformers_run,
        "V1 hookwire+vLLM, 6 layers captured": lambda: asyncio.run(hookwire_run(every_layer)),
        "V1 in-process vLLM, 6 torch hooks": on_worker(vllm_hooked_run),
        "V3 hookwire+vLLM, steering every step": lambda: asyncio.run(hookwire_run(steer)),
        "V3 in-process vLLM, no hooks": on_worker(vllm_plain_run),
        "V4 harvest job, vLLM engine": lambda: asyncio.run(harvest("llama")),
        "V4 harvest job, torch engine": lambda: asyncio.run(harvest("llama-torch")),
    }
    if args.processes:
        variants.update({
            "V2 hookwire+vLLM processes, no hooks": lambda: asyncio.run(hookwire_run([], "llama-mp")),
            "V1 hookwire+vLLM processes, 6 captured": lambda: asyncio.run(hookwire_run(every_layer, "llama-mp")),
            "V3 hookwire+vLLM processes, steering": lambda: asyncio.run(hookwire_run(steer, "llama-mp")),
        })
    settle = 1.5 if args.processes else 0.0
    for fn in variants.values():  # warm up
        fn()
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.repeats):  # interleaved
        for name, fn in variants.items():
            time.sleep(settle)
            times[name].append(fn())
    srv.stop()
    if args.compiled:
        print("compiled mode (V3's other side): " + compiled_run(folder, n))
    print(f"vLLM start-up {startup:.1f} s; torch threads {threads}; {len(PROMPTS)} callers x {n} tokens; "
          f"{args.repeats} repeats, interleaved")
    rate = {k: total / statistics.median(v) for k, v in times.items()}
    for name, v in times.items():
        what = "" if name.startswith("V4") else f"{rate[name]:8.1f} tokens/s  "
        print(f"  {name:40s} {what}(median {statistics.median(v):.3f} s, spread {min(v):.3f}-{max(v):.3f} s)")
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"V2 ratio (hookwire+vLLM / transformers generate, tokens/s): "
          f"{rate['V2 hookwire+vLLM, no hooks'] / rate['V2 transformers generate()']:.2f}x")
    print(f"V1 ratio (hookwire+vLLM capturing / in-process vLLM hooks, tokens/s): "
          f"{rate['V1 hookwire+vLLM, 6 layers captured'] / rate['V1 in-process vLLM, 6 torch hooks']:.2f}x")
    print(f"V3 ratio (hookwire+vLLM steering / in-process vLLM, time): "
          f"{med['V3 hookwire+vLLM, steering every step'] / med['V3 in-process vLLM, no hooks']:.2f}x")
    if args.processes:
        print(f"in worker processes: V2 "
              f"{rate['V2 hookwire+vLLM processes, no hooks'] / rate['V2 transformers generate()']:.2f}x, V1 "
              f"{rate['V1 hookwire+vLLM processes, 6 captured'] / rate['V1 in-process vLLM, 6 torch hooks']:.2f}x, V3 "
              f"{med['V3 hookwire+vLLM processes, steering'] / med['V3 in-process vLLM, no hooks']:.2f}x "
              "(against the same in-process baselines)")
    print(f"V4 ratio (harvest on vLLM / on torch, time): "
          f"{med['V4 harvest job, vLLM engine'] / med['V4 harvest job, torch engine']:.2f}x")
    import resource

    print(f"peak RSS of this process (server, clients, both engines): "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
