"""Named operands (OperandService, issue 25): tensors and sparse autoencoders kept on the
server under a name, which rules and readouts refer to (Tensor.operand, Sae.operand)
instead of carrying them in every request.

- **Once.** An operand is received into preallocated tensors (chunk by chunk), checked
  once (finite floats; an SAE as compile_sae checks an inline one) and kept once, on the
  CPU in the dtype it came in. Rules get that tensor itself; where they need it on another
  device or in another dtype, one copy per (device, dtype) is made from it, on first use,
  and shared by every rule naming it (rules.shared_cast; an SAE's CompiledSae, shared by
  every hook naming it, keeps its casts the same way).
- **Names.** Per principal, plus the operands an operator published from the server's
  operand folder (read-only, everyone's). A caller's own name is looked up first; an
  upload may not take a published name.
- **Lifetime.** An uploaded operand lives with its session or for its TTL; then it
  *ends*: new references are refused, and it is freed once no registered hook or harvest
  job holds it (``used_by``). Deleting one that is held is FAILED_PRECONDITION. A call in
  flight (request-scoped hooks) keeps the tensors it compiled until it ends, without
  holding the name.
- **Quota.** Bytes and count per principal, bytes for the server (Limits), checked from
  the upload's header before any data is received; uploads in progress count, and so
  does an upload that failed (cut short, stalled, refused) until its buffers are freed
  (``_unfreed``): a principal never holds more memory than its quota says.

The store is shared by the event loop (uploads, deletes, lifetimes) and the threads
that compile specs (resolving names): a lock guards its tables.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import json
import logging
import re
import threading
import time
import weakref
from typing import Any, AsyncIterator, Callable, Mapping

import torch

from hookwire.v1 import operand_service_pb2 as op_pb2
from hookwire.v1 import rule_pb2, tensor_pb2
from hookwire.wire import codec
from hookwire.wire import harvest_sources as sources
from hookwire.wire.framing import RawChunk

from .. import limits as limits_mod
from ..auth import Principal
from ..errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, drop_tracebacks
from ..limits import Limits
from ..memory import trim_heap
from .rules import SHARED_CASTS, CompiledSae, OperandSource, all_finite, compile_sae

log = logging.getLogger("hookwire.operands")

#: An operand's name: letters, digits and ``_ - . /``, not starting with ``/`` or ``.``.
NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_./-]*")
#: The Sae message's tensor fields, and SAELens' names for them in sae_weights.safetensors.
SAE_TENSORS = {"w_enc": "W_enc", "b_enc": "b_enc", "w_dec": "W_dec", "b_dec": "b_dec", "threshold": "threshold"}
#: Uploads at least this large give the heap's freed memory back when they are done
#: (memory.trim_heap, on a thread: milliseconds on a large heap).
TRIM_AFTER_BYTES = 16 * 1024 * 1024
#: The largest cfg.json of a published SAE read (a config is a few hundred bytes).
MAX_CONFIG_BYTES = 1 << 20


@dataclasses.dataclass(eq=False)
class StoredOperand:
    """One named operand: its tensors on the CPU (as received), and what holds it."""

    name: str
    #: The principal that uploaded it; "" for a published one.
    owner: str
    #: "tensor" or "sae".
    kind: str
    #: A tensor operand's one tensor under "", an SAE's by Sae field (w_enc, ...).
    tensors: dict[str, torch.Tensor]
    nbytes: int
    #: An SAE's validated form on the CPU (the tensors above, shared).
    sae: CompiledSae | None = None
    #: An SAE's configuration (its Sae message, tensors without data).
    sae_config: rule_pb2.Sae | None = None
    session_id: str = ""
    expires_ns: int = 0
    #: The file or folder a published operand was read from.
    published: str = ""
    #: Its session ended or its TTL passed: freed once ``used_by`` is empty.
    ended: bool = False
    #: Holder id (a hook or harvest job id) -> (what it is, its owner's name).
    used_by: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
    #: Copies vLLM's worker ranks hold (one per rank of each model whose workers run a hook
    #: naming it: engine/vllm_runtime.py): each counts against the quotas as the operand
    #: does. Changed only through its store (``add_rank_copies``), under the store's lock.
    rank_copies: int = 0
    #: The store that holds it (set when it is stored).
    store: OperandStore | None = dataclasses.field(default=None, repr=False, compare=False)
    _timer: asyncio.TimerHandle | None = None

    def add_rank_copies(self, copies: int) -> bool:
        """Counts ``copies`` more (or, negative, fewer) copies of it on vLLM's ranks against
        its owner's quota and the server's; False (nothing counted) when more would pass
        either: its hooks then run in the front."""
        if self.store is None:
            return copies <= 0
        return self.store.add_rank_copies(self, copies)

    @property
    def held_bytes(self) -> int:
        """Its bytes here and on the ranks: what the quotas count."""
        return self.nbytes * (1 + max(0, self.rank_copies))

    @property
    def tensor(self) -> torch.Tensor:
        """A tensor operand's one stored tensor (on the CPU): rules cast it to each
        (device, dtype) they need once, in its shared cache (rules.shared_cast), so a GPU
        model in bfloat16 holds one bfloat16 copy, not a float32 one beside it."""
        return self.tensors[""]

    @property
    def compiled_sae(self) -> CompiledSae:
        """An SAE operand as every rule naming it shares it: its casts per (device, dtype)
        are made once (CompiledSae._on), from the stored tensors."""
        assert self.sae is not None
        return self.sae

    def to_proto(self, viewer: Principal) -> op_pb2.NamedOperand:
        """Its description (no data); ``used_by`` lists the viewer's own holders (all, for an operator)."""
        msg = op_pb2.NamedOperand(
            name=self.name, nbytes=self.nbytes, owner=self.owner, session_id=self.session_id,
            published=bool(self.published), ended=self.ended,
            # list() copies in one step: a spec compiling on a thread may add a holder meanwhile.
            used_by=[what for what, owner in list(self.used_by.values()) if viewer.is_operator or viewer.name == owner],
        )
        if self.kind == "tensor":
            msg.kind = op_pb2.OPERAND_KIND_TENSOR
            t = self.tensors[""]
            msg.tensor.dtype = codec.wire_dtype_of(t.dtype)
            msg.tensor.shape.extend(t.shape)
        else:
            assert self.sae_config is not None
            msg.kind = op_pb2.OPERAND_KIND_SAE
            msg.sae.CopyFrom(self.sae_config)
        if self.expires_ns:
            msg.expires.FromNanoseconds(self.expires_ns)
        return msg


