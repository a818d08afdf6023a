"""Session slots: tensors kept between calls (activation patching).

A slot lives where it was last saved: in the server (the torch engine, vLLM in this
process, or a vLLM step whose hooks ran here), or on a vLLM model's ranks, where a save
in a worker's step leaves it (``SlotHome``: engine.vllm_runtime.WorkerSlots). The session's
store knows every slot either way (its name, dtype, shape, the bytes it holds against
``max_slot_bytes``) and moves a slot to where it is used: a step on the ranks that
patches a slot held here takes it with its plan, and a patch here of a slot on the ranks
reads it back first. Reading one (GetSlot) reads it where it lives; freeing the session
frees every rank's copy.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from typing import Protocol

import torch

from hookwire.wire import codec
from hookwire.v1 import hook_service_pb2

from ..errors import NotFound
from ..limits import Limits, exceeded

DEFAULT_MAX_SLOT_BYTES = Limits.max_slot_bytes  # one default, in limits.py

log = logging.getLogger("hookwire.slots")

_stores = itertools.count(1)


class SlotHome(Protocol):
    """Where a store's slots may live outside the server: one vLLM model's ranks."""

    #: For messages ("model 'x''s vLLM workers").
    label: str
    #: The copies of each slot it holds (one per rank): each counts against the quota.
    copies: int

    def read(self, key: str, name: str) -> torch.Tensor:
        """The slot as the first rank holds it, on the host (blocks while the model
        steps; FailedPrecondition where it cannot wait: NotFound when it is not there)."""
        ...

    def discard(self, key: str, names: list[str] | None) -> None:
        """Frees the ranks' copies of ``names`` of store ``key`` (None: all of them) at the
        latest before the ranks' next step with hooks (never blocks)."""
        ...


@dataclasses.dataclass(frozen=True)
class PlacedSlot:
    """A slot that lives on ``home``: what the server knows of it."""

    home: SlotHome
    dtype: torch.dtype
    shape: tuple[int, ...]
    #: One copy's bytes (each of the home's copies counts).
    nbytes: int


