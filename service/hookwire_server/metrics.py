"""Prometheus metrics of one server (its own registry, so several servers can share a process)."""

from __future__ import annotations

import threading
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    """The server's metrics. Counters are safe to bump from any thread."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.rpcs = Counter("hookwire_rpcs", "RPCs handled, by method and status code.", ["method", "code"], registry=r)
        self.infer_seconds = Histogram(
            "hookwire_infer_seconds", "Infer latency (queueing included), by model.", ["model"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.hook_fires = Counter("hookwire_hook_fires", "Hook firings that passed scope and gating, by model.", ["model"], registry=r)
        self.events_sent = Counter("hookwire_events_sent", "Events handed to gRPC on event streams.", registry=r)
        self.events_dropped = Counter("hookwire_events_dropped", "Events dropped by drop policies, by model.", ["model"], registry=r)
        self.stream_bytes = Counter("hookwire_stream_bytes", "Tensor bytes handed to gRPC on event streams.", registry=r)
        self.buffered_events = Gauge("hookwire_buffered_events", "Events waiting in stream buffers.", registry=r)
        self.buffered_bytes = Gauge("hookwire_buffered_bytes", "Tensor bytes waiting in stream buffers.", registry=r)
        self.sessions = Gauge("hookwire_sessions", "Open sessions.", registry=r)
        self.hooks = Gauge("hookwire_hooks", "Registered hooks (request-scoped ones excluded).", registry=r)
        self.streams = Gauge("hookwire_streams", "Open event streams (sessions and subscriptions).", registry=r)
        self._server: object | None = None
        self._thread: threading.Thread | None = None

    def watch(
        self, *, sessions: Callable[[], float], hooks: Callable[[], float], streams: Callable[[], float],
        buffered: Callable[[], tuple[int, int]],
    ) -> None:
        """Gauges read at scrape time."""
        self.sessions.set_function(sessions)
        self.hooks.set_function(hooks)
        self.streams.set_function(streams)
        self.buffered_events.set_function(lambda: buffered()[0])
        self.buffered_bytes.set_function(lambda: buffered()[1])

    def serve(self, host: str, port: int) -> int:
        """Serves /metrics over HTTP in a thread; returns the bound port."""
        server, thread = start_http_server(port, addr=host, registry=self.registry)
        self._server, self._thread = server, thread
        return int(server.server_port)

    def stop(self) -> None:
        """Stops the HTTP endpoint, if any."""
        if self._server is not None:
            self._server.shutdown()  # type: ignore[attr-defined]
            self._server.server_close()  # type: ignore[attr-defined]
            self._server = None
