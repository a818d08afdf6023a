"""hookwire's part of a vLLM worker process (vLLM's ``worker_extension_cls``): when vLLM
runs the model in worker processes (the default, and always under tensor parallel), the
model's modules are there, not in the server, and this class, mixed into vLLM's worker,
is what hookwire has there: the hook runtime (runtime/), fed each step's plan by the
server, and the taps for steps whose hooks run in the server.

The link is a socket (Unix, or TCP for ranks on other machines), authenticated both
ways with a key the server made (multiprocessing's HMAC challenge: ``dial``), carrying
only bytes: JSON headers, ``HookSpec`` protobuf and hookwire's wire ``Value`` (tensors
as raw bytes). Nothing is pickled either way. Per vLLM step (one forward of the model
and its logits):

- ``step`` (worker -> server): the step's requests in vLLM's order, their query start
  offsets and each one's last scheduled token; the server lays the step out per call
  and answers with the step's plan (runtime/plan.py): the module phases to tap, whether
  it wants the step's logits, and either the step's firings (``run``: the hooks run
  here, with the specs this worker lacks) or none (the taps send what they see);
- ``tap`` (steps whose hooks run in the server): what a tapped module saw (the parts
  asked for); for a tap that may edit, the server answers with the parts its hooks
  changed (or none) before the module goes on; other taps are not answered;
- ``logits``: the step's logits (one row per request), when asked for;
- ``end`` (after the logits): the firings that ran here and each value they captured
  (one frame per value); the server answers at once and finishes the step (its events,
  failed calls) while vLLM goes on; a step's outputs still never reach its calls before
  its captures (the engine's lock: vllm_link).

Under pipeline parallel each stage's first rank talks to the server on a connection of
its own (the step message names its stage): each stage runs the hooks of the modules it
holds, in stage order, and a stage that is not the last ends its part of the step when
its forward returns (the last ends after the logits). Under tensor parallel only the
first rank of each stage's tensor-parallel group talks to the server; it broadcasts each step's plan to the other ranks (torch.distributed on vLLM's
groups). Every rank runs the step's rules on its own copy of the (whole) value, and the
first rank alone captures; in a step whose hooks run in the server the first rank
broadcasts each edit instead. A module whose output is one rank's shard is tapped on
the first rank only (docs/scaling.md).
"""

from __future__ import annotations

import json
import os
import socket
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any

import torch

if os.environ.get("HOOKWIRE_VLLM_KEEP_WEIGHTS") == "1":
    # Before the worker loads the model (vLLM imports this class first): GetParameters
    # reads the linear layers' weights, which vLLM's CPU build would otherwise drop.
    from .vllm_names import keep_cpu_linear_weights

    keep_cpu_linear_weights(True)



#: The key of a request's SamplingParams.extra_args by which the server tells the workers
#: whether a hook can fire on it (vllm_engine.VllmEngine._touched, decided at its
#: admission); a request without it counts as touched.
TOUCHED = "hookwire_touched"
#: The keys by which hookwire's scheduler for vLLM (vllm_scheduler) knows a touched
#: request's call, to start its requests together: the call's id (its first request's
#: when it entered vLLM) and how many requests it has.
CALL = "hookwire_call"
SEQUENCES = "hookwire_sequences"


def dial(address: str, authkey: bytes) -> Connection:
    """A connection to the server's link at ``address`` (a Unix socket's path, or
    tcp://HOST:PORT for ranks on other machines, ``[v6]`` for an IPv6 host), once both
    sides proved they hold ``authkey`` (multiprocessing's HMAC challenge, as its Client
    answers it)."""
    if address.startswith("tcp://"):
        host, _, port = address[len("tcp://"):].rpartition(":")
        sock = socket.create_connection((host.strip("[]"), int(port)))  # IPv4 or IPv6, as the name resolves
    else:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(address)
        except BaseException:
            sock.close()
            raise
    conn = Connection(sock.detach())
    try:
        answer_challenge(conn, authkey)
        deliver_challenge(conn, authkey)
    except BaseException:
        conn.close()
        raise
    return conn