def check_name(name: str, where: str, max_length: int) -> str:
    """``name`` when it is a valid operand name; InvalidArgument naming ``where`` otherwise."""
    if not name:
        raise InvalidArgument(f"{where}: name the operand")
    if len(name.encode()) > max_length:
        raise InvalidArgument(f"{where}: {len(name.encode())} bytes, over the limit of {max_length} (max_name_length)")
    if not NAME.fullmatch(name) or "//" in name:
        raise InvalidArgument(f"{where}: {name!r} is not an operand name (letters, digits and _ - . /, not starting "
                              "with / or .)")
    return name


class _Received(OperandSource):
    """The tensors of an upload's header: inline, or assembled from its chunks."""

    def __init__(self, chunked: Mapping[int, Any]) -> None:
        super().__init__(torch.device("cpu"))
        self._chunked = chunked

    def tensor(self, msg: tensor_pb2.Tensor, where: str) -> torch.Tensor:
        if msg.operand:
            raise InvalidArgument(f"{where}.operand: an upload carries its data, not another operand's name")
        try:
            return codec.decode_tensor(msg, where=where, chunked=self._chunked)  # type: ignore[no-any-return]
        except codec.CodecError as exc:
            raise InvalidArgument(str(exc)) from None


class _Loaded(OperandSource):
    """The tensors of a published SAE, read from its sae_weights.safetensors: compile_sae
    asks for each Sae field (``where`` ends with its name) and checks what it gets."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        super().__init__(torch.device("cpu"))
        self._tensors = tensors

    def tensor(self, msg: tensor_pb2.Tensor, where: str) -> torch.Tensor:
        return self._tensors[SAE_TENSORS[where.rsplit(".", 1)[-1]]]


class OperandStore:
    """Every named operand of the server (see the module docstring)."""

    def __init__(self, limits: Limits, *, root: str | None = None) -> None:
        self.limits = limits
        #: The folder operators publish from (PublishOperand); None: publishing is refused.
        self.root = root
        self._lock = threading.Lock()
        self._own: dict[tuple[str, str], StoredOperand] = {}
        self._published: dict[str, StoredOperand] = {}
        #: Uploads in progress: (owner, name) -> bytes claimed.
        self._uploading: dict[tuple[str, str], int] = {}
        #: The buffers of failed uploads that something still held when the upload ended
        #: (a traceback, a collection not run yet), by (upload, chunk id): (owner, bytes).
        #: They count against the quotas until they are freed; their names are free at once.
        self._unfreed: dict[tuple[int, int], tuple[str, int]] = {}
        #: Keys of ``_unfreed`` whose buffer was freed, appended by its finalizer: that runs
        #: on whichever thread drops the last reference, maybe one holding the lock, so it
        #: only appends (atomic); the lock's holders drain it (``_drain``).
        self._freed: collections.deque[tuple[int, int]] = collections.deque()
        self._uploads = itertools.count()

    # ------------------------------------------------------------------ accounting

    def bytes_of(self, owner: str) -> int:
        """Bytes ``owner``'s operands take, uploads in progress included."""
        with self._lock:
            return self._bytes_of(owner)

    def _bytes_of(self, owner: str) -> int:
        self._drain()
        return (sum(op.held_bytes for (who, _), op in self._own.items() if who == owner)
                + sum(n for (who, _), n in self._uploading.items() if who == owner)
                + sum(n for who, n in self._unfreed.values() if who == owner))

    def _total(self) -> int:
        self._drain()
        return (sum(op.held_bytes for op in self._own.values()) + sum(op.held_bytes for op in self._published.values())
                + sum(self._uploading.values()) + sum(n for _, n in self._unfreed.values()))

    def _drain(self) -> None:
        """Forgets the failed uploads' buffers that were freed; the caller holds the lock."""
        while self._freed:
            self._unfreed.pop(self._freed.popleft(), None)

    def _count_until_freed(self, owner: str, assembler: codec.ChunkAssembler) -> None:
        """A failed upload's buffers count against ``owner``'s quota until they are freed
        (a finalizer on each: what a view of one holds is its base, ``_base``);
        the caller holds the lock."""
        upload = next(self._uploads)
        for chunk_id, tensor in assembler.tensors.items():
            nbytes = tensor.numel() * tensor.element_size()
            if nbytes:
                self._unfreed[(upload, chunk_id)] = (owner, nbytes)
                weakref.finalize(tensor, self._freed.append, (upload, chunk_id)).atexit = False

    def add_rank_copies(self, stored: StoredOperand, copies: int) -> bool:
        """StoredOperand.add_rank_copies."""
        with self._lock:
            if copies > 0:
                more = stored.nbytes * copies
                if self._total() + more > self.limits.max_operand_bytes:
                    return False
                if stored.owner and self._bytes_of(stored.owner) + more > self.limits.max_operand_bytes_per_principal:
                    return False
            stored.rank_copies = max(0, stored.rank_copies + copies)
            return True

    @property
    def total_bytes(self) -> int:
        """Bytes every operand takes (uploads in progress included)."""
        with self._lock:
            return self._total()

    def _admit(self, owner: str, name: str, nbytes: int, *, published: bool) -> None:
        """Checks the name and the quotas for a new operand; the caller holds the lock."""
        if name in self._published or (not published and ((owner, name) in self._own or (owner, name) in self._uploading)):
            what = "a published operand" if name in self._published else "one of your operands"
            raise AlreadyExists(f"name: {name!r} is {what} (delete it first, or choose another name)")
        if published and any(held == name for _, held in list(self._own) + list(self._uploading)):
            # A reference would silently switch to the published one once theirs ends.
            raise AlreadyExists(f"name: {name!r} is a principal's operand (ListOperands shows whose); choose another name")
        total = self._total() + nbytes
        if total > self.limits.max_operand_bytes:
            raise limits_mod.exceeded("the server's operands", f"{total} bytes with this one", self.limits.max_operand_bytes,
                                      "max_operand_bytes")
        if published:
            return
        mine = self._bytes_of(owner) + nbytes
        if mine > self.limits.max_operand_bytes_per_principal:
            raise limits_mod.exceeded(f"operands of {owner!r}", f"{mine} bytes with this one",
                                      self.limits.max_operand_bytes_per_principal, "max_operand_bytes_per_principal")
        count = sum(1 for who, _ in list(self._own) + list(self._uploading) if who == owner)
        limits_mod.check(count, self.limits.max_operands_per_principal, f"{owner!r} has {count} operands",
                         "max_operands_per_principal")

    # ------------------------------------------------------------------ upload

    async def upload(
        self, principal: Principal, header: op_pb2.OperandUpload, chunks: AsyncIterator[tensor_pb2.TensorChunk | RawChunk],
        *, require_session: Callable[[str], Any],
    ) -> StoredOperand:
        """Receives an operand: ``header`` (OperandUpload) then the data of its chunked
        tensors from ``chunks``. ``require_session(id)`` raises unless the caller may
        attach it to that session. Raises InvalidArgument, AlreadyExists,
        ResourceExhausted (before any data is received) or NotFound (the session)."""
        principal.require("user", "uploading an operand")
        name = check_name(header.name, "operand.name", self.limits.max_name_length)
        if bool(header.session_id) == bool(header.ttl_seconds):
            raise InvalidArgument("operand: set one of session_id (it lives with the session) or ttl_seconds")
        if header.session_id:
            require_session(header.session_id)
        kind = header.WhichOneof("value")
        if kind is None:
            raise InvalidArgument("operand: set tensor or sae (the operand)")
        value = header.tensor if kind == "tensor" else header.sae
        if kind == "sae" and value.operand:
            raise InvalidArgument("operand.sae.operand: an upload carries its data, not another operand's name")
        nbytes = 0
        try:
            for where, tensor in codec.iter_tensors(header):  # the tensor, or the SAE's tensors
                nbytes += codec.check_tensor(tensor, f"operand.{where}") * codec.ITEMSIZE[tensor.dtype]
        except codec.CodecError as exc:
            raise InvalidArgument(str(exc)) from None
        key = (principal.name, name)
        with self._lock:
            self._admit(principal.name, name, nbytes, published=False)
            self._uploading[key] = nbytes
        received: list[codec.ChunkAssembler] = []  # the upload's buffers, once allocated
        try:
            stored = await self._receive(key, header, kind, value, nbytes, chunks, received, require_session)
        except BaseException as exc:
            with self._lock:
                self._uploading.pop(key, None)  # its name is free at once; its bytes once they are freed
                if received:
                    self._count_until_freed(principal.name, received.pop())
            # What the frames it passed hold (the buffers) goes with them, before the trim.
            failure = drop_tracebacks(exc)
        else:
            if nbytes >= TRIM_AFTER_BYTES:  # the chunk messages' buffers, freed but kept by the allocator
                await asyncio.to_thread(trim_heap)
            if header.ttl_seconds:
                ttl = min(header.ttl_seconds, self.limits.max_ttl_seconds)
                stored.expires_ns = time.time_ns() + ttl * 1_000_000_000
                stored._timer = asyncio.get_running_loop().call_later(ttl, self._end, stored, f"its TTL of {ttl} s passed")
            log.info("operand %s of %s uploaded (%d bytes)", name, principal.name, nbytes)
            return stored
        if nbytes >= TRIM_AFTER_BYTES:  # as after an upload: its chunks' buffers, and its own
            if isinstance(failure, Exception):
                await asyncio.to_thread(trim_heap)
            else:  # cancelled: this task awaits nothing more
                asyncio.get_running_loop().run_in_executor(None, trim_heap)
        raise failure

    async def _receive(
        self, key: tuple[str, str], header: op_pb2.OperandUpload, kind: str, value: Any, nbytes: int,
        chunks: AsyncIterator[tensor_pb2.TensorChunk | RawChunk], received: list[codec.ChunkAssembler],
        require_session: Callable[[str], Any],
    ) -> StoredOperand:
        """The data of an admitted upload, checked and committed under ``key``; its buffers
        are put in ``received`` as soon as they are allocated."""
        try:
            assembler = codec.ChunkAssembler(header, max_bytes=nbytes)
            received.append(assembler)
            async for chunk in chunks:
                if assembler.done:
                    raise InvalidArgument("UploadOperand: more chunks than the operand's chunked tensors hold")
                assembler.feed(chunk)
        except codec.CodecError as exc:
            raise InvalidArgument(f"UploadOperand: {exc}") from None
        if not assembler.done:
            raise InvalidArgument("UploadOperand: the stream ended before every chunked tensor was complete")
        # Decoding and checking a few hundred MiB takes a while: off the event loop.
        stored = await asyncio.to_thread(self._build, key[0], key[1], kind, value, assembler.result(), nbytes)
        stored.session_id = header.session_id
        if header.session_id:
            # Again, with no await before the commit: a session that ended while the
            # data arrived has ended its operands already, and would never end this one.
            require_session(header.session_id)
        with self._lock:
            del self._uploading[key]
            self._own[key] = stored
            stored.store = self
        return stored

    @staticmethod
    def _build(owner: str, name: str, kind: str, value: Any, chunked: Mapping[int, Any], nbytes: int) -> StoredOperand:
        source = _Received(chunked)
        if kind == "tensor":
            tensor = source.tensor(value, "operand.tensor")
            if not tensor.is_floating_point() or not all_finite(tensor):
                raise InvalidArgument("operand.tensor: must be a finite floating-point tensor")
            return StoredOperand(name, owner, "tensor", {"": _shared(tensor)}, nbytes)
        sae = compile_sae(value, "operand.sae", source, {}, "")  # checks every tensor as an inline SAE's
        return _sae_operand(name, owner, sae, value, nbytes)

    # ------------------------------------------------------------------ publish

    def publish(self, principal: Principal, name: str, path: str) -> StoredOperand:
        """Reads a published operand from the operand folder (blocks: call it on a thread).
        See PublishOperand in operand_service.proto for what it reads and refuses."""
        principal.require("operator", "publishing an operand")
        name = check_name(name, "name", self.limits.max_name_length)
        if not self.root:
            raise FailedPrecondition("this server has no operand folder (operand_root)")
        resolved = self._confined(path)
        try:
            stored = self._read(name, path, resolved)
        except BaseException as exc:
            # What it had read (a refused file's tensors, on the frames it passed) goes with
            # their tracebacks, and the heap gives it back, as after an upload.
            failure = drop_tracebacks(exc)
        else:
            stored.published = str(resolved)
            with self._lock:
                self._admit("", name, stored.nbytes, published=True)
                self._published[name] = stored
                stored.store = self
            log.info("operand %s published from %s (%d bytes)", name, resolved, stored.nbytes)
            return stored
        trim_heap()
        raise failure

    def _read(self, name: str, path: str, resolved: Any) -> StoredOperand:
        """The operand ``resolved`` holds (``path`` as the caller named it); InvalidArgument
        naming it for anything it cannot use."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        where = f"path: {path!r}"
        try:
            if resolved.is_dir():
                if not (resolved / "cfg.json").is_file() or not (resolved / "sae_weights.safetensors").is_file():
                    raise InvalidArgument(f"{where} is a folder without SAELens' cfg.json and sae_weights.safetensors")
                # Each file confined too: a symlink inside the folder must not lead out of the root.
                cfg_path = self._confined(f"{path.rstrip('/')}/cfg.json")
                weights_path = self._confined(f"{path.rstrip('/')}/sae_weights.safetensors")
                if not cfg_path.is_file() or not weights_path.is_file():
                    raise InvalidArgument(f"{where} is a folder without SAELens' cfg.json and sae_weights.safetensors")
                if cfg_path.stat().st_size > MAX_CONFIG_BYTES:
                    raise InvalidArgument(f"{where}: cfg.json is over {MAX_CONFIG_BYTES} bytes")
                try:
                    config = _sae_config(json.loads(cfg_path.read_text()), f"{where}: cfg.json")
                except RecursionError:  # arrays or objects nested about a thousand deep, or more
                    raise InvalidArgument(f"{where}: cfg.json nests arrays or objects too deeply to read "
                                          "(a SAELens config is one flat object)") from None
                self._check_room(name, weights_path.stat().st_size)
                tensors = load_file(str(weights_path))
                wanted = ["w_enc", "b_enc", "w_dec", "b_dec"] + (["threshold"] if config.architecture == "jumprelu" else [])
                for field in wanted:
                    if SAE_TENSORS[field] not in tensors:
                        raise InvalidArgument(f"{where}: sae_weights.safetensors has no {SAE_TENSORS[field]!r}")
                    tensor = tensors[SAE_TENSORS[field]]
                    _check_dtype(tensor, f"{where}: sae_weights.safetensors: {SAE_TENSORS[field]}")
                    getattr(config, field).CopyFrom(_header(tensor))
                sae = compile_sae(config, where, _Loaded(tensors), {}, "")
                nbytes = sum(t.numel() * t.element_size() for t in sae.tensors.values())
                stored = _sae_operand(name, "", sae, config, nbytes)
            elif resolved.is_file() and resolved.suffix == ".safetensors":
                self._check_room(name, resolved.stat().st_size)
                tensors = load_file(str(resolved))
                if len(tensors) != 1:
                    raise InvalidArgument(f"{where} holds {len(tensors)} tensors ({', '.join(sorted(tensors)[:8])}); a "
                                          "tensor operand is a file of one")
                (tensor,) = tensors.values()
                _check_dtype(tensor, where)
                if not all_finite(tensor):
                    raise InvalidArgument(f"{where}: must be a finite floating-point tensor")
                stored = StoredOperand(name, "", "tensor", {"": _shared(tensor)}, tensor.numel() * tensor.element_size())
            else:
                raise InvalidArgument(f"{where} is neither a .safetensors file nor a folder in SAELens' layout "
                                      "(only safetensors are read)")
        except (SafetensorError, OSError, ValueError) as exc:
            raise InvalidArgument(f"{where} cannot be read: {exc}") from None
        return stored

    def _confined(self, path: str) -> Any:
        """``path`` under the operand folder, every symlink resolved and checked (harvest_sources.confine)."""
        assert self.root is not None
        try:
            return sources.confine(self.root, path, what="path")
        except sources.PathNotAllowed as exc:
            raise PermissionDenied(str(exc)) from None
        except sources.SourceError as exc:
            raise InvalidArgument(str(exc)) from None

    def _check_room(self, name: str, nbytes: int) -> None:
        """The name and the server's quota, checked before a published file is read."""
        with self._lock:
            self._admit("", name, nbytes, published=True)

    # ------------------------------------------------------------------ names

    def resolve(self, principal: Principal, name: str, where: str, holder: tuple[str, str] | None) -> StoredOperand:
        """The operand ``principal`` means by ``name`` (their own, else a published one),
        held by ``holder`` (id, what) when given; NotFound, or FailedPrecondition for an
        ended one (unless the holder holds it already)."""
        with self._lock:
            stored = self._own.get((principal.name, name)) or self._published.get(name)
            if stored is None:
                raise NotFound(f"{where}: no operand {name!r} (upload it with UploadOperand; ListOperands lists yours)")
            if stored.ended and (holder is None or holder[0] not in stored.used_by):
                raise FailedPrecondition(f"{where}: operand {name!r} has ended (its session closed or its TTL passed); "
                                         "it lives on only for the hooks and jobs that used it (ListOperands: used_by), "
                                         "and keeps its name until they are gone: upload it under another name")
            if holder is not None:
                stored.used_by[holder[0]] = (holder[1], principal.name)
            return stored

    def release(self, holder_id: str) -> None:
        """``holder_id`` (a hook or job) no longer uses any operand: ended ones it held are freed."""
        with self._lock:
            for key, stored in list(self._own.items()):
                if stored.used_by.pop(holder_id, None) is not None and stored.ended and not stored.used_by:
                    del self._own[key]
                    log.info("operand %s of %s freed (its last user ended)", stored.name, stored.owner)
            for stored in self._published.values():
                stored.used_by.pop(holder_id, None)

    def _end(self, stored: StoredOperand, why: str) -> None:
        """Its session or TTL is over: freed now, or once its last holder lets it go."""
        with self._lock:
            stored.ended = True
            key = (stored.owner, stored.name)
            if self._own.get(key) is stored and not stored.used_by:
                del self._own[key]
        log.info("operand %s of %s ended: %s", stored.name, stored.owner, why)

    def session_ended(self, session_id: str) -> None:
        """Ends the operands that live with ``session_id``."""
        with self._lock:
            ending = [op for op in self._own.values() if op.session_id == session_id]
        for stored in ending:
            self._end(stored, f"session {session_id} ended")

    def delete(self, principal: Principal, name: str, owner: str = "") -> int:
        """Deletes an operand; returns the bytes freed. The caller's own; an operator may
        name another ``owner`` or a published one. NotFound, FailedPrecondition while held."""
        principal.require("user", "deleting an operand")
        if owner and owner != principal.name:
            principal.require("operator", "deleting another principal's operand")
        who = owner or principal.name
        with self._lock:
            stored = self._own.get((who, name))
            published = stored is None and name in self._published and not owner
            if published:
                stored = self._published[name]
                principal.require("operator", "unpublishing an operand (published operands are read-only)")
            if stored is None:
                raise NotFound(f"name: no operand {name!r}" + (f" of {owner!r}" if owner else ""))
            if stored.used_by:
                users = [what for what, _ in stored.used_by.values()]
                raise FailedPrecondition(f"name: operand {name!r} is in use by {', '.join(users[:4])}"
                                         + (f" and {len(users) - 4} more" if len(users) > 4 else "")
                                         + "; deregister them (or cancel the jobs) first")
            if published:
                del self._published[name]
            else:
                del self._own[(who, name)]
        if stored._timer is not None:
            stored._timer.cancel()
        log.info("operand %s of %s deleted by %s", name, stored.owner or "(published)", principal.name)
        return stored.nbytes

    def listing(self, principal: Principal) -> list[StoredOperand]:
        """Published operands, then the caller's own (an operator's listing: everyone's), by owner and name."""
        principal.require("user", "listing operands")
        with self._lock:
            own = [op for (who, _), op in self._own.items() if principal.is_operator or who == principal.name]
            published = list(self._published.values())
        return sorted(published, key=lambda op: op.name) + sorted(own, key=lambda op: (op.owner, op.name))

    def source(self, principal: Principal, device: torch.device, *, holder: tuple[str, str] | None = None,
               pinned: Mapping[str, StoredOperand] | None = None) -> NamedSource:
        """An OperandSource resolving names for ``principal`` (see NamedSource)."""
        return NamedSource(self, principal, device, holder=holder, pinned=pinned)


