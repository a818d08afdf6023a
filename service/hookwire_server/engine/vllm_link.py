"""The server's side of the link to vLLM's worker processes (vllm_worker.py has the
worker's side and the protocol): the model as the server sees it when its modules live
in workers, and the thread that runs the server's hooks on what the workers tap.

The server holds a stand-in module per vLLM module (``ProxyModule``: the same path and
class name, parameters on the meta device with vLLM's shapes and dtypes), so hooks,
rules, module patterns, output views, the module tree and GetParameters' names work
unchanged. Hooks register on the stand-ins as on any module; per step the engine plans
the firings the workers run themselves (vllm_runtime.py), or, for a step whose hooks
need the server, the workers tap the module phases that have hooks (``taps_of``) and the
link runs those hooks on what the workers saw (``run_pre``/``run_post``, in torch's order
and with torch's return conventions), sending back what a rule changed.

One thread per worker connection reads its messages in order and calls the engine
(``LinkEngine``): a step's layout, its taps, its logits, its end. A connection that
closes (the worker died) is reported once (``lost``).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import secrets
import tempfile
import threading
import contextlib
import socket
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any, Protocol

import torch
from torch import nn

from hookwire.v1 import hook_pb2, tensor_pb2
from hookwire.wire import codec

from ..runtime import plan
from . import vllm_threads
from .vllm_worker import plain

log = logging.getLogger("hookwire.vllm")


class ProxyModule(nn.Module):
    """Stands for one of vLLM's modules in a worker process (never runs)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - never called
        raise RuntimeError("a vLLM module in a worker process runs there, not in the server")


_classes: dict[str, type[ProxyModule]] = {}


def _proxy_class(name: str) -> type[ProxyModule]:
    """A ProxyModule subclass named as vLLM's class (the module tree lists it; output
    views are chosen by it)."""
    cls = _classes.get(name)
    if cls is None:
        cls = _classes[name] = type(name, (ProxyModule,), {"__module__": __name__})
    return cls


def proxy_model(description: dict[str, Any]) -> nn.Module:
    """The stand-in module tree of a worker's ``hookwire_describe`` answer."""
    modules: dict[str, nn.Module] = {}
    for path, kind in description["modules"]:
        module = _proxy_class(str(kind))()
        modules[path] = module
        if path:
            parent, _, name = path.rpartition(".")
            modules[parent].add_module(name, module)
    for name, shape, dtype in description["parameters"]:
        owner, _, local = name.rpartition(".")
        holder = modules.get(owner)
        if holder is None or local in holder._parameters:
            continue  # listed twice: the module holds it already
        value = torch.empty([int(n) for n in shape], dtype=getattr(torch, str(dtype)), device="meta")
        holder.register_parameter(local, nn.Parameter(value, requires_grad=False))
    root = modules[""]
    setattr(root, "packed_modules_mapping", {k: list(v) for k, v in description.get("packed", {}).items()})
    return root


#: vLLM's stand-in for a module another pipeline stage holds.
MISSING = "PPMissingLayer"


