"""hookwire on vLLM beside `vllm serve` (issue 35's S1-S4 and F1): the same model folder,
the same streaming clients, servers alternated, never two at once.

Run in .venv-vllm (make test builds it), from the repository root:

    .venv-vllm/bin/python tests/bench/bench_serving.py [--repeats 5] [--clients 8,32] [--tokens 64] [--rounds 1]
        [--variants S1,S1n,S2,S2n,S3,S3n,S2r] [--hookwire default,inproc] [--no-compiled] [--tp 1]

Model: a seeded Llama (hidden 512, 6 layers, 8 heads, vocabulary 32,000, float32) with a
word-level tokenizer built in code that decodes every id ("t123") and has no end token:
greedy calls always make their full length (no `ignore_eos` needed on either side).

Servers (each started by the bench, in a process of its own, and stopped before the next):

- `vllm-eager`: `python -m vllm.entrypoints.openai.api_server ... --enforce-eager
  --no-enable-prefix-caching` (S1's baseline: vLLM with what hookwire had to turn off);
- `vllm`: the same server with vLLM's defaults (compiled, prefix caching);
- `hookwire` (`hookwire serve`, engine = "vllm"): `--hookwire default` runs the model
  with the server's defaults (compiled, taps at the default points, worker processes),
  `inproc` with `worker_processes = false`, `processes` with `worker_processes = true`,
  `processes-front` with it and `hooks_in_workers = false`, `eager` with
  `enforce_eager = true`.

All with `max_model_len` 512, `max_num_seqs` 32, a 512 MiB KV cache and float32; torch
threads are each server's own choice (what a user who runs it gets), printed.

Variants, each at every client count (C clients x N tokens, streaming, greedy; tokens
counted from what each client received):

- S1: no hooks (every server);
- S2: a SCOPE_ALL observer (a TTL hook, no session) capturing every decoder layer's last
  position every step, read by a Subscribe stream with drop_oldest; its drops are
  printed (hookwire only);
- S2r: the same capture as each call's own request hooks, every event read by its client;
- S3: a SCOPE_ALL steering rule (add a vector to layer 2's output) on every call and step;
- S1i: S1 with `stream_interval` 4 (hookwire only): four steps' tokens a message;
- a trailing `n` (S1n, S2n, S3n): the same while a competing process keeps one core busy
  (`while True: pass`), started before and stopped after the variant.

O1-O3 (issue 37: the OpenAI-compatible front), with vLLM's own load generator
(`vllm.benchmarks.serve`, called through its `add_cli_args` / `main`: `--dataset-name
random --random-input-len 128 --random-output-len 64 --ignore-eos --num-prompts 200
--max-concurrency 8 --request-rate inf`) against each server's `/v1/completions`
(hookwire's `--openai-port`):

- O1: no hooks (every server): output tokens/s, TTFT p50, inter-token latency p99;
- O2: the same with S2's SCOPE_ALL observer on gRPC (hookwire only);
- O3: the same load through hookwire's gRPC Generate (the SDK, 8 calls at a time, 200
  prompts of 128 random token ids, 64 tokens each): output tokens/s (hookwire only).

    .venv-vllm/bin/python tests/bench/bench_serving.py --variants O1,O2,O3 --clients 8 --repeats 3

C1-C4 (issue 36: hooks that survive compilation), from the same variants with `--hookwire
default,eager` and vLLM's compiled server in the run: C1 S1 hookwire / `vllm`; C2 S2 /
S1 and C3 S3 / S1 on the compiled hookwire; C4 compiled / eager hookwire, S1 to S3. Each
run keeps its compilation caches in its work folder (`VLLM_CACHE_ROOT`,
`TORCHINDUCTOR_CACHE_DIR`): the first start-up of a compiled server is cold, the later
ones cached; both are printed.

    .venv-vllm/bin/python tests/bench/bench_serving.py --variants S1,S2,S3 --hookwire default,eager --clients 8 --repeats 5 --rounds 4

F1: each server's front process CPU time (user + system of the process the clients talk
to, not its children: vLLM's engine core and workers) per generated token, from /proc.
Start-up time (process start to serving) and the RSS of each process are printed.

Method: per repeat, every server in turn (alternated); on each server the variants in a
fixed interleaved order, after one unmeasured S1 run at each client count (warm). Medians and min-max spread over the repeats; ratios
of medians against the baselines of the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
VOCAB = 32000
HIDDEN = 512
LAYERS = 6


def save_model(folder: pathlib.Path) -> None:
    """The seeded Llama and its word-level tokenizer (no end token), as a folder."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, **{f"t{i}": i for i in range(2, VOCAB)}}
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>",
                                               pad_token="<unk>")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=1376, num_hidden_layers=LAYERS,
        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512,
        pad_token_id=0, bos_token_id=1, eos_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    model.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))


