"""Harvest jobs: activation datasets written by the server (HarvestService).

A job is started by one RPC and then lives on its own, on the server's event loop: it
does not depend on the connection that started it. Its life:

1. ``HarvestManager.start`` validates everything it can before it costs anything (model,
   module patterns, rules, paths under the configured roots, limits, quotas), opens the
   output (``DatasetWriter``: a finished dataset is ALREADY_EXISTS, an unfinished one of
   other settings FAILED_PRECONDITION, an unfinished one of the same settings is resumed)
   and returns the job, PENDING.
2. The job plans on a thread of its own: it tokenizes its source once to count contexts
   and tokens (``hookwire.wire.harvest_sources.plan``), which fixes the batches, the token budget's
   last batch and this worker's share.
3. RUNNING: a producer thread tokenizes the source again and hands this worker's batches
   (past those already committed) to the job, which queues each as *background* work on
   the model's scheduler (``Work.background``): it runs only when no live call waits,
   never shares a pass with live calls, and its hooks are request-scoped hooks of its
   own (the rules first, then one capture hook per module) whose captures the pass hands
   over as tensors (``Pass.tap``), not events. The stored rows are cut on the worker thread
   (real tokens at kept positions), cast, and copied to the CPU once; a writer thread
   stores them while the model runs the next batch.
4. The writer commits groups of shards (their manifest last); ``finish`` commits the rest;
   worker 0 then waits for the other workers and writes the merged manifest.

Job state is also written, as JSON, to a state folder (``harvest_state_dir``, default
``<harvest_output_root>/.hookwire-jobs``): a replica that does not run a job answers
GetHarvest/WatchHarvest/ListHarvests from it, and CancelHarvest leaves a cancel marker
there that the running replica honours at its next batch. Nothing here imports grpc.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import dataclasses
import functools
import hashlib
import json
import logging
import os
import pathlib
import shlex
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from google.protobuf import json_format, timestamp_pb2

from hookwire.wire import __version__ as hookwire_version
from hookwire.wire import codec
from hookwire.wire import harvest_format as fmt
from hookwire.wire import harvest_sources as sources
from hookwire.wire import ids
from hookwire.v1 import harvest_service_pb2 as hv
from hookwire.v1 import hook_pb2, tensor_pb2

from .admission import Admission, captured_modules
from ..engine.core import Engines
from ..engine.harvest_pass import HarvestBatch, HarvestResult
from ..engine.seam import HARVEST
from ..auth import MINIMUM_ROLE, Principal
from ..hooks.capture import compile_cast, compile_select
from ..errors import (
    AlreadyExists, FailedPrecondition, HookwireServerError, InvalidArgument, NotFound, PermissionDenied,
    ResourceExhausted, Unavailable,
)
from ..hooks.hook_record import HookRecord
from ..hooks.hook_specs import hookable_modules
from ..engine.scheduler import Work
from ..hooks.selection import Index
from .. import limits
from ..limits import Limits
from ..memory_budget import Estimate
from ..models.memory_estimate import Estimator, Inputs, TensorShape

log = logging.getLogger("hookwire.harvest")

DEFAULT_LENGTH = 128
DEFAULT_BATCH_SIZE = 8
DEFAULT_SHARD_TOKENS = 65536
DEFAULT_BUFFER_SHARDS = 4
DEFAULT_WATCH_MS = 500
#: How often the state file of a running job is rewritten (progress), at most.
STATE_WRITE_SECONDS = 1.0
#: Batches tokenized ahead of the model (the producer's queue).
AHEAD = 2
#: States a job does not leave (INTERRUPTED: until someone starts it again, as a new job).
ENDED = (hv.HARVEST_STATE_SUCCEEDED, hv.HARVEST_STATE_FAILED, hv.HARVEST_STATE_CANCELLED,
         hv.HARVEST_STATE_INTERRUPTED)
#: The shortest lease a server may give its jobs (harvest_lease_seconds): heartbeats come
#: every third of it, and a state folder on network storage needs time to show them.
MIN_LEASE_SECONDS = 1.0
#: Interrupted jobs whose committed figures are kept (HarvestManager._committed).
MAX_ON_DISK = 4096
#: Seconds between looks for state files to prune (at most).
PRUNE_EVERY_SECONDS = 60.0


_LIMITS = Limits()

#: HarvestConfig's limits: each is the Limits field "harvest_" + its name, which sets it
#: (settings_from) and gives its default.
LIMIT_FIELDS = (
    "max_jobs_per_principal", "max_bytes_per_principal", "lease_seconds", "retention_seconds", "max_modules",
    "max_context_length", "max_positions", "max_workers", "max_shard_tokens", "max_buffer_shards", "max_ended_jobs",
    "min_watch_ms",
)


@dataclasses.dataclass(frozen=True)
class HarvestConfig:
    """The server's harvest settings (ServerSettings.harvest_*): its folders, and its
    limits, each the Limits field of the same name with "harvest_" before it (see Limits
    for what each bounds)."""

    #: Text sources are read from under this folder; None: text sources are refused.
    data_root: str | None = None
    #: Outputs are written under this folder; None: only URL outputs (url_prefixes).
    output_root: str | None = None
    #: fsspec URL prefixes outputs may name ("s3://bucket/harvest/"); empty: none.
    url_prefixes: tuple[str, ...] = ()
    #: Where job state is kept for other replicas; None: <output_root>/.hookwire-jobs.
    state_dir: str | None = None
    #: Seconds between worker 0's looks at the other workers' manifests while it waits to merge.
    merge_poll_seconds: float = 2.0
    max_jobs_per_principal: int = _LIMITS.harvest_max_jobs_per_principal
    max_bytes_per_principal: int = _LIMITS.harvest_max_bytes_per_principal
    lease_seconds: float = _LIMITS.harvest_lease_seconds
    retention_seconds: float = _LIMITS.harvest_retention_seconds
    max_modules: int = _LIMITS.harvest_max_modules
    max_context_length: int = _LIMITS.harvest_max_context_length
    max_positions: int = _LIMITS.harvest_max_positions
    max_workers: int = _LIMITS.harvest_max_workers
    max_shard_tokens: int = _LIMITS.harvest_max_shard_tokens
    max_buffer_shards: int = _LIMITS.harvest_max_buffer_shards
    max_ended_jobs: int = _LIMITS.harvest_max_ended_jobs
    min_watch_ms: int = _LIMITS.harvest_min_watch_ms

    def validate(self) -> None:
        """Raises ValueError naming the setting that is out of range."""
        for name in ("max_modules", "max_context_length", "max_positions", "max_workers", "max_shard_tokens",
                     "max_buffer_shards"):
            if getattr(self, name) < 1:
                raise ValueError(f"harvest_{name}: {getattr(self, name)} is below the minimum of 1")
        for name in ("max_ended_jobs", "min_watch_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"harvest_{name}: {getattr(self, name)} is negative")
        if not self.lease_seconds >= MIN_LEASE_SECONDS:  # NaN too
            raise ValueError(f"harvest_lease_seconds: {self.lease_seconds} is below the minimum of {MIN_LEASE_SECONDS}")
        if not self.retention_seconds >= 0:
            raise ValueError(f"harvest_retention_seconds: {self.retention_seconds} is negative (0 keeps finished jobs)")
        if self.max_jobs_per_principal < 0:
            raise ValueError(f"harvest_max_jobs_per_principal: {self.max_jobs_per_principal} is negative")
        if self.max_bytes_per_principal < 0:
            raise ValueError(f"harvest_max_bytes_per_principal: {self.max_bytes_per_principal} is negative (0: no limit)")

    @property
    def enabled(self) -> bool:
        return bool(self.output_root or self.url_prefixes)

    @property
    def state_path(self) -> pathlib.Path | None:
        if self.state_dir:
            return pathlib.Path(self.state_dir)
        if self.output_root:
            return pathlib.Path(self.output_root) / ".hookwire-jobs"
        return None


@dataclasses.dataclass
class _Settings:
    """A validated StartHarvestRequest."""

    model: str
    patterns: list[str]
    modules: list[str]
    part: int
    select: Index | None
    cast: torch.dtype | None
    rule_specs: list[hook_pb2.HookSpec]
    source: dict[str, Any]
    text: sources.TextDataset | None
    token_ids: np.ndarray | None
    token_pad: int | None
    spec: sources.ContextSpec | None
    length: int
    batch_size: int
    skip_first: int
    only: tuple[int, ...]
    max_tokens: int
    output: str
    url: str
    shard_tokens: int
    overwrite: bool
    shuffle: bool
    buffer_shards: int
    seed: int
    worker_index: int
    num_workers: int

    def describe(self) -> dict[str, Any]:
        """What the dataset's settings_digest covers: everything that changes its contents."""
        return {
            "model": self.model, "modules": self.modules, "part": hook_pb2.Part.Name(self.part),
            "select": None if self.select is None else repr(self.select),
            "dtype": None if self.cast is None else str(self.cast).removeprefix("torch."),
            "rules": [json_format.MessageToDict(s, preserving_proto_field_name=True) for s in self.rule_specs],
            "source": self.source,
            "contexts": {"length": self.length, "batch_size": self.batch_size,
                         "packing": None if self.spec is None else self.spec.packing,
                         "bos_id": None if self.spec is None else self.spec.bos_id,
                         "sep_id": None if self.spec is None else self.spec.sep_id},
            "positions": {"skip_first": self.skip_first, "only": list(self.only)},
            "max_tokens": self.max_tokens, "shard_tokens": self.shard_tokens,
            "shuffle": {"enabled": self.shuffle, "buffer_shards": self.buffer_shards, "seed": self.seed},
            "num_workers": self.num_workers,
        }


