"""Benchmark: remote Generate vs in-process transformers generate(), with and without
capturing every decoder block's output at every step.

    .venv/bin/python tests/bench/bench_generate.py [--repeats 30] [--new-tokens 32] [--batch 1]

Starts `hookwire serve` as a separate process on loopback, hosting the demo models
(`tiny-lm`) and a Hugging Face causal LM that the script builds and saves to a
temporary folder (`gpt2-26m`: a seeded GPT2LMHeadModel, 8 blocks of width 512,
25.7M parameters, with tiny-lm's tokenizer), loaded by the server from that folder
as a `transformers = "..."` model and by this process with the same
`AutoModelForCausalLM.from_pretrained`. Torch runs one intra-op thread on both
sides (`torch.set_num_threads(1)` here, OMP_NUM_THREADS=1 for the server).

For each model, greedy decoding of --new-tokens tokens from the same prompt ids:
  local hooks   in-process `model.generate()` with torch forward hooks cloning the
                output of every decoder block (the in-process baseline);
  remote hooks  Generate (raw gRPC stub) with a request-scoped hook capturing the
                output of every decoder block, timed until GenerateDone, every
                event decoded to torch tensors (hookwire.InterceptEvent);
  local bare    in-process `model.generate()` without hooks;
  remote bare   Generate without hooks.
The four run interleaved (one of each per repeat, after warm-up calls), so a load
change on the machine hits every variant alike. Time to first token: in-process,
when generate()'s streamer receives the first new tokens; remote, when the first
GeneratedTokens message arrives. The first repeat also checks that the remote call
did the same work: the same tokens and bit-identical captures (torch.equal).
Prints medians with min-max spread, tokens/s, the mean CPU time per call (this
process's, plus the server process's for a remote call: what the remote path costs
in total, less sensitive to other load than wall time), and ratios remote/local per
repeat pair (median and spread). Absolute times on shared machines are noisy; the
ratios are what to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import grpc
import torch
import transformers

import hookwire
from hookwire.wire import codec
from hookwire.v1 import model_service_pb2, model_service_pb2_grpc
from hookwire_server.demo_models import tiny_lm, tiny_lm_tokenizer
from hookwire_server.models.module_patterns import match_paths

#: Greedy decoding of both models runs 32 new tokens from it without reaching <eos>.
PROMPT = "hookwire streams every layer of the model"
#: The decoder blocks of each benchmarked model, as a hookwire glob.
BLOCKS = {"tiny-lm": "model.layers.*", "gpt2-26m": "transformer.h.*"}
VARIANTS = ("local hooks", "remote hooks", "local bare", "remote bare")


@dataclasses.dataclass
class Run:
    """One timed generation."""

    total: float
    first_token: float
    cpu: float  # CPU seconds of this process, plus the server's for a remote call
    tokens: torch.Tensor  # [batch, new] the new token ids
    captures: list[tuple[str, torch.Tensor]]  # (module path, output) in firing order


def build_hf_model(folder: pathlib.Path) -> None:
    """A seeded GPT-2 of realistic small size with tiny-lm's tokenizer, saved as a HF folder."""
    tokenizer = tiny_lm_tokenizer()
    config = transformers.GPT2Config(
        vocab_size=len(tokenizer), n_embd=512, n_layer=8, n_head=8, n_positions=512,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config).eval()
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))


class FirstToken(transformers.generation.streamers.BaseStreamer):
    """A streamer that notes when generate() hands it the first new tokens
    (its first put() is the prompt, the second the tokens chosen in step 0)."""

    def __init__(self) -> None:
        self.puts = 0
        self.at = 0.0

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_clone(v) for v in value)
    return value