def prompts(count: int) -> list[str]:
    """``count`` distinct 12-token prompts (distinct: no server gains from a shared prefix)."""
    return [" ".join(f"t{100 + 37 * i + j}" for j in range(12)) for i in range(count)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` alone (all its threads, no children)."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_tree(pid: int) -> dict[str, int]:
    """RSS in MiB of ``pid`` and each of its descendants, by name."""
    import psutil

    out: dict[str, int] = {}
    try:
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                name = " ".join(p.cmdline()[1:3])[:40] or p.name()
                out[f"{p.pid} {name}"] = p.memory_info().rss >> 20
    except psutil.Error:
        pass
    return out


@dataclass
class Server:
    """One server kind the bench starts."""
    name: str
    kind: str  # "vllm" or "hookwire"
    args: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    target: str = ""
    #: Its OpenAI-compatible base URL (vllm serve's own; hookwire's --openai-port).
    openai: str = ""
    startup: list[float] = field(default_factory=list)
    rss: dict[str, int] = field(default_factory=dict)


@contextlib.contextmanager
def running(server: Server, folder: pathlib.Path, tp: int, work: pathlib.Path) -> Iterator[Server]:
    """Starts ``server`` and waits until it serves; stops it (SIGTERM, then SIGKILL) after."""
    log = open(work / f"{server.name}.log", "ab")
    env = dict(os.environ)
    # Compilation caches of this run's own (vLLM's and inductor's): each compiled server's
    # first start-up compiles cold, the later ones load what it cached.
    env.setdefault("VLLM_CACHE_ROOT", str(work / "vllm-cache"))
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(work / "inductor-cache"))
    started = time.perf_counter()
    if server.kind == "vllm":
        port = free_port()
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
               "--served-model-name", "llama", "--host", "127.0.0.1", "--port", str(port),
               "--max-model-len", "512", "--max-num-seqs", "32", "--kv-cache-memory-bytes", str(512 << 20),
               "--dtype", "float32", "--seed", "0", "--tensor-parallel-size", str(tp), *server.args]
        server.proc = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True, env=env)
        server.target = server.openai = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 900
        while True:
            if server.proc.poll() is not None:
                raise RuntimeError(f"{server.name} exited with {server.proc.returncode}: see {log.name}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{server.target}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{server.name} did not start within 15 minutes: see {log.name}")
            time.sleep(0.5)
    else:
        config = work / f"{server.name}.toml"
        settings = {"max_model_len": 512, "max_num_seqs": 32, "kv_cache_bytes": 512 << 20, "dtype": "float32"}
        if tp > 1:
            settings["tensor_parallel_size"] = tp
        for arg in server.args:
            key, value = arg.split("=", 1)
            settings[key] = json.loads(value)
        body = "\n".join(f"{k} = {json.dumps(v)}" for k, v in settings.items())
        # 32 clients of one (anonymous) principal: past the default of 16 Generate calls each.
        config.write_text(f"[server]\nmax_generations_per_principal = 64\n\n"
                          f'[[models]]\nname = "llama"\ntransformers = "{folder}"\nengine = "vllm"\n\n'
                          f"[models.vllm]\n{body}\n")
        openai_port = free_port()
        cmd = [sys.executable, "-m", "hookwire._cli", "serve", "--port", "0", "--config", str(config),
               "--allow-shared-rules",  # S3: an operator's steering rule for every call
               "--openai-port", str(openai_port)]  # O1-O3: the OpenAI-compatible front
        server.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, start_new_session=True, env=env)
        server.target = serving_target(server.proc, log)
        server.openai = f"http://127.0.0.1:{openai_port}"
    server.startup.append(time.perf_counter() - started)
    try:
        yield server
    finally:
        server.rss = rss_tree(server.proc.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.proc.pid, signal.SIGTERM)
        try:
            server.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait(30)
        time.sleep(1.0)  # vLLM's engine process busy-polls a while after its last message
        log.close()


def serving_target(proc: subprocess.Popen[bytes], log: Any) -> str:
    """Reads ``hookwire serve``'s stdout (vLLM's own lines go there too) until the line
    that names its target; a thread copies the rest to ``log`` (an undrained pipe would
    stall the server)."""
    import threading

    assert proc.stdout is not None
    for raw in proc.stdout:
        log.write(raw)
        line = raw.decode(errors="replace").strip()
        if line.startswith("hookwire serving "):
            threading.Thread(target=lambda: [log.write(more) for more in proc.stdout or ()], daemon=True).start()
            return line.rsplit(" ", 1)[-1]
    raise RuntimeError(f"hookwire serve exited with {proc.wait()} before serving: see {log.name}")


async def vllm_clients(target: str, count: int, tokens: int) -> int:
    """``count`` concurrent streaming completions through the OpenAI client; the tokens received."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{target}/v1", api_key="bench", max_retries=0, timeout=600)

    async def one(prompt: str) -> int:
        got = 0
        stream = await client.completions.create(model="llama", prompt=prompt, max_tokens=tokens, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.usage is not None:
                got = chunk.usage.completion_tokens
        return got

    try:
        return sum(await asyncio.gather(*(one(p) for p in prompts(count))))
    finally:
        await client.close()


async def hookwire_clients(target: str, count: int, tokens: int, request_hooks: list[Any], interval: int = 0) -> int:
    """``count`` concurrent streaming Generate calls through the SDK; the tokens received
    (and, with ``request_hooks``, every event read)."""
    import hookwire

    async with hookwire.connect(target) as client:
        model = client.model("llama")

        async def one(prompt: str) -> int:
            got = 0
            async for item in model.generate(prompt, tokens, do_sample=False, hooks=request_hooks,
                                             use_session=False, keep_events=False, stream_interval=interval):
                if isinstance(item, hookwire.GeneratedTokens):
                    got += sum(1 for t in item.token_ids if t != hookwire.GeneratedTokens.FINISHED)
            return got

        return sum(await asyncio.gather(*(one(p) for p in prompts(count))))


@contextlib.asynccontextmanager
async def operator_hooks(target: str, variant: str, drops: list[int]) -> Any:
    """The SCOPE_ALL hooks of S2 (with a reader that counts its drops) and S3, as TTL
    hooks an operator would register; removed after."""
    import hookwire
    from hookwire import HookSpec, capture, rules

    if variant not in ("S2", "S3"):
        yield
        return
    async with hookwire.connect(target) as client:
        if variant == "S2":
            spec = HookSpec("model.layers.*", posthook=capture("output", select="[:, -1]"), scope="all",
                            ttl_seconds=3600)
        else:
            vector = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(1))
            spec = HookSpec("model.layers.2", posthook=[rules.add("output", vector)], scope="all", ttl_seconds=3600)
        handle = await client.register_hook(spec, model="llama")
        reader: asyncio.Task[None] | None = None
        try:
            if variant == "S2":
                sub = client.subscribe([handle.id], policy="drop_oldest")
                await sub.start()

                async def read() -> None:
                    async for event in sub:
                        drops[0] = max(drops[0], event.dropped)  # the stream's count so far

                reader = asyncio.ensure_future(read())
            yield
        finally:
            if reader is not None:
                await asyncio.sleep(0.2)  # the last step's events
                await sub.aclose()
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)
            await client.deregister_hook(handle.id)


#: vLLM's load generator's settings for O1-O3 (the issue's), beside the URL and folder.
LOAD = {"input_len": 128, "output_len": 64, "prompts": 200, "concurrency": 8}


def load_generator(base_url: str, folder: pathlib.Path) -> dict[str, float]:
    """One run of vLLM's own load generator (``vllm.benchmarks.serve``) against an
    OpenAI-compatible server's /v1/completions: its output tokens/s, TTFT p50 and
    inter-token latency p99 (ms)."""
    from vllm.benchmarks.serve import add_cli_args, main as serve_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args([
        "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions", "--model", "llama",
        "--tokenizer", str(folder), "--dataset-name", "random", "--random-input-len", str(LOAD["input_len"]),
        "--random-output-len", str(LOAD["output_len"]), "--ignore-eos", "--num-prompts", str(LOAD["prompts"]),
        "--max-concurrency", str(LOAD["concurrency"]), "--request-rate", "inf", "--seed", "0",
        "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99", "--disable-tqdm",
    ])
    with contextlib.redirect_stdout(open(os.devnull, "w")):  # its own report: the bench prints its figures
        result = serve_main(args)
    assert result["completed"] == LOAD["prompts"], f"{base_url}: {result['completed']} of {LOAD['prompts']} completed"
    return {"tokens/s": float(result["output_throughput"]), "ttft_p50": float(result["p50_ttft_ms"]),
            "itl_p99": float(result["p99_itl_ms"])}


async def grpc_load(target: str) -> tuple[int, float]:
    """O3: LOAD through hookwire's gRPC Generate (the SDK): ``prompts`` calls of
    ``input_len`` random token ids, ``output_len`` tokens each, ``concurrency`` at a time;
    (tokens received, seconds)."""
    import hookwire

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, VOCAB, (LOAD["prompts"], LOAD["input_len"]), generator=g)
    gate = asyncio.Semaphore(LOAD["concurrency"])
    async with hookwire.connect(target) as client:
        model = client.model("llama")

        async def one(row: torch.Tensor) -> int:
            async with gate:
                got = 0
                async for item in model.generate(row[None], LOAD["output_len"], do_sample=False, ignore_eos=True,
                                                 use_session=False, keep_events=False):
                    if isinstance(item, hookwire.GeneratedTokens):
                        got += sum(1 for t in item.token_ids if t != hookwire.GeneratedTokens.FINISHED)
                return got

        t0 = time.perf_counter()
        got = sum(await asyncio.gather(*(one(row) for row in ids)))
        return got, time.perf_counter() - t0


def run_load(server: Server, variant: str, folder: pathlib.Path) -> dict[str, float]:
    """One measured O1 / O2 / O3 run."""
    drops = [0]

    async def go() -> dict[str, float]:
        async with operator_hooks(server.target, "S2" if variant == "O2" else "", drops):
            if variant == "O3":
                got, elapsed = await grpc_load(server.target)
                assert got == LOAD["prompts"] * LOAD["output_len"], f"{server.name} O3: {got} tokens"
                return {"tokens/s": got / elapsed}
            return await asyncio.to_thread(load_generator, server.openai, folder)

    out = asyncio.run(go())
    out["drops"] = drops[0]
    return out


@contextlib.contextmanager
def busy_core(on: bool) -> Iterator[None]:
    """A competing process that keeps one core busy (the OS places it), while inside."""
    if not on:
        yield
        return
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        yield
    finally:
        hog.kill()
        hog.wait()


def run_variant(server: Server, variant: str, clients: int, tokens: int, rounds: int = 1) -> tuple[float, float, int]:
    """One measured run of ``rounds`` rounds, each ``clients`` concurrent calls of
    ``tokens`` tokens: (tokens/s, front CPU seconds per token, drops)."""
    base = variant.rstrip("n")
    drops = [0]
    assert server.proc is not None

    async def go() -> tuple[int, float, float]:
        async with operator_hooks(server.target, base, drops):
            hooks: list[Any] = []
            if base == "S2r":
                from hookwire import HookSpec, capture

                hooks = [HookSpec("model.layers.*", posthook=capture("output", select="[:, -1]"))]

            def one_round() -> Any:
                if server.kind == "vllm":
                    return vllm_clients(server.target, clients, tokens)
                return hookwire_clients(server.target, clients, tokens, hooks, 4 if base == "S1i" else 0)

            with busy_core(variant.endswith("n")):
                cpu0 = cpu_seconds(server.proc.pid)
                t0 = time.perf_counter()
                got = 0
                for _ in range(rounds):
                    got += await one_round()
                elapsed = time.perf_counter() - t0
                cpu = cpu_seconds(server.proc.pid) - cpu0
        asked = rounds * clients * tokens
        assert got == asked, f"{server.name} {variant}: {got} tokens received, {asked} asked"
        return got, elapsed, cpu

    got, elapsed, cpu = asyncio.run(go())
    return got / elapsed, cpu / got, drops[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1,
                    help="rounds of the clients' calls in each measured run (a run of 8 x 64 tokens is about "
                         "a second here: more rounds, less noise)")
    ap.add_argument("--clients", default="8,32")
    ap.add_argument("--variants", default="S1,S1n,S1i,S2,S2n,S3,S3n,S2r")
    ap.add_argument("--hookwire", default="default,inproc",
                    help="hookwire modes: default (compiled, worker processes), inproc, processes, processes-front, eager")
    ap.add_argument("--no-compiled", action="store_true", help="leave out vLLM's compiled default server")
    ap.add_argument("--no-vllm", action="store_true",
                    help="hookwire only (S4: its ratios to its own S1; vllm serve's CPU build may refuse the binding)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--load-prompts", type=int, default=LOAD["prompts"], help="O1-O3: prompts a run (the issue's 200)")
    args = ap.parse_args()
    LOAD["prompts"] = args.load_prompts
    counts = [int(c) for c in args.clients.split(",")]
    variants = args.variants.split(",")
    work = pathlib.Path(tempfile.mkdtemp(prefix="bench_serving_"))
    folder = work / "llama"
    save_model(folder)
    servers = [] if args.no_vllm else [Server("vllm-eager", "vllm", ["--enforce-eager", "--no-enable-prefix-caching"])]
    if not args.no_compiled and not args.no_vllm:
        servers.append(Server("vllm", "vllm"))
    modes = {"default": [], "inproc": ["worker_processes=false"], "processes": ["worker_processes=true"],
             # The model run eagerly (every module hookable; the default is compiled, with taps).
             "eager": ["enforce_eager=true"],
             # Worker processes with every hook run in the server, on what the workers send
             # (the design before the hook runtime moved into the workers).
             "processes-front": ["worker_processes=true", "hooks_in_workers=false"]}
    for mode in args.hookwire.split(","):
        servers.append(Server(f"hookwire-{mode}", "hookwire", modes[mode]))
    results: dict[tuple[str, str, int], list[tuple[float, float, int]]] = {}
    loads: dict[tuple[str, str], list[dict[str, float]]] = {}
    print(f"work folder {work}; {os.cpu_count()} cores; torch {torch.__version__}; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    for repeat in range(args.repeats):
        order = servers if repeat % 2 == 0 else servers[::-1]  # alternated: neither side always first
        for server in order:
            with running(server, folder, args.tp, work):
                for clients in counts:
                    run_variant(server, "S1", clients, args.tokens)  # warm, unmeasured
                for variant in variants:
                    if variant.startswith("O"):
                        if server.kind == "vllm" and variant != "O1":
                            continue
                        load = run_load(server, variant, folder)
                        loads.setdefault((server.name, variant), []).append(load)
                        print(f"  repeat {repeat + 1} {server.name:18s} {variant:4s} " + "  ".join(
                            f"{k} {v:.1f}" for k, v in load.items()), flush=True)
                        continue
                    if server.kind == "vllm" and variant.rstrip("n") != "S1":
                        continue
                    for clients in counts:
                        got = run_variant(server, variant, clients, args.tokens, args.rounds)
                        results.setdefault((server.name, variant, clients), []).append(got)
                        print(f"  repeat {repeat + 1} {server.name:18s} {variant:4s} {clients:2d} clients "
                              f"{got[0]:7.1f} tokens/s  front {got[1] * 1e3:.2f} ms CPU/token"
                              + (f"  drops {got[2]}" if variant.startswith("S2") else ""), flush=True)
    report(servers, results, counts, variants, args)
    report_loads(servers, loads)


def report_loads(servers: list[Server], loads: dict[tuple[str, str], list[dict[str, float]]]) -> None:
    """O1-O3: medians, spreads and the issue's ratios (against the same run's baselines)."""
    if not loads:
        return

    def med(name: str, variant: str, key: str) -> float:
        return statistics.median(r[key] for r in loads[(name, variant)])

    print(f"\n  vLLM's load generator: {LOAD}")
    for (name, variant), rs in loads.items():
        parts = []
        for key in rs[0]:
            values = [r[key] for r in rs]
            parts.append(f"{key} {statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})")
        print(f"  {name:18s} {variant}  " + "  ".join(parts))
    # The baseline: vllm serve --enforce-eager --no-enable-prefix-caching until hooks
    # survive compilation (issue 36), then vLLM's compiled default.
    base = "vllm-eager"
    for s in servers:
        if s.kind != "hookwire" or (s.name, "O1") not in loads:
            continue
        for other in ("vllm", "vllm-eager"):
            if (other, "O1") in loads:
                print(f"  O1 {s.name} / {other}: tokens/s {med(s.name, 'O1', 'tokens/s') / med(other, 'O1', 'tokens/s'):.2f}x"
                      f"  TTFT p50 {med(s.name, 'O1', 'ttft_p50') / med(other, 'O1', 'ttft_p50'):.2f}x"
                      f"  ITL p99 {med(s.name, 'O1', 'itl_p99') / med(other, 'O1', 'itl_p99'):.2f}x"
                      + ("  (the issue's baseline)" if other == base else ""))
        if (s.name, "O2") in loads:
            print(f"  O2 {s.name} / its O1: {med(s.name, 'O2', 'tokens/s') / med(s.name, 'O1', 'tokens/s'):.2f}x "
                  f"(observer drops {sum(r['drops'] for r in loads[(s.name, 'O2')]):.0f})")
        if (s.name, "O3") in loads:
            print(f"  O3 {s.name} OpenAI front / gRPC Generate: "
                  f"{med(s.name, 'O1', 'tokens/s') / med(s.name, 'O3', 'tokens/s'):.2f}x")


def report(servers: list[Server], results: dict[tuple[str, str, int], list[tuple[float, float, int]]],
           counts: list[int], variants: list[str], args: argparse.Namespace) -> None:
    def med(name: str, variant: str, clients: int, i: int = 0) -> float:
        return statistics.median(r[i] for r in results[(name, variant, clients)])

    print(f"\n{args.repeats} repeats, {args.rounds} round(s) of calls a run, {args.tokens} tokens a call, "
          f"tensor parallel {args.tp}; "
          f"load average {os.getloadavg()[0]:.2f}")
    for s in servers:
        later = s.startup[1:] or s.startup
        print(f"  {s.name}: start-up {s.startup[0]:.1f} s the first time (a compiled server compiles cold), then "
              f"{statistics.median(later):.1f} s (median; {min(later):.1f}-{max(later):.1f}); "
              f"RSS MiB at the last stop: {s.rss}")
    print(f"\n  {'server':18s} {'var':4s} {'clients':>7s} {'tokens/s':>9s} {'spread':>15s} {'front ms/token':>14s} drops")
    for (name, variant, clients), rs in results.items():
        rates = [r[0] for r in rs]
        print(f"  {name:18s} {variant:4s} {clients:7d} {statistics.median(rates):9.1f} "
              f"{min(rates):7.1f}-{max(rates):7.1f} {statistics.median(r[1] for r in rs) * 1e3:14.2f} "
              f"{sum(r[2] for r in rs) if variant.startswith('S2') else ''}")
    print("\n  ratios (medians of tokens/s)")
    for s in servers:
        if s.kind != "hookwire":
            continue
        for clients in counts:
            for variant in variants:
                if (s.name, variant, clients) not in results:
                    continue
                mine = med(s.name, variant, clients)
                base = variant.rstrip("n")
                loaded = variant.endswith("n")
                if base == "S1" and ("vllm-eager", variant, clients) not in results:
                    line = f"{mine:.1f} tokens/s (no vllm serve in this run)"
                elif base == "S1i":
                    line = f"/ its own S1 {mine / med(s.name, 'S1', clients):.2f}x; front CPU per token / S1's " \
                           f"{med(s.name, variant, clients, 1) / med(s.name, 'S1', clients, 1):.2f}x"
                elif base == "S1":
                    eager = med("vllm-eager", variant, clients)
                    line = f"/ vllm serve --enforce-eager --no-enable-prefix-caching {mine / eager:.2f}x"
                    if ("vllm", variant, clients) in results:
                        line += f"; / vllm serve (compiled default) {mine / med('vllm', variant, clients):.2f}x"
                else:
                    s1 = "S1n" if loaded else "S1"
                    if (s.name, s1, clients) not in results:
                        continue
                    line = f"/ its own {s1} {mine / med(s.name, s1, clients):.2f}x"
                    if ("vllm-eager", s1, clients) in results:  # (not with --no-vllm)
                        line += f"; / vllm-eager {s1} {mine / med('vllm-eager', s1, clients):.2f}x"
                print(f"  {s.name:18s} {variant:4s} {clients:2d} clients: {line}")
        for clients in counts:
            if (s.name, "S1", clients) in results and ("vllm-eager", "S1", clients) in results:
                f1 = med(s.name, "S1", clients, 1) / med("vllm-eager", "S1", clients, 1)
                print(f"  F1 {s.name} {clients} clients: front CPU per token / vllm serve's API server {f1:.2f}x")
    # Issue 36: hookwire compiled (its default) against vllm serve's compiled default and
    # against itself run eagerly.
    compiled, eager = "hookwire-default", "hookwire-eager"
    for clients in counts:
        def has(name: str, variant: str) -> bool:
            return (name, variant, clients) in results

        if has(compiled, "S1") and has("vllm", "S1"):
            print(f"  C1 {clients} clients: hookwire compiled / vllm serve compiled (no hooks) "
                  f"{med(compiled, 'S1', clients) / med('vllm', 'S1', clients):.2f}x")
        for name, variant in (("C2", "S2"), ("C3", "S3")):
            if has(compiled, variant) and has(compiled, "S1"):
                print(f"  {name} {clients} clients: hookwire compiled {variant} / its S1 "
                      f"{med(compiled, variant, clients) / med(compiled, 'S1', clients):.2f}x")
        for variant in ("S1", "S2", "S3"):
            if has(compiled, variant) and has(eager, variant):
                print(f"  C4 {clients} clients {variant}: hookwire compiled / eager "
                      f"{med(compiled, variant, clients) / med(eager, variant, clients):.2f}x")


if __name__ == "__main__":
    main()