class NamedSource(OperandSource):
    """Inline operands, and named ones resolved for ``principal``: held by ``holder`` (a
    registered hook's or a harvest job's id and description) as they are resolved, so that
    nothing deletes them between the check and the hook's life. ``used`` lists them."""

    def __init__(self, store: OperandStore, principal: Principal, device: torch.device, *,
                 holder: tuple[str, str] | None = None, pinned: Mapping[str, StoredOperand] | None = None) -> None:
        super().__init__(device)
        self._store = store
        self._principal = principal
        self._holder = holder
        self._pinned = pinned or {}
        #: The named operands resolved, by name.
        self.used: dict[str, StoredOperand] = {}

    def _resolve(self, name: str, where: str, kind: str) -> StoredOperand:
        stored = self._pinned.get(name) or self._store.resolve(self._principal, name, f"{where}.operand", self._holder)
        self.used[name] = stored
        if stored.kind != kind:
            raise FailedPrecondition(f"{where}.operand: {name!r} is {'an SAE' if stored.kind == 'sae' else 'a tensor'} "
                                     f"operand; {where} needs {'an SAE' if kind == 'sae' else 'a tensor'}")
        return stored

    def named_tensor(self, msg: tensor_pb2.Tensor, where: str) -> torch.Tensor:
        if msg.dtype or len(msg.shape) or msg.chunk_id or msg.data:
            raise InvalidArgument(f"{where}: a named operand ({msg.operand!r}) carries no dtype, shape or data of its own")
        return self._resolve(msg.operand, where, "tensor").tensor

    def sae(self, msg: Any, where: str) -> CompiledSae:
        extra = [field.name for field, _ in msg.ListFields() if field.name != "operand"]
        if extra:
            raise InvalidArgument(f"{where}: a named SAE ({msg.operand!r}) sets nothing else (it sets {', '.join(extra)})")
        return self._resolve(msg.operand, where, "sae").compiled_sae