def plain(value: Any) -> Any:
    """``value`` with what hookwire's wire form cannot carry (vLLM's attention metadata,
    a layer object, a tensor of a dtype the wire has no form for) as None: the server's
    hooks see it as null."""
    if isinstance(value, torch.Tensor):
        from hookwire.wire import codec

        try:
            codec.wire_dtype_of(value.dtype)
        except Exception:
            return None
        return value.detach()
    if isinstance(value, (tuple, list)):
        return type(value)(plain(v) for v in value) if type(value) in (tuple, list) else tuple(plain(v) for v in value)
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    from hookwire.v1 import tensor_pb2

    if isinstance(value, tensor_pb2.TensorSummary):  # a capture's summary (runtime.step)
        return value
    return None


def merge(original: Any, new: Any) -> Any:
    """``new`` (what the server's hooks left) with ``original``'s leaves where the wire
    could not carry them, and each tensor back on its original's device and dtype."""
    if isinstance(original, torch.Tensor):
        if not isinstance(new, torch.Tensor):
            return original
        return new.to(device=original.device, dtype=original.dtype)
    if isinstance(original, (tuple, list)) and isinstance(new, (tuple, list)) and len(original) == len(new):
        items = [merge(o, n) for o, n in zip(original, new)]
        return type(original)(items) if type(original) in (tuple, list) else type(original)(*items)
    if isinstance(original, dict) and isinstance(new, dict):
        return {k: merge(v, new.get(str(k), v)) for k, v in original.items()}
    if new is None:
        return original
    return new


def tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value``, in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_of(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_of(v)]
    return []


def with_tensors(value: Any, tensors: list[torch.Tensor]) -> Any:
    """``value`` with its tensors replaced, in order, by ``tensors`` (consumed)."""
    if isinstance(value, torch.Tensor):
        return tensors.pop(0)
    if isinstance(value, (tuple, list)):
        items = [with_tensors(v, tensors) for v in value]
        return type(value)(items) if type(value) in (tuple, list) else type(value)(*items)
    if isinstance(value, dict):
        return {k: with_tensors(v, tensors) for k, v in value.items()}
    return value


