"""Harvest from the SDK: server-side jobs (HarvestService) and the client sink.

``await client.harvest(...)`` starts a job on the server and returns a HarvestJob handle
(progress, watch, wait, cancel); the job runs on the server whatever the client does.
``await client.harvest_local(...)`` runs the harvest from the client instead, for servers
without harvest storage: batches go over Infer with request-scoped capture hooks, and the
client writes the same dataset format (docs/harvest.md) with DatasetWriter.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import os
import pathlib
import time
import types
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from .wire import harvest_sources as sources
from ._errors import HookwireError, from_rpc_error
from ._transport import Transport, unary
from .v1 import harvest_service_pb2 as hv
from .v1 import harvest_service_pb2_grpc as hv_grpc
from .v1 import hook_pb2, tensor_pb2

if TYPE_CHECKING:
    from ._specs import HookSpecLike

_DTYPES = {None: tensor_pb2.DTYPE_UNSPECIFIED, "float16": tensor_pb2.DTYPE_FLOAT16,
           "bfloat16": tensor_pb2.DTYPE_BFLOAT16, "float32": tensor_pb2.DTYPE_FLOAT32}
_PARTS = {"output": hook_pb2.PART_OUTPUT, "input": hook_pb2.PART_ARGS}
_PACKING = {"truncate": hv.PACKING_TRUNCATE, "pack": hv.PACKING_PACK}
_FORMATS = {None: hv.TEXT_FORMAT_UNSPECIFIED, "jsonl": hv.TEXT_FORMAT_JSONL, "parquet": hv.TEXT_FORMAT_PARQUET,
            "text": hv.TEXT_FORMAT_TEXT, "hf": hv.TEXT_FORMAT_HF_DATASET}
#: States a job does not leave ("interrupted": its server stopped; starting it again resumes it).
ENDED = ("succeeded", "failed", "cancelled", "interrupted")


class HarvestFailed(HookwireError):
    """A harvest job ended FAILED (the message is the server's reason)."""


class HarvestInterrupted(HarvestFailed):
    """A harvest job is INTERRUPTED: the server running it stopped (killed, its node
    lost) and nothing runs it. The message says how to resume it (``resume_command``:
    the same command again, at the same output, resumes from its committed shards)."""

    def __init__(self, message: str, *, resume_command: str = "") -> None:
        super().__init__(message)
        #: The ``hookwire harvest ...`` command that resumes it ("" when the CLI cannot say it).
        self.resume_command = resume_command


@dataclasses.dataclass(frozen=True)
class HarvestProgress:
    """A harvest job's state at one moment (HarvestService's HarvestJob, decoded)."""

    job_id: str
    #: "pending", "running", "succeeded", "failed", "cancelled" or "interrupted" (its
    #: server stopped without ending it; ``error`` says how to resume it).
    state: str
    owner: str
    model: str
    output: str
    tokens_done: int
    #: 0 while the job is still counting its source.
    tokens_total: int
    tokens_per_second: float
    eta_seconds: float
    shards_written: int
    bytes_written: int
    batches_done: int
    batches_total: int
    resumed_tokens: int
    error: str
    worker_index: int
    num_workers: int
    modules: tuple[str, ...]
    #: Whether the merged manifest.json is written (the dataset is complete).
    committed: bool
    #: The ``hookwire harvest ...`` command that starts the job again at the same output
    #: (resuming it); "" when the CLI has no flags for its settings, or for a client sink.
    resume_command: str = ""

    @property
    def ended(self) -> bool:
        """Whether the job will not change any more (succeeded, failed, cancelled, interrupted)."""
        return self.state in ENDED

    @classmethod
    def from_proto(cls, msg: hv.HarvestJob) -> HarvestProgress:
        return cls(
            job_id=msg.job_id, state=hv.HarvestState.Name(msg.state).removeprefix("HARVEST_STATE_").lower(),
            owner=msg.owner, model=msg.model, output=msg.output, tokens_done=msg.tokens_done,
            tokens_total=msg.tokens_total, tokens_per_second=msg.tokens_per_second, eta_seconds=msg.eta_seconds,
            shards_written=msg.shards_written, bytes_written=msg.bytes_written, batches_done=msg.batches_done,
            batches_total=msg.batches_total, resumed_tokens=msg.resumed_tokens, error=msg.error,
            worker_index=msg.worker_index, num_workers=msg.num_workers, modules=tuple(msg.modules),
            committed=msg.committed, resume_command=msg.resume_command,
        )


def harvest_request(
    model: str, modules: Sequence[str] | str, *, data: str | None = None, tokens: Any = None,
    pad_token_id: int | None = None, text_field: str = "text", format: str | None = None, split: str | None = None,
    out: str, dtype: str | None = None, part: str = "output", select: str | None = None,
    rules: Sequence[HookSpecLike] = (), length: int = 128, batch_size: int = 8, packing: str = "truncate",
    bos: bool | None = None, skip_first: int = 0, positions: Sequence[int] = (), max_tokens: int = 0,
    shard_tokens: int = 65536, shuffle: bool = False, shuffle_buffer: int = 4, seed: int = 0,
    overwrite: bool = False, worker_index: int = 0, num_workers: int = 1,
) -> hv.StartHarvestRequest:
    """The StartHarvestRequest of ``Client.harvest``'s arguments (ValueError for unknown
    names of dtype, part, packing or format; the server checks the rest)."""
    from .wire.codec import encode_tensor
    from ._specs import spec_proto

    for name, value, table in (("dtype", dtype, _DTYPES), ("part", part, _PARTS), ("packing", packing, _PACKING),
                               ("format", format, _FORMATS)):
        if value not in table:
            raise ValueError(f"{name} {value!r} is not one of {sorted(k for k in table if k)}")
    if (data is None) == (tokens is None):
        raise ValueError("give data= (a text dataset on the server) or tokens= (token ids), not both")
    request = hv.StartHarvestRequest(
        model=model, modules=[modules] if isinstance(modules, str) else list(modules), part=_PARTS[part],
        select=select or "", dtype=_DTYPES[dtype], max_tokens=max_tokens, worker_index=worker_index,
        num_workers=num_workers,
        contexts=hv.HarvestContexts(length=length, batch_size=batch_size, packing=_PACKING[packing]),
        positions=hv.HarvestPositions(skip_first=skip_first, only=list(positions)),
        output=hv.HarvestOutput(path=out, shard_tokens=shard_tokens, overwrite=overwrite, shuffle=hv.HarvestShuffle(
            enabled=shuffle, buffer_shards=shuffle_buffer, seed=seed)),
    )
    if bos is not None:
        request.contexts.bos = bos
    if data is not None:
        request.source.text.CopyFrom(hv.TextSource(path=data, format=_FORMATS[format], text_field=text_field,
                                                   split=split or ""))
    else:
        request.source.tokens.input_ids.CopyFrom(encode_tensor(tokens))
        if pad_token_id is not None:
            request.source.tokens.pad_token_id = pad_token_id
    request.rules.extend(spec_proto(spec, model) for spec in rules)
    return request


class HarvestJob:
    """A handle on a server-side harvest job. Nothing here stops the job but ``cancel``."""

    def __init__(self, client: Transport, job_id: str, last: HarvestProgress | None = None) -> None:
        self._client = client
        self.id = job_id
        #: The last state seen (``refresh``, ``watch`` and ``wait`` update it).
        self.last = last

    def __repr__(self) -> str:
        state = self.last.state if self.last else "?"
        return f"HarvestJob({self.id!r}, {state})"

    @property
    def _stub(self) -> hv_grpc.HarvestServiceStub:
        return self._client.harvest_stub

    async def refresh(self) -> HarvestProgress:
        """The job's state now (one GetHarvest). NotFoundError for an unknown job."""
        reply = await unary(self._client, self._stub.GetHarvest, hv.GetHarvestRequest(job_id=self.id))
        self.last = HarvestProgress.from_proto(reply)
        return self.last

    async def watch(self, *, interval: float = 0.5) -> AsyncIterator[HarvestProgress]:
        """The job's state now, then as it changes (at most every ``interval`` seconds),
        until it ends (the last one has ``ended``). Leaving the loop does not stop the job."""
        call = self._stub.WatchHarvest(hv.WatchHarvestRequest(job_id=self.id, interval_ms=max(50, int(interval * 1e3))))
        try:
            async for msg in call:
                self.last = HarvestProgress.from_proto(msg)
                yield self.last
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, target=self._client.target) from None
        finally:
            call.cancel()

    async def wait(self, *, progress: bool = False, interval: float = 0.5) -> HarvestProgress:
        """Waits until the job ends (blocks the caller, not the job); its final state.
        Raises HarvestFailed when it FAILED, HarvestInterrupted (a HarvestFailed) when its
        server stopped without ending it (the message says how to resume it); a cancelled
        job is returned, state "cancelled". ``progress=True`` shows a tqdm bar (tokens,
        and the job's own tokens/s and ETA) on stderr."""
        bar = _Bar(progress)
        try:
            last = self.last
            async for last in self.watch(interval=interval):
                bar.update(last)
        finally:
            bar.close()
        assert last is not None
        raise_if_failed(last)
        return last

    async def cancel(self) -> HarvestProgress:
        """Asks the job to stop after its running batch (its committed shards stay; the
        same request started again resumes). Returns its state."""
        reply = await unary(self._client, self._stub.CancelHarvest, hv.CancelHarvestRequest(job_id=self.id))
        self.last = HarvestProgress.from_proto(reply)
        return self.last


