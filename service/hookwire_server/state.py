"""The server's state that every call and every stream consults: its limits, its
metrics, and whether it is draining (stopping: nothing new is accepted)."""

from __future__ import annotations

import dataclasses

from .errors import Unavailable
from .limits import Limits
from .memory_budget import MemoryBudget
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
    #: What running calls and the models' resident memory may take (memory_budget.py);
    #: None: made from ``limits.memory_budget_bytes`` on first use.
    memory: MemoryBudget | None = None

    def __post_init__(self) -> None:
        if self.memory is None:
            self.memory = MemoryBudget(self.limits.memory_budget_bytes)

    @property
    def budget(self) -> MemoryBudget:
        """The memory budget (see ``memory``)."""
        assert self.memory is not None
        return self.memory

    def refuse_when_draining(self) -> None:
        """Unavailable while the server stops."""
        if self.draining:
            raise Unavailable(SHUTDOWN_REASON)
