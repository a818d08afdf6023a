"""Harvest batches on a torch model (worker thread): one pass over a batch of token
contexts, the captured modules' kept rows gathered (on the model's device, copied to
the host without waiting) for the job to store."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np
import torch

from hookwire.wire import harvest_sources as sources
from hookwire.v1 import hook_pb2

from ..errors import InvalidArgument
from ..hooks.deferred import HostCopies
from ..hooks.event_bus import HeldBytes
from ..hooks.hook_record import HookRecord
from ..hooks.passes import Pass
from ..models.model_registry import forward_parameters
from . import batching
from .pass_runner import running


@dataclasses.dataclass
class HarvestBatch:
    """One harvest batch on its way through the model (the payload of its Work)."""

    job_id: str
    owner: str
    records: list[HookRecord]
    capture_ids: dict[str, str]  # hook id -> module path it captures
    #: The job's settings (calls.harvest): part, select, cast and modules are read here.
    settings: Any
    batch: sources.TokenBatch
    keep: np.ndarray
    #: Where events of other hooks that a full stream cannot take are counted (the job
    #: owner's max_buffered_bytes_per_principal); None: nowhere.
    held_bytes: HeldBytes | None = None


@dataclasses.dataclass
class HarvestResult:
    values: dict[str, torch.Tensor]
    token_ids: torch.Tensor
    sequence: torch.Tensor
    position: torch.Tensor

    @property
    def tokens(self) -> int:
        return int(self.token_ids.numel())


def run_harvest_batch(host: Any, works: list[HarvestBatch]) -> list[Any]:
    """Runs harvest batches on the model's worker thread (the scheduler runs each alone):
    the batch's stored rows, or the exception it failed with."""
    results: list[Any] = []
    for work in works:
        try:
            results.append(_harvest_pass(host, work))
        except Exception as exc:
            results.append(exc)
    return results


#: Runs a harvest batch's forward pass for an engine that runs it its own way (the vLLM
#: engine: a prompt pass through vLLM): (the batch's Pass, input_ids, attention_mask, the
#: job's hook records to attach for the pass).
Forward = Callable[[Pass, torch.Tensor, torch.Tensor, list[HookRecord]], None]


def harvest_pass(host: Any, work: HarvestBatch, forward: Forward | None = None) -> HarvestResult:
    """One harvest batch: its pass (the model's forward, or ``forward``), what the job's
    capture hooks kept, gathered to the kept rows. Raises what the batch fails with."""
    return _harvest_pass(host, work, forward)


def _harvest_pass(host: Any, work: HarvestBatch, forward: Forward | None = None) -> HarvestResult:
    s = work.settings
    batch = work.batch
    ids = torch.from_numpy(batch.input_ids)
    mask = torch.from_numpy(batch.attention_mask)
    keep = torch.from_numpy(work.keep)
    part_name = "output" if s.part == hook_pb2.PART_OUTPUT else "input"
    collected: dict[str, torch.Tensor] = {}
    copies = HostCopies()

    def tap(hook_id: str, action: Any, path: str, call_index: int, parts: dict[str, Any]) -> None:
        module = work.capture_ids.get(hook_id)
        if module is None:
            return
        if call_index > 0:
            raise InvalidArgument(
                f"module {path!r} runs more than once in a pass; a harvest stores one value per module and token"
            )
        if s.part == hook_pb2.PART_OUTPUT:
            value = parts.get("output")
        else:
            args = parts.get("args") or ()
            value = args[0] if args else None
        if isinstance(value, (tuple, list)):
            value = value[0] if value else None
        if not isinstance(value, torch.Tensor):
            raise InvalidArgument(f"the {part_name} of module {path!r} is {type(value).__name__}, not a tensor")
        v = value.detach()
        if s.select is not None:
            try:
                v = v[s.select]
            except (IndexError, RuntimeError, TypeError, ValueError) as exc:
                raise InvalidArgument(f"select does not fit the {part_name} of module {path!r}: {exc}") from None
        if v.dim() < 2 or tuple(v.shape[:2]) != tuple(keep.shape):
            raise InvalidArgument(
                f"the {part_name} of module {path!r} has shape {list(v.shape)}{' after select' if s.select else ''}, "
                f"not [batch, positions, ...] = [{keep.shape[0]}, {keep.shape[1]}, ...]: a harvest stores per-token values"
            )
        if s.cast is not None and v.is_floating_point():
            v = v.to(s.cast)
        # One copy: the kept rows, gathered (a new tensor). On an accelerator the gather
        # stays there and its copy to pinned host memory is started, not waited for: the
        # forward goes on, and the pass waits for every copy once, at its end.
        gathered = v[keep.to(v.device)]
        collected[module] = gathered if gathered.device.type == "cpu" else copies.copy(gathered)

    p = Pass(work.job_id, "", principal=work.owner, model=host.name)
    p.held_bytes = work.held_bytes
    p.tap = tap
    try:
        if forward is not None:
            forward(p, ids, mask, work.records)
        else:
            inputs: dict[str, Any] = {"input_ids": ids.to(host.device)}
            params = forward_parameters(host.module)
            if "attention_mask" in params:
                inputs["attention_mask"] = mask.to(host.device)
            if "use_cache" in params:
                inputs["use_cache"] = False  # a KV cache nobody reads: no values change, less memory
            with running(host, batching.Batch.alone(p), work.records), torch.no_grad():
                host.module(**inputs)
    finally:
        # Other hooks' events (e.g. an operator's SCOPE_ALL capture) that a full stream
        # could not take during the pass go out from a thread of their own: the model goes on.
        p.finish(end=False)
    for event in copies.events():
        event.synchronize()  # the values in collected are complete from here on
    del copies
    for record in work.records:
        if record.disabled_reason:  # a rule failed: a dataset of a half-steered model is worse than none
            raise InvalidArgument(f"a rule failed, so the job stops: {record.disabled_reason}")
    missing = [m for m in s.modules if m not in collected]
    if missing:
        raise InvalidArgument(f"module(s) {missing} did not run in the forward pass, so nothing can be stored for them")
    rows = torch.arange(ids.shape[0], dtype=torch.int64).unsqueeze(1).expand_as(ids)
    positions = torch.arange(ids.shape[1], dtype=torch.int64).unsqueeze(0).expand_as(ids)
    return HarvestResult(
        values=collected,
        token_ids=ids[keep].to(torch.int64),
        sequence=rows[keep] + batch.first_sequence,
        position=positions[keep],
    )