class Job:
    """One harvest job and its progress. Its fields change on the event loop only."""

    def __init__(self, job_id: str, owner: str, settings: _Settings) -> None:
        self.id = job_id
        self.owner = owner
        self.settings = settings
        self.state = hv.HARVEST_STATE_PENDING
        self.error = ""
        self.created = time.time()
        self.started: float | None = None
        self.ended: float | None = None
        self.tokens_done = 0
        self.tokens_total = 0
        self.resumed_tokens = 0
        self.batches_done = 0
        self.batches_total = 0
        self.shards_written = 0
        self.bytes_written = 0
        #: Tokens its worker manifest has committed (tokens_done counts every batch the
        #: model ran, those still buffered for the next group too).
        self.tokens_committed = 0
        self.rate = 0.0
        self.committed = False
        self.cancel_reason = ""
        #: The CLI command that starts this job again (resume_command()), "" when none can.
        self.resume_command = ""
        self.task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()
        self._version = 0

    def changed(self) -> None:
        """Wakes the watchers."""
        self._version += 1
        self._changed.set()
        self._changed = asyncio.Event()

    async def next_change(self, version: int) -> int:
        """Waits until the job changed after ``version``; returns the new version."""
        while self._version == version:
            await self._changed.wait()
        return self._version

    @property
    def version(self) -> int:
        return self._version

    @property
    def active(self) -> bool:
        return self.state not in ENDED

    def to_proto(self) -> hv.HarvestJob:
        s = self.settings
        eta = 0.0
        if self.active and self.rate > 0 and self.tokens_total > self.tokens_done:
            eta = (self.tokens_total - self.tokens_done) / self.rate
        msg = hv.HarvestJob(
            job_id=self.id, state=self.state, owner=self.owner, model=s.model, output=s.output,
            tokens_done=self.tokens_done, tokens_total=self.tokens_total, tokens_per_second=self.rate,
            eta_seconds=eta, shards_written=self.shards_written, bytes_written=self.bytes_written,
            batches_done=self.batches_done, batches_total=self.batches_total, resumed_tokens=self.resumed_tokens,
            error=self.error, worker_index=s.worker_index, num_workers=max(1, s.num_workers), modules=s.modules,
            committed=self.committed, resume_command=self.resume_command,
        )
        for field, when in (("created", self.created), ("started", self.started), ("ended", self.ended)):
            if when is not None:
                getattr(msg, field).CopyFrom(_timestamp(when))
        return msg


def _timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