def raise_if_failed(p: HarvestProgress) -> None:
    """HarvestInterrupted for an interrupted job, HarvestFailed for a failed one."""
    if p.state == "interrupted":
        raise HarvestInterrupted(f"harvest {p.job_id}: {p.error}", resume_command=p.resume_command)
    if p.state == "failed":
        raise HarvestFailed(f"harvest {p.job_id} failed: {p.error}")


def format_rate(p: HarvestProgress) -> str:
    """"62.1k tok/s, ETA 0:01:05" from the job's own figures ("" when it has none): the
    rate the job measures over its last batches, not one a watcher derives from the
    tokens it saw arrive (a watcher that attaches late sees the earlier tokens at once)."""
    if p.ended or p.tokens_per_second <= 0:
        return ""
    rate = p.tokens_per_second
    scaled = next((f"{rate / f:.1f}{u}" for f, u in ((1e9, "G"), (1e6, "M"), (1e3, "k")) if rate >= f), f"{rate:.0f}")
    text = f"{scaled} tok/s"
    if p.eta_seconds > 0:
        eta = int(round(p.eta_seconds))
        text += f", ETA {eta // 3600}:{eta // 60 % 60:02d}:{eta % 60:02d}"
    return text


#: The bar's line: tqdm's rate and remaining time are left out (they come from the
#: counts a watcher saw change, wrong for a watcher that attached late); the job's own
#: rate and ETA are in the postfix.
_BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} tok [{elapsed}{postfix}]"


