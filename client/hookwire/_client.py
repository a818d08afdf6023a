"""The async client: connection, models, sessions, hooks, subscriptions."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import ipaddress
import logging
import os
import urllib.parse
from types import TracebackType
from typing import Any, AsyncIterator, Callable, Generator, Iterable, Literal, Mapping, Protocol, Sequence, Union

import grpc

from .wire import codec
from .wire.framing import INFER_STREAM_CHUNK, CutReply, RawChunk
from ._credentials import bearer_token_interceptors, channel_credentials
from ._transport import TensorCalls, unary
from ._errors import FailedPreconditionError, HookwireError, NotFoundError, UnavailableError, from_rpc_error
from . import _harvest
from ._generation import GenerateStream, generate_request
from ._harvest import HarvestJob, HarvestProgress
from ._operands import OperandInfo, upload_messages
from ._progress import TransferProgress
from ._parameters import CastName, parameters_request, read_parameters
from ._session import EventRouter, kind_of, pump, reader_policy, uncut
from ._cache import ActivationCache, cache_hooks
from ._specs import (
    ActionLike, Backward, CastName, HookSpec, HookSpecLike, OnErrorName, PartName, Sampling, ScopeName, StepsLike,
    spec_proto,
)
from ._types import HookInfo, InferResult, InterceptEvent, ModelInfo, Notice, SlotInfo, Tokenized
from .v1 import (
    harvest_service_pb2_grpc,
    hook_service_pb2,
    hook_service_pb2_grpc,
    model_service_pb2,
    model_service_pb2_grpc,
    operand_service_pb2,
    operand_service_pb2_grpc,
)

log = logging.getLogger("hookwire")

DEFAULT_TARGET = "127.0.0.1:50051"
#: Below this message limit, Infer always streams (InferStream), so responses fit too.
UNARY_MIN_MESSAGE_BYTES = 64 * 1024 * 1024
#: A call whose last reply (same model, mode and request-scoped hooks) was larger than
#: this streams (InferStream): its large tensors then come in chunks, each copied once
#: into its tensor, where a unary reply is copied whole at every step (see
#: docs/benchmarks.md: from 4 MiB on, streaming is faster, and stays linear in size).
STREAM_REPLY_BYTES = 4 * 1024 * 1024
#: How many kinds of call (see CallSizes) a client remembers.
CALL_SIZES_KEPT = 1024
_MODES = {"eval": model_service_pb2.MODE_EVAL, "train": model_service_pb2.MODE_TRAIN}


@dataclasses.dataclass(frozen=True)
class ConnectOptions:
    """Connection settings."""

    #: Largest message sent or received, in bytes (gRPC's 4 MiB default is too small for tensors).
    max_message_bytes: int = 1024 * 1024 * 1024
    #: Deadline in seconds for unary calls; None for none.
    timeout: float | None = None
    #: Buffer of the session stream on the server, and the SDK's read-ahead of it, in
    #: events (0: the server's default, 1024).
    session_max_events: int = 0
    #: The same in bytes of tensor data (0: the server's default, 32 MiB).
    session_max_bytes: int = 0
    #: What the session stream does when its buffer is full: "default" (block for this
    #: client's own calls, drop the oldest of other callers'), "block", "drop_oldest", "drop_newest".
    session_policy: PolicyName = "default"
    #: Bearer token sent with every call; None reads HOOKWIRE_TOKEN (unset: no token).
    token: str | None = dataclasses.field(default=None, repr=False)
    #: Use TLS. Implied by tls_ca / tls_cert and by an https:// target.
    tls: bool = False
    #: CA certificate (path or PEM bytes) that verifies the server; None for the system roots.
    tls_ca: str | bytes | None = None
    #: Client certificate and key (paths or PEM bytes) for mTLS.
    tls_cert: str | bytes | None = None
    tls_key: str | bytes | None = dataclasses.field(default=None, repr=False)
    #: Expected server name in its certificate, when it differs from the target's host.
    tls_server_name: str | None = None

    @property
    def stream_max_message_bytes(self) -> int:
        """The largest message streams send to this client (larger events come in chunks)."""
        return min(self.max_message_bytes, 2**31 - 1)


class CallSizes:
    """Which kinds of Infer call had a large reply last time, so that the next one of
    the kind streams. A kind is the model, the mode and the request-scoped hooks; the
    most recent CALL_SIZES_KEPT kinds are kept. Streaming or not never changes a
    result, only how it travels."""

    def __init__(self) -> None:
        self._large: collections.OrderedDict[tuple[Any, ...], None] = collections.OrderedDict()

    @staticmethod
    def kind(request: model_service_pb2.InferRequest) -> tuple[Any, ...]:
        """The kind of a call (cheap: the hooks' bytes, without tensors)."""
        return (request.model, request.mode, request.HasField("backward"),
                tuple(spec.SerializeToString(deterministic=True) for spec in request.hooks))

    def expects_large(self, kind: tuple[Any, ...]) -> bool:
        """Whether the last reply of this kind was large."""
        return kind in self._large

    def note(self, kind: tuple[Any, ...], reply_bytes: int) -> None:
        """Records the size of a reply of this kind."""
        if reply_bytes > STREAM_REPLY_BYTES:
            self._large[kind] = None
            self._large.move_to_end(kind)
            if len(self._large) > CALL_SIZES_KEPT:
                self._large.popitem(last=False)
        else:
            self._large.pop(kind, None)


class CallLike(Protocol):
    """A finished or running call, named by its request id: an InferResult, a
    GenerateResult, or a GenerateStream once it has started."""

    @property
    def request_id(self) -> str:
        """The server's id of the call."""
        ...


#: A call for ``events(until=...)``: a CallLike, or a request id.
CallRef = Union[str, CallLike]


def request_id_of(call: CallRef) -> str:
    """The request id ``call`` names; TypeError / ValueError when it names none."""
    request_id = call if isinstance(call, str) else getattr(call, "request_id", None)
    if not isinstance(request_id, str):
        raise TypeError(f"until: expected a call result or a request id, not {type(call).__name__}")
    if not request_id:
        raise ValueError("until: the call has no request id yet (a GenerateStream that has not started: "
                         "await stream.start() first)")
    return request_id


PolicyName = Literal["default", "block", "drop_oldest", "drop_newest"]
_POLICIES = {
    "default": hook_service_pb2.DELIVERY_POLICY_UNSPECIFIED,
    "block": hook_service_pb2.DELIVERY_POLICY_BLOCK,
    "drop_oldest": hook_service_pb2.DELIVERY_POLICY_DROP_OLDEST,
    "drop_newest": hook_service_pb2.DELIVERY_POLICY_DROP_NEWEST,
}


def _delivery(policy: str, max_events: int, max_bytes: int, max_message_bytes: int) -> hook_service_pb2.DeliveryOptions:
    if policy not in _POLICIES:
        raise ValueError(f"policy must be one of {sorted(_POLICIES)}, not {policy!r}")
    return hook_service_pb2.DeliveryOptions(
        policy=_POLICIES[policy], max_events=max_events, max_bytes=max_bytes,
        max_message_bytes=min(max_message_bytes, 2**32 - 1),
    )

def _is_loopback_target(target: str) -> bool:
    host = target.rsplit(":", 1)[0].strip("[]").removeprefix("ipv4:").removeprefix("ipv6:")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_URL_PORTS = {"http": 80, "https": 443}


def resolve_target(target: str) -> tuple[str, bool]:
    """The gRPC target to dial for what a user typed, and whether it asks for TLS.

    ``host:port`` and gRPC's own target URIs (``dns:///host:port``,
    ``unix:/path``, ``ipv4:...``, ``ipv6:...``) pass through unchanged (False).
    ``http://host[:port]`` becomes ``host:port`` in plaintext (port 80 when
    omitted); ``https://host[:port]`` becomes ``host:port`` over TLS (port 443
    when omitted), as browsers and ``buf curl`` read them. Raises ValueError for
    a URL with a path, query, fragment or user name, and for ``grpc://`` or
    ``grpcs://`` (not target syntax: use ``host:port`` or ``https://``).
    """
    scheme, sep, _ = target.partition("://")
    scheme = scheme.lower()
    if not sep:
        return target, False
    if scheme in ("grpc", "grpcs"):
        raise ValueError(
            f"target {target!r}: {scheme}:// is not a gRPC target; use host:port (plaintext) or https://host:port (TLS)"
        )
    if scheme not in _URL_PORTS:
        return target, False  # a gRPC URI such as dns://authority/host:port
    url = urllib.parse.urlsplit(target)
    if url.path not in ("", "/") or url.query or url.fragment or url.username is not None or not url.hostname:
        raise ValueError(f"target {target!r}: give {scheme}://host:port with nothing after the port")
    try:
        port = url.port
    except ValueError:
        raise ValueError(f"target {target!r}: the port is not a number from 0 to 65535") from None
    host = f"[{url.hostname}]" if ":" in url.hostname else url.hostname
    return f"{host}:{port if port is not None else _URL_PORTS[scheme]}", scheme == "https"


def connect(target: str = DEFAULT_TARGET, *, options: ConnectOptions | None = None) -> Client:
    """A client for the server at ``target``.

    ``target`` is ``host:port``, a gRPC target URI (``dns:///host:port``), or
    ``http://host:port`` / ``https://host:port`` (https means TLS; see
    ``resolve_target``). Nothing is sent until the first call. Use it as
    ``async with connect(...) as client:``, or call ``await client.close()``
    when done. Raises ValueError for a target it cannot read, or for an
    ``http://`` target with TLS options. A call to a server that does not
    answer raises UnavailableError naming the target.
    """
    return Client(target, options=options or ConnectOptions())


class Client:
    """A connection to a hookwire server.

    The client opens one session lazily, on the first hook it registers; its
    Infer calls then carry that session, so the session's hooks fire for them.
    Closing the client ends the session, which removes its hooks on the server.
    """

    def __init__(self, target: str, *, options: ConnectOptions) -> None:
        #: The address dialled ("host:port" for an http(s):// target).
        self.target, url_tls = resolve_target(target)
        tls_options = options.tls or options.tls_ca is not None or options.tls_cert is not None
        if target.lower().startswith("http://") and tls_options:
            raise ValueError(f"target {target!r} is plaintext (http://) but TLS options are set: use https://")
        self._tls = url_tls or tls_options
        self.options = options
        self._channel: grpc.aio.Channel | None = None
        self._models: model_service_pb2_grpc.ModelServiceStub | None = None
        self._hooks: hook_service_pb2_grpc.HookServiceStub | None = None
        self._streams: TensorCalls | None = None
        self._harvests: harvest_service_pb2_grpc.HarvestServiceStub | None = None
        self._operands: operand_service_pb2_grpc.OperandServiceStub | None = None
        #: Which Infer calls stream their replies (see CallSizes).
        self.call_sizes = CallSizes()
        self._session: Session | None = None
        self._session_lock: asyncio.Lock | None = None

    # ---------------------------------------------------------------- connection

    def _open(self) -> None:
        if self._channel is None:
            options = self.options
            size = options.max_message_bytes
            channel_options: list[tuple[str, Any]] = [
                ("grpc.max_send_message_length", size),
                ("grpc.max_receive_message_length", size),
                ("grpc.keepalive_time_ms", 10_000),
                ("grpc.keepalive_timeout_ms", 5_000),
                # gRPC core otherwise waits 60 s for a ping's ack, not keepalive_timeout.
                ("grpc.http2.ping_timeout_ms", 5_000),
            ]
            token = options.token if options.token is not None else os.environ.get("HOOKWIRE_TOKEN")
            interceptors = bearer_token_interceptors(token) if token else []
            if self._tls:
                if options.tls_server_name:
                    channel_options.append(("grpc.ssl_target_name_override", options.tls_server_name))
                credentials = channel_credentials(options.tls_ca, options.tls_cert, options.tls_key)
                self._channel = grpc.aio.secure_channel(
                    self.target, credentials, options=channel_options, interceptors=interceptors
                )
            else:
                if token and not _is_loopback_target(self.target):
                    log.warning("sending a bearer token to %s without TLS: anyone on the path can read it", self.target)
                self._channel = grpc.aio.insecure_channel(
                    self.target, options=channel_options, interceptors=interceptors
                )
            self._models = model_service_pb2_grpc.ModelServiceStub(self._channel)
            self._hooks = hook_service_pb2_grpc.HookServiceStub(self._channel)
            self._streams = TensorCalls(self._channel)
            self._harvests = harvest_service_pb2_grpc.HarvestServiceStub(self._channel)
            self._operands = operand_service_pb2_grpc.OperandServiceStub(self._channel)

    @property
    def model_stub(self) -> model_service_pb2_grpc.ModelServiceStub:
        """The raw ModelService stub (escape hatch)."""
        self._open()
        assert self._models is not None
        return self._models

    @property
    def hook_stub(self) -> hook_service_pb2_grpc.HookServiceStub:
        """The raw HookService stub (escape hatch)."""
        self._open()
        assert self._hooks is not None
        return self._hooks

    @property
    def harvest_stub(self) -> harvest_service_pb2_grpc.HarvestServiceStub:
        """The raw HarvestService stub (escape hatch)."""
        self._open()
        assert self._harvests is not None
        return self._harvests

    # ---------------------------------------------------------------- harvest

    @property
    def operand_stub(self) -> operand_service_pb2_grpc.OperandServiceStub:
        """The raw OperandService stub (escape hatch)."""
        self._open()
        assert self._operands is not None
        return self._operands

    # ---------------------------------------------------------------- named operands

    async def upload_operand(self, name: str, value: Any, *, ttl: float | None = None) -> OperandInfo:
        """Uploads a tensor or an ``rules.Sae`` (with its tensors) under ``name``, once;
        rules then name it (``rules.operand(name)``, ``rules.Sae.named(name)``) instead of
        carrying it. Without ``ttl`` it lives with this client's session (opened now if
        none is: closing the client deletes it, once no hook uses it); with ``ttl``
        seconds it outlives the client until then. Large tensors travel in 1 MiB chunks.
        Blocks until the server has it. Raises AlreadyExistsError (the name is taken),
        ResourceExhaustedError (over your operand quota, before any data is sent),
        InvalidArgumentError (not finite floats, an SAE whose shapes do not fit)."""
        if ttl is not None and not ttl > 0:
            raise ValueError(f"ttl must be a positive number of seconds, not {ttl}")
        session_id = "" if ttl is not None else (await self.session()).session_id
        messages = upload_messages(name, value, session_id=session_id,
                                   ttl_seconds=0 if ttl is None else min(max(1, int(ttl)), 2**32 - 1))
        # The header now, in the caller: a value that cannot be uploaded raises ValueError
        # here (inside gRPC's request stream it would surface as a cancelled call).
        header = next(messages)

        async def stream() -> AsyncIterator[Any]:
            yield header
            for message in messages:  # built lazily: one chunk's bytes at a time
                yield message

        try:
            reply = await self.tensor_calls.upload_operand(stream(), timeout=self.options.timeout)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, target=self.target) from None
        return OperandInfo.from_proto(reply)

    async def delete_operand(self, name: str, *, owner: str = "") -> int:
        """Deletes one of your operands (an operator may name another ``owner``, or
        unpublish a published one); returns the bytes freed. FailedPreconditionError
        while a hook or harvest job uses it (the message names them); NotFoundError."""
        request = operand_service_pb2.DeleteOperandRequest(name=name, owner=owner)
        return int((await self._unary(self.operand_stub.DeleteOperand, request)).nbytes)

    async def list_operands(self) -> list[OperandInfo]:
        """The published operands, then yours (an operator's listing: everyone's)."""
        reply = await self._unary(self.operand_stub.ListOperands, operand_service_pb2.ListOperandsRequest())
        return [OperandInfo.from_proto(op) for op in reply.operands]

    async def publish_operand(self, name: str, path: str) -> OperandInfo:
        """Operators: publishes a read-only operand for everyone from the server's
        operand folder (``path`` relative to its ``operand_root``): a folder in SAELens'
        layout (cfg.json, sae_weights.safetensors) or a .safetensors file of one tensor.
        PermissionDeniedError (not an operator, or a path leaving the folder)."""
        request = operand_service_pb2.PublishOperandRequest(name=name, path=path)
        return OperandInfo.from_proto(await self._unary(self.operand_stub.PublishOperand, request))

    async def harvest(self, model: str, modules: Sequence[str] | str, *, out: str, **options: Any) -> HarvestJob:
        """Starts a harvest job on the server (docs/harvest.md) and returns its handle at
        once; the job runs on the server whatever this client does. ``out`` and ``data``
        are paths under the server's harvest roots. Options (see ``harvest_request``):
        data, tokens, pad_token_id, text_field, format, split, dtype ("bfloat16", ...), part
        ("output" or "input"), select, rules, length, batch_size, packing ("truncate" or
        "pack"), bos, skip_first, positions, max_tokens, shard_tokens, shuffle,
        shuffle_buffer, seed, overwrite, worker_index, num_workers. Raises what StartHarvest
        answers (AlreadyExistsError for a finished dataset, FailedPreconditionError for a
        server without harvest storage, PermissionDeniedError for a path outside its roots,
        ...). ``await job.wait(progress=True)`` follows it to the end."""
        return await _harvest.start(self, _harvest.harvest_request(model, modules, out=out, **options))

    def harvest_job(self, job_id: str) -> HarvestJob:
        """A handle on an existing job (nothing is sent until it is used)."""
        return HarvestJob(self, job_id)

    async def harvests(self, *, model: str | None = None, active_only: bool = False) -> list[HarvestProgress]:
        """The caller's harvest jobs (everyone's for operators), newest first."""
        return await _harvest.list_jobs(self, model, active_only)

    async def harvest_local(self, model: str, modules: Sequence[str] | str, *, out: str, **options: Any) -> HarvestProgress:
        """Harvests from this client into ``out`` (local or an fsspec URL), for servers
        without harvest storage; see ``hookwire._harvest.harvest_local``. Blocks until done."""
        return await _harvest.harvest_local(self, model, modules, out=out, **options)

    @property
    def tensor_calls(self) -> TensorCalls:
        """The RPCs that carry large tensors, as the SDK calls them (see TensorCalls)."""
        self._open()
        assert self._streams is not None
        return self._streams

    async def _unary(self, method: Any, request: Any) -> Any:
        return await unary(self, method, request)

    async def __aenter__(self) -> Client:
        self._open()
        return self

    def __enter__(self) -> Client:
        raise TypeError(
            "hookwire.connect() is the async client: use `async with hookwire.connect(...) as client:` "
            "(top-level await works in a Jupyter notebook), or `with hookwire.connect_sync(...) as client:` "
            "for blocking calls"
        )

    def __exit__(self, *exc: object) -> None:  # pragma: no cover - __enter__ always raises
        pass

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Ends the session (its hooks are removed) and closes the channel. Idempotent."""
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    # ---------------------------------------------------------------- models

    async def list_models(self) -> list[ModelInfo]:
        """The hosted models (without module trees)."""
        reply = await self._unary(self.model_stub.ListModels, model_service_pb2.ListModelsRequest())
        return [ModelInfo.from_proto(m) for m in reply.models]

    async def wait_ready(self, models: Sequence[str] | None = None, *, timeout: float | None = None) -> list[ModelInfo]:
        """Waits until every named model (every configured one when ``models`` is None)
        is ready, and returns their ModelInfo in that order.

        Blocks, polling ListModels, while models load; a server that does not answer
        yet (starting, not listening) is asked again. Raises FailedPreconditionError
        when a model failed to load (the message has the reason), NotFoundError when a
        named model is not configured on the server, TimeoutError when ``timeout``
        seconds pass first (None: no limit), and other HookwireErrors as ListModels
        raises them (e.g. UnauthenticatedError).
        """
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        delay = 0.05
        waiting_for = "the server to answer"
        while True:
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"models not ready after {timeout} s: waiting for {waiting_for}")
            try:
                reply = await self.model_stub.ListModels(model_service_pb2.ListModelsRequest(), timeout=remaining)
            except grpc.RpcError as exc:
                error = from_rpc_error(exc)
                if not isinstance(error, UnavailableError) and error.code != "DEADLINE_EXCEEDED":
                    raise error from None
                waiting_for = f"the server to answer ({error})"
            else:
                listed = {m.name: ModelInfo.from_proto(m) for m in reply.models}
                wanted = list(listed) if models is None else list(models)
                unknown = [name for name in wanted if name not in listed]
                if unknown:
                    raise NotFoundError(f"no model {', '.join(map(repr, unknown))} on {self.target} "
                                        f"(configured: {', '.join(sorted(listed)) or 'none'})")
                failed = [listed[name] for name in wanted if listed[name].state == "failed"]
                if failed:
                    raise FailedPreconditionError(
                        "; ".join(f"model {m.name!r} failed to load: {m.state_message}" for m in failed)
                    )
                loading = [name for name in wanted if listed[name].state != "ready"]
                if not loading:
                    return [listed[name] for name in wanted]
                waiting_for = f"{', '.join(loading)} to load"
            pause = delay if deadline is None else min(delay, max(0.0, deadline - loop.time()))
            await asyncio.sleep(pause)
            delay = min(delay * 2, 1.0)

    def model(self, name: str) -> RemoteModel:
        """A handle on a hosted model; nothing is sent until it is used."""
        return RemoteModel(self, name)

    # ---------------------------------------------------------------- sessions and hooks

    async def session(self) -> Session:
        """The client's session, opened on first use (this call waits for the server)."""
        if self._session_lock is None:
            self._session_lock = asyncio.Lock()
        async with self._session_lock:
            if self._session is None or self._session.ended:
                self._session = await Session.open(self)
            return self._session

    def own_call(self, session_id: str) -> Callable[[], None]:
        """Counts a call made in the client's session ``session_id`` as in flight on the
        session's stream until the returned function is called: a "block" session stream
        is read past its bound meanwhile (EventRouter.own_call). A no-op for another or no
        session."""
        session = self._session
        if session_id and session is not None and not session.ended and session.session_id == session_id:
            return session.router.own_call()
        return lambda: None

    @property
    def session_id(self) -> str:
        """The open session's id, or "" before one is opened."""
        return self._session.session_id if self._session is not None and not self._session.ended else ""

    async def register_hook(self, spec: HookSpec, *, model: str = "") -> HookHandle:
        """Registers ``spec``; returns once the hook is attached.

        A spec with ``ttl_seconds`` is registered without a session (it outlives this
        client until the TTL, needs scope "all" or "tagged", and its events reach
        subscribers: ``handle.events()`` subscribes). Otherwise it joins the client's
        session. Raises NotFoundError (model, module), InvalidArgumentError (spec).
        """
        if spec.ttl_seconds:
            request = hook_service_pb2.RegisterHookRequest(spec=spec.to_proto(model))
            reply = await self._unary(self.hook_stub.RegisterHook, request)
            return HookHandle(self, HookInfo.from_proto(reply), None)
        session = await self.session()
        return await session.register(spec, model=model)

    async def list_hooks(
        self, *, model: str = "", session_id: str = "", include_operand_data: bool = False,
    ) -> list[HookInfo]:
        """Registered hooks on the server, oldest first, optionally filtered.

        Rule operand tensors in ``HookInfo.raw.spec`` carry only their dtype and shape,
        unless ``include_operand_data`` (then the reply holds every operand's bytes,
        which can be large). Raises the SDK's errors (e.g. UnavailableError).
        """
        request = hook_service_pb2.ListHooksRequest(
            model=model, session_id=session_id, include_operand_data=include_operand_data
        )
        reply = await self._unary(self.hook_stub.ListHooks, request)
        return [HookInfo.from_proto(h) for h in reply.hooks]

    async def deregister_hook(self, hook_id: str) -> bool:
        """Removes any hook by id; False when it was unknown or already removed."""
        reply = await self._unary(self.hook_stub.DeregisterHook, hook_service_pb2.DeregisterHookRequest(hook_id=hook_id))
        return bool(reply.removed)

    async def get_slot(self, name: str) -> Any:
        """The tensor a ``save`` rule kept in slot ``name`` of this client's session.

        NotFoundError when the slot is empty (or no session is open).
        """
        reply = await self._unary(
            self.hook_stub.GetSlot, hook_service_pb2.GetSlotRequest(session_id=self.session_id, name=name)
        )
        return codec.decode_tensor(reply.tensor, where=f"slot {name!r}")

    async def list_slots(self) -> list[SlotInfo]:
        """The slots of this client's session (names, dtypes, shapes, sizes)."""
        reply = await self._unary(
            self.hook_stub.ListSlots, hook_service_pb2.ListSlotsRequest(session_id=self.session_id)
        )
        return [SlotInfo.from_proto(s) for s in reply.slots]

    def subscribe(
        self, hook_ids: Iterable[str], *, policy: PolicyName = "default", max_events: int = 0, max_bytes: int = 0,
    ) -> Subscription:
        """A further stream of the events of existing hooks (fan-out).

        ``policy`` is what the server does when this stream's buffer is full: the
        default drops the oldest events (a subscriber never slows the model);
        "block" is lossless and makes passes wait for this reader. ``max_events`` and
        ``max_bytes`` (0: the server's defaults) bound that buffer and the SDK's own
        read-ahead of the stream, where the same policy applies (see ``start``). Lazy:
        the RPC starts on ``async with`` (which waits until the server has attached the
        stream, so later events are not missed) or on first iteration.
        """
        request = hook_service_pb2.SubscribeRequest(
            hook_ids=list(hook_ids),
            delivery=_delivery(policy, max_events, max_bytes, self.options.stream_max_message_bytes),
        )
        return Subscription(self, request)


