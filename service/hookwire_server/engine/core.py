"""The engine layer's state: for every model, the engine that runs it (seam.Engine) and
its scheduler (scheduler.Scheduler), made on first use. Calls submit work here; the
server closes it on shutdown, before the models' worker threads go."""

from __future__ import annotations

from typing import Any, Callable

from ..hooks.event_bus import DeliveryGate
from ..models.model_loading import ModelConfig
from ..models.model_loading import build_host as load_torch_host
from ..models.model_registry import ModelHost, ModelRegistry
from .scheduler import Scheduler, Work
from .seam import Engine
from .torch_engine import TorchEngine


def default_engine(host: ModelHost) -> Engine:
    """The engine of ``host``: the one that loaded it (vLLM), else the torch engine."""
    loaded = host.loaded_engine
    return loaded if loaded is not None else TorchEngine(host)


def build_host(config: ModelConfig) -> ModelHost:
    """Builds one configured model with the engine its config names (blocks while it
    loads): the torch engine's loader (models.model_loading.build_host), or vLLM's
    (vllm_engine.build_host, imported only for such a model)."""
    if config.engine == "vllm":
        config.check()
        from .vllm_engine import build_host as build_vllm_host

        return build_vllm_host(config)
    return load_torch_host(config)


class Engines:
    """Each model's engine and scheduler (see the module docstring). Event loop."""

    def __init__(
        self, registry: ModelRegistry, gate: DeliveryGate | None = None,
        factory: Callable[[ModelHost], Engine] = default_engine,
    ) -> None:
        self._registry = registry
        #: Makes the engine of a model (the torch engine for every model so far).
        self._factory = factory
        #: Which calls must wait for a stream's reader before they start (the hook
        #: manager's DeliveryGate); None: none do.
        self._gate = gate
        self._engines: dict[str, Engine] = {}
        self._schedulers: dict[str, Scheduler] = {}
        if gate is not None:
            gate.listen(self._room)

    def engine(self, host: ModelHost) -> Engine:
        """The engine that runs ``host`` (made by the factory on first use)."""
        engine = self._engines.get(host.name)
        if engine is None or engine.host is not host:
            engine = self._engines[host.name] = self._factory(host)
            host.engine, host.refused = engine.name, engine.refused  # what clients are told (Model)
        return engine

    def use(self, factory: Callable[[ModelHost], Engine]) -> None:
        """Makes the engines of models with no calls yet with ``factory`` (a test engine
        behind the seam, or the next engine). Event loop, before the models' first calls."""
        self._factory = factory
        self._engines = {name: e for name, e in self._engines.items() if name in self._schedulers}
        for host in self._registry:  # made now: ListModels names each model's engine at once
            self.engine(host)

    def scheduler(self, host: ModelHost) -> Scheduler:
        """``host``'s scheduler (made on first use)."""
        scheduler = self._schedulers.get(host.name)
        if scheduler is None:
            scheduler = self._schedulers[host.name] = Scheduler(host, self.engine(host), self._gate)
        return scheduler

    async def submit(self, host: ModelHost, work: Work) -> Any:
        """Queues ``work`` on ``host``'s scheduler and waits for its result (Scheduler.submit)."""
        return await self.scheduler(host).submit(work)

    def start(self, host: ModelHost, work: Work) -> None:
        """Queues a running call on ``host``'s scheduler without waiting (Scheduler.enqueue)."""
        self.scheduler(host).enqueue(work)

    def _room(self) -> None:
        """Calls held back by a full stream may start: every scheduler looks again."""
        for scheduler in list(self._schedulers.values()):
            scheduler.poke()

    def close(self) -> None:
        """Fails the waiting works of every model (the server stops) and takes no more."""
        for scheduler in self._schedulers.values():
            scheduler.close()
