"""The grpc.aio server: wiring, start, graceful stop."""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import signal
from typing import Any, Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from hookwire.v1 import harvest_service_pb2, hook_service_pb2, model_service_pb2, operand_service_pb2

from ..auth import TokenStore
from ..models.batch_settings import DEFAULT_MAX_BATCH_DELAY_MS, DEFAULT_MAX_BATCH_SIZE, BatchSettings
from .security import AuthInterceptor, server_credentials
from ..hooks.hook_manager import HookManager
from ..hooks.hook_store import HookStore
from ..hooks.operands import OperandStore
from ..calls.generation import Generation
from ..calls.harvest import HarvestConfig, HarvestManager, settings_from
from ..calls.inference import Inference
from ..engine.core import Engines
from ..calls.admission import Admission
from ..state import ServerState
from ..limits import Limits
from ..memory_budget import format_bytes, process_memory_limit
from ..metrics import Metrics
from ..engine.core import build_host
from ..models.model_loading import ConfigError, ModelConfig, check_names, load_models
from ..models.model_registry import ModelHost, ModelRegistry, ModelState
from ..calls.parameters import Parameters
from .request_bounds import RequestBounds
from .status_mapping import RawRequest
from .servicers import HarvestServicer, HookServicer, ModelServicer, OperandServicer, add_to_server
from ..calls.tokenization import Tokenization

log = logging.getLogger("hookwire.server")

#: The services whose calls act on a model, and the one whose calls need none.
MODEL_SERVICES = (
    model_service_pb2.DESCRIPTOR.services_by_name["ModelService"].full_name,
    hook_service_pb2.DESCRIPTOR.services_by_name["HookService"].full_name,
    harvest_service_pb2.DESCRIPTOR.services_by_name["HarvestService"].full_name,
)
OPERAND_SERVICE = operand_service_pb2.DESCRIPTOR.services_by_name["OperandService"].full_name
SERVICES = (*MODEL_SERVICES, OPERAND_SERVICE)
#: Liveness: NOT_SERVING once a model failed while serving (nothing restarts an engine:
#: the process must be restarted) and while the server stops; SERVING otherwise, model
#: loading included (docs/deploy.md).
LIVENESS_SERVICE = "hookwire.live"
#: Each configured model's own health service is this prefix and its name: SERVING while
#: the model is READY.
MODEL_HEALTH_PREFIX = "hookwire.model."
#: Readiness: the server ("") and the services whose calls act on a model are SERVING once
#: the models have settled, while at least one model is READY (or none is configured).
#: OperandService (named operands need no model) is SERVING once the models have settled.
READINESS_SERVICES = ("", *MODEL_SERVICES)