class HarvestManager:
    """The server's harvest jobs (HarvestService's domain)."""

    def __init__(
        self, registry: Any, hooks: Any, config: HarvestConfig, *, limits: Any, engines: Engines | None = None,
        admission: Admission | None = None,
    ) -> None:
        self._registry = registry
        #: The admission step every call goes through (None: a manager that starts no job).
        self._admission = admission
        self._hooks = hooks
        #: Each model's engine and scheduler (shared with live calls); None: runs no job.
        self._engines = engines
        self._metrics = hooks.metrics
        self.config = config
        self.limits = limits
        self._jobs: dict[str, Job] = {}
        #: Outputs (and worker) of the active jobs: two jobs never write the same files.
        self._outputs: dict[tuple[str, int], str] = {}
        self._bytes: dict[str, int] = {}
        #: Starts in progress per principal (StartHarvest between its quota check and its
        #: job's registration): they count against harvest_max_jobs_per_principal.
        self._starting: dict[str, int] = {}
        self._closing = False
        #: The state folder's records: file name -> (mtime_ns, size, record). A file is read
        #: again only when its mtime or size changed (another replica wrote it).
        self._index: dict[str, tuple[int, int, dict[str, Any]]] = {}
        self._last_prune = 0.0
        #: Interrupted jobs' committed figures read from their outputs: job id ->
        #: (heartbeat, figures); read once per job and heartbeat, not at every look.
        self._on_disk: dict[str, tuple[float, tuple[int, int, int] | None]] = {}
        self._heartbeat: asyncio.Task[None] | None = None
        #: Blocking harvest work (counting sources, writing shards, manifests): threads of
        #: its own, so that jobs never take the event loop's default executor from live
        #: calls (Infer compiles its request hooks there).
        self._io = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="harvest-io")

    # ---- starting -------------------------------------------------------------------

    async def start(self, request: hv.StartHarvestRequest, principal: Principal) -> Job:
        """Validates the request, opens its output and starts the job (see the module
        docstring); raises a HookwireServerError naming what is wrong."""
        if self._admission is None:
            raise Unavailable("this harvest manager starts no jobs")
        # Who may start one, whether the server still takes calls, which model: the same
        # admission step, in the same words, as every other call.
        host = self._admission.enter("StartHarvest", principal, request.model, action="starting a harvest")
        if self._closing:
            raise Unavailable("the server is shutting down")
        host.refuse("harvest", "StartHarvest")
        if not self.config.enabled:
            raise FailedPrecondition(
                "this server has no harvest storage: its operator sets harvest_output_root (or harvest_url_prefixes); "
                "without it, `hookwire harvest --sink client` writes the dataset on the client"
            )
        # The quota counts a start from its check on: the slot is reserved here, before
        # the first await (validation and opening the output are awaits, and concurrent
        # starts of one principal would all pass a check that counted registered jobs
        # only), and released on every way out of this method: by the job itself once
        # it is registered (it counts as active), or by a failure.
        self._reserve(principal.name)
        try:
            return await self._start_reserved(request, principal, host)
        finally:
            self._starting[principal.name] -= 1
            if not self._starting[principal.name]:
                del self._starting[principal.name]

    def _reserve(self, owner: str) -> None:
        """Takes a job slot of ``owner``'s quota (synchronously: no await between the
        check and the count), or raises RESOURCE_EXHAUSTED naming the setting."""
        active = sum(1 for j in self._jobs.values() if j.active and j.owner == owner) + self._starting.get(owner, 0)
        limits.check(active, self.config.max_jobs_per_principal, f"{owner!r} has {active} harvest jobs running or starting",
                     "harvest_max_jobs_per_principal")
        self._check_bytes(owner)
        self._starting[owner] = self._starting.get(owner, 0) + 1

    def _check_bytes(self, owner: str) -> None:
        quota = self.config.max_bytes_per_principal
        if quota and self._bytes.get(owner, 0) >= quota:
            raise limits.exceeded(f"harvest shards of {owner!r}", f"{self._bytes[owner]} bytes written", quota,
                                  "harvest_max_bytes_per_principal", "no more may be written on this server")

    async def _start_reserved(self, request: hv.StartHarvestRequest, principal: Principal, host: Any) -> Job:
        settings = await self._blocking(self._validate, request, host)
        key = (settings.url, settings.worker_index)
        if key in self._outputs:
            raise AlreadyExists(f"output.path: job {self._outputs[key]} is writing {settings.output!r} (worker {key[1]})")
        job_id = ids.new_harvest_job_id()
        try:
            return await self._start_job(job_id, request, settings, key, principal, host)
        except BaseException:
            self._hooks.operands.release(job_id)  # the job did not start: the operands its rules named are free
            raise

    async def _start_job(
        self, job_id: str, request: hv.StartHarvestRequest, settings: _Settings, key: tuple[str, int],
        principal: Principal, host: Any,
    ) -> Job:
        records, capture_ids = self._records(host, settings, principal, job_id)
        if self._admission is not None and self._engines is not None:
            # A batch that could never fit the memory budget is refused now, not at its turn.
            await self._admission.check_memory(
                host, self._engines.engine(host), f"a batch of harvest job {job_id} on {host.name!r}",
                functools.partial(_batch_estimate, inputs=_batch_inputs((settings.batch_size, settings.length)),
                                  captures=captured_modules(records)),
            )
        header = {
            "model": settings.model, "modules": settings.modules, "settings": settings.describe(),
            "source": settings.source, "hookwire_version": hookwire_version,
        }
        self._outputs[key] = "(starting)"
        try:
            try:
                writer = await self._blocking(
                    fmt.DatasetWriter, settings.url, header=header, worker_index=settings.worker_index,
                    num_workers=max(1, settings.num_workers), shard_tokens=settings.shard_tokens,
                    shuffle_buffer_shards=settings.buffer_shards if settings.shuffle else 0,
                    shuffle_seed=settings.seed, overwrite=settings.overwrite,
                    # Local outputs: every file the job opens is checked as it is opened
                    # (no symlink inside the output folder), not only the path at start.
                    confine="://" not in settings.url,
                )
            except fmt.UnsafePath as exc:
                raise PermissionDenied(f"output.path: {exc}") from None
            except fmt.DatasetExists as exc:
                raise AlreadyExists(f"output.path: {exc} (set output.overwrite to replace it)") from None
            except fmt.SettingsMismatch as exc:
                raise FailedPrecondition(
                    f"output.path: {settings.output!r} holds an unfinished dataset of other settings: {exc}; "
                    "use another path, the same settings (to resume), or output.overwrite"
                ) from None
            except (OSError, ValueError) as exc:
                raise FailedPrecondition(f"output.path: {settings.output!r} cannot be written: {exc}") from None
        except BaseException:
            del self._outputs[key]
            raise
        try:
            # The other jobs of this principal wrote on while this start awaited: the
            # byte quota is checked again with no await between the check and the job.
            self._check_bytes(principal.name)
        except ResourceExhausted:
            del self._outputs[key]
            raise
        job = Job(job_id, principal.name, settings)
        job.resume_command = resume_command(request)
        self._outputs[key] = job.id
        self._forget_old_jobs()
        self._jobs[job.id] = job
        job.resumed_tokens = job.tokens_done = job.tokens_committed = writer.tokens_done
        job.shards_written, job.bytes_written = writer.shards_written, writer.bytes_written
        self._save_state(job)
        self._start_heartbeats()
        job.task = asyncio.get_running_loop().create_task(self._run(job, host, writer, records, capture_ids))
        log.info("harvest %s started on %s into %s (resuming at %d tokens)", job.id, settings.model, settings.output,
                 writer.tokens_done, extra={"model": settings.model})
        return job

    async def _blocking(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` on the harvest threads."""
        return await asyncio.get_running_loop().run_in_executor(self._io, functools.partial(fn, *args, **kwargs))

    def _forget_old_jobs(self) -> None:
        ended = [job_id for job_id, job in self._jobs.items() if not job.active]
        for job_id in ended[:max(0, len(ended) - self.config.max_ended_jobs)]:
            del self._jobs[job_id]

    def _validate(self, request: hv.StartHarvestRequest, host: Any) -> _Settings:
        """Everything about the request that can be checked before the job starts (a
        thread: the source's fingerprint reads its files)."""
        if not request.modules:
            raise InvalidArgument("modules: at least one module path or glob is needed")
        paths: dict[str, None] = {}
        for i, pattern in enumerate(request.modules):
            if not pattern:
                raise InvalidArgument(f"modules[{i}]: empty")
            try:
                found = hookable_modules(host, pattern, f"modules[{i}]")
            except (NotFound, InvalidArgument) as exc:
                raise type(exc)(f"modules[{i}]: {exc}") from None
            paths.update(dict.fromkeys(found))
        if len(paths) > self.config.max_modules:
            raise limits.exceeded("modules", f"the patterns match {len(paths)} modules", self.config.max_modules,
                                  "harvest_max_modules", error=InvalidArgument)
        order = {p: i for i, p in enumerate(host.paths)}
        modules = sorted(paths, key=order.__getitem__)
        part = request.part or hook_pb2.PART_OUTPUT
        if part not in (hook_pb2.PART_OUTPUT, hook_pb2.PART_ARGS):
            raise InvalidArgument(f"part: {part} is not PART_OUTPUT or PART_ARGS")
        select = compile_select(request.select, "select")
        cast = compile_cast(request.dtype, "dtype")
        for i, spec in enumerate(request.rules):
            if spec.model and spec.model != host.name:
                raise InvalidArgument(f"rules[{i}].model: {spec.model!r} is not the job's model {host.name!r}")
            for field in ("prehook", "posthook", "backward_prehook", "backward_hook"):
                if spec.HasField(field) and getattr(spec, field).capture:  # type: ignore[arg-type]
                    raise InvalidArgument(f"rules[{i}].{field}.capture: a harvest's rules change values only; "
                                          "what is stored is named by modules and part")
            if spec.HasField("backward_prehook") or spec.HasField("backward_hook"):
                raise InvalidArgument(f"rules[{i}]: a harvest runs no backward pass")
        c = request.contexts
        length = c.length or DEFAULT_LENGTH
        if length > self.config.max_context_length:
            raise limits.exceeded("contexts.length", f"{length} tokens", self.config.max_context_length,
                                  "harvest_max_context_length", error=InvalidArgument)
        if host.positions is not None and length > host.positions:
            raise InvalidArgument(f"contexts.length: {length} is over the model's {host.positions} positions")
        batch_size = c.batch_size or DEFAULT_BATCH_SIZE
        if batch_size > host.batching.max_batch_size:
            raise InvalidArgument(
                f"contexts.batch_size: {batch_size} is over the model's max_batch_size of {host.batching.max_batch_size}"
            )
        if c.packing not in hv.Packing.values():
            raise InvalidArgument(f"contexts.packing: unknown value {c.packing}")
        positions = request.positions
        if len(positions.only) > self.config.max_positions:
            raise limits.exceeded("positions.only", f"{len(positions.only)} entries", self.config.max_positions,
                                  "harvest_max_positions", error=InvalidArgument)
        bad = [p for p in positions.only if p >= length]
        if bad:
            raise InvalidArgument(f"positions.only: {bad[:5]} not below contexts.length {length}")
        if positions.skip_first >= length:
            raise InvalidArgument(f"positions.skip_first: {positions.skip_first} leaves no position of {length}")
        workers = request.num_workers
        if workers > self.config.max_workers:
            raise limits.exceeded("num_workers", f"{workers} workers", self.config.max_workers, "harvest_max_workers",
                                  error=InvalidArgument)
        if request.worker_index >= max(1, workers):
            raise InvalidArgument(f"worker_index: {request.worker_index} is not below num_workers {max(1, workers)}")
        out = request.output
        shard_tokens = out.shard_tokens or DEFAULT_SHARD_TOKENS
        if shard_tokens > self.config.max_shard_tokens:
            raise limits.exceeded("output.shard_tokens", f"{shard_tokens} tokens", self.config.max_shard_tokens,
                                  "harvest_max_shard_tokens", error=InvalidArgument)
        buffer_shards = out.shuffle.buffer_shards or DEFAULT_BUFFER_SHARDS
        if buffer_shards > self.config.max_buffer_shards:
            raise limits.exceeded("output.shuffle.buffer_shards", f"{buffer_shards} shards", self.config.max_buffer_shards,
                                  "harvest_max_buffer_shards", error=InvalidArgument)
        url = self._output_url(out.path)
        text = token_ids = spec = None
        token_pad = None
        kind = request.source.WhichOneof("kind")
        if kind == "text":
            text, spec, source = self._text_source(request.source.text, c, host, length)
        elif kind == "tokens":
            token_ids, token_pad, source = _token_source(request.source.tokens, length)
        else:
            raise InvalidArgument("source: set source.text (a dataset on the server) or source.tokens (token ids)")
        return _Settings(
            model=host.name, patterns=list(request.modules), modules=modules, part=part, select=select, cast=cast,
            rule_specs=list(request.rules), source=source, text=text, token_ids=token_ids, token_pad=token_pad,
            spec=spec, length=length, batch_size=batch_size, skip_first=positions.skip_first,
            only=tuple(positions.only), max_tokens=request.max_tokens, output=out.path, url=url,
            shard_tokens=shard_tokens, overwrite=out.overwrite, shuffle=out.shuffle.enabled,
            buffer_shards=buffer_shards, seed=out.shuffle.seed, worker_index=request.worker_index,
            num_workers=max(1, workers),
        )

    def _output_url(self, path: str) -> str:
        if not path:
            raise InvalidArgument("output.path: empty; name a folder under the server's harvest output root")
        if "://" in path:
            if not any(path.startswith(prefix) for prefix in self.config.url_prefixes):
                raise PermissionDenied(
                    f"output.path: {path!r} is not under a URL prefix this server allows (harvest_url_prefixes)"
                )
            if "/../" in path + "/" or "\\" in path:
                raise PermissionDenied(f"output.path: {path!r} has '..' in it")
            return path
        if not self.config.output_root:
            raise FailedPrecondition("output.path: this server writes harvests to URLs only (harvest_url_prefixes)")
        try:
            resolved = sources.confine(self.config.output_root, path, what="output.path")
        except sources.PathNotAllowed as exc:
            raise PermissionDenied(str(exc)) from None
        except sources.SourceError as exc:
            raise InvalidArgument(str(exc)) from None
        state = self.config.state_path
        if state is not None:
            # The job-state folder is the server's own (job records, cancel markers): a
            # dataset there could overwrite or be pruned with them.
            state_real = pathlib.Path(os.path.realpath(state))
            if resolved == state_real or state_real in resolved.parents:
                raise InvalidArgument(
                    f"output.path: {path!r} is inside the server's job-state folder (harvest_state_dir); "
                    "name a folder outside it"
                )
        return str(resolved)

    def _text_source(
        self, text: hv.TextSource, c: hv.HarvestContexts, host: Any, length: int,
    ) -> tuple[sources.TextDataset, sources.ContextSpec, dict[str, Any]]:
        if not self.config.data_root:
            raise FailedPrecondition("source.text: this server has no harvest data root (harvest_data_root)")
        if host.tokenizer is None:
            raise FailedPrecondition(
                f"source.text: model {host.name!r} has no tokenizer; send token ids (source.tokens) instead"
            )
        try:
            path = sources.confine(self.config.data_root, text.path, what="source.text.path")
        except sources.PathNotAllowed as exc:
            raise PermissionDenied(str(exc)) from None
        except sources.SourceError as exc:
            raise InvalidArgument(str(exc)) from None
        if not path.exists():
            raise NotFound(f"source.text.path: {text.path!r} does not exist under the data root")
        formats = {hv.TEXT_FORMAT_JSONL: "jsonl", hv.TEXT_FORMAT_PARQUET: "parquet", hv.TEXT_FORMAT_TEXT: "text",
                   hv.TEXT_FORMAT_HF_DATASET: "hf"}
        if text.format and text.format not in formats:
            raise InvalidArgument(f"source.text.format: unknown value {text.format}")
        try:
            dataset = sources.TextDataset(
                path, format=formats.get(text.format), text_field=text.text_field or "text", split=text.split or None,
            )
            described = dataset.describe()
        except sources.SourceError as exc:
            raise InvalidArgument(f"source.text: {exc}") from None
        described["path"] = text.path  # as given (the root is the server's business)
        bos, sep, pad = sources.special_ids(host.tokenizer, bos=c.bos if c.HasField("bos") else None)
        if c.HasField("bos") and c.bos and bos is None:
            raise InvalidArgument(f"contexts.bos: the tokenizer of {host.name!r} has no BOS (or CLS) token")
        packing = "pack" if c.packing == hv.PACKING_PACK else "truncate"
        spec = sources.ContextSpec(length=length, packing=packing, bos_id=bos, sep_id=sep, pad_id=pad)
        return dataset, spec, described

    def _records(
        self, host: Any, settings: _Settings, principal: Principal, request_id: str,
    ) -> tuple[list[HookRecord], dict[str, str]]:
        """The job's hooks (request-scoped hooks of its passes, whose request id is the
        job's id): its rules first (so a capture on the same module sees their effect),
        then one capture hook per stored module."""
        try:
            # The job holds the named operands its rules use until it ends (DeleteOperand
            # refuses them meanwhile); its captures name none.
            rules = self._hooks.request_hooks(host, settings.rule_specs, request_id, None, principal,
                                              holder=(request_id, f"harvest job {request_id}"))
        except (InvalidArgument, NotFound, FailedPrecondition) as exc:
            raise type(exc)(str(exc).replace("hooks[", "rules[", 1)) from None
        for i, record in enumerate(rules):
            if record.compiled.uses_slots:
                raise InvalidArgument(f"rules[{i}]: save and patch rules need a session; a harvest has none")
        action = hook_pb2.HookAction()
        action.capture.append(settings.part)  # type: ignore[arg-type]
        captures = []
        for module in settings.modules:
            spec = hook_pb2.HookSpec(module=module)
            if settings.part == hook_pb2.PART_OUTPUT:
                spec.posthook.CopyFrom(action)
            else:
                spec.prehook.CopyFrom(action)
            captures.extend(self._hooks.request_hooks(host, [spec], request_id, None, principal))
        capture_ids = {r.hook_id: m for r, m in zip(captures, settings.modules)}
        return rules + captures, capture_ids

    # ---- running --------------------------------------------------------------------

    async def _run(
        self, job: Job, host: Any, writer: fmt.DatasetWriter, records: list[HookRecord], capture_ids: dict[str, str],
    ) -> None:
        s = job.settings
        stop = threading.Event()
        writes = _Writer(self._io)
        final = (hv.HARVEST_STATE_FAILED, "the job stopped without a reason")
        try:
            plan = await self._blocking(self._plan, job, host)
            mine = plan.worker_batches(s.worker_index, s.num_workers)
            job.batches_total = len(mine)
            job.tokens_total = plan.worker_tokens(s.worker_index, s.num_workers)
            await self._blocking(writer.set_batches_total, len(mine))
            skip = min(writer.resume_batches, len(mine))
            job.batches_done = skip
            job.state = hv.HARVEST_STATE_RUNNING
            job.started = time.time()
            job.changed()
            self._save_state(job)
            wanted = set(mine[skip:])
            batches = _Handoff(asyncio.get_running_loop(), AHEAD, stop)
            producer = threading.Thread(
                target=self._produce, args=(job, host, wanted, plan.num_batches, batches, stop),
                name=f"harvest-tokens:{job.id}", daemon=True,
            )
            producer.start()
            rate = _Rate()
            last_saved = 0.0
            while True:
                item = await batches.get()
                if item is None:
                    break
                if isinstance(item, BaseException):
                    raise item
                self._check_cancel(job)
                keep = sources.keep_mask(item.attention_mask, skip_first=s.skip_first, only=s.only)
                work = Work(
                    HARVEST,
                    HarvestBatch(job.id, job.owner, records, capture_ids, s, item, keep, self._hooks.held_bytes),
                    key=None, rows=int(item.input_ids.shape[0]), background=True,
                    caller=("", job.owner),
                )
                assert self._engines is not None, "a HarvestManager without engines runs no job"
                assert self._admission is not None
                # Each batch claims its estimated peak in the server's memory budget while it
                # runs (the job's start checked that one can fit): it waits for room as calls do.
                claim = await self._admission.claim_memory(
                    host, self._engines.engine(host), f"harvest job {job.id} on {host.name!r}",
                    functools.partial(_batch_estimate, inputs=_batch_inputs(item.input_ids.shape),
                                      captures=captured_modules(records)),
                )
                try:
                    result = await self._engines.submit(host, work)
                finally:
                    if claim is not None:
                        claim.release()
                await writes.wait()  # at most one batch being written while the next one runs
                self._account(job, writer)
                writes.start(writer, result)
                job.batches_done += 1
                job.tokens_done += result.tokens
                self._metrics.harvest_tokens.labels(s.model).inc(result.tokens)
                job.rate = rate.add(result.tokens)
                job.changed()
                now = time.monotonic()
                if now - last_saved >= STATE_WRITE_SECONDS:
                    last_saved = now
                    self._save_state(job)
            await writes.wait()
            await self._blocking(writer.finish)
            self._account(job, writer)
            if s.worker_index == 0:
                job.changed()
                self._save_state(job)
                while not await self._blocking(writer.merge):
                    self._check_cancel(job)
                    await asyncio.sleep(self.config.merge_poll_seconds)
                job.committed = True
            final = (hv.HARVEST_STATE_SUCCEEDED, "")
            log.info("harvest %s done: %d tokens, %d shards", job.id, job.tokens_done, job.shards_written)
        except (asyncio.CancelledError, _Cancelled):
            final = (hv.HARVEST_STATE_CANCELLED, job.cancel_reason or "cancelled")
        except fmt.UnsafePath as exc:  # a symlink planted in the output folder while the job ran
            final = (hv.HARVEST_STATE_FAILED, f"output.path: {exc}")
        except HookwireServerError as exc:
            final = (hv.HARVEST_STATE_FAILED, str(exc))
        except Exception as exc:
            log.exception("harvest %s failed", job.id)
            final = (hv.HARVEST_STATE_FAILED, f"{type(exc).__name__}: {exc}")
        finally:
            # The job ends (its state turns final) only once its writes are done and its
            # output is free: a client that sees it end can start it again at once.
            stop.set()
            try:
                await asyncio.shield(writes.wait())  # what was handed over is written (or failed)
            except BaseException:
                pass
            try:
                self._account(job, writer)
            except ResourceExhausted:  # the job is over either way; the quota stops the next one
                pass
            self._outputs.pop((s.url, s.worker_index), None)
            job.ended = time.time()
            job.rate = 0.0
            job.state, job.error = final
            job.changed()
            self._save_state(job)
            self._hooks.operands.release(job.id)

    def _account(self, job: Job, writer: fmt.DatasetWriter) -> None:
        """Takes the writer's committed figures into the job and the owner's byte quota."""
        grown = writer.bytes_written - job.bytes_written
        job.shards_written, job.bytes_written = writer.shards_written, writer.bytes_written
        job.tokens_committed = writer.tokens_done
        if grown > 0:
            self._metrics.harvest_bytes.labels(job.settings.model).inc(grown)
            self._bytes[job.owner] = self._bytes.get(job.owner, 0) + grown
            quota = self.config.max_bytes_per_principal
            if quota and self._bytes[job.owner] > quota and job.active:
                raise limits.exceeded(f"harvest shards of {job.owner!r}", f"{self._bytes[job.owner]} bytes written",
                                      quota, "harvest_max_bytes_per_principal", "the shards written so far are kept")

    def _check_cancel(self, job: Job) -> None:
        if not job.cancel_reason and self._cancel_marker(job.id) is not None:
            job.cancel_reason = "cancelled (by CancelHarvest on another replica)"
        if job.cancel_reason:
            raise _Cancelled()

    def _batches(self, job: Job, host: Any, tokenizer: Any) -> Iterator[sources.TokenBatch]:
        s = job.settings
        if s.token_ids is not None:
            return sources.token_batches(s.token_ids, s.batch_size, s.token_pad)
        assert s.text is not None and s.spec is not None
        return sources.batches(
            sources.contexts(
                s.text.documents(), lambda texts: tokenizer(texts, add_special_tokens=False)["input_ids"], s.spec,
            ),
            s.batch_size, s.spec.pad_id,
        )

    def _plan(self, job: Job, host: Any) -> sources.Plan:
        """Counts the source (a thread): the batches, their stored tokens, the budget's end."""
        s = job.settings
        tokenizer = copy.deepcopy(host.tokenizer) if s.text is not None else None
        try:
            plan = sources.plan(
                self._batches(job, host, tokenizer), skip_first=s.skip_first, only=s.only, max_tokens=s.max_tokens,
            )
        except sources.SourceError as exc:
            raise InvalidArgument(f"source: {exc}") from None
        if plan.num_batches == 0:
            raise InvalidArgument("source: it holds no context to harvest (empty documents, or none at all)")
        return plan

    def _produce(
        self, job: Job, host: Any, wanted: set[int], num_batches: int, out: _Handoff, stop: threading.Event,
    ) -> None:
        """Tokenizes the source again on a thread of its own and hands over this worker's
        batches that are still to do (then None; an exception if it fails)."""
        put = out.put
        try:
            tokenizer = copy.deepcopy(host.tokenizer) if job.settings.text is not None else None
            for batch in self._batches(job, host, tokenizer):
                if batch.index >= num_batches or stop.is_set():
                    break
                if batch.index in wanted and not put(batch):
                    return
            put(None)
        except sources.SourceError as exc:
            put(InvalidArgument(f"source: {exc}"))
        except Exception as exc:
            put(exc)

    # ---- looking at jobs ------------------------------------------------------------

    def _visible(self, job_id: str, principal: Principal) -> Job | dict[str, Any]:
        job = self._jobs.get(job_id)
        if job is not None:
            if job.owner == principal.name or principal.is_operator:
                return job
            raise NotFound(f"no harvest job {job_id!r}")
        stored = self._load_state(job_id)
        if stored is None or not (stored.get("owner") == principal.name or principal.is_operator):
            raise NotFound(f"no harvest job {job_id!r}")
        return stored

    def get(self, job_id: str, principal: Principal) -> hv.HarvestJob:
        """The job's state (from this server, or the shared state folder)."""
        principal.require(MINIMUM_ROLE["GetHarvest"], "looking at harvest jobs")
        found = self._visible(job_id, principal)
        return found.to_proto() if isinstance(found, Job) else self._interpret(found)

    async def watch(self, job_id: str, principal: Principal, interval_ms: int) -> AsyncIterator[hv.HarvestJob]:
        """The job's state, then each change (at most every interval), until it ends."""
        principal.require(MINIMUM_ROLE["WatchHarvest"], "watching harvest jobs")
        if interval_ms and interval_ms < self.config.min_watch_ms:
            raise limits.below("interval_ms", f"{interval_ms} ms", f"{self.config.min_watch_ms} ms", "harvest_min_watch_ms")
        interval = (interval_ms or DEFAULT_WATCH_MS) / 1e3
        found = self._visible(job_id, principal)
        if not isinstance(found, Job):  # another replica runs it: follow its state file
            while True:
                msg = self._interpret(found)
                yield msg
                if msg.state in ENDED:
                    return
                await asyncio.sleep(max(interval, STATE_WRITE_SECONDS))
                found = self._load_state(job_id) or found
        job = found
        # The stream ends after the message that shows the job ended, never on the job's
        # own state: a job may end while a message is being sent, and that message (taken
        # before) would then be the stream's last, showing it running.
        version = job.version
        msg = job.to_proto()
        yield msg
        while msg.state not in ENDED:
            await job.next_change(version)
            if job.active:
                await asyncio.sleep(interval)  # changes meanwhile are folded into one message
            version = job.version
            msg = job.to_proto()
            yield msg

    async def cancel(self, job_id: str, principal: Principal) -> hv.HarvestJob:
        """Cancels the job (it stops after its current batch) and returns its state."""
        principal.require(MINIMUM_ROLE["CancelHarvest"], "cancelling harvest jobs")
        found = self._visible(job_id, principal)
        if isinstance(found, Job):
            if found.active and not found.cancel_reason:
                found.cancel_reason = f"cancelled by {principal.name}"
                if found.state == hv.HARVEST_STATE_PENDING and found.task is not None:
                    found.task.cancel()  # still counting: nothing to keep
                found.changed()
            return found.to_proto()
        msg = self._interpret(found)
        if msg.state == hv.HARVEST_STATE_INTERRUPTED:
            # Nothing runs it: this server ends it. The cancel marker stays as well, so
            # that a server that only seemed gone (a long pause) stops it when it wakes.
            self._write_cancel_marker(job_id, principal.name)
            msg.state = hv.HARVEST_STATE_CANCELLED
            msg.error = f"cancelled by {principal.name} (it was interrupted: its server had stopped)"
            msg.eta_seconds = msg.tokens_per_second = 0
            if not msg.HasField("ended"):
                msg.ended.CopyFrom(_timestamp(time.time()))
            self._write_record(job_id, json_format.MessageToDict(msg, preserving_proto_field_name=True))
        elif msg.state not in ENDED:
            self._write_cancel_marker(job_id, principal.name)
        return msg

    def list_jobs(self, request: hv.ListHarvestsRequest, principal: Principal) -> list[hv.HarvestJob]:
        """The caller's jobs (everyone's for operators), here and in the state folder, newest first."""
        principal.require(MINIMUM_ROLE["ListHarvests"], "listing harvest jobs")
        found: dict[str, hv.HarvestJob] = {}
        for stored in self._stored_states():
            msg = self._interpret(stored)
            found[msg.job_id] = msg
        self._maybe_prune()
        for job in self._jobs.values():
            found[job.id] = job.to_proto()
        jobs = [
            j for j in found.values()
            if (j.owner == principal.name or principal.is_operator) and (not request.model or j.model == request.model)
            and (not request.active_only or j.state not in ENDED)
        ]
        jobs.sort(key=lambda j: j.created.ToNanoseconds(), reverse=True)
        return jobs

    async def close(self, timeout: float) -> None:
        """Cancels every job (the server stops); waits up to ``timeout`` for them to end."""
        self._closing = True
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        tasks = []
        for job in self._jobs.values():
            if job.active and job.task is not None:
                job.cancel_reason = job.cancel_reason or "the server shut down (start the job again to resume it)"
                job.task.cancel()
                tasks.append(job.task)
        if tasks:
            await asyncio.wait(tasks, timeout=max(0.01, timeout))
        self._io.shutdown(wait=False, cancel_futures=True)

    # ---- the shared state folder ----------------------------------------------------

    def _state_file(self, job_id: str, suffix: str = ".json") -> pathlib.Path | None:
        folder = self.config.state_path
        if folder is None or not job_id.startswith("hv-") or not job_id[3:].isalnum():
            return None
        return folder / f"{job_id}{suffix}"

    def _save_state(self, job: Job) -> None:
        """Writes the job's state file; for a pending or running job it is also its
        heartbeat (the time written renews its lease)."""
        record = json_format.MessageToDict(job.to_proto(), preserving_proto_field_name=True)
        # Where its committed part is (the output as resolved) and how much it was when
        # written: what an INTERRUPTED job reports, not tokens_done (see _committed).
        record.update(output_url=job.settings.url, tokens_committed=job.tokens_committed)
        self._write_record(job.id, record)

    def _write_record(self, job_id: str, record: dict[str, Any]) -> None:
        path = self._state_file(job_id)
        if path is None:
            return
        # Wall-clock time (not monotonic): other replicas compare it with their own clock.
        record = {**record, "heartbeat": time.time(), "lease_seconds": self.config.lease_seconds}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(record))
            os.replace(tmp, path)
        except OSError as exc:  # progress bookkeeping must not fail the job
            log.warning("harvest %s: cannot write its state file %s: %s", job_id, path, exc)

    def _interpret(self, record: dict[str, Any]) -> hv.HarvestJob:
        """A stored record as a HarvestJob: a pending or running job whose lease expired
        (no heartbeat for lease_seconds: its server was killed or lost) is INTERRUPTED,
        with a message saying how to resume it."""
        msg = _from_state(record)
        if msg.state in ENDED:
            return msg
        beat = record.get("heartbeat")
        lease = record.get("lease_seconds")
        if not isinstance(beat, (int, float)):  # written before leases: its file's time is its heartbeat
            beat = record.get("_mtime", time.time())
        if not isinstance(lease, (int, float)) or lease <= 0:
            lease = self.config.lease_seconds
        now = time.time()
        if now - float(beat) <= float(lease):
            return msg
        msg.state = hv.HARVEST_STATE_INTERRUPTED
        msg.tokens_per_second = msg.eta_seconds = 0
        msg.ended.CopyFrom(_timestamp(float(beat)))
        committed = self._committed(record, float(beat))
        if committed is not None:
            msg.tokens_done, msg.shards_written, msg.bytes_written = committed
        msg.error = interrupted_message(msg, now - float(beat), float(lease))
        return msg

    def _committed(self, record: dict[str, Any], beat: float) -> tuple[int, int, int] | None:
        """(tokens, shards, bytes) an interrupted job's worker committed: read from its
        worker manifest on disk (a local output), else the figure its state file last
        recorded (an object store is not read on the event loop); None for a state file
        that records neither (written before either was kept).

        The state file's tokens_done is not it: it counts every batch the model ran,
        and the batches of a group not yet committed when the server died are lost
        (the resumed job runs them again)."""
        job_id = str(record.get("job_id", ""))
        cached = self._on_disk.get(job_id)
        if cached is not None and cached[0] == beat:
            return cached[1]
        figures = None
        url = record.get("output_url")
        if isinstance(url, str) and url and "://" not in url:
            figures = _manifest_figures(url, record)
        if figures is None and isinstance(record.get("tokens_committed"), int):
            figures = (int(record["tokens_committed"]), int(record.get("shards_written", 0)),
                       int(record.get("bytes_written", 0)))
        if len(self._on_disk) >= MAX_ON_DISK:
            self._on_disk.pop(next(iter(self._on_disk)))
        self._on_disk[job_id] = (beat, figures)
        return figures

    def _load_state(self, job_id: str) -> dict[str, Any] | None:
        path = self._state_file(job_id)
        if path is None:
            return None
        return self._indexed(path)

    def _indexed(self, path: pathlib.Path, stat: os.stat_result | None = None) -> dict[str, Any] | None:
        """The record in ``path``, from the index when the file has not changed since it
        was read (same mtime and size), else read again; None when there is none."""
        try:
            st = stat if stat is not None else path.stat()
        except OSError:
            self._index.pop(path.name, None)
            return None
        cached = self._index.get(path.name)
        if cached is not None and cached[0] == st.st_mtime_ns and cached[1] == st.st_size:
            return cached[2]
        try:
            loaded = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(loaded, dict):
            return None
        loaded["_mtime"] = st.st_mtime
        self._index[path.name] = (st.st_mtime_ns, st.st_size, loaded)
        return loaded

    def _stored_states(self) -> list[dict[str, Any]]:
        """Every record in the state folder: one directory listing and one stat per
        file; only files that changed since the last call are read."""
        folder = self.config.state_path
        if folder is None or not folder.is_dir():
            self._index.clear()
            return []
        out = []
        seen = set()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            return []
        for entry in entries:
            name = entry.name
            if not (name.startswith("hv-") and name.endswith(".json")):
                continue
            seen.add(name)
            try:
                stat = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            record = self._indexed(pathlib.Path(entry.path), stat)
            if record is not None:
                out.append(record)
        for gone in set(self._index) - seen:
            del self._index[gone]
        return out

    def _maybe_prune(self) -> None:
        """Prunes at most every PRUNE_EVERY_SECONDS (listing calls it, and the heartbeats)."""
        now = time.monotonic()
        if self.config.retention_seconds and now - self._last_prune >= PRUNE_EVERY_SECONDS:
            self._last_prune = now
            self.prune()

    def prune(self, now: float | None = None) -> list[str]:
        """Removes the state files (and cancel markers) of jobs that ended more than
        harvest_retention_seconds ago (INTERRUPTED ones: since their last heartbeat);
        returns their ids. Jobs this server runs are never pruned; 0 keeps everything."""
        retention = self.config.retention_seconds
        if not retention:
            return []
        now = time.time() if now is None else now
        pruned = []
        for record in self._stored_states():
            msg = self._interpret(record)
            if msg.state not in ENDED or msg.job_id in self._jobs and self._jobs[msg.job_id].active:
                continue
            ended = msg.ended.ToNanoseconds() / 1e9 if msg.HasField("ended") else float(record.get("_mtime", now))
            if now - ended <= retention:
                continue
            for suffix in (".json", ".cancel"):
                path = self._state_file(msg.job_id, suffix)
                if path is not None:
                    try:
                        path.unlink(missing_ok=True)
                    except OSError as exc:
                        log.warning("harvest: cannot prune %s: %s", path, exc)
            self._index.pop(f"{msg.job_id}.json", None)
            pruned.append(msg.job_id)
        if pruned:
            log.info("harvest: pruned the state of %d finished jobs (harvest_retention_seconds)", len(pruned))
        return pruned

    def _start_heartbeats(self) -> None:
        if self._heartbeat is None or self._heartbeat.done():
            self._heartbeat = asyncio.get_running_loop().create_task(self._beat())

    async def _beat(self) -> None:
        """Renews the leases of this server's active jobs every third of the lease (their
        state files rewritten), and prunes the state folder now and then."""
        while True:
            await asyncio.sleep(self.config.lease_seconds / 3)
            for job in list(self._jobs.values()):
                if job.active:
                    self._save_state(job)
            try:
                self._maybe_prune()
            except Exception:  # pruning is housekeeping: it never stops the heartbeats
                log.exception("harvest: pruning the state folder failed")

    def _write_cancel_marker(self, job_id: str, by: str) -> None:
        path = self._state_file(job_id, ".cancel")
        if path is not None:
            try:
                path.write_text(by)
            except OSError as exc:
                raise Unavailable(f"cannot leave a cancel request for {job_id}: {exc}") from None

    def _cancel_marker(self, job_id: str) -> str | None:
        path = self._state_file(job_id, ".cancel")
        if path is None or not path.exists():
            return None
        try:
            return path.read_text()
        except OSError:
            return None


class _Cancelled(Exception):
    """The job was asked to stop."""


def _manifest_figures(url: str, record: dict[str, Any]) -> tuple[int, int, int] | None:
    """(tokens, shards, shard bytes) the worker manifest at local output ``url`` commits
    for the job's worker (``worker_index``/``num_workers`` of ``record``), or None when
    it cannot be read (no manifest, not JSON, another worker's split). A few stat and
    read calls on a small file."""
    try:
        worker = int(record.get("worker_index", 0))
        workers = max(1, int(record.get("num_workers", 1)))
        path = pathlib.Path(url, fmt.worker_manifest_name(worker, workers))
        manifest = json.loads(path.read_text())
        shards = manifest["shards"]
        return int(manifest["tokens_done"]), len(shards), sum(int(entry["bytes"]) for entry in shards)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _from_state(record: dict[str, Any]) -> hv.HarvestJob:
    msg = hv.HarvestJob()
    json_format.ParseDict(record, msg, ignore_unknown_fields=True)
    return msg


def _token_source(tokens: hv.TokenSource, length: int) -> tuple[np.ndarray, int | None, dict[str, Any]]:
    try:
        codec.check_tensor(tokens.input_ids, "source.tokens.input_ids")
        t = codec.decode_tensor(tokens.input_ids)
    except codec.CodecError as exc:
        raise InvalidArgument(str(exc)) from None
    if t.dim() != 2 or t.shape[0] == 0 or t.shape[1] == 0:
        raise InvalidArgument(f"source.tokens.input_ids: shape {list(t.shape)} is not [contexts, length] with both > 0")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise InvalidArgument(f"source.tokens.input_ids: dtype {t.dtype} is not an integer type")
    if t.shape[1] > length:
        raise InvalidArgument(f"source.tokens.input_ids: rows of {t.shape[1]} tokens are longer than contexts.length {length}")
    ids = t.to(torch.int64).numpy()
    pad = tokens.pad_token_id if tokens.HasField("pad_token_id") else None
    digest = hashlib.sha256(ids.tobytes()).hexdigest()
    return ids, pad, {"kind": "tokens", "shape": list(ids.shape), "pad_token_id": pad, "fingerprint": digest}


class _Rate:
    """Tokens per second over the last batches (a window of about 20 s)."""

    def __init__(self) -> None:
        self._marks: list[tuple[float, int]] = [(time.monotonic(), 0)]

    def add(self, tokens: int) -> float:
        now = time.monotonic()
        total = self._marks[-1][1] + tokens
        self._marks.append((now, total))
        while len(self._marks) > 2 and now - self._marks[1][0] > 20.0:
            self._marks.pop(0)
        t0, n0 = self._marks[0]
        return (total - n0) / (now - t0) if now > t0 else 0.0


class _Writer:
    """At most one batch being stored, on a harvest thread, while the model runs the next."""

    def __init__(self, executor: concurrent.futures.Executor) -> None:
        self._executor = executor
        self._future: asyncio.Future[Any] | None = None

    def start(self, writer: fmt.DatasetWriter, result: HarvestResult) -> None:
        self._future = asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(
            writer.add, result.values, result.token_ids, result.sequence, result.position,
        ))

    async def wait(self) -> None:
        future, self._future = self._future, None
        if future is not None:
            await future


def settings_from(
    *, data_root: str | None, output_root: str | None, url_prefixes: str | None, state_dir: str | None,
    limits: Limits, merge_poll_seconds: float = 2.0,
) -> HarvestConfig:
    """A HarvestConfig from the server's flat settings (url_prefixes comma-separated) and
    the harvest_* fields of ``limits``; ValueError naming the setting that is out of range."""
    prefixes = tuple(p.strip() for p in (url_prefixes or "").split(",") if p.strip())
    config = HarvestConfig(
        data_root=data_root or None, output_root=output_root or None, url_prefixes=prefixes, state_dir=state_dir or None,
        merge_poll_seconds=merge_poll_seconds, **{name: getattr(limits, "harvest_" + name) for name in LIMIT_FIELDS},
    )
    config.validate()
    return config


_CLI_DTYPES = {tensor_pb2.DTYPE_FLOAT16: "float16", tensor_pb2.DTYPE_BFLOAT16: "bfloat16",
               tensor_pb2.DTYPE_FLOAT32: "float32"}
_CLI_FORMATS = {hv.TEXT_FORMAT_JSONL: "jsonl", hv.TEXT_FORMAT_PARQUET: "parquet", hv.TEXT_FORMAT_TEXT: "text",
                hv.TEXT_FORMAT_HF_DATASET: "hf"}


def resume_command(request: hv.StartHarvestRequest) -> str:
    """The ``hookwire harvest ...`` command that sends ``request`` again (without
    ``--overwrite``: at the same output it resumes the job from its committed shards),
    or "" when the CLI has no flags for it (token ids, rules, positions.only, a value
    the CLI cannot name). The target (--target or HOOKWIRE_TARGET) is the caller's own."""
    kind = request.source.WhichOneof("kind")
    if kind != "text" or request.rules or request.positions.only:
        return ""
    if request.dtype and request.dtype not in _CLI_DTYPES or request.source.text.format and \
            request.source.text.format not in _CLI_FORMATS:
        return ""
    args = ["hookwire", "harvest", request.model]
    for pattern in request.modules:
        args += ["--modules", pattern]
    text = request.source.text
    args += ["--data", text.path]
    if text.text_field and text.text_field != "text":
        args += ["--text-field", text.text_field]
    if text.format:
        args += ["--format", _CLI_FORMATS[text.format]]
    if text.split:
        args += ["--split", text.split]
    args += ["--out", request.output.path]
    if request.dtype:
        args += ["--dtype", _CLI_DTYPES[request.dtype]]
    if request.part == hook_pb2.PART_ARGS:
        args += ["--part", "input"]
    if request.select:
        args += ["--select", request.select]
    if request.max_tokens:
        args += ["--tokens", str(request.max_tokens)]
    c = request.contexts
    if (c.length or DEFAULT_LENGTH) != DEFAULT_LENGTH:
        args += ["--length", str(c.length)]
    if (c.batch_size or DEFAULT_BATCH_SIZE) != DEFAULT_BATCH_SIZE:
        args += ["--batch-size", str(c.batch_size)]
    if c.packing == hv.PACKING_PACK:
        args += ["--packing", "pack"]
    if c.HasField("bos") and not c.bos:
        args += ["--no-bos"]
    if request.positions.skip_first:
        args += ["--skip-first", str(request.positions.skip_first)]
    out = request.output
    if (out.shard_tokens or DEFAULT_SHARD_TOKENS) != DEFAULT_SHARD_TOKENS:
        args += ["--shard-tokens", str(out.shard_tokens)]
    if out.shuffle.enabled:
        args += ["--shuffle"]
        if (out.shuffle.buffer_shards or DEFAULT_BUFFER_SHARDS) != DEFAULT_BUFFER_SHARDS:
            args += ["--shuffle-buffer", str(out.shuffle.buffer_shards)]
        if out.shuffle.seed:
            args += ["--seed", str(out.shuffle.seed)]
    if request.num_workers > 1:
        args += ["--worker-index", str(request.worker_index), "--num-workers", str(request.num_workers)]
    return shlex.join(args)


def interrupted_message(msg: hv.HarvestJob, silent: float, lease: float) -> str:
    """HarvestJob.error of an INTERRUPTED job: what happened, and how to resume it."""
    how = (f"resume it with: {msg.resume_command}" if msg.resume_command else
           f"resume it by sending the same StartHarvestRequest again (output {msg.output!r})")
    return (f"interrupted: the server running it stopped ({silent:.0f} s without a heartbeat, lease {lease:g} s) "
            f"with {msg.tokens_done} tokens committed; nothing runs it now. Starting it again at the same output "
            f"resumes it from there: {how}")


class _Handoff:
    """Batches from the producer thread to the job on the event loop, at most ``ahead``
    at a time: the producer blocks on a semaphore (checking ``stop``), the job awaits an
    asyncio queue. No executor thread sits waiting for the next batch."""

    def __init__(self, loop: asyncio.AbstractEventLoop, ahead: int, stop: threading.Event) -> None:
        self._loop = loop
        self._items: asyncio.Queue[Any] = asyncio.Queue()
        self._room = threading.Semaphore(ahead)
        self._stop = stop

    def put(self, item: Any) -> bool:
        """Producer thread: hands ``item`` over once there is room; False when the job stopped."""
        while not self._stop.is_set():
            if self._room.acquire(timeout=0.2):
                try:
                    self._loop.call_soon_threadsafe(self._items.put_nowait, item)
                except RuntimeError:  # the loop is closed: nobody takes it
                    return False
                return True
        return False

    async def get(self) -> Any:
        """Event loop: the next item."""
        item = await self._items.get()
        self._room.release()
        return item


__all__ = ["HarvestConfig", "HarvestManager", "Job", "settings_from"]


def _batch_inputs(shape: Sequence[int]) -> Inputs:
    """A harvest batch's inputs as the memory estimate reads them: token ids and mask."""
    ids = TensorShape(tuple(int(n) for n in shape), torch.long)
    return (ids,), {"attention_mask": ids}


def _batch_estimate(estimator: Estimator, *, inputs: Inputs, captures: int) -> Estimate:
    return estimator.infer(inputs, captures=captures)