class Session:
    """A server session: its stream of events and the hooks registered in it."""

    def __init__(self, client: Client, call: grpc.aio.UnaryStreamCall, session_id: str,
                 delivery: hook_service_pb2.DeliveryOptions | None = None) -> None:
        self._client = client
        self._call = call
        self.session_id = session_id
        delivery = delivery or hook_service_pb2.DeliveryOptions()
        #: The stream's events read ahead of the hooks' readers, bounded like the server's
        #: buffer (see EventRouter).
        self.router = EventRouter(policy=reader_policy(delivery.policy, session=True),
                                  max_events=delivery.max_events, max_bytes=delivery.max_bytes)
        self._pump = asyncio.ensure_future(pump(call, self.router, client.target))

    @classmethod
    async def open(cls, client: Client) -> Session:
        """Opens a session; waits for the server's SessionOpened."""
        options = client.options
        request = hook_service_pb2.OpenSessionRequest(
            delivery=_delivery(options.session_policy, options.session_max_events, options.session_max_bytes,
                               options.stream_max_message_bytes)
        )
        call = client.tensor_calls.open_session(request)
        try:
            first = await call.read()
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, target=client.target) from None
        if first is grpc.aio.EOF or kind_of(first) != "opened":
            call.cancel()
            raise ConnectionError("the server did not open a session")
        return cls(client, call, first.opened.session_id, request.delivery)

    @property
    def ended(self) -> bool:
        """True once the stream has ended (closed, or the server went away)."""
        return self.router.closed

    async def register(self, spec: HookSpec, *, model: str = "") -> HookHandle:
        """Registers a hook in this session; see Client.register_hook."""
        request = hook_service_pb2.RegisterHookRequest(session_id=self.session_id, spec=spec.to_proto(model))
        reply = await self._client._unary(self._client.hook_stub.RegisterHook, request)
        info = HookInfo.from_proto(reply)
        self.router.modules[info.hook_id] = info.modules
        return HookHandle(self._client, info, self.router)

    async def close(self) -> None:
        """Ends the stream; the server removes the session's hooks. Idempotent."""
        self._call.cancel()
        self._pump.cancel()  # it may be waiting for its readers (EventRouter.room), not on the stream
        await asyncio.gather(self._pump, return_exceptions=True)


