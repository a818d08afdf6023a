"""hookwire on vLLM (issue 24's V1 and V2), interleaved, ratios, medians and spread.

Run in .venv-vllm (make test builds it), from the repository root:

    .venv-vllm/bin/python tests/bench/bench_vllm.py [--repeats 5] [--tokens 32]

Model: a seeded Llama with hidden 512 and 6 layers (float32), tiny-lm's tokenizer (its
vocabulary is 357 tokens, not the issue's 32k: hookwire decodes every generated token to
text, which needs a tokenizer that knows it), saved as a folder. Torch threads are equal
on both sides (vLLM binds its own; transformers gets the same count).

- V2: 8 concurrent Generate callers x N tokens through hookwire on vLLM (in-process), no
  hooks, vs transformers' batched generate() of the same 8 prompts, in-process, greedy.
- V1: the same 8 callers with every decoder layer captured every step vs in-process vLLM
  (the same LLM object, LLM.generate) with torch hooks on every decoder layer copying
  each step's output to host memory.
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

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import hookwire  # noqa: E402
from hookwire import HookSpec, capture  # noqa: E402
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    folder = pathlib.Path(tempfile.mkdtemp())
    save_model(folder)
    started = time.perf_counter()
    host = build_host(ModelConfig(name="llama", transformers=str(folder), engine="vllm",
                                  vllm={"max_model_len": 256, "max_num_seqs": 8, "kv_cache_bytes": 256 << 20}))
    startup = time.perf_counter() - started
    threads = torch.get_num_threads()  # what vLLM left this process
    import transformers

    hf = transformers.LlamaForCausalLM.from_pretrained(str(folder)).eval()
    tok = tiny_lm_tokenizer()
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    srv = ServerThread(ModelRegistry([host]), ServerSettings(port=0)).start()
    llm = host.loaded_engine.llm
    layers = [host.modules[f"model.layers.{i}"] for i in range(6)]
    n = args.tokens
    total = n * len(PROMPTS)

    async def hookwire_run(hooks: list[HookSpec]) -> float:
        async with hookwire.connect(srv.target) as client:
            model = client.model("llama")
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

    every_layer = [HookSpec("model.layers.*", posthook=capture("output"))]
    variants = {
        "V2 hookwire+vLLM, no hooks": lambda: asyncio.run(hookwire_run([])),
        "V2 transformers generate()": transformers_run,
        "V1 hookwire+vLLM, 6 layers captured": lambda: asyncio.run(hookwire_run(every_layer)),
        "V1 in-process vLLM, 6 torch hooks": vllm_hooked_run,
    }
    for fn in variants.values():  # warm up
        fn()
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.repeats):  # interleaved
        for name, fn in variants.items():
            times[name].append(fn())
    srv.stop()
    print(f"vLLM start-up {startup:.1f} s; torch threads {threads}; {len(PROMPTS)} callers x {n} tokens; "
          f"{args.repeats} repeats, interleaved")
    rate = {k: total / statistics.median(v) for k, v in times.items()}
    for name, v in times.items():
        print(f"  {name:40s} {rate[name]:8.1f} tokens/s  (median {statistics.median(v):.3f} s, "
              f"spread {min(v):.3f}-{max(v):.3f} s)")
    print(f"V2 ratio (hookwire+vLLM / transformers generate): {rate['V2 hookwire+vLLM, no hooks'] / rate['V2 transformers generate()']:.2f}x")
    print(f"V1 ratio (hookwire+vLLM capturing / in-process vLLM hooks): "
          f"{rate['V1 hookwire+vLLM, 6 layers captured'] / rate['V1 in-process vLLM, 6 torch hooks']:.2f}x")


if __name__ == "__main__":
    main()