def merge_stages(descriptions: list[dict[str, Any]]) -> tuple[dict[str, Any], list[set[str]]]:
    """The whole model's description from its ranks' (``hookwire_describe`` of every rank,
    under pipeline parallel: each stage holds its own layers, the others are vLLM's
    ``PPMissingLayer`` without children), and the module paths each stage holds (the
    root and containers every stage runs are in each stage's set; a module a later stage
    keeps only for weights tied to another of its modules, the embeddings of a tied head,
    is the earlier stage's alone)."""
    by_stage: dict[int, dict[str, Any]] = {}
    for answer in descriptions:
        by_stage.setdefault(int(answer.get("stage", 0)), answer)
    stages = [by_stage[k] for k in sorted(by_stage)]
    held: list[set[str]] = []
    for answer in stages:
        missing = [path for path, kind in answer["modules"] if kind == MISSING]
        tied = set(answer.get("tied", ()))
        held.append({path for path, kind in answer["modules"] if kind != MISSING
                     and not any(path == m or path.startswith(m + ".") for m in missing)
                     and not (path in tied and any(path in earlier for earlier in held))})
    # The tree walked from the root: each module as the first stage that holds it describes
    # it, its children in that stage's order, then those only other stages have (the head).
    kinds = [dict((path, kind) for path, kind in answer["modules"]) for answer in stages]
    children: list[dict[str, list[str]]] = []
    for answer in stages:
        kids: dict[str, list[str]] = {}
        for path, _ in answer["modules"]:
            if path:
                kids.setdefault(path.rpartition(".")[0], []).append(path)
        children.append(kids)
    modules: list[list[str]] = []
    seen: set[str] = set()
    pending = [""] if "" in kinds[0] else []
    while pending:
        path = pending.pop()
        owner = next((i for i, paths in enumerate(held) if path in paths),
                     next(i for i, k in enumerate(kinds) if path in k))
        modules.append([path, kinds[owner][path]])
        seen.add(path)
        order = list(children[owner].get(path, ()))
        for kids in children:
            order += [c for c in kids.get(path, ()) if c not in order]
        pending += reversed([c for c in order if c not in seen])
    parameters: list[list[Any]] = []
    named: set[str] = set()
    for answer in stages:
        for entry in answer["parameters"]:
            if entry[0] not in named:
                named.add(entry[0])
                parameters.append(entry)
    merged = {"modules": modules, "parameters": parameters, "packed": stages[0].get("packed", {})}
    return merged, held


def unedited_modules(modules: dict[str, nn.Module], ranks: int, partial: set[str]) -> dict[tuple[str, int], str]:
    """(path, hook phase) -> why, for every module phase a rule may not edit under tensor
    parallel over ``ranks``: all but those whose values are whole and the same on every
    rank (an allowlist: a rule's edit is made on the first rank's value and broadcast,
    which is only right where every rank holds that value). Whole: decoder layers, their
    norms and the model's final norm (not the per-head norms inside attention), the
    embeddings, and row-parallel layers' outputs that they reduce themselves (not those in
    ``partial``). Their hooks capture the first rank's value everywhere."""
    why = (f"under tensor_parallel_size {ranks} its value is one rank's shard or partial sum (rules edit only "
           "values every rank holds whole: decoder layers, their norms, the final norm, embeddings, reduced "
           "projection outputs)")
    out: dict[tuple[str, int], str] = {}
    for path, module in modules.items():
        kind = type(module).__name__
        parent = path.rpartition(".")[0]
        parent_kind = type(modules[parent]).__name__ if parent in modules else ""
        whole_in = whole_out = False
        if kind.endswith("DecoderLayer"):
            whole_in = whole_out = True
        elif kind.endswith("Norm") and (parent_kind.endswith("DecoderLayer") or parent_kind.endswith("Model")):
            whole_in = whole_out = True
        elif kind == "VocabParallelEmbedding":
            whole_out = True
        elif kind == "RowParallelLinear" and path not in partial:
            whole_out = True
        if not whole_in:
            out[(path, hook_pb2.PHASE_FORWARD_PRE)] = why
        if not whole_out:
            out[(path, hook_pb2.PHASE_FORWARD)] = why
    return out


def _reads(hooks: Any) -> tuple[list[str], bool]:
    """What a module phase's hooks read (roots) and whether any may edit."""
    roots: set[str] = set()
    edits = False
    for hook in hooks.values():
        roots.update(getattr(hook, "hookwire_roots", ("args", "kwargs", "output")))
        edits = edits or getattr(hook, "hookwire_edits", True)
    return sorted(roots), edits


def taps_of(modules: dict[str, nn.Module]) -> list[list[Any]]:
    """The module phases the workers tap for a step: those with hooks, as
    [path, "pre"/"post", roots, edits] (lm_head's hooks are on the logits processor:
    ModelHost.hook_targets)."""
    taps: list[list[Any]] = []
    for path, module in modules.items():
        if module._forward_pre_hooks:
            roots, edits = _reads(module._forward_pre_hooks)
            taps.append([path, "pre", roots, edits])
        if module._forward_hooks:
            roots, edits = _reads(module._forward_hooks)
            taps.append([path, "post", roots, edits])
    return taps


