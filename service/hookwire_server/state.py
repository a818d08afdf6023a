"""The server's state that every call and every stream consults: its limits, its
metrics, and whether it is draining (stopping: nothing new is accepted)."""

from __future__ import annotations

import dataclasses

from .errors import Unavailable
from .limits import Limits
from .metrics import Metrics

#: Why a call, stream or hook is refused (or a stream ended) while the server stops.
SHUTDOWN_REASON = "the server is shutting down"


@dataclasses.dataclass(eq=False)
class ServerState:
    """See the module docstring. Event loop (``draining`` is also read on worker threads)."""

    limits: Limits = dataclasses.field(default_factory=Limits)
    metrics: Metrics = dataclasses.field(default_factory=Metrics)
    #: True once the server is stopping: nothing new is accepted.
    draining: bool = False

    def refuse_when_draining(self) -> None:
        """Unavailable while the server stops."""
        if self.draining:
            raise Unavailable(SHUTDOWN_REASON)
