"""What a capture sends: selection, cast and server-side summaries of captured tensors,
and which firings send at all (sampling). Compiled at registration; applied in hooks."""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Mapping
from typing import Any

import torch

from hookwire.wire import codec
from hookwire.v1 import hook_pb2, tensor_pb2

from ..errors import InvalidArgument
from .selection import Index, SelectionError, parse_selection

MAX_HISTOGRAM_BINS = 4096
_CASTS = {
    tensor_pb2.DTYPE_FLOAT16: torch.float16,
    tensor_pb2.DTYPE_BFLOAT16: torch.bfloat16,
    tensor_pb2.DTYPE_FLOAT32: torch.float32,
}


@dataclasses.dataclass(frozen=True)
class CaptureOptions:
    """How captured tensors are reduced before they are sent."""

    select: Index | None = None
    cast: torch.dtype | None = None
    #: None: send tensors; an int: send summaries with that many histogram bins.
    summary_bins: int | None = None
    #: A readout sent instead of each tensor (readouts.CompiledReadout), or None.
    readout: Any = None

    @property
    def transforms(self) -> bool:
        """Whether captured values need preparing at all."""
        return (self.select is not None or self.cast is not None or self.summary_bins is not None
                or self.readout is not None)

    @classmethod
    def compile(cls, action: hook_pb2.HookAction, field: str) -> CaptureOptions:
        """Validated options of a HookAction; InvalidArgument naming the field."""
        select = compile_select(action.select, f"{field}.select")
        cast = compile_cast(action.cast, f"{field}.cast")
        bins = None
        if action.HasField("summarize"):
            bins = action.summarize.histogram_bins
            if bins > MAX_HISTOGRAM_BINS:
                raise InvalidArgument(f"{field}.summarize.histogram_bins: {bins} is above {MAX_HISTOGRAM_BINS}")
        return cls(select=select, cast=cast, summary_bins=bins)

    def prepare(self, value: Any) -> Any:
        """``value`` with each tensor selected, cast, or summarized (containers rebuilt)."""
        if isinstance(value, torch.Tensor):
            t = value.detach()
            if self.select is not None:
                t = t[self.select]
            if self.cast is not None and t.is_floating_point():
                t = t.to(self.cast)
            if self.readout is not None:
                return self.readout.apply(t)
            return summarize(t, self.summary_bins) if self.summary_bins is not None else t
        if isinstance(value, (tuple, list)):
            return type(value)(self.prepare(v) for v in value) if type(value) in (tuple, list) else tuple(
                self.prepare(v) for v in value)
        if isinstance(value, Mapping):
            return {k: self.prepare(v) for k, v in value.items()}
        return value


def compile_select(text: str, field: str) -> Index | None:
    """A selection's index, or None for none; InvalidArgument naming ``field``."""
    if not text:
        return None
    try:
        return parse_selection(text)
    except SelectionError as exc:
        raise InvalidArgument(f"{field}: {exc}") from None


def compile_cast(dtype: int, field: str) -> torch.dtype | None:
    """The floating dtype captures are cast to, or None to keep theirs; InvalidArgument
    naming ``field`` for a dtype that is not a float cast."""
    if not dtype:
        return None
    cast = _CASTS.get(dtype)  # type: ignore[call-overload]
    if cast is None:
        raise InvalidArgument(
            f"{field}: {codec.dtype_name(dtype)} is not one of DTYPE_FLOAT16, DTYPE_BFLOAT16, DTYPE_FLOAT32"
        )
    return cast


def summarize(t: torch.Tensor, bins: int = 0) -> tensor_pb2.TensorSummary:
    """Statistics of ``t``, computed by torch in float64 on the tensor's device."""
    msg = tensor_pb2.TensorSummary(
        dtype=codec.wire_dtype_of(t.dtype), shape=list(t.shape), numel=t.numel()
    )
    x = t.detach().to(torch.float64)
    if x.numel() == 0:
        msg.min = msg.max = msg.mean = msg.std = math.nan
        msg.l2_norm = 0.0
        return msg
    # The statistics stacked on the tensor's device and read in one transfer: on a GPU each
    # .item() is a synchronization with the device (seven of them per summary before).
    stats = torch.stack([
        x.min(), x.max(), x.mean(), x.std() if x.numel() > 1 else x.new_tensor(math.nan),
        torch.linalg.vector_norm(x), torch.isnan(x).sum(dtype=torch.float64), torch.isinf(x).sum(dtype=torch.float64),
    ]).tolist()
    msg.min, msg.max, msg.mean, msg.std, msg.l2_norm = stats[:5]
    msg.nan_count, msg.inf_count = int(stats[5]), int(stats[6])
    if bins:
        finite = x[torch.isfinite(x)]
        if finite.numel():
            lo, hi = torch.stack([finite.min(), finite.max()]).tolist()
            msg.histogram_min, msg.histogram_max = lo, hi
            counts = torch.histc(finite, bins=bins, min=lo, max=hi) if hi > lo else None
            if counts is None:  # all equal: everything in the first bin
                msg.histogram.extend([finite.numel()] + [0] * (bins - 1))
            else:
                msg.histogram.extend(int(c) for c in counts.tolist())
    return msg


class Sampler:
    """Decides which firings of a hook send an event. One per hook; worker thread only.

    ``every_n`` counts the firings of each module (and phase) of the hook on its own,
    so a hook on several modules samples each of them evenly; the probability draw
    and ``max_events`` are per hook.
    """

    def __init__(self, sampling: hook_pb2.Sampling) -> None:
        self.every_n = max(1, sampling.every_n)
        self.probability = sampling.probability if sampling.HasField("probability") else None
        self.max_events = sampling.max_events
        self._rng = random.Random(sampling.seed)
        self._firings: dict[tuple[str, int], int] = {}
        self._sent = 0

    @classmethod
    def compile(cls, sampling: hook_pb2.Sampling) -> Sampler | None:
        """A sampler, or None when every firing sends; InvalidArgument for bad values."""
        if sampling.HasField("probability") and not 0.0 <= sampling.probability <= 1.0:
            raise InvalidArgument(f"sampling.probability: {sampling.probability} is not in [0, 1]")
        if sampling.every_n <= 1 and not sampling.HasField("probability") and not sampling.max_events:
            return None
        return cls(sampling)

    def state(self) -> tuple[Any, ...]:
        """What ``take`` changes, for ``restore`` (a failed shared pass is undone)."""
        return dict(self._firings), self._sent, self._rng.getstate()

    def restore(self, state: tuple[Any, ...]) -> None:
        firings, self._sent, rng = state
        self._firings = dict(firings)
        self._rng.setstate(rng)

    def take(self, module: str, phase: int) -> bool:
        """Whether this firing of ``module`` in ``phase`` sends (and counts it)."""
        key = (module, phase)
        index = self._firings.get(key, 0)
        self._firings[key] = index + 1
        if self.max_events and self._sent >= self.max_events:
            return False
        if index % self.every_n:
            return False
        if self.probability is not None and self._rng.random() >= self.probability:
            return False
        self._sent += 1
        return True