def _shared(t: torch.Tensor) -> torch.Tensor:
    """``t`` marked as a named operand's tensor: rules share its casts (rules.shared_cast)."""
    setattr(t, SHARED_CASTS, {})
    return t


#: The dtypes of a published tensor: those a rule computes in and the wire carries
#: (ListHooks, ListOperands describe them), and whose finiteness torch can check.
OPERAND_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _check_dtype(t: torch.Tensor, where: str) -> None:
    """InvalidArgument naming ``where`` unless ``t`` is of an OPERAND_DTYPES dtype (a
    file may hold float8, integers or anything else safetensors stores)."""
    if t.dtype not in OPERAND_DTYPES:
        raise InvalidArgument(f"{where}: a tensor of {str(t.dtype).removeprefix('torch.')}; an operand is "
                              "float32, float64, float16 or bfloat16 (convert it before publishing)")


def _header(t: torch.Tensor) -> tensor_pb2.Tensor:
    return tensor_pb2.Tensor(dtype=codec.wire_dtype_of(t.dtype), shape=list(t.shape))


def _sae_operand(name: str, owner: str, sae: CompiledSae, msg: rule_pb2.Sae, nbytes: int) -> StoredOperand:
    """A stored SAE: its tensors shared with its CompiledSae, its config without data."""
    config = rule_pb2.Sae()
    config.CopyFrom(msg)
    for field in SAE_TENSORS:
        if config.HasField(field):
            getattr(config, field).data = b""
            getattr(config, field).chunk_id = 0
    return StoredOperand(name, owner, "sae", dict(sae.tensors), nbytes, sae=sae, sae_config=config)