@dataclasses.dataclass(frozen=True)
class SlotInfo:
    """A slot as ListSlots describes it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    #: Where it lives ("" for the server).
    home: str


class SlotStore:
    """A session's named tensors, bounded in total bytes (each rank's copy counting).
    Written from model worker threads and vLLM's link threads, read from the event loop:
    every access holds the lock."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_SLOT_BYTES) -> None:
        self.max_bytes = max_bytes
        #: The ranks' name for this store (never reused: a new session of the same id
        #: is another store).
        self.key = f"s{next(_stores)}"
        self._lock = threading.Lock()
        self._slots: dict[str, torch.Tensor | PlacedSlot] = {}
        self._bytes = 0
        #: Copies of slots on other devices or in other dtypes (get_as), dropped with the slot.
        self._moved: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}
        self._closed = False
        #: The homes that keep a store of this session's (they free it when it ends).
        self._homes: dict[int, SlotHome] = {}

    @staticmethod
    def _size(entry: torch.Tensor | PlacedSlot | None) -> int:
        if entry is None:
            return 0
        if isinstance(entry, PlacedSlot):
            return entry.nbytes * entry.home.copies
        return entry.numel() * entry.element_size()

    def _check(self, name: str, size: int, total: int) -> None:
        if total > self.max_bytes:
            raise exceeded(
                f"slot {name!r}", f"saving {size} bytes would put the session's slots at {total} bytes",
                self.max_bytes, "max_slot_bytes",
            )

    def _replace(self, name: str, entry: torch.Tensor | PlacedSlot | None) -> None:
        """Puts ``entry`` under ``name`` (lock held); a copy on another home is freed there."""
        old = self._slots.pop(name, None)
        self._bytes -= self._size(old)
        if entry is not None:
            self._slots[name] = entry
            self._bytes += self._size(entry)
        self._drop_moved(name)
        if isinstance(old, PlacedSlot) and not (isinstance(entry, PlacedSlot) and entry.home is old.home):
            old.home.discard(self.key, [name])

    def save(self, name: str, tensor: torch.Tensor) -> None:
        """Stores a detached copy under ``name`` (replacing it); ResourceExhausted past the bound."""
        size = tensor.numel() * tensor.element_size()
        with self._lock:
            self._check(name, size, self._bytes - self._size(self._slots.get(name)) + size)
            self._replace(name, tensor.detach().clone())

    def remove(self, name: str) -> None:
        """Frees ``name`` here only (a rank's copy the front no longer counts)."""
        with self._lock:
            self._bytes -= self._size(self._slots.pop(name, None))
            self._drop_moved(name)

    def visited(self, home: SlotHome) -> None:
        """``home`` keeps this session's slots (even none yet): it is told when the session ends."""
        with self._lock:
            self._homes[id(home)] = home

    def place(self, name: str, home: SlotHome, dtype: torch.dtype, shape: tuple[int, ...], nbytes: int) -> bool:
        """A save on ``home``'s ranks (they checked the bound: ``budget_for``): the slot now
        lives there. False (the copies are freed) when the session ended meanwhile."""
        with self._lock:
            if not self._closed:
                self._replace(name, PlacedSlot(home, dtype, tuple(shape), int(nbytes)))
                return True
        home.discard(self.key, [name])
        return False

    def budget_for(self, home: SlotHome) -> int:
        """The bytes one of ``home``'s ranks may hold for this session: the bound less
        what lives elsewhere, shared by its copies."""
        with self._lock:
            elsewhere = sum(self._size(e) for e in self._slots.values()
                            if not (isinstance(e, PlacedSlot) and e.home is home))
        return max(0, self.max_bytes - elsewhere) // max(1, home.copies)

    def ship_to(self, home: SlotHome, names: set[str]) -> tuple[list[tuple[str, torch.Tensor]], list[str]]:
        """For a step on ``home``'s ranks whose hooks patch ``names``: those held here, which
        the caller sends with the step's plan (then ``moved_to``), and those that cannot
        go: living on another home, or whose copies on every rank would pass the bound
        (the step's hooks then run in the server)."""
        out: list[tuple[str, torch.Tensor]] = []
        blocked: list[str] = []
        with self._lock:
            total = self._bytes
            for name, entry in self._slots.items():
                if name not in names:
                    continue
                if isinstance(entry, PlacedSlot):
                    if entry.home is not home:
                        blocked.append(name)
                    continue
                size = entry.numel() * entry.element_size()
                total += size * (home.copies - 1)
                out.append((name, entry))
            if total > self.max_bytes:
                blocked.extend(name for name, _ in out)
        return out, blocked

    def moved_to(self, name: str, tensor: torch.Tensor, home: SlotHome) -> None:
        """``tensor`` (held in ``name``) was sent to ``home``'s ranks: it lives there now
        (unless it was saved again meanwhile)."""
        with self._lock:
            if self._slots.get(name) is tensor:
                self._replace(name, PlacedSlot(home, tensor.dtype, tuple(tensor.shape),
                                               tensor.numel() * tensor.element_size()))
                return
        home.discard(self.key, [name])  # saved again meanwhile: the copy sent is not the slot

    def homes(self) -> dict[str, SlotHome]:
        """The home of each slot that lives outside the server, by name."""
        with self._lock:
            return {n: e.home for n, e in self._slots.items() if isinstance(e, PlacedSlot)}

    def placed_on(self, home: SlotHome) -> list[str]:
        """The names of the slots living on ``home``."""
        with self._lock:
            return sorted(n for n, e in self._slots.items() if isinstance(e, PlacedSlot) and e.home is home)

    def restore(self, name: str, tensor: torch.Tensor | None, home: SlotHome) -> None:
        """A slot read back from ``home`` (its ranks freed it): it lives here again. None:
        the ranks did not have it (it is forgotten)."""
        with self._lock:
            entry = self._slots.get(name)
            if isinstance(entry, PlacedSlot) and entry.home is home:
                self._bytes -= self._size(entry)
                del self._slots[name]
                if tensor is not None:
                    self._slots[name] = tensor
                    self._bytes += self._size(tensor)

    def forget_home(self, home: SlotHome, why: str) -> None:
        """``home`` is gone (its model failed): the slots that lived there are lost."""
        with self._lock:
            lost = [n for n, e in self._slots.items() if isinstance(e, PlacedSlot) and e.home is home]
            for name in lost:
                self._bytes -= self._size(self._slots.pop(name))
        if lost:
            log.warning("slots %s of a session were lost: %s", ", ".join(map(repr, lost)), why)

    def get(self, name: str) -> torch.Tensor | None:
        """The tensor in ``name``, or None; a slot on a vLLM model's ranks is read back
        first and lives here from then on (blocks while that model steps)."""
        with self._lock:
            entry = self._slots.get(name)
        if not isinstance(entry, PlacedSlot):
            return entry
        try:
            tensor = entry.home.read(self.key, name)
        except NotFound:
            self._taken_back(name, entry, None)  # the ranks no longer hold it: it is empty
            return None
        return self._taken_back(name, entry, tensor)

    def _taken_back(self, name: str, entry: PlacedSlot, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """``entry``, read back from its home as ``tensor``, lives here now and its copies
        there go, unless it was saved again meanwhile (then the newer one stands)."""
        with self._lock:
            current = self._slots.get(name)
            if current is not entry:
                return current if isinstance(current, torch.Tensor) else tensor
            self._bytes -= self._size(entry)
            del self._slots[name]
            if tensor is not None:
                self._slots[name] = tensor
                self._bytes += self._size(tensor)
            entry.home.discard(self.key, [name])
        return tensor

    def get_as(self, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """The tensor in ``name`` in ``dtype`` on ``device``, or None when empty. A patch
        into a module on another device than the save (a device map) moves the slot once,
        not on every firing: the moved copy is kept until the slot is saved again or
        freed. It is not counted against ``max_bytes`` (it lives on the patching device,
        one per device and dtype)."""
        key = (name, dtype, device)
        tensor = self.get(name)
        if tensor is None or (tensor.dtype == dtype and tensor.device == device):
            return tensor
        with self._lock:
            moved = self._moved.get(key)
        if moved is not None:
            return moved
        # Moved outside the lock (the event loop takes it to list slots); only the model's
        # worker thread patches, so nobody else moves this slot meanwhile.
        moved = tensor.to(dtype=dtype, device=device)
        with self._lock:
            if self._slots.get(name) is tensor:  # not saved again meanwhile (from another model's thread)
                self._moved[key] = moved
        return moved

    def _drop_moved(self, name: str) -> None:
        for key in [k for k in self._moved if k[0] == name]:
            del self._moved[key]

    def require(self, name: str) -> torch.Tensor:
        """The tensor in ``name``; NotFound when empty."""
        tensor = self.get(name)
        if tensor is None:
            raise NotFound(f"no slot {name!r} in this session")
        return tensor

    def read(self, name: str) -> torch.Tensor:
        """GetSlot: the tensor in ``name`` where it lives (a slot on a vLLM model's ranks is
        read from its first rank and stays there; blocks while that model steps);
        NotFound when empty."""
        with self._lock:
            entry = self._slots.get(name)
        if entry is None:
            raise NotFound(f"no slot {name!r} in this session")
        if isinstance(entry, PlacedSlot):
            try:
                return entry.home.read(self.key, name)
            except NotFound:
                self._taken_back(name, entry, None)  # the ranks no longer hold it: forgotten
                raise
        return entry

    def describe(self) -> list[SlotInfo]:
        """Every slot, by name (ListSlots: nothing is read)."""
        with self._lock:
            items = sorted(self._slots.items())
        out = []
        for name, entry in items:
            if isinstance(entry, PlacedSlot):
                out.append(SlotInfo(name, entry.dtype, entry.shape, entry.nbytes, entry.home.label))
            else:
                out.append(SlotInfo(name, entry.dtype, tuple(entry.shape), entry.numel() * entry.element_size(), ""))
        return out

    def items(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) pairs of the slots held here, by name."""
        with self._lock:
            return sorted((n, e) for n, e in self._slots.items() if isinstance(e, torch.Tensor))

    @property
    def total_bytes(self) -> int:
        """Bytes held (each rank's copy of a slot on a vLLM model's ranks counts)."""
        with self._lock:
            return self._bytes

    def clear(self) -> None:
        """Frees every slot, and every rank's copy (the session ended)."""
        with self._lock:
            homes = {**self._homes, **{id(e.home): e.home for e in self._slots.values() if isinstance(e, PlacedSlot)}}
            self._slots.clear()
            self._moved.clear()
            self._bytes = 0
            self._closed = True
        for home in homes.values():
            home.discard(self.key, None)


def slot_to_proto(info: SlotInfo, tensor: torch.Tensor | None = None) -> hook_service_pb2.Slot:
    """A slot as the wire describes it (with its data for GetSlot: ``tensor``)."""
    msg = hook_service_pb2.Slot(
        name=info.name, dtype=codec.wire_dtype_of(info.dtype), shape=list(info.shape), nbytes=info.nbytes,
    )
    if tensor is not None:
        codec.encode_tensor_into(tensor, msg.tensor)
    return msg


def info_of(name: str, tensor: torch.Tensor) -> SlotInfo:
    """A tensor read from a slot, described."""
    return SlotInfo(name, tensor.dtype, tuple(tensor.shape), tensor.numel() * tensor.element_size(), "")
