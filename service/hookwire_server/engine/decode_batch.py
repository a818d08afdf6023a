"""The persistent decoding batch of a model (worker thread): the KV cache that Generate
calls share after their prompt pass, with a block of rows per call, which calls join
and leave without the others' rows being copied.

Why not transformers' own cache classes as they are: a ``DynamicCache`` grows by
concatenation, so rows cannot be written into it in place (a call joining would
re-stack every other call, as each joined step did before), and a ``StaticCache``
attends over its whole capacity every step, with one fill level for all rows (a call
that joins late would need its history moved). So the batch keeps, per attention layer,
one preallocated block ``[row capacity, heads, column capacity, head dim]`` and hands
the model a ``DynamicCache`` whose layers (``BlockLayer``, a ``DynamicLayer`` to the
model: full attention, mask sizes from its length) are *views* of the columns in use:
a step writes one new column per row into the block, nothing else is copied. Measured
on tiny-lm (eager attention) and the gpt2-26m bench model (sdpa): logits over such
strided views are bit-equal to those over a contiguous ``DynamicCache`` of the same
content.

Layout, as batched ``generate()`` has it: every row's history ends at the write column
``end`` (padding on the left, masked), so one step writes one column for all rows. A
call joins with its history right-aligned at ``end`` in free rows (a hole a call left,
or new rows at the bottom) and its prompt's mask; a call leaves by freeing its rows
(a hole, masked, computed as a dummy row until a call takes it or the rows below it
go too). The pass attends over the window ``[start, end]``: ``start`` is the earliest
column a member's history begins at, so old columns are dropped by moving a view, and
the window is widened to the left only where hooks need a key length that no model
dimension has (batching.padded_length). Only growth copies: more rows than the block
holds, columns past its capacity, a joining history longer than the columns on the
left (each a reallocation that doubles, so rare).

A call in the batch may sit out a pass (its stream lags; calls of one slots group
never share a batch): its row still runs as a dummy, its column of that pass masked for
good; its hooks then see that masked key among its own. A member that sat out more than
``SIT_OUT_PASSES`` passes in a row, or ``SIT_OUT_COLUMNS`` in all, is evicted (``evict``:
a copy of its own columns, without the masked ones, for a plain cache of its own), so
that its masked columns never hold the window open without bound.

Exactness: logits over the block equal those over a contiguous ``DynamicCache`` of the
same rows bit for bit; calls that arrive together decode bit for bit as batched
``generate()`` while the window is not widened (a longer history joining, or a padded
key length for hooks) and no member sits out a pass. Otherwise the sums run in another
order: equal up to rounding.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .batching import padded_length

#: Free columns left of the first call's history when a batch starts: room for a call
#: with a longer history to join (and for the window to widen) without reallocating.
HEADROOM = 32

#: A member that sat out more passes in a row than this, or more passes in all than
#: ``SIT_OUT_COLUMNS``, is evicted (``lagging``, ``evict``): its masked columns would
#: otherwise hold the window (every row's attention, the block's columns) open without
#: bound, and its hooks would see ever more masked keys.
SIT_OUT_PASSES = 8
SIT_OUT_COLUMNS = 32


class BlockLayer(DynamicLayer):  # type: ignore[misc]  # transformers is untyped
    """One attention layer's keys and values: views of the batch's block (see the
    module docstring). ``update`` writes the pass's new keys at the batch's write
    column and returns the window including them."""

    def __init__(self, batch: DecodeBatch, index: int) -> None:
        super().__init__()
        self._batch = batch
        self._index = index
        self.is_initialized = True
        self.refresh()

    def refresh(self) -> None:
        """Views the window before the pass's column (what get_seq_length counts)."""
        b = self._batch
        self.device = b.keys[self._index].device
        self.keys = b.keys[self._index][:b.rows, :, b.window:b.end]
        self.values = b.values[self._index][:b.rows, :, b.window:b.end]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any,
               ) -> tuple[torch.Tensor, torch.Tensor]:
        b, q = self._batch, int(key_states.shape[-2])
        stop = b.end + q
        b.keys[self._index][:b.rows, :, b.end:stop] = key_states
        b.values[self._index][:b.rows, :, b.end:stop] = value_states
        self.keys = b.keys[self._index][:b.rows, :, b.window:stop]
        self.values = b.values[self._index][:b.rows, :, b.window:stop]
        return self.keys, self.values