def _sae_config(cfg: Any, where: str) -> rule_pb2.Sae:
    """An Sae message (no tensors yet) from SAELens' cfg.json; InvalidArgument naming what it cannot use."""
    if not isinstance(cfg, dict):
        raise InvalidArgument(f"{where}: not a JSON object")
    architecture = cfg.get("architecture", "standard")
    normalize = cfg.get("normalize_activations") or "none"
    reshape = cfg.get("reshape_activations", "none")
    for key, value in (("architecture", architecture), ("normalize_activations", normalize),
                       ("reshape_activations", reshape or "none")):
        # A name, or the error quoting it could be as large as the file.
        if not isinstance(value, str) or len(value) > 64:
            raise InvalidArgument(f"{where}: {key} must be a name (a short string), not "
                                  f"{type(value).__name__ if not isinstance(value, str) else f'{len(value)} characters'}")
    if reshape not in (None, "none"):
        raise InvalidArgument(f"{where}: reshape_activations {reshape!r} is not supported (only 'none')")
    msg = rule_pb2.Sae(architecture=architecture, normalize_activations=normalize)
    if "apply_b_dec_to_input" in cfg:
        msg.apply_b_dec_to_input = bool(cfg["apply_b_dec_to_input"])
    if architecture == "topk":
        k = cfg.get("k")
        if not isinstance(k, int) or k < 1:
            raise InvalidArgument(f"{where}: a topk SAE needs an integer k >= 1, not {k!r}")
        msg.k = k
    return msg