@dataclasses.dataclass
class ServerSettings(Limits):
    """Where and how the server listens, who may call it, and its limits (see Limits)."""

    host: str = "127.0.0.1"
    #: 0 picks a free port.
    port: int = 50051
    #: Seconds in-flight calls get to finish on stop; the process exits within it
    #: even when a pass is still running (its thread cannot be stopped, only left).
    grace: float = 5.0
    #: Seconds without data from a client before the server pings it. With
    #: keepalive_timeout, a client that stops answering (frozen, or its host gone)
    #: is dropped within about keepalive_time + keepalive_timeout, and its sessions
    #: and their hooks end.
    keepalive_time: float = 10.0
    #: Seconds a ping may go unanswered before the server closes the connection.
    keepalive_timeout: float = 5.0
    #: Allow rules that change values on SCOPE_ALL / SCOPE_TAGGED hooks (other callers' results);
    #: with authentication on, only operators may register them.
    allow_shared_rules: bool = False
    #: A token file (see auth.py); with it, or HOOKWIRE_TOKENS, every call needs credentials.
    tokens_file: str | None = None
    #: principal:roles:sha256 entries (also read from the HOOKWIRE_TOKENS variable).
    tokens: str | None = None
    #: PEM certificate chain and key: serve TLS.
    tls_cert: str | None = None
    tls_key: str | None = None
    #: PEM CA of client certificates: require and verify them (mTLS).
    tls_client_ca: str | None = None
    #: Allow listening beyond loopback without authentication.
    insecure: bool = False
    #: Port of the OpenAI-compatible HTTP front (/v1/completions, /v1/chat/completions,
    #: /v1/models, /health; api/openai_front.py), on ``host``, with the same TLS and tokens;
    #: None for none (the default), 0 for a free one.
    openai_port: int | None = None
    #: Port of the Prometheus /metrics endpoint (on ``host``); None for none, 0 for a free one.
    metrics_port: int | None = None
    #: Serve gRPC server reflection (grpcurl, buf curl, Postman discover the API from it).
    reflection: bool = True
    #: Join concurrent compatible calls on a model into one forward pass (dynamic
    #: batching; docs/batching.md). A model's config can turn it off for that model.
    batching: bool = True
    #: Most rows in one batched pass, for models whose config does not say.
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    #: How long (ms) the first call of a pass may wait for others to join when more callers
    #: were seen lately than wait now (engine/scheduler.py), for models whose config does not
    #: say; 0 joins only calls that are already waiting.
    max_batch_delay_ms: float = DEFAULT_MAX_BATCH_DELAY_MS
    #: Harvest jobs (HarvestService; docs/harvest.md) read text sources from under this
    #: folder; None: text sources are refused.
    harvest_data_root: str | None = None
    #: Harvest jobs write datasets under this folder; None (and no URL prefixes): harvest
    #: jobs are refused (clients can still write datasets themselves: --sink client).
    harvest_output_root: str | None = None
    #: Comma-separated fsspec URL prefixes harvest outputs may name ("s3://bucket/acts/").
    harvest_url_prefixes: str | None = None
    #: Where job state is kept for lookups from other replicas; None:
    #: <harvest_output_root>/.hookwire-jobs (shared storage makes jobs visible everywhere).
    harvest_state_dir: str | None = None
    #: Operators publish read-only operands (PublishOperand: SAEs in SAELens' layout,
    #: .safetensors tensors) from under this folder; None: publishing is refused.
    operand_root: str | None = None
    #: Hooks without a session (ttl_seconds) are saved under this folder (mode 0700, files
    #: 0600) and registered again, with their ids, when a server starts on it again
    #: (hooks/hook_store.py); None: they end with the process. One server per folder.
    state_dir: str | None = None

    def __post_init__(self) -> None:
        try:
            self.batch_defaults()
        except ValueError as exc:
            raise ConfigError(f"batching settings: {exc}") from None
        try:
            self.harvest_config()
        except ValueError as exc:
            raise ConfigError(f"harvest settings: {exc}") from None

    def harvest_config(self) -> HarvestConfig:
        """The harvest settings: the harvest_* folders here and the harvest_* limits
        (ValueError naming one that is out of range)."""
        return settings_from(
            data_root=self.harvest_data_root, output_root=self.harvest_output_root,
            url_prefixes=self.harvest_url_prefixes, state_dir=self.harvest_state_dir, limits=self,
        )

    def batch_defaults(self) -> BatchSettings:
        """The batching settings of models whose config leaves them unset."""
        return BatchSettings(
            enabled=self.batching, max_batch_size=self.max_batch_size, max_batch_delay_ms=self.max_batch_delay_ms,
        )