@dataclasses.dataclass(eq=False)
class Member:
    """A call's block of rows in a batch."""

    #: The call (a seam.GenerateCall).
    call: Any
    #: Its rows: ``row:row + count``.
    row: int
    count: int
    #: The column its history starts at.
    start: int
    #: Passes it sat out: in a row (since it last stepped), and in all.
    idle: int = 0
    sat_out: int = 0


class DecodeBatch:
    """The persistent batch (see the module docstring). Worker thread only."""

    def __init__(self, model: Any, cache_key: str, plain: dict[str, Any], avoid: frozenset[int], limit: int) -> None:
        self.model = model
        self.cache_key = cache_key
        #: The plain model inputs every member's steps share (logits_to_keep, use_cache, ...).
        self.plain = plain
        #: Sizes a padded key length must avoid (the model's dimensions).
        self.avoid = avoid
        #: Most rows the batch holds (the model's max_batch_size).
        self.limit = limit
        self.members: list[Member] = []
        #: Who holds each row (None: a hole).
        self.owners: list[Member | None] = []
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.mask = torch.zeros((0, 0), dtype=torch.long)
        #: Per row: the position and the input token of its next step.
        self.positions = torch.zeros(0, dtype=torch.long)
        self.last = torch.zeros(0, dtype=torch.long)
        #: The write column, and the first column of the window the next pass attends over.
        self.end = 0
        self.window = 0
        self.cache: Any = None
        #: Set by ``drop``: the error its former members' steps fail with.
        self.broken: Exception | None = None

    @property
    def rows(self) -> int:
        return len(self.owners)

    def has_room(self, count: int) -> bool:
        """Whether a call of ``count`` rows may join: a hole that large, or room below the
        last row up to ``limit`` (holes smaller than it do not add up: a pass never runs
        more than ``limit`` rows)."""
        if not self.members:
            return count <= self.limit
        return self._hole(count) is not None or self.rows + count <= self.limit

    def _hole(self, count: int) -> int | None:
        """The first row of the first run of ``count`` free rows, if any."""
        run = 0
        for r, owner in enumerate(self.owners):
            run = run + 1 if owner is None else 0
            if run == count:
                return r - count + 1
        return None

    def fits(self, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Whether a call's cache (per layer: keys, values ``[rows, heads, length, dim]``)
        has this batch's layer shapes, dtype and device."""
        if not self.keys:
            return True
        if len(layers) != len(self.keys):
            return False
        for (k, v), bk, bv in zip(layers, self.keys, self.values):
            if (k.shape[1], k.shape[3], v.shape[1], v.shape[3]) != (bk.shape[1], bk.shape[3], bv.shape[1], bv.shape[3]):
                return False
            if k.dtype != bk.dtype or k.device != bk.device:
                return False
        return True

    # ---------------------------------------------------------------- join and leave

    def join(self, call: Any, layers: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor,
             last: torch.Tensor, room: int = 0) -> Member:
        """Puts a call's history in the batch: ``layers`` its keys and values per layer
        (``[rows, heads, length, dim]``, its own columns only), ``mask`` its prompt's
        mask over them ``[rows, length]`` (0 on its own left padding), ``last`` the
        token each of its rows feeds its next step. Copies only the call's own data
        (unless the block must grow). ``room``: the rows a new block is made for (the
        calls of a shared prompt pass that join with this one)."""
        count, length = int(mask.shape[0]), int(mask.shape[1])
        if not self.has_room(count):
            raise ValueError(f"no room for {count} rows in the decoding batch (at most {self.limit} rows)")
        if not self.members:
            self._reset(layers, max(count, min(room, self.limit)), length)
        if self.end - length < 0:
            self._reshape(self.mask.shape[0], self.mask.shape[1] + length - self.end + HEADROOM,
                          length - self.end + HEADROOM)
        held = self.rows
        row = self._take_rows(count)
        start = self.end - length
        rows = slice(row, row + count)
        try:
            for i, (k, v) in enumerate(layers):
                # The whole row first: a previous occupant's keys and values stay in its columns
                # otherwise, and a NaN or Inf there leaks through the masked softmax (0 x NaN).
                self.keys[i][rows].zero_()
                self.values[i][rows].zero_()
                self.keys[i][rows, :, start:self.end] = k
                self.values[i][rows, :, start:self.end] = v
            self.mask[rows] = 0
            self.mask[rows, start:self.end] = mask.to(self.mask.device)
            # generate()'s position ids: cumsum(mask) - 1 over the prompt, then +1 a step.
            self.positions[rows] = mask.to(self.positions.device).sum(-1)
            self.last[rows] = last.to(self.last.device)
        except BaseException:  # its rows stay free (masked: they run as holes), new ones go
            self.mask[rows] = 0
            del self.owners[held:]
            raise
        member = Member(call, row, count, start)
        self.members.append(member)
        for r in range(row, row + count):
            self.owners[r] = member
        self.window = min(m.start for m in self.members)
        return member

    def leave(self, member: Member) -> None:
        """Frees a call's rows (nothing is copied: they become a hole, or go if no
        member is below them)."""
        if member not in self.members:
            return
        self.members.remove(member)
        for r in range(member.row, member.row + member.count):
            self.owners[r] = None
        self.mask[member.row:member.row + member.count] = 0
        while self.owners and self.owners[-1] is None:
            self.owners.pop()
        if not self.members:  # nothing to keep: the memory goes too
            self.keys, self.values, self.cache = [], [], None
            self.mask = self.mask[:0, :0]
            self.owners.clear()
            self.end = self.window = 0
            return
        self.window = min(m.start for m in self.members)

    def drop(self, error: Exception) -> None:
        """After a failure that leaves the batch's state unknown (a step that raised past
        its pass): its members' next steps fail with ``error``; its memory goes."""
        self.broken = error
        self.members.clear()
        self.owners.clear()
        self.keys, self.values, self.cache = [], [], None

    def lagging(self) -> list[Member]:
        """Members that sat out too many passes (SIT_OUT_PASSES in a row, SIT_OUT_COLUMNS in all)."""
        return [m for m in self.members if m.idle > SIT_OUT_PASSES or m.sat_out > SIT_OUT_COLUMNS]

    def evict(self, member: Member) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor]:
        """Takes a member out of the batch with a copy of its own history: per layer its
        keys and values ``[rows, heads, length, dim]`` over the columns any of its rows
        attends to (without the masked columns of the passes it sat out, nor those left
        of its history), its mask over them, and its rows' next positions. Its rows
        leave (``leave``)."""
        rows = slice(member.row, member.row + member.count)
        own = self.mask[rows, member.start:self.end].any(0).nonzero().squeeze(-1) + member.start
        layers = [(k[rows].index_select(2, own), v[rows].index_select(2, own)) for k, v in zip(self.keys, self.values)]
        mask = self.mask[rows].index_select(1, own)
        positions = self.positions[rows].clone()
        self.leave(member)
        return layers, mask, positions

    def _reset(self, layers: list[tuple[torch.Tensor, torch.Tensor]], rows: int, length: int) -> None:
        """A new block for the first call(s) to join: ``rows`` rows (calls that join
        later grow it by doubling) and ``HEADROOM`` columns on either side of the history.
        (Made for the rows known to come only: a lone call's first token waits for it.)"""
        columns = HEADROOM + length + HEADROOM
        self.keys = [k.new_zeros((rows, k.shape[1], columns, k.shape[3])) for k, _ in layers]
        self.values = [v.new_zeros((rows, v.shape[1], columns, v.shape[3])) for _, v in layers]
        device = layers[0][0].device
        self.mask = torch.zeros((rows, columns), dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.last = torch.zeros(rows, dtype=torch.long, device=device)
        self.owners = []
        self.end = self.window = HEADROOM + length
        self.cache = DynamicCache()
        self.cache.layers = [BlockLayer(self, i) for i in range(len(layers))]

    def _take_rows(self, count: int) -> int:
        """The first row of ``count`` free rows: the first hole that large, else new
        rows at the bottom (growing the block if full); has_room said there are."""
        hole = self._hole(count)
        if hole is not None:
            return hole
        row = self.rows
        assert row + count <= self.limit
        if row + count > self.mask.shape[0]:
            self._reshape(max(2 * self.mask.shape[0], row + count), self.mask.shape[1], 0)
        self.owners.extend([None] * count)
        return row

    def _reshape(self, rows: int, columns: int, shift: int) -> None:
        """Reallocates the block with ``rows`` x ``columns``, its columns moved right by
        ``shift`` (growth: the only copy of members' rows)."""
        used = slice(0, self.rows)

        def moved(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
            out = t.new_zeros(shape)
            # old column c goes to c + shift; those that fall outside are dropped (left of the window)
            lo, hi = max(0, -shift), min(int(t.shape[-1 if t.dim() == 2 else 2]), columns - shift)
            if t.dim() == 2:
                out[used, lo + shift:hi + shift] = t[used, lo:hi]
            else:
                out[used, :, lo + shift:hi + shift] = t[used, :, lo:hi]
            return out

        # Every new tensor first, then all at once: running out of memory halfway leaves
        # the batch as it was.
        keys = [moved(k, (rows, k.shape[1], columns, k.shape[3])) for k in self.keys]
        values = [moved(v, (rows, v.shape[1], columns, v.shape[3])) for v in self.values]
        mask = moved(self.mask, (rows, columns))
        vectors = {}
        for name in ("positions", "last"):
            old = getattr(self, name)
            new = old.new_zeros(rows)
            new[used] = old[used]
            vectors[name] = new
        self.keys, self.values, self.mask = keys, values, mask
        self.positions, self.last = vectors["positions"], vectors["last"]
        for m in self.members:
            m.start += shift
        self.end += shift
        self.window += shift

    # ---------------------------------------------------------------- a pass

    def prepare(self, stepping: list[Member]) -> tuple[dict[str, Any], int | None, list[int]]:
        """The model inputs of one decoding step of ``stepping`` (members; the others'
        rows run as dummies, their column of this pass masked), the padded key length
        hooks cut to (None: every stepping call attends over the whole window), and
        each stepping member's own key length (its span up to this pass's column)."""
        if self.end + 1 > self.mask.shape[1]:  # columns full: drop those left of the window, double
            keep = self.end - self.window
            self._reshape(self.mask.shape[0], max(2 * (keep + 1), keep + 1 + HEADROOM) + HEADROOM,
                          HEADROOM - self.window)
        end, rows = self.end, self.rows
        spans = [end + 1 - m.start for m in stepping]
        width = end + 1 - self.window
        padded: int | None = None
        if any(span < width for span in spans):  # hooks cut per call: a key length no model dimension has
            padded = padded_length([width], self.avoid | {rows}, None)
            assert padded is not None
            while padded > end + 1:  # no room left of the window to widen it into
                self._reshape(self.mask.shape[0], self.mask.shape[1] + HEADROOM, HEADROOM)
                end = self.end
            self.window = end + 1 - padded
        column = self.mask[:rows, end]
        column.zero_()
        for r, owner in enumerate(self.owners):
            if owner is None:
                column[r] = 1  # a hole attends to its own column: never a row with no key at all
        for m in stepping:
            column[m.row:m.row + m.count] = 1
        for layer in self.cache.layers:
            layer.refresh()
        mask = self.mask[:rows, self.window:end + 1]
        inputs = dict(self.plain)
        inputs["input_ids"] = self.last[:rows, None]
        inputs["position_ids"] = self.positions[:rows, None]
        # As generate(): an all-ones mask is dropped (the model takes the causal path).
        inputs["attention_mask"] = None if bool(mask.all()) else mask
        inputs[self.cache_key] = self.cache
        return inputs, padded, spans

    def advance(self, stepping: list[Member], tokens: list[torch.Tensor]) -> None:
        """After a pass: the write column moves on, each stepping member's rows take
        their next position and input token (``tokens``: per member, per row)."""
        self.end += 1
        for m in self.members:
            if m in stepping:
                m.idle = 0
            else:
                m.idle += 1
                m.sat_out += 1
        for m, chosen in zip(stepping, tokens):
            rows = slice(m.row, m.row + m.count)
            self.positions[rows] += 1
            self.last[rows] = chosen.to(self.last.device)