class HookHandle:
    """A registered hook. ``remove()`` is idempotent; ``async with`` removes it on exit."""

    def __init__(self, client: Client, info: HookInfo, router: EventRouter | None) -> None:
        self._client = client
        self.info = info
        self._router = router  # None for a hook without a session
        self._removed = False
        #: A hook without a session: the subscription its events() reads, from the first
        #: iteration until remove().
        self._subscription: Subscription | None = None

    @property
    def id(self) -> str:
        """The server's hook id."""
        return self.info.hook_id

    @property
    def modules(self) -> tuple[str, ...]:
        """The module paths the pattern resolved to."""
        return self.info.modules

    def events(self, *, until: CallRef | None = None, timeout: float | None = None) -> AsyncIterator[InterceptEvent]:
        """The hook's events, in firing order, as they arrive.

        Waits for each event; ends after the hook is removed (every event fired
        before the removal is delivered first) or raises the session's error if
        its stream failed. For a hook without a session this subscribes (with the
        default drop policy) when the first iteration starts, and keeps that
        subscription until ``remove()``, so events of calls made between two
        iterations wait for the next one.

        ``until`` (a call: its InferResult or GenerateResult, a started
        GenerateStream, or a request id) also ends the iteration once that call is
        over on the session stream, without a timeout: the server sends a CallEnded
        marker after the call's last event on the stream, and the iteration ends
        when the marker has arrived and every event of this hook that came before
        it has been yielded (unread events of earlier calls come first; the call
        may still be running when iteration starts). It ends at once for a call
        whose marker an earlier iteration already passed. The server marks the
        calls made in the session (with this client's session: every call, also
        one none of its hooks captured anything from) and the calls that had
        events on the stream. Another caller's call seen by a scope "all" or
        "tagged" hook gets a marker only if one of the session's hooks captured
        from it (else the iteration waits until the hook is removed or the session
        ends), and may lose it, as it may lose events, when this client has fallen
        far behind (more than max(1024, the stream's max_events) unread markers). Raises ValueError for a hook without a
        session (subscribe with ``client.subscribe`` before the call, and use
        ``Subscription.events(until=...)``: a subscription started later could
        miss the marker).

        ``timeout`` (seconds) also ends the iteration, quietly, once no event has
        arrived for that long: a way out for a hook whose events may never come
        (sampled away, another caller's calls). It is an idle limit, not a limit on
        the whole iteration; events that come later stay queued for the next one.

        Events not yet read wait in the SDK up to the stream's limits
        (``ConnectOptions.session_max_events`` / ``session_max_bytes``), past which the
        stream's policy applies (``session_policy``; docs/sdk.md): the default and
        "block" stop reading, so that the session's own calls wait for the reader.
        """
        request_id = None if until is None else request_id_of(until)
        _check_timeout(timeout)
        if self._router is None:
            if request_id is not None:
                raise ValueError(
                    "events(until=...) needs a session hook; for a hook without a session, start "
                    "client.subscribe([hook.id]) before the call and iterate sub.events(until=call)"
                )
            return self._subscribed_events(timeout)
        return self._router.events(self.id, until=request_id, timeout=timeout)

    async def _subscribed_events(self, timeout: float | None) -> AsyncIterator[InterceptEvent]:
        # One subscription for the handle's life (closed by remove()): one per iteration lost
        # the events of calls made between two iterations that ended on their timeout.
        if self._removed:
            return  # removed: nothing to subscribe to (and nothing would close it)
        if self._subscription is None:
            self._subscription = self._client.subscribe([self.id])
            self._subscription.modules[self.id] = self.modules
        async for event in self._subscription.events(timeout=timeout):
            yield event

    async def remove(self) -> bool:
        """Removes the hook on the server; True if this call removed it. Safe to repeat."""
        if self._removed:
            return False
        self._removed = True
        subscription, self._subscription = self._subscription, None
        try:
            if self._router is not None and self._router.closed:
                return False  # the session is gone, and its hooks with it
            return await self._client.deregister_hook(self.id)
        finally:
            if subscription is not None:
                await subscription.aclose()

    async def __aenter__(self) -> HookHandle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.remove()