def local_generate(model: Any, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, blocks: list[str] | None) -> Run:
    """In-process generate(); with ``blocks``, forward hooks clone each block's output."""
    captures: list[tuple[str, torch.Tensor]] = []
    handles = []
    if blocks is not None:
        modules = dict(model.named_modules())
        for path in blocks:
            handles.append(modules[path].register_forward_hook(
                lambda mod, args, out, path=path: captures.append((path, _clone(out)))))
    streamer = FirstToken()
    try:
        c0, t0 = time.process_time(), time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             streamer=streamer)
        total, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        for h in handles:
            h.remove()
    return Run(total, streamer.at - t0, cpu, out[:, ids.shape[1]:], captures)


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far; Linux /proc, in clock ticks
    (10 ms): read per call, summed over the repeats. 0.0 where /proc is missing."""
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def remote_generate(stub: model_service_pb2_grpc.ModelServiceStub, name: str, ids: torch.Tensor,
                          mask: torch.Tensor, new_tokens: int, pattern: str | None, server_pid: int) -> Run:
    """Generate over the raw stub, until GenerateDone; events decoded to torch."""
    request = model_service_pb2.GenerateRequest(model=name, max_new_tokens=new_tokens, do_sample=False)
    codec.encode_tensor_into(ids, request.input_ids)
    codec.encode_tensor_into(mask, request.attention_mask)
    if pattern is not None:
        request.hooks.append(hookwire.HookSpec(pattern, posthook=hookwire.capture("output")).to_proto(name))
    captures: list[tuple[str, torch.Tensor]] = []
    steps: list[list[int]] = []
    first = 0.0
    s0, c0, t0 = process_cpu(server_pid), time.process_time(), time.perf_counter()
    async for msg in stub.Generate(request):
        kind = msg.WhichOneof("kind")
        if kind == "event":
            event = hookwire.InterceptEvent.from_proto(msg.event)
            captures.append((event.module, event.output))
        elif kind == "batch":  # small events of one step, sent together
            for raw in msg.batch.events:
                event = hookwire.InterceptEvent.from_proto(raw)
                captures.append((event.module, event.output))
        elif kind == "tokens":
            if not steps:
                first = time.perf_counter()
            steps.append(list(msg.tokens.token_ids))
        elif kind == "chunk":  # every capture here is far below the 4 MiB message size
            raise AssertionError("unexpected chunked capture")
    total = time.perf_counter() - t0
    cpu = time.process_time() - c0 + process_cpu(server_pid) - s0
    return Run(total, first - t0, cpu, torch.tensor(steps, dtype=torch.int64).T, captures)


def check_same_work(name: str, local: Run, remote: Run) -> None:
    """The remote call generated the same tokens and captured the same tensors."""
    assert torch.equal(local.tokens, remote.tokens), f"{name}: tokens differ:\n{local.tokens}\n{remote.tokens}"
    assert len(local.captures) == len(remote.captures), (
        f"{name}: {len(local.captures)} local captures, {len(remote.captures)} remote")
    for (lp, lt), (rp, rt) in zip(local.captures, remote.captures):
        assert lp == rp and torch.equal(lt, rt), f"{name}: capture of {lp} differs from {rp}'s"


async def bench_model(target: str, server_pid: int, name: str, model: Any, tokenizer: Any,
                      ns: argparse.Namespace) -> dict[str, list[Run]]:
    batch = tokenizer([PROMPT] * ns.batch, return_tensors="pt")
    ids, mask = batch.input_ids, batch.attention_mask
    blocks = match_paths(BLOCKS[name], [p for p, _ in model.named_modules()])
    pattern = BLOCKS[name]
    runs: dict[str, list[Run]] = {v: [] for v in VARIANTS}
    async with grpc.aio.insecure_channel(target) as channel:
        stub = model_service_pb2_grpc.ModelServiceStub(channel)

        async def one(variant: str) -> Run:
            hooks = variant.endswith("hooks")
            if variant.startswith("local"):
                return local_generate(model, ids, mask, ns.new_tokens, blocks if hooks else None)
            return await remote_generate(stub, name, ids, mask, ns.new_tokens, pattern if hooks else None, server_pid)

        for _ in range(ns.warmup):
            for variant in VARIANTS:
                await one(variant)
        for rep in range(ns.repeats):
            for variant in VARIANTS:
                run = await one(variant)
                if rep > 0:  # keep only the timings: the captures of 32 steps add up
                    run.captures = []
                runs[variant].append(run)
            if rep == 0:
                check_same_work(name, runs["local hooks"][0], runs["remote hooks"][0])
                check_same_work(name, runs["local bare"][0], runs["remote bare"][0])
                runs["local hooks"][0].captures = runs["remote hooks"][0].captures = []
    return runs


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def report(name: str, params: float, runs: dict[str, list[Run]], blocks: int, ns: argparse.Namespace) -> None:
    new = int(runs["local bare"][0].tokens.numel())
    print(f"\n{name}: {params / 1e6:.1f}M parameters, {blocks} decoder blocks, prompt "
          f"{ns.prompt_tokens[name]} tokens x batch {ns.batch}, {new // ns.batch} new tokens per sequence (greedy), "
          f"{ns.repeats} repeats after {ns.warmup} warm-up; captures per call (hooks): {blocks * (new // ns.batch)}")
    print(f"{'variant':<14}{'total ms':>10}{'(min-max)':>18}{'first token ms':>16}{'(min-max)':>16}{'tokens/s':>10}"
          f"{'CPU ms':>9}")
    for variant in VARIANTS:
        totals = [r.total for r in runs[variant]]
        firsts = [r.first_token for r in runs[variant]]
        med = statistics.median(totals)
        print(f"{variant:<14}{_ms(med):>10}{_ms(min(totals)) + '-' + _ms(max(totals)):>18}"
              f"{_ms(statistics.median(firsts)):>16}{_ms(min(firsts)) + '-' + _ms(max(firsts)):>16}"
              f"{new / med:>10.0f}{_ms(statistics.fmean(r.cpu for r in runs[variant])):>9}")

    def ratio(num: str, den: str, field: str) -> str:
        pairs = sorted(getattr(a, field) / getattr(b, field) for a, b in zip(runs[num], runs[den]))
        medians = statistics.median(getattr(r, field) for r in runs[num]) / statistics.median(
            getattr(r, field) for r in runs[den])
        return f"{medians:.2f}  (per repeat pair: median {statistics.median(pairs):.2f}, {pairs[0]:.2f}-{pairs[-1]:.2f})"

    print(f"ratio remote/local, every block captured every step: {ratio('remote hooks', 'local hooks', 'total')}")
    print(f"ratio remote/local, no hooks:                        {ratio('remote bare', 'local bare', 'total')}")
    print(f"ratio remote/local, time to first token (no hooks):   {ratio('remote bare', 'local bare', 'first_token')}")
    print(f"ratio remote/local, time to first token (hooks):      {ratio('remote hooks', 'local hooks', 'first_token')}")
    print(f"cost of the captures, remote (hooks/bare):           {ratio('remote hooks', 'remote bare', 'total')}")
    print(f"cost of the captures, local (hooks/bare):            {ratio('local hooks', 'local bare', 'total')}")
    cpu = {v: statistics.fmean(r.cpu for r in runs[v]) for v in VARIANTS}
    print(f"CPU remote (server + client) / local: hooks {cpu['remote hooks'] / cpu['local hooks']:.2f}, "
          f"no hooks {cpu['remote bare'] / cpu['local bare']:.2f}")


def serve_gpt2(tmp: pathlib.Path, *, demo: bool) -> tuple[subprocess.Popen[str], str]:
    """Builds gpt2-26m in ``tmp``/gpt2-26m and starts `hookwire serve` on it (and the demo
    models with ``demo``) in a process of its own, one torch thread; returns the process
    and its target."""
    folder = tmp / "gpt2-26m"
    build_hf_model(folder)
    config = tmp / "hookwire.toml"
    config.write_text(f'[[models]]\nname = "gpt2-26m"\ntransformers = "{folder}"\n')
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    server = subprocess.Popen(
        [sys.executable, "-m", "hookwire._cli", "serve", "--port", "0", "--config", str(config),
         *(["--demo"] if demo else []), "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    target = server.stdout.readline().rsplit(" ", 1)[-1].strip()  # type: ignore[union-attr]
    return server, target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--models", default="tiny-lm,gpt2-26m", help="comma-separated: tiny-lm, gpt2-26m")
    ns = parser.parse_args()
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    names = [n for n in ns.models.split(",") if n]
    with tempfile.TemporaryDirectory(prefix="hookwire-bench-generate-") as tmp:
        folder = pathlib.Path(tmp) / "gpt2-26m"
        server, target = serve_gpt2(pathlib.Path(tmp), demo=True)
        try:
            local = {
                "tiny-lm": (tiny_lm(), tiny_lm_tokenizer()),
                "gpt2-26m": (transformers.AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True).eval(),
                             transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)),
            }
            ns.prompt_tokens = {n: len(tok(PROMPT).input_ids) for n, (_, tok) in local.items()}
            results = {}
            started = time.perf_counter()
            for name in names:
                model, tokenizer = local[name]
                results[name] = asyncio.run(bench_model(target, server.pid, name, model, tokenizer, ns))
            elapsed = time.perf_counter() - started
        finally:
            server.terminate()
            server.wait(30)
    print(f"Generate vs in-process generate(), torch threads 1 on both sides, server on loopback "
          f"({os.cpu_count()} CPUs, {elapsed:.0f} s)")
    for name in names:
        model = local[name][0]
        blocks = len(match_paths(BLOCKS[name], [p for p, _ in model.named_modules()]))
        report(name, sum(p.numel() for p in model.parameters()), results[name], blocks, ns)


if __name__ == "__main__":
    main()