class HookwireWorker:
    """Mixed into vLLM's worker class (``worker_extension_cls``); its methods are called
    by the server through ``collective_rpc`` (their arguments and results are plain
    data: vLLM's msgpack). ``self`` is vLLM's worker (``model_runner``, ``rank``)."""

    def hookwire_connect(self, address: str, authkey: str) -> dict[str, Any]:
        """Connects the first rank of each stage's tensor-parallel group to the server's
        link at ``address`` and installs the step taps on every rank. Returns this
        process's pid, rank and stage (VllmEngine.worker_pids)."""
        tap = _Taps(self.model_runner, address, bytes.fromhex(authkey))  # type: ignore[attr-defined]
        self._hookwire = tap  # type: ignore[attr-defined]
        return {"pid": os.getpid(), "rank": int(getattr(self, "rank", 0)), "leader": tap.leader, "stage": tap.stage}

    def hookwire_pipeline_buffers(self) -> None:
        """Makes the buffer a later pipeline stage receives the earlier stage's values in
        (vLLM 0.32's model runner makes it only when it warms up a compiled model, so an
        eager one fails its first step on a later stage)."""
        from vllm.distributed import parallel_state

        runner = self.model_runner  # type: ignore[attr-defined]
        if parallel_state.get_pp_group().is_first_rank or getattr(runner, "intermediate_tensors", None) is not None:
            return
        runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
            batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device)

    def hookwire_partial(self) -> list[str]:
        """The row-parallel layers whose output is each rank's partial sum (reduced later
        by the model: ``reduce_results`` false), by path."""
        model = self.model_runner.model  # type: ignore[attr-defined]
        return [path for path, m in model.named_modules()
                if type(m).__name__ == "RowParallelLinear" and not getattr(m, "reduce_results", True)]

    def hookwire_describe(self) -> dict[str, Any]:
        """The model's module tree (path, class name), parameters (name, shape, dtype)
        and vLLM's fused-module mapping, as this rank holds them (under pipeline parallel,
        the modules of other stages are vLLM's ``PPMissingLayer``, without children), the
        modules whose weights are tied to another's, this rank's stage, and in a compiled
        model its tap points and compiled cores (``{"points": [...], "cores": [...]}``)."""
        from vllm.distributed import parallel_state

        model = self.model_runner.model  # type: ignore[attr-defined]
        modules = [[path, type(m).__name__] for path, m in model.named_modules()]
        params = [[name, list(p.shape), str(p.dtype).removeprefix("torch.")]
                  for name, p in model.named_parameters(remove_duplicate=False)]
        packed = {k: list(v) for k, v in (getattr(model, "packed_modules_mapping", None) or {}).items()}
        # Modules whose weights another module here also holds (a tied head and the
        # embeddings): under pipeline parallel the last stage keeps the embeddings for its
        # head without running them.
        owners: dict[int, set[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            owners.setdefault(id(p), set()).add(name.rpartition(".")[0])
        tied = sorted({path for paths in owners.values() if len(paths) > 1 for path in paths})
        # A compiled model's tap points and compiled cores (engine.vllm_taps); None: eager.
        return {"modules": modules, "parameters": params, "packed": packed, "tied": tied,
                "stage": int(parallel_state.get_pp_group().rank_in_group), "taps": getattr(self, "hookwire_taps", None)}

    def hookwire_slot(self, key: str, name: str, stage: int = 0) -> list[Any]:
        """Slot ``name`` of session ``key`` as this rank holds it: [bytes, shape, dtype], or
        [] when it holds none; only the first rank of pipeline stage ``stage``'s
        tensor-parallel group answers (every rank's copy is the same; another stage's may
        be an older one, not yet freed)."""
        if not self._hookwire.leader or self._hookwire.stage != stage:  # type: ignore[attr-defined]
            return []
        store = self._hookwire.runtime.slots.stores.get(key)  # type: ignore[attr-defined]
        tensor = store.get(name) if store is not None else None
        if tensor is None:
            return []
        tensor = tensor.detach().to("cpu").contiguous()
        return [tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"",
                list(tensor.shape), str(tensor.dtype).removeprefix("torch.")]

    def hookwire_drop_slots(self, drops: list[list[Any]]) -> None:
        """Frees slots on this rank: [session key, names or None (all)] each."""
        slots = self._hookwire.runtime.slots  # type: ignore[attr-defined]
        for key, names in drops:
            slots.drop(str(key), None if names is None else [str(n) for n in names])

    def hookwire_slots_held(self) -> list[int]:
        """[sessions, bytes] of the slots this rank holds (what tests and operators see)."""
        slots = self._hookwire.runtime.slots  # type: ignore[attr-defined]
        return [len(slots.stores), slots.held_bytes]

    def hookwire_parameter(self, name: str) -> list[Any]:
        """Parameter ``name``'s value on this rank: [bytes, shape, dtype], from the first
        rank of the tensor-parallel group of the stage that holds it (the others answer
        empty, so their shards do not travel for nothing)."""
        from vllm.distributed import parallel_state

        model = self.model_runner.model  # type: ignore[attr-defined]
        held = dict(model.named_parameters(remove_duplicate=False)).get(name)
        if held is None or parallel_state.get_tp_group().rank_in_group != 0:
            return [b"", [], ""]
        param = held.detach().to("cpu").contiguous()
        return [param.view(torch.uint8).numpy().tobytes() if param.numel() else b"", list(param.shape),
                str(param.dtype).removeprefix("torch.")]


#: A step's captured values up to this many bytes in all travel to the front as one
#: message (runtime.plan: the ``end`` message).
JOINED_BYTES = 4 << 20


def send_end(conn: Any, header: dict[str, Any], frames: list[bytes]) -> None:
    """Sends a step's end ``header`` (runtime.plan) and its captured values' frames (b"":
    a value that could not be encoded), the header saying how many (``values``), their
    ``sizes`` and whether they are ``joined``: up to JOINED_BYTES in all they go as one
    message after the header, else one message each (no second copy of large captures);
    none, nothing after it. Why one message: each is a read on the front's link thread,
    and each read lets go of the GIL, which the thread then waits to get back from a busy
    event loop (up to the interpreter's switch interval) while this worker waits."""
    sizes = [len(f) for f in frames]
    joined = sum(sizes) <= JOINED_BYTES
    conn.send_bytes(json.dumps({**header, "values": len(frames), "sizes": sizes, "joined": joined}).encode())
    if joined and frames:
        conn.send_bytes(b"".join(frames))
    elif not joined:
        for frame in frames:
            conn.send_bytes(frame)


class _Taps:
    """The taps of one worker (see the module docstring)."""

    def __init__(self, runner: Any, address: str, authkey: bytes) -> None:
        from vllm.distributed import parallel_state

        self.runner = runner
        self.group = parallel_state.get_tp_group()
        self.parallel = self.group.world_size > 1
        self.leader = self.group.rank_in_group == 0
        pipeline = parallel_state.get_pp_group()
        #: This rank's pipeline stage; a stage before the last ends its part of a step when
        #: the model's forward returns (no logits there).
        self.stage = int(pipeline.rank_in_group)
        self.last_stage = bool(pipeline.is_last_rank)
        self.conn = dial(address, authkey) if self.leader else None
        model = runner.model
        self.modules = dict(model.named_modules())
        # The end of a step goes after its logits: the logits processor, wherever the model
        # keeps it (multimodal models nest it in their language model); on an earlier
        # pipeline stage, the model itself.
        head = next((m for m in self.modules.values() if type(m).__name__ == "LogitsProcessor"), None)
        if head is None and self.last_stage:
            raise RuntimeError("hookwire found no LogitsProcessor module in the model: it cannot tell when a step ends")
        self.head: Any = head if self.last_stage else model
        #: (path, phase) -> [roots, edits, handle]
        self.taps: dict[tuple[str, str], list[Any]] = {}
        self.logits = False
        self._end_handle: Any = None
        # The hooks themselves, for steps the server plans to run here (runtime.step):
        # captures on the first rank only, rules on every rank (their values are whole).
        from ..runtime.step import StepRunner

        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.runtime = StepRunner(device, captures=self.leader)
        model.register_forward_pre_hook(self._begin)

    # -------------------------------------------------------------- the link

    def _send(self, header: dict[str, Any], value: Any = None, *, has_value: bool = False) -> None:
        from hookwire.wire import codec

        assert self.conn is not None
        # Encoded first: a value that cannot be encoded raises before the header went out
        # (the server never waits for a value that does not come).
        body = codec.encode_value(plain(value)).SerializeToString() if has_value else None
        self.conn.send_bytes(json.dumps(header).encode())
        if body is not None:
            self.conn.send_bytes(body)

    def _receive(self) -> tuple[dict[str, Any], Any]:
        from hookwire.v1 import tensor_pb2
        from hookwire.wire import codec

        assert self.conn is not None
        header = json.loads(self.conn.recv_bytes())
        value = None
        if header.get("value"):
            msg = tensor_pb2.Value()
            msg.ParseFromString(self.conn.recv_bytes())
            value = codec.decode_value(msg, where="edit")
        return header, value

    def _broadcast_bytes(self, data: bytes | None) -> bytes:
        """The first rank's ``data``, on every rank of the group."""
        import torch.distributed as dist

        group = self.group.cpu_group
        src = self.group.ranks[0]
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        dist.broadcast(size, src=src, group=group)
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(int(size), dtype=torch.uint8)
        if int(size):
            dist.broadcast(buffer, src=src, group=group)
        return bytes(buffer.numpy().tobytes())

    def _broadcast_tensors(self, tensors: list[torch.Tensor]) -> None:
        """The first rank's ``tensors`` into the other ranks' (same shapes), in place."""
        import torch.distributed as dist

        for t in tensors:
            if t.is_cuda:
                self.group.broadcast(t, src=0)
            else:
                dist.broadcast(t, src=self.group.ranks[0], group=self.group.cpu_group)

    # -------------------------------------------------------------- per step

    def _begin(self, module: Any, args: Any) -> None:
        """Root pre-hook: tells the server the step's requests, installs its taps."""
        from ..runtime import plan

        config = b""
        if self.leader:
            batch = self.runner.input_batch
            n = batch.num_reqs
            if not any(self._touched(rid) for rid in batch.req_ids[:n]):
                # No hook can fire on any request of the step (the server decided at each
                # one's admission): it runs as vLLM alone would, without a word to the server.
                config = plan.pack({"skip": True})
        if self.leader and not config:
            batch = self.runner.input_batch
            n = batch.num_reqs
            starts = self.runner.query_start_loc.cpu[: n + 1].tolist()
            # Each request's last scheduled token (a decoding step's input token): rules'
            # token-id signals read it, and the server may not have the last step's yet.
            ids = self.runner.input_ids.cpu
            last = [int(ids[end - 1]) for end in starts[1:]]
            self._send({"t": "step", "stage": self.stage, "ids": list(batch.req_ids[:n]), "starts": starts,
                        "last": last})
            assert self.conn is not None
            config = self.conn.recv_bytes()  # the step's plan (runtime.plan)
        if self.parallel:
            config = self._broadcast_bytes(config if self.leader else None)
        header, blobs = plan.unpack(config)
        if self.leader and header.get("pull_slots"):
            self._send_slots(header["pull_slots"])
        self.runtime.configure(header, blobs, self._input_ids)
        self._sync(header.get("taps", []))
        self.logits = bool(header.get("logits"))
        # The end of the step goes last among the logits processor's hooks (after a tap there).
        if self._end_handle is not None:
            self._end_handle.remove()
            self._end_handle = None
        if not header.get("skip"):
            self._end_handle = self.head.register_forward_hook(self._end)

    def _send_slots(self, pairs: list[list[str]]) -> None:
        """The slots the server reads back before a step whose hooks run there (each
        [session key, name]): one frame each (empty: not here); every rank then frees them."""
        from hookwire.wire import codec

        assert self.conn is not None
        frames = []
        for key, name in pairs:
            store = self.runtime.slots.stores.get(str(key))
            tensor = store.get(str(name)) if store is not None else None
            frames.append(codec.encode_value(tensor.to("cpu")).SerializeToString() if tensor is not None else b"")
        self.conn.send_bytes(json.dumps({"t": "slots", "slots": pairs}).encode())
        for frame in frames:
            self.conn.send_bytes(frame)

    def _input_ids(self) -> torch.Tensor | None:
        """The step's token ids, flat (rules' token-id signals)."""
        ids = getattr(self.runner, "input_ids", None)
        return getattr(ids, "cpu", None) if ids is not None else None

    def _touched(self, request_id: str) -> bool:
        """Whether the server said a hook may fire on request ``request_id`` (its
        SamplingParams' extra_args, set at its admission); unknown ones count as touched."""
        state = self.runner.requests.get(request_id)
        extra = getattr(getattr(state, "sampling_params", None), "extra_args", None) or {}
        return bool(extra.get(TOUCHED, True))

    def _sync(self, taps: list[list[Any]]) -> None:
        wanted = {(path, phase): (roots, bool(edits)) for path, phase, roots, edits in taps
                  if path in self.modules}
        for key in [k for k in self.taps if k not in wanted or self.taps[k][:2] != list(wanted[k])]:
            self.taps.pop(key)[2].remove()
        for (path, phase), (roots, edits) in wanted.items():
            if (path, phase) in self.taps or (not edits and not self.leader):
                continue  # a tap that only captures runs on the first rank alone
            module = self.modules[path]
            if phase == "pre":
                handle = module.register_forward_pre_hook(self._pre(path, roots, edits), with_kwargs=True)
            else:
                handle = module.register_forward_hook(self._post(path, roots, edits), with_kwargs=True)
            self.taps[(path, phase)] = [roots, edits, handle]

    def _tap(self, path: str, phase: str, parts: dict[str, Any], edits: bool) -> dict[str, Any] | None:
        """Sends ``parts`` to the server; for a tap that may edit, the parts as its hooks
        left them (every rank: the first rank broadcasts them), or None when unchanged."""
        new = None
        if self.leader:
            self._send({"t": "tap", "path": path, "phase": phase, "edits": edits}, parts, has_value=True)
            if edits:
                header, value = self._receive()
                if header.get("value"):
                    new = {k: merge(parts[k], value.get(k)) for k in parts}
        if not (edits and self.parallel):
            return new
        changed = self._broadcast_bytes(b"1" if new is not None else b"0" if self.leader else None) == b"1"
        if not changed:
            return None
        if not self.leader:
            new = {k: with_tensors(v, [t.clone() for t in tensors_of(v)]) for k, v in parts.items()}
        assert new is not None
        self._broadcast_tensors([t for k in sorted(new) for t in tensors_of(new[k])])
        return new

    def _pre(self, path: str, roots: list[str], edits: bool) -> Any:
        def pre(module: Any, args: Any, kwargs: Any) -> Any:
            if self.runtime.active:  # the hooks run here (runtime.step)
                new = self.runtime.fire(path, "pre", {"args": args, "kwargs": kwargs})
                return None if new is None else (new["args"], new["kwargs"])
            parts = {k: v for k, v in (("args", args), ("kwargs", kwargs)) if k in roots or edits}
            new = self._tap(path, "pre", parts, edits)
            if new is None:
                return None
            return new.get("args", args), new.get("kwargs", kwargs)
        return pre

    def _post(self, path: str, roots: list[str], edits: bool) -> Any:
        def post(module: Any, args: Any, kwargs: Any, output: Any) -> Any:
            if self.runtime.active:  # the hooks run here (runtime.step)
                new = self.runtime.fire(path, "post", {"args": args, "kwargs": kwargs, "output": output})
                return None if new is None else new["output"]
            parts = {k: v for k, v in (("args", args), ("kwargs", kwargs), ("output", output)) if k in roots}
            parts["output"] = output
            new = self._tap(path, "post", parts, edits)
            return None if new is None else new["output"]
        return post

    def _end(self, module: Any, args: Any, output: Any) -> None:
        """After the step's logits: the server finishes the step."""
        ran = self.runtime.active
        fired, values = self.runtime.results() if ran else ([], [])
        saved = self.runtime.slots.saved() if ran else []
        if not self.leader:
            return
        if self.logits and self.last_stage:
            self._send({"t": "logits"}, output, has_value=True)
        if ran:
            # The step's firings, then the values they captured, each encoded on its own
            # (runtime.plan): a value that cannot be encoded is reported, never raised out
            # of the step.
            from hookwire.wire import codec

            frames: list[bytes] = []
            bad: dict[str, str] = {}
            for i, value in enumerate(values):
                try:
                    frames.append(codec.encode_value(plain(value)).SerializeToString())
                except Exception as exc:
                    frames.append(b"")
                    bad[str(i)] = f"{type(exc).__name__}: {exc}"
            assert self.conn is not None
            send_end(self.conn, {"t": "end", "fired": fired, "bad": bad, "slots": saved}, frames)
        else:
            self._send({"t": "end"})
        self._receive()
