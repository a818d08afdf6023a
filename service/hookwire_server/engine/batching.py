"""Batches: one forward pass over the rows of several calls, each call's hooks seeing
only its own rows.

A ``Batch`` is the list of calls (``Segment``: a call's ``Pass`` and its rows along the
model's batch dimension) that one pass runs over; ``ModelHost.current_batch`` holds it
while the pass runs, and every hook that fires walks its segments (hook_record): for
each call the hook applies to, it takes that call's rows (``Batch.take``), runs its
gating, rules and captures on them exactly as for a call running alone, and puts what
its rules changed back into the batch's tensors (``Batch.put``). A call running alone
is a batch of one segment: nothing is sliced, so it computes exactly what it computed
before batching existed.

Token inputs of different lengths are joined by padding them on the right (positions
stay those of the call alone); the padded length is chosen to differ from every
dimension of the model's parameters and its head counts, so that a tensor's token
dimensions are recognised by their size and cut back to each call's own length.

Everything here runs on the model's worker thread, except ``request_key`` (the event
loop: it reads only shapes and dtypes from the request, nothing is decoded).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping
from typing import TYPE_CHECKING, Any, Iterable

import torch

from hookwire.v1 import model_service_pb2, tensor_pb2

from ..hooks.compact import CompactReadouts
from ..hooks.deferred import DeferredCaptures
from ..errors import InvalidArgument
from ..models.batch_settings import KEEPS_LAST_TOKENS, BatchSettings

if TYPE_CHECKING:
    from ..hooks.passes import Pass


class Unsplittable(InvalidArgument):
    """A tensor a hook or the output holds whose size along the batch dimension is not
    the batch's row count: it cannot be cut per call. The batched pass fails with it
    and its calls run again, each alone."""


@dataclasses.dataclass
class Segment:
    """One call's rows in a batch: ``start:stop`` along the batch dimension, and its own
    token length when the batch is padded past it (None: nothing to cut)."""

    p: Pass
    start: int
    stop: int
    length: int | None = None


class Batch:
    """The calls one pass runs over (see the module docstring)."""

    def __init__(
        self, segments: list[Segment], *, dim: int = 0, padded: int | None = None, side: str = "right",
        rows: int | None = None,
    ) -> None:
        self.segments = segments
        self.dim = dim
        #: The padded token length when some call is shorter (its tensors get cut), else None.
        self.padded = padded
        #: Where the padding is: "right" (Infer's token inputs: a call's own tokens come
        #: first) or "left" (a decoding step's keys: a call's own history ends the row).
        self.side = side
        #: The pass's rows: by default up to the last call's, or ``rows`` when rows that
        #: belong to no call of the pass run too (a decoding batch's dummy rows: decode_batch).
        self.rows = rows if rows is not None else (segments[-1].stop if segments else 0)
        #: Whether several calls share the pass (a single call is never sliced).
        self.shared = len(segments) > 1
        #: Whether hooks see the pass's tensors as they are (one call in the model's own
        #: layout); False: each call's rows are taken and put back (take/put), as in a
        #: shared pass, a call among rows that are not its own, or a packed layout (packed.py).
        self.direct = not self.shared and (
            rows is None or (segments[0].start == 0 and segments[0].stop == rows and padded is None))
        #: The hooks that fired in this shared pass, with their state before it (see undo).
        self._ledger: dict[int, tuple[Any, Any]] = {}
        #: Its asynchronous captures whose copies are in flight (deferred.py).
        self.deferred = DeferredCaptures()
        #: Its compact readout events in the making, sent when it ends (hooks.compact).
        self.compact = CompactReadouts()

    def fail_call(self, p: Pass, exc: BaseException) -> bool:
        """A hook failed for one call of this pass: True when the batch keeps the failure
        for that call alone and the pass goes on (a pass that cannot run again, e.g. a
        vLLM step: packed.PackedBatch); False (here): the hook raises, and the pass fails
        (a shared pass then runs its calls again alone)."""
        return False

    def note(self, record: Any) -> None:
        """Remembers a hook's state before its first firing in this pass. Worker thread."""
        if id(record) not in self._ledger:
            self._ledger[id(record)] = (record, record.state())

    def undo(self) -> None:
        """Puts every hook that fired in this failed shared pass back as it was before it
        (counts, sampling budgets and draws), so that its calls, run again alone, fire as if
        it never ran. (A hook a failing rule disabled stays disabled: its notice is out.)"""
        self.deferred.drop()
        self.compact.drop()
        for record, state in self._ledger.values():
            record.restore(state)
        self._ledger.clear()

    @classmethod
    def alone(cls, p: Pass) -> Batch:
        """A pass of one call: its hooks see everything, as they always did."""
        return cls([Segment(p, 0, 0)])

    @property
    def passes(self) -> list[Pass]:
        return [s.p for s in self.segments]

    # ------------------------------------------------------------------ slicing

    def _index(self, x: torch.Tensor, seg: Segment, where: str) -> tuple[slice, ...]:
        dim = self.dim
        if x.dim() <= dim or x.shape[dim] != self.rows:
            size = "no batch dimension" if x.dim() <= dim else f"{x.shape[dim]} rows along dimension {dim}"
            raise Unsplittable(
                f"{where}: a tensor of shape {list(x.shape)} has {size}, but the batch has {self.rows} rows: it cannot "
                "be split per call (set batching = false for this model if its forward makes such tensors)"
            )
        index = [slice(None)] * x.dim()
        index[dim] = slice(seg.start, seg.stop)
        if self.padded is not None and seg.length is not None and seg.length < self.padded:
            own = slice(0, seg.length) if self.side == "right" else slice(self.padded - seg.length, self.padded)
            for d in range(1, x.dim()):
                if d != dim and x.shape[d] == self.padded:
                    index[d] = own
        return tuple(index)

    def take(self, value: Any, seg: Segment, where: str) -> Any:
        """``value`` with each tensor cut to the call's rows (and own length): views, no copies.
        Unsplittable for a tensor without the batch's rows."""
        return _map(value, lambda x: x[self._index(x, seg, where)])

    def put(self, full: Any, before: Any, after: Any, seg: Segment, where: str, cloned: set[int]) -> Any:
        """``full`` with the call's rows replaced where the rules changed them: ``before``
        is what ``take`` gave the rules, ``after`` what they returned (a tensor they did
        not change is the same object). A changed tensor is cloned once per firing
        (``cloned`` holds the clones' ids), then written in place."""
        if isinstance(after, torch.Tensor) or isinstance(full, torch.Tensor):
            if after is before:
                return full
            if not isinstance(full, torch.Tensor) or not isinstance(after, torch.Tensor):
                raise InvalidArgument(f"{where}: a rule replaced a tensor by a {type(after).__name__}")
            index = self._index(full, seg, where)
            target = full if id(full) in cloned else full.clone()
            cloned.add(id(target))
            if tuple(target[index].shape) != tuple(after.shape):
                raise InvalidArgument(
                    f"{where}: a rule changed the call's rows from shape {list(target[index].shape)} to {list(after.shape)}"
                )
            target[index] = after
            return target
        if after is before:
            return full
        if isinstance(full, Mapping):
            out: Any = dict(full) if type(full) is dict else _copy_mapping(full)
            for key in full:
                out[key] = self.put(full[key], before[key], after[key], seg, where, cloned)
            return out
        if isinstance(full, (tuple, list)):
            items = [self.put(f, b, a, seg, where, cloned) for f, b, a in zip(full, before, after)]
            return _rebuild(full, items)
        return full

    def split(self, value: Any, where: str) -> list[Any]:
        """``value`` cut per call (the output of a pass); Unsplittable as ``take``."""
        return [self.take(value, seg, where) for seg in self.segments]


