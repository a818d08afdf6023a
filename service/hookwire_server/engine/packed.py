"""The packed layout: every call's tokens side by side along one token dimension, as
paged-KV engines lay out a step (vLLM's model runner: ``[tokens, hidden]``, no batch
dimension, no padding), and what each call's hooks see of it.

A ``PackedBatch`` is a ``batching.Batch`` whose calls' rows are token ranges of the
packed dimension (``PackedSegment.spans``: one ``(start, stop)`` per sequence of the
call). Whatever the engine packed, a hook of a call sees that call's rows in the layout
the call alone has on the torch engine: ``[sequences, tokens, ...]``, each sequence
padded with zeros to the call's longest, on the left for a Generate prompt step (later
decoding steps have one token per sequence), on the right for an Infer or harvest
prompt pass, as their inputs are padded. A rule's
``index`` counts positions in that layout; what it writes goes back to the packed
tensor at the call's own token positions only, so pad positions are never edited and a
rule never reaches another call's tokens. Even a call alone in a pass is translated
(the packed tensor is never its layout), so ``direct`` is False.

Engines that pack choose the token dimension: 0 for ``[tokens, hidden]``; 1 for a
transformers model run on ``[1, tokens]`` with a block-diagonal mask (dimensions before
the token dimension must have size 1 and are dropped in a call's view).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from ..errors import InvalidArgument
from .batching import Batch, Segment, Unsplittable, _map

if TYPE_CHECKING:
    from ..hooks.passes import Pass


class _Hidden(Exception):
    """A tensor of a shared pass that cannot rerun, not laid out by tokens: hidden."""


@dataclasses.dataclass
class PackedSegment(Segment):
    """One call's token ranges in a packed pass: ``spans[i]`` is sequence i's tokens
    along the packed dimension (``start``/``stop`` bound them all)."""

    spans: tuple[tuple[int, int], ...] = ()
    #: Each sequence's row in a tensor laid out by sequence (one row per sequence of the
    #: pass: vLLM's logits, of each sequence's last position), or -1 where the sequence
    #: is not in the pass (it finished).
    rows: tuple[int, ...] = ()
    #: Where a shorter sequence's padding goes in the call's layout: "left" (a prompt
    #: step of Generate: each sequence ends at the last position) or "right" (a prompt
    #: pass of Infer or harvest, whose inputs are padded on the right).
    side: str = "left"

    @classmethod
    def of(cls, p: Pass, spans: list[tuple[int, int]], side: str = "left", width: int | None = None,
           rows: list[int] | None = None) -> PackedSegment:
        """``width``: the call's layout length when it is longer than its longest sequence
        (an Infer call's inputs padded past it); None: the longest sequence's. ``rows``:
        each sequence's row in tensors laid out by sequence (see ``rows``)."""
        return cls(p, spans[0][0], spans[-1][1], width, spans=tuple(spans), side=side, rows=tuple(rows or ()))

    def at(self, i: int, width: int) -> slice:
        """Where sequence i's tokens are in the call's layout of ``width`` positions."""
        a, b = self.spans[i]
        return slice(width - (b - a), width) if self.side == "left" else slice(0, b - a)

    @property
    def width(self) -> int:
        """The call's layout length: its longest sequence here (or the width it was given)."""
        return max([b - a for a, b in self.spans] + [self.length or 0])


class PackedBatch(Batch):
    """The calls of one packed pass (see the module docstring)."""

    def __init__(self, segments: list[PackedSegment], *, dim: int, tokens: int, rerun: bool = True) -> None:
        super().__init__(list(segments), dim=dim)
        #: Whether a shared pass that fails can run again call by call (the test engine's
        #: passes can; a vLLM step cannot): if not, a tensor that is not laid out by tokens
        #: (vLLM's logits: one row per request) is hidden from each call (None), never
        #: shown whole, so no call sees another's rows.
        self.rerun = rerun
        #: Sequences in the pass: a tensor with this many rows (and not ``tokens``) is laid
        #: out by sequence, one row each (0: none is).
        self.sequences = 0
        #: Calls a hook failed for in a pass that cannot rerun: id(Pass) -> (Pass, error).
        self.failures: dict[int, tuple[Pass, BaseException]] = {}
        #: Tokens along the packed dimension (a tensor of another size there is not the
        #: call's rows: Unsplittable in a shared pass, left as it is for a call alone).
        self.tokens = tokens
        self.rows = tokens
        self.direct = False

    def fail_call(self, p: Pass, exc: BaseException) -> bool:
        """In a pass that cannot rerun, a hook's failure is kept for its call (which the
        engine fails after the step) and the pass goes on for the others: an exception
        out of a vLLM step would leave every request of the step stuck."""
        if self.rerun:
            return False
        self.failures.setdefault(id(p), (p, exc))
        return True

    def _by_sequence(self, x: torch.Tensor) -> bool:
        """Whether ``x`` has one row per sequence of the pass (and is not by tokens)."""
        dim = self.dim
        return (bool(self.sequences) and x.dim() > dim and x.shape[dim] == self.sequences
                and x.shape[dim] != self.tokens and all(n == 1 for n in x.shape[:dim]))

    def _check(self, x: torch.Tensor, where: str) -> bool:
        """Whether ``x`` is laid out by tokens (else: not the calls' rows)."""
        dim = self.dim
        if x.dim() <= dim or x.shape[dim] != self.tokens or any(n != 1 for n in x.shape[:dim]):
            if not self.shared:
                return False  # a call alone: a tensor not by tokens is the call's own (e.g. a cache)
            if not self.rerun:
                raise _Hidden
            size = "no token dimension" if x.dim() <= dim else f"{x.shape[dim]} along dimension {dim}"
            raise Unsplittable(
                f"{where}: a tensor of shape {list(x.shape)} has {size}, but the packed pass has {self.tokens} tokens: "
                "it cannot be split per call"
            )
        return True

    def _view(self, x: torch.Tensor, seg: PackedSegment) -> torch.Tensor:
        flat = x.reshape(x.shape[self.dim:])  # the leading size-1 dimensions dropped
        spans, width = seg.spans, seg.width
        a0 = spans[0][0]
        if all(b - a == width for a, b in spans) and all(s[0] == a0 + i * width for i, s in enumerate(spans)):
            return flat[a0:a0 + len(spans) * width].view(len(spans), width, *flat.shape[1:])  # no copy
        out = flat.new_zeros((len(spans), width, *flat.shape[1:]))
        for i, (a, b) in enumerate(spans):
            out[i, seg.at(i, width)] = flat[a:b]
        return out

    def take(self, value: Any, seg: Segment, where: str) -> Any:
        """``value`` with each packed tensor laid out as ``[sequences, tokens, ...]`` for the
        call (a view when its sequences are equally long, else a zero-padded copy)."""
        assert isinstance(seg, PackedSegment)

        def view(x: torch.Tensor) -> Any:
            if seg.rows and self._by_sequence(x):  # [sequences, 1, ...]: each sequence's row
                flat = x.reshape(x.shape[self.dim:])
                out = flat.new_zeros((len(seg.rows), 1, *flat.shape[1:]))
                for i, row in enumerate(seg.rows):
                    if row >= 0:
                        out[i, 0] = flat[row]
                return out
            try:
                return self._view(x, seg) if self._check(x, where) else x
            except _Hidden:
                return None
        return _map(value, view)

    def put(self, full: Any, before: Any, after: Any, seg: Segment, where: str, cloned: set[int]) -> Any:
        """``full`` with the call's own token positions replaced where the rules changed
        them (pad positions of the call's layout are dropped)."""
        assert isinstance(seg, PackedSegment)
        if isinstance(full, torch.Tensor) and before is None:
            return full  # hidden from the call (see rerun): nothing of it is the call's to edit
        if (isinstance(full, torch.Tensor) and isinstance(after, torch.Tensor) and after is not before
                and seg.rows and self._by_sequence(full)):
            target = full if id(full) in cloned else full.clone()
            cloned.add(id(target))
            flat = target.view(target.shape[self.dim:])
            for i, row in enumerate(seg.rows):
                if row >= 0:
                    flat[row] = after[i, 0]
            return target
        if isinstance(full, torch.Tensor) and isinstance(after, torch.Tensor) and after is not before:
            if not self._check(full, where):
                return after  # a call alone's own tensor, not laid out by tokens
            width = seg.width
            if tuple(after.shape) != (len(seg.spans), width, *full.shape[self.dim + 1:]):
                raise InvalidArgument(
                    f"{where}: a rule changed the call's rows from shape {[len(seg.spans), width, *full.shape[self.dim + 1:]]} "
                    f"to {list(after.shape)}"
                )
            target = full if id(full) in cloned else full.clone()
            cloned.add(id(target))
            flat = target.view(target.shape[self.dim:])
            for i, (a, b) in enumerate(seg.spans):
                flat[a:b] = after[i, seg.at(i, width)]
            return target
        return super().put(full, before, after, seg, where, cloned)