class PendingHook:
    """``model.hook(...)``: await it for a HookHandle, or use ``async with`` to remove on exit."""

    def __init__(self, client: Client, spec: HookSpec, model: str) -> None:
        self._client = client
        self._spec = spec
        self._model = model
        self._handle: HookHandle | None = None

    def __await__(self) -> Generator[Any, None, HookHandle]:
        return self._client.register_hook(self._spec, model=self._model).__await__()

    async def __aenter__(self) -> HookHandle:
        self._handle = await self._client.register_hook(self._spec, model=self._model)
        return self._handle

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._handle is not None:
            await self._handle.remove()


class Subscription:
    """A Subscribe stream: ``async with client.subscribe(ids) as sub: async for event in sub: ...``."""

    def __init__(self, client: Client, request: hook_service_pb2.SubscribeRequest) -> None:
        self._client = client
        self._request = request
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._pump: asyncio.Future[None] | None = None
        self._closed = False
        delivery = request.delivery
        # Every hook's events in one inbox, in arrival order, read ahead no further than
        # the stream's policy and limits allow (see EventRouter).
        self._router = EventRouter(policy=reader_policy(delivery.policy, session=False),
                                   max_events=delivery.max_events, max_bytes=delivery.max_bytes, one_inbox=True)
        self._router.resolve = self._resolve_modules
        #: The subscribed hooks' resolved modules, which their compact readout events index
        #: (InterceptEvent.expand); listed (ListHooks) at the first such event of a hook
        #: not here.
        self.modules: dict[str, Sequence[str]] = self._router.modules

    @property
    def notices(self) -> list[Notice]:
        """Notices received so far (drops, removed or disabled hooks)."""
        return self._router.notices

    async def start(self) -> None:
        """Starts the RPC and waits until the server has attached it. Idempotent. From
        then on the SDK reads the stream in the background, ahead of ``events`` by at most
        the stream's ``max_events`` / ``max_bytes`` (the server's defaults for 0): past
        that it drops (policy "drop_oldest", the default, or "drop_newest"; counted in
        each event's ``dropped``) or, for "block", stops reading so that the server's
        buffer fills and the server's policy applies."""
        if self._call is not None:
            return
        self._call = self._client.tensor_calls.subscribe(self._request)
        try:
            first = await self._call.read()
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, target=self._client.target) from None
        if first is grpc.aio.EOF or kind_of(first) != "subscribed":
            raise ConnectionError("the server did not confirm the subscription")
        self._pump = asyncio.ensure_future(pump(self._call, self._router, self._client.target))

    async def __aenter__(self) -> Subscription:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Ends the subscription (an iteration running in another task ends quietly)."""
        self._closed = True
        if self._call is not None:
            self._call.cancel()
        if self._pump is not None:
            self._pump.cancel()  # it may be waiting for readers (EventRouter.room), not on the stream
            await asyncio.gather(self._pump, return_exceptions=True)
        self._router.end()  # also when the pump never ran: its readers stop

    async def _resolve_modules(self, hook_id: str) -> None:
        try:
            self.modules.update({h.hook_id: h.modules for h in await self._client.list_hooks()})
        except HookwireError:
            pass
        self.modules.setdefault(hook_id, ())  # not listed (removed): "#INDEX", once

    def __aiter__(self) -> AsyncIterator[InterceptEvent]:
        """Events of the subscribed hooks; ends when all of them are removed."""
        return self.events()

    async def events(self, *, until: CallRef | None = None, timeout: float | None = None) -> AsyncIterator[InterceptEvent]:
        """Events of the subscribed hooks, in arrival order; ends when all of them are
        removed (or the subscription is closed); raises the stream's error once the
        events that came before it are read. Starts the subscription if needed (see
        ``start``).

        ``until`` (a call's result, a started GenerateStream, or a request id) also ends
        it at that call's CallEnded marker: every event the call put on this stream
        came before it. It ends at once when an earlier iteration already passed the
        marker. Only calls that had events on this stream are marked (see
        HookHandle.events), and only calls that ran after ``start()``: start the
        subscription before the call.

        ``timeout`` (seconds) also ends it once nothing has arrived for that long (see
        HookHandle.events); what arrives later is kept for the next iteration.
        """
        request_id = None if until is None else request_id_of(until)
        _check_timeout(timeout)
        if self._closed:
            return
        await self.start()
        inner = self._router.events("", until=request_id, timeout=timeout)
        try:
            async for event in inner:
                if self._closed:
                    return  # aclose() from another task (or remove() of its hook)
                yield event
        finally:
            await inner.aclose()


def _check_timeout(timeout: float | None) -> None:
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0 (or None: no limit), not {timeout!r}")


def _cut_result(reply: CutReply, model: str = "") -> InferResult:
    """The InferResult of an Infer reply whose large tensors were cut out: each is copied
    once from the received bytes into its tensor. ``raw`` then holds chunk ids for them,
    as an InferStream reply does. CodecError when the data does not fit its tensor."""
    assembler = codec.ChunkAssembler(reply.msg)
    assembler.take(reply.views)
    if not assembler.done:  # a chunk id the server set itself: its data never comes on a unary call
        raise codec.CodecError("a tensor of the reply has a chunk_id: its data did not arrive")
    return InferResult.from_proto(reply.msg, chunked=assembler.result(), model=model)


class RemoteModel:
    """A hosted model, called like a torch module: ``out = await model(x, attention_mask=m)``."""

    def __init__(self, client: Client, name: str) -> None:
        self._client = client
        self.name = name

    async def info(self) -> ModelInfo:
        """The model and its module tree. NotFoundError for an unknown model."""
        reply = await self._client._unary(self._client.model_stub.GetModel, model_service_pb2.GetModelRequest(name=self.name))
        return ModelInfo.from_proto(reply)

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Runs forward in eval mode and returns the output; the session's hooks fire."""
        return (await self.infer(*args, kwargs=kwargs)).output

    async def infer(
        self,
        *args: Any,
        hooks: Sequence[HookSpecLike] = (),
        backward: Backward | None = None,
        mode: str = "eval",
        seed: int | None = None,
        tags: Sequence[str] = (),
        use_session: bool = True,
        stream: bool | None = None,
        progress: bool | None = False,
        kwargs: Mapping[str, Any] | None = None,
        **model_kwargs: Any,
    ) -> InferResult:
        """One forward (and optional backward) pass.

        ``hooks`` fire for this call only, and their events come back in the
        result. ``mode`` is "eval" or "train"; ``seed`` makes train-mode dropout
        reproducible; ``tags`` select SCOPE_TAGGED hooks. Keyword arguments for the model go in ``**model_kwargs``, or in
        ``kwargs=`` when a name clashes with this method's. Waits for the result;
        raises InvalidArgumentError (bad input, or the model raised: the message
        names the module), NotFoundError, FailedPreconditionError (train mode
        not allowed).

        Memory: ``stream=True`` sends the call over InferStream, where captured tensors
        arrive in chunks, each copied once into its preallocated tensor: the client then
        holds the result plus one chunk (about 1 MiB). A unary reply arrives whole first,
        so decoding it holds about twice its size for a moment. ``stream=None`` (the
        default) streams calls whose last reply of the same kind was over 4 MiB, and
        inputs with large tensors; ``stream=False`` is unary where it can be (not with
        large input tensors or a message limit under 64 MiB). ``progress=True`` streams and shows a tqdm bar (bytes,
        total, rate; on stderr, or a widget in Jupyter) while a reply of 8 MiB or more
        arrives; ``None`` does so only when stderr is a terminal.
        """
        if mode not in _MODES:
            raise ValueError(f"mode must be 'eval' or 'train', not {mode!r}")
        request = model_service_pb2.InferRequest(model=self.name, mode=_MODES[mode])
        chunker = codec.Chunker(snapshot=False)  # the call is awaited: inputs do not change meanwhile
        for arg in args:
            codec.encode_value_into(arg, request.args.add(), chunker=chunker)
        for key, value in {**(kwargs or {}), **model_kwargs}.items():
            codec.encode_value_into(value, request.kwargs[key], chunker=chunker)
        if use_session:
            request.session_id = self._client.session_id
        for spec in hooks:
            request.hooks.append(spec_proto(spec, self.name))
        if backward is not None:
            request.backward.CopyFrom(backward.to_proto(chunker))
        if seed is not None:
            request.seed = seed
        request.tags.extend(tags)
        sizes = self._client.call_sizes
        kind = sizes.kind(request)
        if progress is not False and stream is None:
            stream = True  # a unary reply arrives in one piece: nothing to show progress of
        if stream is None:
            stream = (
                bool(chunker.tensors) or self._client.options.max_message_bytes < UNARY_MIN_MESSAGE_BYTES
                or sizes.expects_large(kind)
            )
        elif not stream and (chunker.tensors or self._client.options.max_message_bytes < UNARY_MIN_MESSAGE_BYTES):
            stream = True  # large inputs, or a message limit a unary reply may not fit, need the stream
        # A call in the session waits on the server for the session stream's reader: its
        # events are read past the SDK's bound while it runs (EventRouter.own_call).
        release = self._client.own_call(request.session_id)
        try:
            return await self._infer_call(request, chunker, stream, progress, kind)
        finally:
            release()

    async def _infer_call(
        self, request: model_service_pb2.InferRequest, chunker: codec.Chunker, stream: bool, progress: bool | None,
        kind: Any,
    ) -> InferResult:
        sizes = self._client.call_sizes
        if not stream:
            reply = await self._client._unary(self._client.tensor_calls.infer, request)
            if type(reply) is CutReply:
                sizes.note(kind, reply.msg.ByteSize() + sum(len(view) for view in reply.views.values()))
                return _cut_result(reply, request.model)
            sizes.note(kind, reply.ByteSize())
            return InferResult.from_proto(reply, model=request.model)
        result, reply_bytes = await self._infer_stream(request, chunker, progress)
        sizes.note(kind, reply_bytes)
        return result

    async def run_with_cache(
        self,
        *args: Any,
        modules: str | Sequence[str] = "**",
        parts: PartName | Sequence[PartName] = "output",
        select: str = "",
        cast: CastName | None = None,
        hooks: Sequence[HookSpecLike] = (),
        backward: Backward | None = None,
        mode: str = "eval",
        seed: int | None = None,
        use_session: bool = True,
        stream: bool | None = True,
        progress: bool | None = False,
        kwargs: Mapping[str, Any] | None = None,
        **model_kwargs: Any,
    ) -> tuple[Any, ActivationCache]:
        """Runs the model once and returns its output and what every matched module saw,
        as TransformerLens' ``run_with_cache`` does::

            out, cache = await model.run_with_cache(ids, attention_mask=mask, modules="encoder.layer.*")
            cache["encoder.layer.3"]                  # [batch, seq, hidden]
            cache.stack("encoder.layer.*")            # [layers, batch, seq, hidden]

        ``modules``: a path or glob (or several) as hooks take them; the default ``"**"``
        is every module. ``parts``: "output" (the default), "args", "kwargs", and with a
        ``backward`` pass "grad_input" / "grad_output". ``select`` and ``cast`` reduce
        every captured tensor on the server first (``select="[:, -1]"`` keeps the last
        position, ``cast="bfloat16"`` halves the bytes). The captures are request-scoped
        hooks of this one call (``hooks`` are added before them: rules there steer what
        is cached); the rest is as ``infer``. Keys: see ActivationCache.

        Blocks until the call and its captures are in. ``stream`` and ``progress`` are as
        in ``infer``, but streaming is the default here: captures arrive in chunks, each
        copied once into its tensor, so the client holds about one copy of the data
        (1.05x the cache at peak, where a unary reply takes 3x: docs/benchmarks.md);
        ``progress=True`` shows a bar while a large cache arrives (docs/sdk.md). Raises ValueError for bad ``modules`` / ``parts``
        (before anything is sent), and what ``infer`` raises: NotFoundError when a
        pattern matches no module, InvalidArgumentError for bad inputs or a select that
        does not apply, ResourceExhaustedError past the server's limits.
        """
        cached = cache_hooks(modules, parts, select=select, cast=cast, backward=backward is not None)
        result = await self.infer(
            *args, hooks=[*hooks, *cached], backward=backward, mode=mode, seed=seed, use_session=use_session,
            stream=stream, progress=progress, kwargs=kwargs, **model_kwargs,
        )
        own = range(len(hooks) + 1, len(hooks) + len(cached) + 1)  # the cache's hooks, not the caller's
        return result.output, ActivationCache.from_result(result, parts, hooks=own)

    async def _infer_stream(
        self, request: model_service_pb2.InferRequest, chunker: codec.Chunker, progress: bool | None = False,
    ) -> tuple[InferResult, int]:
        """InferStream: large tensors travel as chunks both ways, each message within the
        limit. Returns the result and the bytes of the reply (its tensors included)."""
        limit = self._client.options.max_message_bytes
        chunk_bytes = max(64 * 1024, min(1024 * 1024, limit - 64 * 1024))

        async def messages() -> AsyncIterator[model_service_pb2.InferStreamRequest | bytes]:
            yield model_service_pb2.InferStreamRequest(request=request, max_response_message_bytes=min(limit, 2**32 - 1))
            for chunk in chunker.frames(INFER_STREAM_CHUNK, chunk_bytes):  # wire bytes, one copy each
                yield chunk

        call = self._client.tensor_calls.infer_stream(messages(), timeout=self._client.options.timeout)
        bar = TransferProgress(f"{self.name}: reply", enabled=progress)
        try:
            first = await call.read()
            if first is grpc.aio.EOF or kind_of(first) != "response":
                raise HookwireError("InferStream ended without a response", code="DATA_LOSS")
            first, views = uncut(first)
            assembler = codec.ChunkAssembler(first.response)
            assembler.take(views)
            bar.update(assembler.received, assembler.nbytes)
            while not assembler.done:
                msg = await call.read()
                if type(msg) is RawChunk:
                    assembler.feed(msg)
                elif msg is grpc.aio.EOF or kind_of(msg) != "chunk":
                    raise HookwireError("InferStream ended before the response's tensors were complete", code="DATA_LOSS")
                else:
                    assembler.feed(msg.chunk)
                bar.update(assembler.received, assembler.nbytes)
            reply_bytes = first.response.ByteSize() + assembler.nbytes
            return InferResult.from_proto(first.response, chunked=assembler.result(), model=request.model), reply_bytes
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, target=self._client.target) from None
        except codec.CodecError as exc:
            raise HookwireError(f"InferStream: {exc}", code="DATA_LOSS") from None
        finally:
            bar.close()
            call.cancel()  # a no-op once it has finished

    async def tokenize(
        self, texts: str | Sequence[str], *, add_special_tokens: bool | None = None, padding_side: str = "",
    ) -> Tokenized:
        """Tokenizes ``texts`` (one string, or several, batched) with the model's tokenizer
        on the server and returns the padded ids, the attention mask and each text's
        token strings (``Tokenized``), as transformers' ``tokenizer(texts, padding=True,
        return_tensors="pt", padding_side=...)`` does, without truncation.

        ``add_special_tokens`` None uses the tokenizer's default (True for transformers
        tokenizers). ``padding_side`` is "left" or "right"; "" pads on the left for a
        model that generates (a causal LM), else on the tokenizer's own side. Waits for
        the reply (the tokenizer runs on the server, on a thread of the model's own).
        Raises FailedPreconditionError when the model has no tokenizer (send input_ids
        instead), NotFoundError for an unknown model, UnavailableError while it loads,
        InvalidArgumentError for no texts or a bad ``padding_side``, and
        ResourceExhaustedError past the server's limits (max_tokenize_texts,
        max_tokenize_chars, max_prompt_tokens; the message names it).
        """
        request = model_service_pb2.TokenizeRequest(
            model=self.name, texts=[texts] if isinstance(texts, str) else list(texts), padding_side=padding_side,
        )
        if add_special_tokens is not None:
            request.add_special_tokens = add_special_tokens
        reply = await self._client._unary(self._client.model_stub.Tokenize, request)
        return Tokenized.from_proto(reply)

    async def parameters(
        self, *names: str, dtype: CastName | None = None, progress: bool | None = False,
    ) -> dict[str, Any]:
        """The model's parameters that ``names`` name, by name, in the model's
        ``named_parameters()`` order (each once)::

            weights = await model.parameters("encoder.layer.*.attention.output.dense.weight")
            everything = await model.parameters("**", dtype="bfloat16")

        Each of ``names`` is an exact name as ``named_parameters()`` gives it (a tied
        weight answers to each of its names) or a glob: ``*`` within one dotted segment,
        ``**`` across segments, ``?`` one character, as hook modules match. ``dtype``
        ("float16", "bfloat16", "float32") casts the floating-point ones on the server
        (as in-process ``.to(dtype)``); None keeps their dtype. Values are torch tensors
        (numpy arrays without torch), bit-identical to the server's weights as they were
        between two of its passes.

        Waits for them all (GetParameters): large ones arrive in chunks, each copied once
        into its tensor, so memory is the tensors plus one message. The model's config
        must allow it (``parameters_readable = true``): FailedPreconditionError otherwise.
        Raises NotFoundError for an unknown model or a name or glob that matches no
        parameter, UnavailableError while the model loads, PermissionDeniedError below
        the user role, ResourceExhaustedError past the server's limits
        (max_parameter_names, max_parameter_bytes, max_parameter_calls_per_principal: the
        message names it); ValueError at once for no names or an unknown ``dtype``.
        ``progress=True`` draws a bar (bytes so far, rate) once 8 MiB have arrived;
        ``None`` only when stderr is a terminal.
        """
        request = parameters_request(self.name, names, dtype, self._client.options.stream_max_message_bytes)
        call = self._client.tensor_calls.get_parameters(request, timeout=self._client.options.timeout)
        with TransferProgress(f"{self.name}: parameters", enabled=progress) as bar:
            return await read_parameters(call, target=self._client.target, progress=bar)

    async def parameter(self, name: str, *, dtype: CastName | None = None, progress: bool | None = False) -> Any:
        """One parameter by its exact name, e.g. ``await model.parameter("lm_head.weight")``:
        ``parameters(name, dtype=dtype)[name]`` (see ``parameters`` for what it waits for
        and raises). ValueError for a glob (use ``parameters``)."""
        if "*" in name or "?" in name:
            raise ValueError(f"parameter() takes one exact name, not the glob {name!r}: use parameters()")
        return (await self.parameters(name, dtype=dtype, progress=progress))[name]

    def generate(
        self,
        prompt_or_ids: str | Sequence[str] | Any,
        max_new_tokens: int,
        *,
        hooks: Sequence[HookSpecLike] = (),
        attention_mask: Any = None,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] = (),
        tags: Sequence[str] = (),
        use_session: bool = True,
        keep_events: bool = True,
        max_response_message_bytes: int | None = None,
        stream_interval: int = 0,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        ignore_eos: bool = False,
        min_new_tokens: int = 0,
        n: int = 1,
    ) -> GenerateStream:
        """Generates up to ``max_new_tokens`` tokens per sequence with a causal language
        model, as transformers' ``generate()`` does (greedy or sampling), streaming the
        tokens and what the hooks see at every step. Returns a GenerateStream: iterate
        it for the items as they happen, await it for the GenerateResult::

            result = await model.generate("Once upon a time", 32)
            async for item in model.generate(["a", "b"], 16, hooks=[...]):
                ...

        ``prompt_or_ids`` is a text, a list of texts (tokenized on the server as
        ``tokenize`` does: special tokens added, padded on the left), or integer
        ``input_ids`` [batch, seq] (a tensor, an array or nested lists) with an optional
        ``attention_mask`` (0 for padding, which goes on the left). ``hooks`` fire for
        this call only (as in ``infer``), at every step unless their ``steps`` say
        otherwise; their events arrive in the stream as they fire, each with its
        ``step``. The session's hooks fire too when ``use_session`` (their events go to
        the session stream; see HookHandle.events(until=...)), and SCOPE_TAGGED ones
        for ``tags``. ``do_sample``, ``temperature``, ``top_k``, ``top_p``: None keeps
        the model's generation_config. ``seed`` makes sampling reproducible (the same
        tokens as ``torch.manual_seed(seed)`` then in-process ``generate()``); without
        it the server draws one and reports it (``GenerateResult.seed``). ``stop``: stop
        strings (a sequence ends once its text ends with one; it stays in the text).
        ``keep_events=False`` leaves events out of the result (iterate to see them), for
        captures too large to keep. Captured tensors larger than
        ``max_response_message_bytes`` (default: this client's stream limit) arrive in
        chunks and are reassembled before they are yielded. ``stream_interval`` N > 1
        has the server send the tokens of N steps at a time (fewer messages, less CPU per
        token on both ends, tokens later); they are still yielded one GeneratedTokens per
        step, after those steps' events.

        ``logprobs`` k (0 included) reports each chosen token's log-probability and the k
        most likely tokens beside it (``GeneratedTokens.logprobs``,
        ``GenerateResult.logprobs``); ``prompt_logprobs`` k scores each prompt token after
        the first the same way (``GenerateResult.prompt_logprobs``: what evaluation
        harnesses score prompts with); both raw log-softmax of the logits, k at most the
        server's max_top_logprobs. ``ignore_eos`` keeps generating after an
        end-of-sequence token; no sequence ends before ``min_new_tokens`` (0: the model's
        generation_config). ``n`` sequences per prompt, sampled apart from one random
        generator (a prompt's n sequences are consecutive rows).

        Lazy: nothing is sent until the stream is iterated, awaited or started. Raises
        ValueError / TypeError at once for arguments it cannot send; everything else
        (the server's errors) where the stream is read: see GenerateStream, which also
        says what cancels the call. There is no backward pass (use ``infer``).
        """
        limit = self._client.options.stream_max_message_bytes
        request = generate_request(
            self.name, prompt_or_ids, max_new_tokens, attention_mask=attention_mask, hooks=hooks,
            do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop=stop, tags=tags,
            session_id=self._client.session_id if use_session else "",
            max_response_message_bytes=limit if max_response_message_bytes is None else max_response_message_bytes,
            stream_interval=stream_interval, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            ignore_eos=ignore_eos, min_new_tokens=min_new_tokens, n=n,
        )
        return GenerateStream(self._client, request, keep_events=keep_events)

    def hook(
        self,
        module: str,
        *,
        prehook: ActionLike = None,
        posthook: ActionLike = None,
        backward_prehook: ActionLike = None,
        backward_hook: ActionLike = None,
        prehook_kwargs: Mapping[str, bool] | None = None,
        posthook_kwargs: Mapping[str, bool] | None = None,
        backward_prehook_kwargs: Mapping[str, bool] | None = None,
        backward_hook_kwargs: Mapping[str, bool] | None = None,
        train_update: bool = True,
        eval_update: bool = True,
        scope: ScopeName = "session",
        tags: Sequence[str] = (),
        on_error: OnErrorName = "default",
        sampling: Sampling | None = None,
        ttl_seconds: int = 0,
        steps: StepsLike = None,
    ) -> PendingHook:
        """A hook on the modules ``module`` names, in the client's session.

        ``await model.hook(...)`` registers it and returns a HookHandle;
        ``async with model.hook(...) as h:`` also removes it on exit. Scope
        "session" fires for this client's calls only; "all" for every caller's;
        "tagged" for calls carrying one of ``tags``. ``sampling`` thins its events;
        ``ttl_seconds`` registers it without a session (see Client.register_hook).
        ``steps`` (a StepRange or a ``(first, last)`` tuple) limits it to those steps
        of Generate calls, e.g. ``(1, None)`` for the new tokens only; ValueError for
        a range that ends before it starts. An action is a HookAction
        (``hookwire.capture(...)``, ``hookwire.edit(...)``), a rule, or a list of rules.
        """
        spec = HookSpec(
            module=module, prehook=prehook, posthook=posthook, backward_prehook=backward_prehook,
            backward_hook=backward_hook, prehook_kwargs=prehook_kwargs, posthook_kwargs=posthook_kwargs,
            backward_prehook_kwargs=backward_prehook_kwargs, backward_hook_kwargs=backward_hook_kwargs,
            train_update=train_update, eval_update=eval_update, scope=scope, model=self.name,
            tags=tuple(tags), on_error=on_error, sampling=sampling, ttl_seconds=ttl_seconds, steps=steps,
        )
        return PendingHook(self._client, spec, self.name)