def run_pre(module: nn.Module, parts: dict[str, Any]) -> dict[str, Any] | None:
    """``module``'s forward pre-hooks on ``parts`` (args, kwargs) as torch runs them;
    the parts they left, or None when none changed anything."""
    args = parts.get("args", ())
    kwargs = parts.get("kwargs", {})
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    changed = False
    for hook_id, hook in list(module._forward_pre_hooks.items()):
        if hook_id in module._forward_pre_hooks_with_kwargs:
            result = hook(module, args, kwargs)
            if result is not None:
                args, kwargs = result
                changed = True
        else:
            result = hook(module, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
                changed = True
    return {"args": args, "kwargs": kwargs} if changed else None


def run_post(module: nn.Module, parts: dict[str, Any]) -> dict[str, Any] | None:
    """``module``'s forward hooks on ``parts`` (args, kwargs, output) as torch runs them;
    the parts with the output they left, or None when none changed it."""
    args = parts.get("args", ())
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    kwargs = parts.get("kwargs", {})
    output = parts["output"]
    changed = False
    for hook_id, hook in list(module._forward_hooks.items()):
        if hook_id in module._forward_hooks_with_kwargs:
            result = hook(module, args, kwargs, output)
        else:
            result = hook(module, args, output)
        if result is not None:
            output = result
            changed = True
    return {"output": output} if changed else None


_LINK = threading.local()


def on_link_thread() -> bool:
    """Whether this thread serves a worker's connection (it runs a step's hooks: it must
    not wait for another model's steps)."""
    return bool(getattr(_LINK, "serving", False))


class LinkEngine(Protocol):
    """What the link calls in the engine (vllm_engine.VllmEngine), on a connection's thread."""

    def link_step(self, ids: list[str], starts: list[int],
                  last: list[int] | None = None, stage: int = 0) -> tuple[dict[str, Any], list[bytes]]: ...
    def link_tap(self, path: str, phase: str, parts: dict[str, Any]) -> dict[str, Any] | None: ...
    def link_logits(self, logits: torch.Tensor) -> None: ...
    def link_slots(self, pairs: list[list[str]], values: list[Any], stage: int = 0) -> None: ...
    def link_end(self, fired: list[Any] | None = None, values: list[Any] | None = None,
                 bad: dict[int, str] | None = None, saved: list[list[Any]] | None = None, stage: int = 0) -> None: ...
    def link_closed(self) -> None: ...
    def lost(self, why: str) -> None: ...


def tcp_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for an IPv6 host) as a socket address; ValueError
    saying what is wrong."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{text!r} is not HOST:PORT (a port from 0 to 65535; 0 picks a free one)")
    if host in ("0.0.0.0", "::", "0:0:0:0:0:0:0:0"):
        raise ValueError(f"{text!r}: {host} is no address a rank can dial (the ranks connect to HOST): name this "
                         "server's address on the ranks' network")
    return host, int(port)