def _bracketed(host: str) -> str:
    """An IPv6 address in the brackets a host:port needs."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only this machine."""
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def channel_options(
    max_message_bytes: int, keepalive_time: float = 10.0, keepalive_timeout: float = 5.0,
) -> list[tuple[str, int]]:
    """Message limits, keepalive (a dead or frozen peer is noticed within
    keepalive_time + keepalive_timeout seconds) and no port sharing."""
    timeout_ms = max(1, round(keepalive_timeout * 1000))
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", max(1, round(keepalive_time * 1000))),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        # gRPC core waits for a ping's ack for ping_timeout (default 60 s), not for
        # keepalive_timeout alone: without this a frozen client held its sessions
        # and hooks for a minute.
        ("grpc.http2.ping_timeout_ms", timeout_ms),
        # Keep pinging a peer that sends nothing (a frozen client, or one whose
        # stream is stalled on flow control); the default stops after 2 pings.
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        # gRPC sets SO_REUSEPORT by default, so a second server on a busy port would
        # start and share the clients at random with the first: refuse instead.
        ("grpc.so_reuseport", 0),
    ]


class HookwireServer:
    """A running hookwire server around a model registry."""

    def __init__(self, registry: ModelRegistry, settings: ServerSettings | None = None) -> None:
        self.registry = registry
        self.settings = settings or ServerSettings()
        self.metrics = Metrics()
        registry.configure_batching(self.settings.batch_defaults(), self.metrics.observe_batch)
        self.metrics.watch_fires(lambda: {host.name: host.fires for host in registry})
        #: The limits, metrics and draining flag every call and stream consults.
        self.state = ServerState(limits=self.settings, metrics=self.metrics)
        self.metrics.watch_memory(self.state.budget)
        #: Named operands (OperandService), resolved by the specs the hook manager compiles.
        self.operands = OperandStore(self.settings, root=self.settings.operand_root)
        #: Where hooks without a session outlive the process (state_dir), opened by start.
        self.hook_store = HookStore(self.settings.state_dir) if self.settings.state_dir else None
        self.hooks = HookManager(registry, allow_shared_rules=self.settings.allow_shared_rules, state=self.state,
                                 operands=self.operands, store=self.hook_store)
        #: Each model's engine and scheduler: Infer, Generate and harvest jobs share them.
        self.engines = Engines(registry, gate=self.hooks.gate)
        #: The admission step every call goes through.
        self.admission = Admission(registry, self.hooks, self.state)
        self.inference = Inference(self.admission, self.hooks, engines=self.engines)
        self.tokenization = Tokenization(self.admission)
        self.generation = Generation(self.admission, self.hooks, engines=self.engines)
        self.parameters = Parameters(self.admission)
        s = self.settings
        self.harvests = HarvestManager(registry, self.hooks, s.harvest_config(), limits=self.settings,
                                       engines=self.engines, admission=self.admission)
        self.tokens = TokenStore(self.settings.tokens_file, self.settings.tokens)
        self._server: grpc.aio.Server | None = None
        self.port: int | None = None
        self.metrics_port: int | None = None
        #: The OpenAI-compatible front (openai_port), once started, and its bound port.
        self.openai: Any = None
        self.openai_port: int | None = None
        self.health = health.aio.HealthServicer()
        #: Whether the server takes calls (set_serving), and whether it has begun to stop:
        #: with the models' states, what health says (health_statuses).
        self._serving = False
        self._stopping = False
        self._health_sent: dict[str, bool] = {}
        self._health_lock = asyncio.Lock()
        self._health_updates: set[asyncio.Future[None]] = set()
        self._unlisten: Callable[[], None] | None = None
        self.metrics.watch_models(
            lambda: [(e.name, e.state.value) for e in registry.entries()], [s.value for s in ModelState]
        )

    async def start(self) -> int:
        """Binds and starts serving; returns the bound port."""
        settings = self.settings
        tls = bool(settings.tls_cert and settings.tls_key)
        if bool(settings.tls_cert) != bool(settings.tls_key):
            raise ValueError("TLS needs both tls_cert and tls_key")
        if settings.tls_client_ca and not tls:
            raise ValueError("tls_client_ca (mTLS) needs tls_cert and tls_key")
        if not self.tokens.enabled and not is_loopback(settings.host) and not settings.insecure:
            raise ValueError(
                f"refusing to listen on {settings.host} without authentication: configure tokens "
                "(--tokens-file or HOOKWIRE_TOKENS), or pass --insecure"
            )
        if settings.keepalive_time <= 0 or settings.keepalive_timeout <= 0:
            raise ValueError("keepalive_time and keepalive_timeout must be positive (seconds)")
        if settings.infer_stream_idle_timeout <= 0:
            raise ValueError("infer_stream_idle_timeout must be positive (seconds)")
        if settings.generate_idle_timeout <= 0:
            raise ValueError("generate_idle_timeout must be positive (seconds)")
        if settings.memory_budget_bytes < 0:
            raise ValueError("memory_budget_bytes must be 0 (70% of the memory the process may use) or a positive "
                             "number of bytes")
        interceptor = AuthInterceptor(self.tokens, client_certs=bool(settings.tls_client_ca))
        server = grpc.aio.server(
            options=channel_options(settings.max_message_bytes, settings.keepalive_time, settings.keepalive_timeout),
            interceptors=[interceptor],
        )
        add_to_server(
            ModelServicer(
                self.registry, self.inference, self.metrics, self.tokens, self.tokenization, self.generation,
                self.parameters,
            ),
            model_service_pb2.DESCRIPTOR.services_by_name["ModelService"], server,
        )
        add_to_server(
            HookServicer(self.hooks, self.tokens), hook_service_pb2.DESCRIPTOR.services_by_name["HookService"], server
        )
        add_to_server(
            HarvestServicer(self.harvests, self.tokens, self.metrics),
            harvest_service_pb2.DESCRIPTOR.services_by_name["HarvestService"], server,
        )
        add_to_server(
            OperandServicer(self.hooks, self.inference, self.tokens),
            operand_service_pb2.DESCRIPTOR.services_by_name["OperandService"], server,
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        if self.settings.reflection:
            reflection.enable_server_reflection((*SERVICES, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        await self.set_serving(False)  # until the caller says the models are ready
        loop = asyncio.get_running_loop()

        def models_changed(_entry: object) -> None:
            # Any thread (a vLLM engine fails on its own): health is set on the loop.
            try:
                loop.call_soon_threadsafe(self._health_changed)
            except RuntimeError:  # the loop is closed: nobody asks any more
                pass

        self._unlisten = self.registry.listen(models_changed)
        address = f"{_bracketed(self.settings.host)}:{self.settings.port}"
        try:
            if tls:
                port = server.add_secure_port(
                    address, server_credentials(str(settings.tls_cert), str(settings.tls_key), settings.tls_client_ca)
                )
            else:
                port = server.add_insecure_port(address)
        except RuntimeError:  # grpc raises "Failed to bind" where older versions returned 0
            port = 0
        if port == 0:
            raise OSError(
                f"cannot listen on {address}: the port is in use (is another server running there?) "
                "or the address is not available on this machine"
            )
        if self.hook_store is not None:
            try:
                self.hook_store.open()  # StateDirError (a ValueError) when another server holds it
            except BaseException:
                await server.stop(None)
                raise
            await self.restore_hooks()  # on the models loaded already; serve() tries again after loading
        await server.start()
        self._server, self.port = server, port
        budget = self.state.budget
        log.info("memory budget: %s for calls' estimated peaks and the models' resident memory (%s)",
                 format_bytes(budget.limit),
                 "memory_budget_bytes" if settings.memory_budget_bytes else
                 f"the default: 70% of {format_bytes(process_memory_limit()[0])}, {process_memory_limit()[1]}")
        if settings.openai_port is not None:
            from .openai_front import OpenAIFront  # FastAPI and uvicorn only where the front is on

            self.openai = OpenAIFront(
                self.registry, self.generation, self.engines, self.tokens, self.metrics, self.settings,
                lambda: self.health_statuses().get("", False), client_certs=bool(settings.tls_client_ca),
            )
            try:
                self.openai_port = await self.openai.start(
                    settings.host, settings.openai_port, tls_cert=settings.tls_cert if tls else None,
                    tls_key=settings.tls_key if tls else None, tls_client_ca=settings.tls_client_ca,
                )
            except BaseException:
                await server.stop(None)
                raise
            log.info("OpenAI-compatible front on %s://%s:%d/v1", "https" if tls else "http", settings.host,
                     self.openai_port)
        if self.settings.metrics_port is not None:
            self.metrics_port = self.metrics.serve(self.settings.host, self.settings.metrics_port)
            log.info("metrics on http://%s:%d/metrics", self.settings.host, self.metrics_port)
        log.info(
            "listening on %s:%d (%s, %s)", self.settings.host, port, "TLS" if tls else "plaintext",
            f"{'mTLS and ' if settings.tls_client_ca else ''}tokens required" if self.tokens.enabled
            else "no authentication: loopback only" if is_loopback(settings.host) else "no authentication (--insecure)",
        )
        return port

    async def restore_hooks(self) -> int:
        """Registers again the hooks saved in ``state_dir`` whose models are ready
        (HookManager.restore), each saved request read with the checks of a new
        RegisterHook request; those on models still loading wait for the next call.
        Returns how many were restored; 0 without a state folder."""
        if self.hook_store is None:
            return 0
        bounds = RequestBounds.of(self.settings)
        return await self.hooks.restore(
            self.tokens, lambda data: RawRequest(hook_service_pb2.RegisterHookRequest, data).parse(bounds),
        )

    @property
    def target(self) -> str:
        """host:port clients connect to."""
        return f"{_bracketed(self.settings.host)}:{self.port}"

    async def set_serving(self, serving: bool) -> None:
        """Whether the server takes calls (False until its models have settled, and from the
        start of a stop); the health services follow it and the models' states
        (health_statuses)."""
        self._serving = serving
        await self._refresh_health()

    def health_statuses(self) -> dict[str, bool]:
        """Each health service's status now (True: SERVING): readiness (READINESS_SERVICES,
        OperandService), liveness (LIVENESS_SERVICE) and each model's own
        (MODEL_HEALTH_PREFIX + name). Everything is NOT_SERVING once the server stops."""
        entries = self.registry.entries()
        alive = not self._stopping
        ready = self._serving and (not entries or any(e.state is ModelState.READY for e in entries))
        # A model that failed at load never served: the others serve as before. One that
        # failed while serving (e.g. its vLLM engine died in a step) stays failed until
        # the process restarts.
        died = any(e.state is ModelState.FAILED and e.host is not None for e in entries)
        statuses = {service: alive and ready for service in READINESS_SERVICES}
        statuses[OPERAND_SERVICE] = alive and self._serving
        statuses[LIVENESS_SERVICE] = alive and not died
        for e in entries:
            statuses[MODEL_HEALTH_PREFIX + e.name] = alive and e.state is ModelState.READY
        return statuses

    def _health_changed(self) -> None:
        """A model's state changed (on the loop): health follows."""
        update = asyncio.ensure_future(self._refresh_health())
        self._health_updates.add(update)  # kept until done: the loop holds tasks weakly
        update.add_done_callback(self._health_updates.discard)

    async def _refresh_health(self) -> None:
        async with self._health_lock:  # statuses read under it: a later update never loses to an earlier one
            for service, serving in self.health_statuses().items():
                if self._health_sent.get(service) is not serving:
                    self._health_sent[service] = serving
                    await self.health.set(service, health_pb2.HealthCheckResponse.SERVING if serving
                                          else health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace: float | None = None) -> None:
        """Graceful stop: health turns NOT_SERVING and new calls, sessions and hooks are
        refused (UNAVAILABLE); in-flight Infer calls get ``grace`` seconds to finish with
        their sessions' hooks intact; then event streams end with UNAVAILABLE, every hook
        is removed and the model threads are told to stop. Returns within about
        ``grace`` seconds: a pass still running is left to its (daemon) thread, which
        does not keep the process alive."""
        grace = self.settings.grace if grace is None else grace
        deadline = asyncio.get_running_loop().time() + grace
        self._stopping = True
        if self._unlisten is not None:
            self._unlisten()
        await self.set_serving(False)
        self.state.draining = True
        # Generate calls end at their next step boundary, with finish_reason "shutdown".
        # Harvest jobs stop after their running batch, keeping what they committed (resumable).
        await asyncio.gather(
            self.inference.drained(grace), self.generation.drained(grace), self.harvests.close(grace),
        )
        self.hooks.begin_shutdown()
        if self.openai is not None:  # its streams ended with their calls (drained above)
            await self.openai.stop(max(0.0, deadline - asyncio.get_running_loop().time()))
        if self._server is not None:
            await self._server.stop(max(0.0, deadline - asyncio.get_running_loop().time()))
        await self.hooks.close(timeout=max(0.0, deadline - asyncio.get_running_loop().time()))
        if self.hook_store is not None:
            self.hook_store.close()  # the saved hooks stay: the next start registers them again
        self.metrics.stop()
        self.engines.close()
        self.registry.shutdown()

    async def wait(self) -> None:
        """Returns when the server has stopped."""
        if self._server is not None:
            await self._server.wait_for_termination()


async def serve(
    settings: ServerSettings, models: Sequence[ModelConfig],
    on_ready: Callable[[HookwireServer], None] | None = None,
    *, build: Callable[[ModelConfig], ModelHost] = build_host,
) -> None:
    """Serves until SIGINT or SIGTERM, then stops gracefully (within ``settings.grace``).

    Every configured model is listed from the start (MODEL_STATE_LOADING); the
    server answers health checks (NOT_SERVING) while the models load one after
    the other off the event loop, and each model takes calls as soon as it is
    ready. A model that fails to load is listed as FAILED with the reason and the
    others are served. Once every model is settled the server turns SERVING and
    calls ``on_ready``; ConfigError (after a graceful stop) when no model loaded.
    ValueError for two models with one name; OSError when the address is busy.
    """
    check_names(list(models))
    registry = ModelRegistry()
    for config in models:
        registry.expect(config.name, description=config.description, training_allowed=config.training_allowed,
                        parameters_readable=config.parameters_readable)
    server = HookwireServer(registry, settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    def reload_tokens() -> None:
        try:
            count = server.tokens.reload()
        except ValueError as exc:  # keep the tokens in force
            log.error("tokens not reloaded: %s", exc)
            return
        if server.tokens.enabled:
            ended = server.hooks.reauthorize(server.tokens)
            log.info("tokens reloaded: %d principals; %d sessions, streams and hooks ended (credentials rotated or "
                     "revoked, or no longer allowed by the new roles)", count, ended)

    loop.add_signal_handler(signal.SIGHUP, reload_tokens)
    await server.start()
    loading = asyncio.ensure_future(load_models(registry, list(models), build))
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([loading, stopping], return_when=asyncio.FIRST_COMPLETED)
        if not stop.is_set():
            loading.result()
            await server.restore_hooks()  # the saved hooks of the models that were still loading
            failed = [e for e in registry.entries() if e.state is ModelState.FAILED]
            if models and len(failed) == len(models):
                raise ConfigError("no model could be loaded: " + "; ".join(f"{e.name}: {e.reason}" for e in failed))
            for host in list(server.registry):  # what the models keep, before their first calls
                await server.admission.note_resident(host, server.engines.engine(host))
            await server.set_serving(True)
            if on_ready is not None:
                on_ready(server)
            await stopping
    finally:
        loading.cancel()  # a model still loading is left to its daemon thread
        stopping.cancel()
        log.info("stopping")
        await server.stop()
