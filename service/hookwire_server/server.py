"""The grpc.aio server: wiring, start, graceful stop."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from hookwire.v1 import hook_service_pb2, hook_service_pb2_grpc, model_service_pb2, model_service_pb2_grpc

from .hook_manager import DEFAULT_MAX_TTL_SECONDS, HookManager
from .inference import DEFAULT_MAX_REQUEST_BYTES, Inference
from .metrics import Metrics
from .model_registry import ModelHost, ModelRegistry
from .servicers import HookServicer, ModelServicer
from .slots import DEFAULT_MAX_SLOT_BYTES

log = logging.getLogger("hookwire.server")

DEFAULT_MAX_MESSAGE_BYTES = 1024 * 1024 * 1024
SERVICES = (
    model_service_pb2.DESCRIPTOR.services_by_name["ModelService"].full_name,
    hook_service_pb2.DESCRIPTOR.services_by_name["HookService"].full_name,
)


@dataclasses.dataclass
class ServerSettings:
    """Where and how the server listens."""

    host: str = "127.0.0.1"
    #: 0 picks a free port.
    port: int = 50051
    #: Largest message sent or received (gRPC's default of 4 MiB is too small for tensors).
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    #: Seconds in-flight calls get to finish on stop.
    grace: float = 5.0
    #: Allow rules that change values on SCOPE_ALL / SCOPE_TAGGED hooks (other callers' results).
    allow_shared_rules: bool = False
    #: Bytes of slots each session may keep.
    max_slot_bytes: int = DEFAULT_MAX_SLOT_BYTES
    #: Longest TTL of a hook registered without a session.
    max_ttl_seconds: int = DEFAULT_MAX_TTL_SECONDS
    #: Most bytes the chunked tensors of one InferStream request may claim.
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    #: Port of the Prometheus /metrics endpoint (on ``host``); None for none, 0 for a free one.
    metrics_port: int | None = None
    #: Serve gRPC server reflection (grpcurl, buf curl, Postman discover the API from it).
    reflection: bool = True


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Message limits and keepalive, so a dead peer is noticed within seconds."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


class HookwireServer:
    """A running hookwire server around a model registry."""

    def __init__(self, registry: ModelRegistry, settings: ServerSettings | None = None) -> None:
        self.registry = registry
        self.settings = settings or ServerSettings()
        self.metrics = Metrics()
        self.hooks = HookManager(
            registry, allow_shared_rules=self.settings.allow_shared_rules, max_slot_bytes=self.settings.max_slot_bytes,
            max_ttl_seconds=self.settings.max_ttl_seconds, metrics=self.metrics,
        )
        self.inference = Inference(registry, self.hooks, max_request_bytes=self.settings.max_request_bytes)
        self._server: grpc.aio.Server | None = None
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.health = health.aio.HealthServicer()

    async def start(self) -> int:
        """Binds and starts serving; returns the bound port."""
        server = grpc.aio.server(options=channel_options(self.settings.max_message_bytes))
        model_service_pb2_grpc.add_ModelServiceServicer_to_server(
            ModelServicer(self.registry, self.inference, self.metrics), server
        )
        hook_service_pb2_grpc.add_HookServiceServicer_to_server(HookServicer(self.hooks), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        if self.settings.reflection:
            reflection.enable_server_reflection((*SERVICES, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        await self.set_serving(False)  # until the caller says the models are ready
        address = f"{self.settings.host}:{self.settings.port}"
        port = server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"cannot listen on {address}")
        await server.start()
        self._server, self.port = server, port
        if self.settings.metrics_port is not None:
            self.metrics_port = self.metrics.serve(self.settings.host, self.settings.metrics_port)
            log.info("metrics on http://%s:%d/metrics", self.settings.host, self.metrics_port)
        log.info("serving on %s:%d", self.settings.host, port)
        return port

    @property
    def target(self) -> str:
        """host:port clients connect to."""
        return f"{self.settings.host}:{self.port}"

    async def set_serving(self, serving: bool) -> None:
        """Sets the health status of the server ("") and of each hookwire service."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", *SERVICES):
            await self.health.set(service, status)

    async def stop(self, grace: float | None = None) -> None:
        """Graceful stop: health turns NOT_SERVING, event streams end with UNAVAILABLE,
        new calls are refused, in-flight Infer calls get ``grace`` seconds to finish, then
        every hook is removed and the model threads stop."""
        await self.set_serving(False)
        self.hooks.begin_shutdown()
        if self._server is not None:
            await self._server.stop(self.settings.grace if grace is None else grace)
        await self.hooks.close()
        self.metrics.stop()
        self.registry.shutdown()

    async def wait(self) -> None:
        """Returns when the server has stopped."""
        if self._server is not None:
            await self._server.wait_for_termination()


async def serve(
    settings: ServerSettings, load_models: Callable[[], list[ModelHost]],
    on_ready: Callable[[HookwireServer], None] | None = None,
) -> None:
    """Serves until SIGINT or SIGTERM, then stops gracefully.

    The server answers health checks (NOT_SERVING) while ``load_models`` runs in a
    thread; it turns SERVING once every model is hosted.
    """
    registry = ModelRegistry()
    server = HookwireServer(registry, settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    try:
        loading = asyncio.ensure_future(asyncio.to_thread(load_models))
        await asyncio.wait([loading, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        if not stop.is_set():
            for host in loading.result():
                registry.add(host)
            await server.set_serving(True)
            if on_ready is not None:
                on_ready(server)
            await stop.wait()
    finally:
        log.info("stopping")
        await server.stop()
