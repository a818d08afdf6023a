"""Session slots: tensors kept on the server between Infer calls (activation patching)."""

from __future__ import annotations

import threading

import torch

from hookwire.wire import codec
from hookwire.v1 import hook_service_pb2

from ..errors import NotFound
from ..limits import Limits, exceeded

DEFAULT_MAX_SLOT_BYTES = Limits.max_slot_bytes  # one default, in limits.py


class SlotStore:
    """A session's named tensors, bounded in total bytes. Written from model worker
    threads, read from the event loop: every access holds the lock."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_SLOT_BYTES) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._slots: dict[str, torch.Tensor] = {}
        self._bytes = 0
        #: Copies of slots on other devices or in other dtypes (get_as), dropped with the slot.
        self._moved: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    @staticmethod
    def _size(tensor: torch.Tensor) -> int:
        return tensor.numel() * tensor.element_size()

    def save(self, name: str, tensor: torch.Tensor) -> None:
        """Stores a detached copy under ``name`` (replacing it); ResourceExhausted past the bound."""
        size = self._size(tensor)
        with self._lock:
            old = self._slots.get(name)
            total = self._bytes - (self._size(old) if old is not None else 0) + size
            if total > self.max_bytes:
                raise exceeded(
                    f"slot {name!r}", f"saving {size} bytes would put the session's slots at {total} bytes",
                    self.max_bytes, "max_slot_bytes",
                )
            self._slots[name] = tensor.detach().clone()
            self._bytes = total
            self._drop_moved(name)

    def get(self, name: str) -> torch.Tensor | None:
        """The tensor in ``name``, or None."""
        with self._lock:
            return self._slots.get(name)

    def get_as(self, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """The tensor in ``name`` in ``dtype`` on ``device``, or None when empty. A patch
        into a module on another device than the save (a device map) moves the slot once,
        not on every firing: the moved copy is kept until the slot is saved again or
        freed. It is not counted against ``max_bytes`` (it lives on the patching device,
        one per device and dtype)."""
        key = (name, dtype, device)
        with self._lock:
            tensor = self._slots.get(name)
            if tensor is None or (tensor.dtype == dtype and tensor.device == device):
                return tensor
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

    def items(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) pairs, by name."""
        with self._lock:
            return sorted(self._slots.items())

    @property
    def total_bytes(self) -> int:
        """Bytes held."""
        with self._lock:
            return self._bytes

    def clear(self) -> None:
        """Frees every slot."""
        with self._lock:
            self._slots.clear()
            self._moved.clear()
            self._bytes = 0


def slot_to_proto(name: str, tensor: torch.Tensor, *, with_data: bool) -> hook_service_pb2.Slot:
    """A slot as the wire describes it (with its data for GetSlot)."""
    msg = hook_service_pb2.Slot(
        name=name, dtype=codec.wire_dtype_of(tensor.dtype), shape=list(tensor.shape),
        nbytes=tensor.numel() * tensor.element_size(),
    )
    if with_data:
        codec.encode_tensor_into(tensor, msg.tensor)
    return msg