class _Bar:
    """A tqdm progress bar over a job's tokens (or nothing). Rate and ETA are the job's
    own (HarvestProgress.tokens_per_second, eta_seconds)."""

    def __init__(self, enabled: bool, *, desc: str = "harvest", file: Any = None) -> None:
        self._bar: Any = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=0, unit="tok", unit_scale=True, desc=desc, dynamic_ncols=True,
                             bar_format=_BAR_FORMAT, file=file)

    def update(self, p: HarvestProgress) -> None:
        if self._bar is None:
            return
        if p.tokens_total and self._bar.total != p.tokens_total:
            self._bar.total = p.tokens_total
        self._bar.n = p.tokens_done
        rate = format_rate(p)
        self._bar.set_postfix_str(
            f"{rate + ', ' if rate else ''}{p.state}, {p.shards_written} shards, {p.bytes_written / 2**20:.1f} MiB",
            refresh=False,
        )
        self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


async def start(client: Transport, request: hv.StartHarvestRequest) -> HarvestJob:
    reply = await unary(client, client.harvest_stub.StartHarvest, request)
    return HarvestJob(client, reply.job_id, HarvestProgress.from_proto(reply))


async def list_jobs(client: Transport, model: str | None, active_only: bool) -> list[HarvestProgress]:
    reply = await unary(
        client, client.harvest_stub.ListHarvests, hv.ListHarvestsRequest(model=model or "", active_only=active_only)
    )
    return [HarvestProgress.from_proto(j) for j in reply.jobs]


# ------------------------------------------------------------------------ client sink


