"""``hookwire tap``: a live terminal view of a model's modules, like ``top``."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import sys
import time
from typing import Any, TextIO

from ._client import ConnectOptions, connect
from ._specs import Sampling, capture
from ._types import InterceptEvent, TensorSummary


@dataclasses.dataclass
class ModuleStats:
    """What the tap knows about one module."""

    events: int = 0
    recent: collections.deque[float] = dataclasses.field(default_factory=lambda: collections.deque(maxlen=10_000))
    summary: TensorSummary | None = None


def _first_summary(value: Any) -> TensorSummary | None:
    if isinstance(value, TensorSummary):
        return value
    if isinstance(value, (tuple, list)):
        for item in value:
            found = _first_summary(item)
            if found is not None:
                return found
    if isinstance(value, dict):
        return _first_summary(list(value.values()))
    return None


class TapView:
    """Accumulates events and renders the table."""

    def __init__(self, model: str, pattern: str, modules: tuple[str, ...], *, every: int, stats: bool, window: float = 5.0):
        self.model, self.pattern, self.every, self.stats, self.window = model, pattern, every, stats, window
        self.modules = {path: ModuleStats() for path in modules}
        self.dropped = 0
        self.started = time.monotonic()

    def add(self, event: InterceptEvent) -> None:
        """Counts one event."""
        stats = self.modules.setdefault(event.module, ModuleStats())
        stats.events += 1
        stats.recent.append(time.monotonic())
        stats.summary = _first_summary(event.output) or stats.summary
        self.dropped = max(self.dropped, event.dropped)

    def rate(self, stats: ModuleStats, now: float) -> float:
        """Calls per second over the window (events times the sampling stride)."""
        horizon = min(self.window, max(now - self.started, 1e-9))
        recent = sum(1 for t in stats.recent if now - t <= horizon)
        return recent * self.every / horizon

    def render(self) -> list[str]:
        """The lines of the table."""
        now = time.monotonic()
        head = (f"hookwire tap {self.model} {self.pattern!r}   every {self.every}   "
                f"dropped {self.dropped}   up {now - self.started:.0f}s   (Ctrl-C to stop)")
        columns = f"{'module':<34}{'calls/s':>9}{'events':>9}"
        if self.stats:
            columns += f"{'mean':>11}{'std':>11}{'min':>11}{'max':>11}{'l2':>11}{'nan/inf':>9}"
        lines = [head, "", columns]
        for path, stats in self.modules.items():
            line = f"{(path or '<root>')[:33]:<34}{self.rate(stats, now):>9.1f}{stats.events:>9}"
            if self.stats:
                s = stats.summary
                if s is None:
                    line += f"{'-':>11}" * 5 + f"{'-':>9}"
                else:
                    line += "".join(f"{v:>11.4g}" for v in (s.mean, s.std, s.min, s.max, s.l2_norm))
                    line += f"{f'{s.nan_count}/{s.inf_count}':>9}"
            lines.append(line)
        return lines


async def run_tap(
    target: str, model: str, pattern: str, *, stats: bool, every: int, scope: str, interval: float,
    duration: float | None, plain: bool, out: TextIO = sys.stdout, options: ConnectOptions | None = None,
) -> int:
    """Registers a summarizing hook, renders until Ctrl-C (or ``duration``, or the hook's
    removal), then removes it. Raises the stream's HookwireError when it fails (the
    server went away)."""
    async with connect(target, options=options) as client:
        async with client.model(model).hook(
            pattern, posthook=capture("output", summarize=True), scope=scope,  # type: ignore[arg-type]
            sampling=Sampling(every_n=every) if every > 1 else None,
        ) as hook:
            view = TapView(model, pattern, hook.modules, every=every, stats=stats)

            async def consume() -> None:
                async for event in hook.events():
                    view.add(event)

            reader = asyncio.ensure_future(consume())
            deadline = None if duration is None else time.monotonic() + duration
            try:
                while deadline is None or time.monotonic() < deadline:
                    await asyncio.wait((reader,), timeout=interval)
                    if reader.done():  # the stream failed (the server went away: say so) or the hook was removed
                        reader.result()
                        break
                    lines = view.render()
                    if plain:
                        out.write("\n".join(lines) + "\n\n")
                    else:
                        out.write("\x1b[H\x1b[2J" + "\n".join(lines) + "\n")
                    out.flush()
            finally:
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)
    out.write(f"tap stopped; hook {hook.id} removed\n")
    out.flush()
    return 0