def _copy_mapping(value: Mapping[str, Any]) -> Any:
    import copy

    return copy.copy(value)


def _rebuild(value: Any, items: list[Any]) -> Any:
    if isinstance(value, list):
        return items
    if type(value) is tuple:
        return tuple(items)
    return type(value)(*items)  # a namedtuple


def _map(value: Any, fn: Any) -> Any:
    """``value`` with fn applied to every tensor in it, containers rebuilt alike; other
    leaves (None, numbers, a KV cache object) are kept as they are."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, Mapping):
        new = {k: _map(v, fn) for k, v in value.items()}
        if type(value) is dict:
            return new
        out = _copy_mapping(value)
        for k, v in new.items():
            out[k] = v
        return out
    if isinstance(value, (tuple, list)):
        return _rebuild(value, [_map(v, fn) for v in value])
    return value


# ---------------------------------------------------------------------- joining inputs


@dataclasses.dataclass(frozen=True)
class Shape:
    """What decides whether an Infer request joins others: its key (equal keys join),
    its rows, and its token length when it may be padded (None: equal shapes only)."""

    key: Hashable
    rows: int
    length: int | None
    #: Every size of its tensors' other dimensions (a pass's row total avoids them).
    sizes: frozenset[int] = frozenset()


def request_key(request: model_service_pb2.InferRequest, settings: BatchSettings) -> Shape | None:
    """The batching shape of a request of plain arguments (tensors and scalars), read
    from dtypes and shapes only; None when it must run alone (lists or maps among its
    arguments, a reducing input, tensors without a common row count)."""
    dim = settings.batch_dim
    if any(name in request.kwargs for name in settings.reducing_inputs):
        return None
    named: list[tuple[str, Any]] = [(str(i), v) for i, v in enumerate(request.args)]
    named += sorted(request.kwargs.items())
    length = _token_length(request, settings)
    rows: int | None = None
    sizes: set[int] = set()
    key: list[Hashable] = [len(request.args)]
    for name, value in named:
        kind = value.WhichOneof("kind")
        if kind == "tensor":
            t = value.tensor
            shape = list(t.shape)
            if len(shape) <= dim or t.chunk_id:
                return None
            if rows is None:
                rows = shape[dim]
            elif shape[dim] != rows:
                return None
            shape[dim] = -1
            sizes.update(n for n in shape if n >= 0)
            if length is not None and len(shape) >= 2 and shape[1] == length:
                shape[1] = -2  # a token dimension: padded when joined
            key.append((name, t.dtype, tuple(shape)))
        elif kind in ("list", "map", "summary"):
            return None
        else:
            key.append((name, kind, getattr(value, kind) if kind is not None else None))
    if rows is None or rows == 0:
        return None
    return Shape(tuple(key), rows, length, frozenset(sizes))


_INTEGER_DTYPES = frozenset({
    tensor_pb2.DTYPE_INT64, tensor_pb2.DTYPE_INT32, tensor_pb2.DTYPE_INT16, tensor_pb2.DTYPE_INT8, tensor_pb2.DTYPE_UINT8,
})


def _token_length(request: model_service_pb2.InferRequest, settings: BatchSettings) -> int | None:
    """The token length of a request that may be padded: integer ``input_ids`` (the
    keyword, or the first argument) and a 2-D ``attention_mask`` of the same shape, a
    known pad token, batch dimension 0. None otherwise."""
    if settings.pad_token_id is None or settings.batch_dim != 0 or not settings.padding:
        return None
    if any(name in request.kwargs for name in KEEPS_LAST_TOKENS):
        return None  # it keeps the last positions: padding would put pads there
    mask = request.kwargs.get("attention_mask")
    if "input_ids" in request.kwargs:
        ids = request.kwargs["input_ids"]
    elif request.args:
        ids = request.args[0]
    else:
        return None
    if mask is None or mask.WhichOneof("kind") != "tensor" or ids.WhichOneof("kind") != "tensor":
        return None
    if ids.tensor.dtype not in _INTEGER_DTYPES or len(ids.tensor.shape) != 2:
        return None
    if list(mask.tensor.shape) != list(ids.tensor.shape) or ids.tensor.shape[1] < 1:
        return None
    return int(ids.tensor.shape[1])


def padded_length(lengths: Iterable[int], avoid: frozenset[int], limit: int | None) -> int | None:
    """The length calls of ``lengths`` are padded to: the longest, raised past any size
    in ``avoid`` (the model's own dimensions, so token dimensions stay recognisable);
    None when that passes ``limit`` (the model's positions)."""
    length = max(lengths)
    while length in avoid:
        length += 1
    if limit is not None and length > limit:
        return None
    return length


def join_inputs(
    calls: list[tuple[list[Any], dict[str, Any]]], lengths: list[int | None], *, dim: int, padded: int | None,
    pad_token_id: int | None,
) -> tuple[list[Any], dict[str, Any]]:
    """The calls' decoded inputs stacked along ``dim`` (their keys are equal); with
    ``padded``, each call's token tensors (size ``length`` in dimension 1) padded on the
    right to it: ``input_ids`` (the keyword, or the first argument) with the pad token,
    the others (attention mask, token type ids, ...) with 0."""

    def pad(x: torch.Tensor, length: int | None, is_ids: bool) -> torch.Tensor:
        if padded is None or length is None or length == padded or x.dim() < 2 or x.shape[1] != length:
            return x
        value = pad_token_id if is_ids and pad_token_id is not None else 0
        extra = torch.full((x.shape[0], padded - length, *x.shape[2:]), value, dtype=x.dtype, device=x.device)
        return torch.cat([x, extra], dim=1)

    first_args, first_kwargs = calls[0]
    ids_kw = "input_ids" in first_kwargs
    args = []
    for i, value in enumerate(first_args):
        if isinstance(value, torch.Tensor):
            parts = [pad(c[0][i], n, i == 0 and not ids_kw) for c, n in zip(calls, lengths)]
            args.append(torch.cat(parts, dim=dim))
        else:
            args.append(value)
    kwargs = {}
    for key, value in first_kwargs.items():
        if isinstance(value, torch.Tensor):
            parts = [pad(c[1][key], n, key == "input_ids") for c, n in zip(calls, lengths)]
            kwargs[key] = torch.cat(parts, dim=dim)
        else:
            kwargs[key] = value
    return args, kwargs