async def harvest_local(
    client: Transport, model: str, modules: Sequence[str] | str, *, out: str, data: str | os.PathLike[str] | None = None,
    tokens: Any = None, pad_token_id: int | None = None, tokenizer: Any = None, text_field: str = "text",
    format: str | None = None, split: str | None = None, dtype: str | None = None, part: str = "output",
    select: str | None = None, rules: Sequence[HookSpecLike] = (), length: int = 128, batch_size: int = 8,
    packing: str = "truncate", bos: bool | None = None, skip_first: int = 0, positions: Sequence[int] = (),
    max_tokens: int = 0, shard_tokens: int = 65536, shuffle: bool = False, shuffle_buffer: int = 4, seed: int = 0,
    overwrite: bool = False, progress: bool = False, storage_options: Mapping[str, Any] | None = None,
    on_progress: Callable[[HarvestProgress], None] | None = None,
) -> HarvestProgress:
    """Harvests from the client: the same contexts, batches and dataset format as a
    server-side job (docs/harvest.md), written to ``out`` (a local folder or an fsspec URL)
    by this process. Needs torch. Blocks (awaits) until done; resumes an unfinished
    dataset of the same settings like a server job.

    Text (``data``, a local file or folder) is tokenized by the model's own tokenizer
    on the server (Tokenize calls, in batches within the server's max_tokenize_texts and
    max_tokenize_chars; the ids are exactly the tokenizer's), or here with ``tokenizer``
    (a transformers tokenizer, or the path of a folder holding one: the model's own);
    ``tokens`` are token ids ``[contexts, length]``. A document over the server's
    max_prompt_tokens (or max_tokenize_chars) cannot be tokenized there: HookwireError
    naming the limit (pass ``tokenizer=``). Each batch is
    one Infer call carrying request-scoped capture hooks on the modules (the cast and
    selection run on the server) and a seed, so that it never shares a pass with other
    callers' calls and its values are exactly what a job alone computes. Memory: one
    group of shards (``shard_tokens``, times ``shuffle_buffer`` with shuffling) plus one
    batch's captures.

    ``progress=True`` draws a tqdm bar on stderr; ``on_progress`` is called (on the event
    loop) with a HarvestProgress after every batch, rate and ETA included (a command
    line prints plain lines with it).
    """
    import numpy as np
    import torch

    from .wire import harvest_format as fmt
    from ._specs import spec_proto
    from .wire import __version__

    if dtype not in _DTYPES or part not in _PARTS or packing not in _PACKING:
        raise ValueError(f"dtype {dtype!r}, part {part!r} or packing {packing!r} is not known")
    remote = client.model(model)
    info = await remote.info()
    order = {m.path: i for i, m in enumerate(info.modules)} if getattr(info, "modules", None) else {}
    if data is not None:
        tokenize: Callable[[list[str]], list[list[int]]]
        if tokenizer is None:
            # The server's tokenizer (Tokenize): the model's own, no local copy needed.
            if not getattr(info, "has_tokenizer", False):
                raise ValueError(f"model {model!r} has no tokenizer on the server: pass tokenizer= (its folder) "
                                 "or tokens= (token ids)")
            ids_msg = info.raw.tokenizer_ids if info.raw.HasField("tokenizer_ids") else None
            if ids_msg is None:
                raise ValueError("the server does not say its tokenizer's special tokens (an older server): "
                                 "pass tokenizer= (the model's tokenizer folder)")
            tokenizer_ids: Any = types.SimpleNamespace(**{
                name: getattr(ids_msg, name) if ids_msg.HasField(name) else None
                for name in ("bos_token_id", "eos_token_id", "pad_token_id", "cls_token_id", "sep_token_id")
            })
            tokenize = RemoteTokenize(remote, asyncio.get_running_loop())
        else:
            if isinstance(tokenizer, (str, os.PathLike)):
                import transformers

                tokenizer = transformers.AutoTokenizer.from_pretrained(os.fspath(tokenizer), local_files_only=True)
            tokenizer_ids = tokenizer
            tok = copy.deepcopy(tokenizer)

            def tokenize(texts: list[str]) -> list[list[int]]:
                return list(tok(texts, add_special_tokens=False)["input_ids"])
        dataset = sources.TextDataset(pathlib.Path(data), format=format, text_field=text_field,
                                      split=split)
        bos_id, sep_id, pad_id = sources.special_ids(tokenizer_ids, bos=bos)
        spec = sources.ContextSpec(length=length, packing=packing, bos_id=bos_id, sep_id=sep_id, pad_id=pad_id)
        source: dict[str, Any] = await asyncio.to_thread(dataset.describe)

        def make() -> Any:
            return sources.batches(sources.contexts(dataset.documents(), tokenize, spec), batch_size, pad_id)
    elif tokens is not None:
        ids = np.asarray(tokens.cpu() if hasattr(tokens, "cpu") else tokens, dtype=np.int64)
        source = {"kind": "tokens", "shape": list(ids.shape), "pad_token_id": pad_token_id}

        def make() -> Any:
            return sources.token_batches(ids, batch_size, pad_token_id)
    else:
        raise ValueError("give data= (a local text dataset) or tokens= (token ids)")
    plan = await asyncio.to_thread(sources.plan, make(), skip_first=skip_first, only=positions, max_tokens=max_tokens)
    action = hook_pb2.HookAction(select=select or "", cast=_DTYPES[dtype])
    action.capture.append(_PARTS[part])
    patterns = [modules] if isinstance(modules, str) else list(modules)
    specs = [spec_proto(s, model) for s in rules]
    for pattern in patterns:
        capture = hook_pb2.HookSpec(module=pattern)
        (capture.posthook if part == "output" else capture.prehook).CopyFrom(action)
        specs.append(capture)
    settings = {
        "model": model, "modules": patterns, "part": part, "select": select, "dtype": dtype,
        "rules": [str(s) for s in specs[:len(rules)]], "source": source,
        "contexts": {"length": length, "batch_size": batch_size, "packing": packing, "bos": bos},
        "positions": {"skip_first": skip_first, "only": list(positions)}, "max_tokens": max_tokens,
        "shard_tokens": shard_tokens, "shuffle": {"enabled": shuffle, "buffer_shards": shuffle_buffer, "seed": seed},
        "num_workers": 1, "sink": "client",
    }
    header = {"model": model, "modules": [], "settings": settings, "source": source,
              "hookwire_version": __version__}
    writer = await asyncio.to_thread(
        fmt.DatasetWriter, out, header=header, shard_tokens=shard_tokens,
        shuffle_buffer_shards=shuffle_buffer if shuffle else 0, shuffle_seed=seed, overwrite=overwrite,
        storage_options=storage_options,
    )
    writer.set_batches_total(plan.num_batches)
    # The modules the patterns match are known from the first batch's events (a resumed
    # dataset names them already); they are stored in the model's module order.
    stored_modules: list[str] = list(writer.manifest.get("modules") or [])
    writer.header["modules"] = stored_modules
    bar = _Bar(progress, desc="harvest (client)")
    done = writer.tokens_done
    rate_start, rate_tokens = time.monotonic(), 0
    pending: asyncio.Future[Any] | None = None
    # Batches are formed on a thread (reading and tokenizing, over Tokenize calls when the
    # server tokenizes): the event loop stays free for the calls themselves.
    batch_iter = iter(make())
    try:
        while True:
            batch = await asyncio.to_thread(next, batch_iter, None)
            if batch is None:
                break
            if batch.index >= plan.num_batches:
                break
            if batch.index < writer.resume_batches:  # committed by an earlier run
                continue
            keep_np = sources.keep_mask(batch.attention_mask, skip_first=skip_first, only=positions)
            ids_t = torch.from_numpy(batch.input_ids)
            mask_t = torch.from_numpy(batch.attention_mask)
            result = await remote.infer(hooks=specs, seed=0, use_session=False, input_ids=ids_t, attention_mask=mask_t)
            keep = torch.from_numpy(keep_np)
            values: dict[str, Any] = {}
            for event in result.events:
                value = event.output if part == "output" else (event.args[0] if event.args else None)
                if isinstance(value, (tuple, list)):
                    value = value[0] if value else None
                if not isinstance(value, torch.Tensor):
                    raise HookwireError(f"the {part} of module {event.module!r} is not a tensor")
                if event.call_index > 0:
                    raise HookwireError(f"module {event.module!r} runs more than once in a pass")
                values[event.module] = value[keep]
            if not stored_modules:
                stored_modules.extend(sorted(values, key=lambda m: order.get(m, len(order))))
                writer.manifest["modules"] = stored_modules
            rows = torch.arange(ids_t.shape[0]).unsqueeze(1).expand_as(ids_t)
            pos = torch.arange(ids_t.shape[1]).unsqueeze(0).expand_as(ids_t)
            if pending is not None:
                await pending  # one batch being written while the next one runs
            pending = asyncio.ensure_future(asyncio.to_thread(
                writer.add, values, ids_t[keep], rows[keep] + batch.first_sequence, pos[keep]))
            n = int(keep.sum())
            done += n
            rate_tokens += n
            elapsed = time.monotonic() - rate_start
            rate = rate_tokens / elapsed if elapsed else 0.0
            snapshot = HarvestProgress(
                job_id="local", state="running", owner="", model=model, output=out, tokens_done=done,
                tokens_total=plan.total_tokens, tokens_per_second=rate,
                eta_seconds=max(0, plan.total_tokens - done) / rate if rate > 0 else 0.0,
                shards_written=writer.shards_written, bytes_written=writer.bytes_written,
                batches_done=batch.index + 1, batches_total=plan.num_batches, resumed_tokens=0, error="",
                worker_index=0, num_workers=1, modules=tuple(stored_modules), committed=False,
            )
            bar.update(snapshot)
            if on_progress is not None:
                on_progress(snapshot)
        if pending is not None:
            await pending
        await asyncio.to_thread(writer.finish)
        await asyncio.to_thread(writer.merge)
    finally:
        if pending is not None and not pending.done():
            await asyncio.wait([pending])
        bar.close()
    elapsed = time.monotonic() - rate_start
    return HarvestProgress(
        job_id="local", state="succeeded", owner="", model=model, output=out, tokens_done=writer.tokens_done,
        tokens_total=plan.total_tokens, tokens_per_second=rate_tokens / elapsed if elapsed else 0.0, eta_seconds=0.0,
        shards_written=writer.shards_written, bytes_written=writer.bytes_written, batches_done=plan.num_batches,
        batches_total=plan.num_batches, resumed_tokens=0, error="", worker_index=0, num_workers=1,
        modules=tuple(stored_modules), committed=True,
    )