class WorkerLink:
    """Listens for the workers' connections and serves each on a thread of its own.

    By default on a Unix socket in a private folder (ranks on this machine); with
    ``tcp`` (``HOST:PORT``, port 0 for a free one) on a TCP socket, which ranks on other
    machines reach at that host (``address`` is then ``tcp://HOST:PORT``). Either way a
    connection must prove it holds ``authkey`` (multiprocessing's HMAC challenge, both
    ways) before anything is read from it; what travels is not encrypted (bytes of the
    model's activations): keep a TCP link on a private network."""

    def __init__(self, name: str, tcp: str | None = None, cores: list[int] | None = None) -> None:
        """Listens at once (OSError: the address is taken or not this machine's). ``cores``:
        the cores the link's threads keep to (those the workers leave to the front:
        vllm_threads.keep_to); [] or None: wherever the kernel runs them."""
        self.name = name
        self.cores = list(cores or [])
        self._folder = tempfile.TemporaryDirectory(prefix="hookwire-vllm-")
        self.authkey = secrets.token_bytes(32)
        try:
            if tcp is None:
                self.address = os.path.join(self._folder.name, "link")
                self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self._socket.bind(self.address)
                self._socket.listen(4)
            else:
                host, port = tcp_address(tcp)
                family = socket.AF_INET6 if ":" in host else socket.AF_INET
                self._socket = socket.create_server((host, port), family=family, backlog=4)
                bound = self._socket.getsockname()
                shown = f"[{host}]" if ":" in host else host
                self.address = f"tcp://{shown}:{bound[1]}"
        except BaseException:
            self._folder.cleanup()
            raise
        #: What the workers' messages go to (set before their first step).
        self.engine: LinkEngine | None = None
        self._closed = False
        self._threads: list[threading.Thread] = []
        #: The worker processes' pids, by rank (set once they are linked).
        self.pids: list[int] = []

    def start(self, connections: int) -> None:
        """Accepts ``connections`` workers' connections, each served on a thread of its
        own (started now: the caller then makes the workers connect). Set ``engine``
        before the workers run a step."""
        for i in range(connections):
            thread = threading.Thread(target=self._accept, name=f"vllm-link:{self.name}:{i}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _accept(self) -> None:
        vllm_threads.keep_to(self.cores)  # off the workers' cores: a step's messages wake this thread
        while True:
            try:
                sock, _ = self._socket.accept()
            except OSError as exc:  # closed before a worker connected
                if not self._closed:
                    log.error("model %r: a vLLM worker could not connect: %r", self.name, exc)
                return
            conn = _authenticated(sock, self.authkey)
            if conn is None:
                # Not a worker of this model (a stray, silent or hostile connection on a TCP
                # link): refused before anything of it was read; the rank's slot stays open.
                log.warning("model %r: a connection to the vLLM link failed authentication within %.0f s",
                            self.name, HANDSHAKE_SECONDS)
                continue
            with conn:
                self._serve(conn)
            return

    def _serve(self, conn: Connection) -> None:
        engine: LinkEngine | None = None
        _LINK.serving = True
        stage = 0  # the pipeline stage this connection serves (its step messages name it)
        try:
            while True:
                header = json.loads(conn.recv_bytes())
                engine = self.engine  # set before the workers' first step
                if engine is None:
                    raise ValueError("a worker ran a step before the model was ready")
                kind = header.get("t")
                if kind == "step":
                    last = header.get("last")
                    stage = int(header.get("stage", 0))
                    reply, blobs = engine.link_step(list(header["ids"]), list(header["starts"]),
                                                    [int(t) for t in last] if isinstance(last, list) else None, stage)
                    conn.send_bytes(plan.pack(reply, blobs))
                elif kind == "tap":
                    parts = _receive_value(conn)
                    new = engine.link_tap(str(header["path"]), str(header["phase"]), parts)
                    if header.get("edits"):
                        _answer(conn, new)
                elif kind == "slots":  # read back before a step whose hooks run here
                    pairs = [[str(k), str(n)] for k, n in header.get("slots", ())]
                    engine.link_slots(pairs, [_receive_value(conn) for _ in pairs], stage)
                elif kind == "logits":
                    engine.link_logits(_receive_value(conn))
                elif kind == "end":
                    fired = header.get("fired")
                    values = _receive_values(conn, header)
                    bad = header.get("bad") or {}
                    saved = header.get("slots")
                    # The worker goes on at once (vLLM samples, its engine core schedules the
                    # next step) while the step's hooks finish here. Its tokens cannot overtake
                    # its events: the engine's worker thread takes a step's outputs under the
                    # engine's lock, which this thread holds from link_step until link_end returns.
                    conn.send_bytes(b"{}")
                    engine.link_end(fired if isinstance(fired, list) else None, values,
                                    {int(k): str(v) for k, v in bad.items()},
                                    saved if isinstance(saved, list) else None, stage)
                else:
                    raise ValueError(f"unknown message {kind!r}")
        except (EOFError, OSError) as exc:
            engine = self.engine
            if not self._closed and engine is not None:
                engine.lost(f"a vLLM worker process of model {self.name!r} went away ({type(exc).__name__})")
        except Exception as exc:  # a protocol error: the model cannot go on
            engine = self.engine
            if self._closed:  # shutting down: a stage waiting for its turn is told so
                log.debug("model %r: a link thread ends at shutdown: %r", self.name, exc)
            else:
                log.exception("model %r: the link to a vLLM worker failed", self.name)
            if engine is not None and not self._closed:
                engine.lost(f"the link to a vLLM worker of model {self.name!r} failed: {type(exc).__name__}: {exc}")
        finally:
            engine = self.engine
            if engine is not None:
                engine.link_closed()  # a step this thread had open ends (its lock goes back)

    def close(self) -> None:
        self._closed = True
        try:
            # shutdown wakes a thread blocked in accept (close alone does not on Linux).
            with contextlib.suppress(OSError):
                self._socket.shutdown(socket.SHUT_RDWR)
            self._socket.close()
        finally:
            self._folder.cleanup()


#: How long a new connection has to pass the key's challenge (both ways) before it is
#: dropped: a peer that connects and says nothing must not hold the rank's accept.
HANDSHAKE_SECONDS = 10.0


def _authenticated(sock: socket.socket, authkey: bytes) -> Connection | None:
    """The connection on ``sock`` once it proved it holds ``authkey`` and this side proved
    it too (multiprocessing's HMAC challenge, as its Listener does, server first), all
    within HANDSHAKE_SECONDS of accepting it; None (closed) when it fails, stalls,
    trickles or hangs up."""
    # A deadline for the whole challenge, not for each read: at it, the socket is shut
    # down, which ends any read the challenge is blocked in (EOFError or OSError).
    expired: list[bool] = []
    watchdog = threading.Timer(HANDSHAKE_SECONDS, _shut, args=(sock, expired))
    watchdog.daemon = True
    watchdog.start()
    try:
        conn = Connection(os.dup(sock.fileno()))
    except OSError:
        watchdog.cancel()
        sock.close()
        return None
    try:
        deliver_challenge(conn, authkey)
        answer_challenge(conn, authkey)
    except (AuthenticationError, EOFError, OSError, ValueError):
        watchdog.cancel()
        conn.close()
        sock.close()
        return None
    watchdog.cancel()
    watchdog.join()
    sock.close()  # the connection holds its own descriptor of the socket
    if expired:  # the deadline passed as the challenge ended: the socket is shut down
        conn.close()
        return None
    return conn


def _shut(sock: socket.socket, expired: list[bool]) -> None:
    expired.append(True)
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _receive_value(conn: Connection) -> Any:
    """The next value frame, decoded."""
    data = conn.recv_bytes()
    if not data:
        return None  # a value the worker could not encode (it says so in the header)
    msg = tensor_pb2.Value()
    msg.ParseFromString(data)
    return codec.decode_value(msg, where="tap")


def _receive_values(conn: Connection, header: dict[str, Any]) -> list[Any]:
    """The captured values that follow a worker's step end ``header`` (runtime.plan;
    vllm_worker.send_end), each as its ``Value`` message (events copy its bytes as they
    are: codec.encode_value_into); None where the worker could not encode one (size 0).
    ValueError where what arrives disagrees with the header (the link cannot go on)."""
    sizes = [int(n) for n in header.get("sizes", ())]
    if len(sizes) != int(header.get("values", 0)):
        raise ValueError(f"a worker's step end names {header.get('values', 0)} values and {len(sizes)} sizes")
    if not sizes:
        return []
    if header.get("joined", True):  # one message, cut by the sizes
        data = conn.recv_bytes()
        if len(data) != sum(sizes):
            raise ValueError(f"a worker's step end carried {len(data)} bytes of values, its header {sum(sizes)}")
        view = memoryview(data)
        cuts = itertools.accumulate(sizes, initial=0)
        frames: list[Any] = [view[a:a + n] for a, n in zip(cuts, sizes)]
    else:  # one message each
        frames = []
        for n in sizes:
            frames.append(conn.recv_bytes())
            if len(frames[-1]) != n:
                raise ValueError(f"a worker's captured value carried {len(frames[-1])} bytes, its header {n}")
    values: list[Any] = []
    for frame in frames:
        if not len(frame):
            values.append(None)
            continue
        msg = tensor_pb2.Value()
        msg.ParseFromString(frame)
        values.append(msg)
    return values


def _answer(conn: Connection, new: dict[str, Any] | None) -> None:
    if new is None:
        conn.send_bytes(b'{"value": false}')
        return
    conn.send_bytes(b'{"value": true}')
    conn.send_bytes(codec.encode_value(plain(new)).SerializeToString())