class RemoteTokenize:
    """``tokenize(texts) -> ids per text`` with the model's tokenizer on the server
    (Tokenize, ``add_special_tokens=False``), as a harvest's contexts need them; called
    from a worker thread (it waits for calls made on ``loop``), never on the loop itself.

    The texts are sent in batches within the server's limits: at most ``max_texts`` texts
    and ``max_chars`` characters a call (the servers' defaults of max_tokenize_texts and
    max_tokenize_chars); a server with lower limits answers RESOURCE_EXHAUSTED naming
    one, and the batch is halved and sent again. A single text over max_tokenize_chars
    or max_prompt_tokens cannot be tokenized there: HookwireError naming the limit.
    The ids are the padded rows' real tokens (the attention mask), so they are exactly
    what the tokenizer gives for each text alone."""

    def __init__(self, remote: Any, loop: asyncio.AbstractEventLoop, *, max_texts: int = 256,
                 max_chars: int = 1 << 20) -> None:
        self._remote = remote
        self._loop = loop
        self.max_texts = max_texts
        self.max_chars = max_chars
        #: Tokenize calls made so far.
        self.calls = 0

    def __call__(self, texts: list[str]) -> list[list[int]]:
        from ._errors import FailedPreconditionError, ResourceExhaustedError

        out: list[list[int]] = []
        i = 0
        while i < len(texts):
            j, chars = i, 0
            while j < len(texts) and j - i < self.max_texts and (j == i or chars + len(texts[j]) <= self.max_chars):
                chars += len(texts[j])
                j += 1
            batch = texts[i:j]
            try:
                self.calls += 1
                reply = asyncio.run_coroutine_threadsafe(
                    self._remote.tokenize(batch, add_special_tokens=False, padding_side="right"), self._loop,
                ).result()
            except ResourceExhaustedError as exc:
                message = str(exc)
                if len(batch) > 1 and ("max_tokenize_texts" in message or "max_tokenize_chars" in message):
                    self.max_texts = max(1, len(batch) // 2)  # a server with lower limits: smaller calls
                    self.max_chars = max(1, chars // 2)
                    continue
                raise HookwireError(
                    f"the server cannot tokenize a document of the data ({message}); tokenize on this machine "
                    "with the model's tokenizer (tokenizer=, --tokenizer)", code=exc.code,
                ) from None
            except FailedPreconditionError as exc:
                if len(batch) > 1 and "pad token" in str(exc):  # texts of different lengths cannot be padded there
                    self.max_texts = 1
                    continue
                raise
            ids, mask = reply.input_ids, reply.attention_mask
            for row in range(len(batch)):
                out.append([int(t) for t, m in zip(ids[row].tolist(), mask[row].tolist()) if m])
            i = j
        return out


__all__ = ["HarvestFailed", "HarvestInterrupted", "HarvestJob", "HarvestProgress", "harvest_local", "harvest_request"]
