"""The server-wide memory budget: what the calls running at once may take together.

A call's peak memory is estimated before it runs (models/memory_estimate.py: from the
model's config and the call's shapes, or a probe pass on fake tensors) and *claimed*
here for as long as it runs; what the models keep for good (their weights, a vLLM
engine's KV cache) is claimed once, as *resident*. A call whose estimate can never fit
(more than the budget less what is resident) is refused at once with RESOURCE_EXHAUSTED
naming its estimate and the setting; one that fits the budget but not what is free now
waits, first come first served, until earlier calls give their claims back (a call of at
most 1% of the budget that fits what is free goes ahead of waiting larger ones). So one
request that would need tens of gigabytes is refused instead of growing the process
until the kernel kills it (with every tenant's calls, sessions and TTL hooks), and calls
that each fit but together would not run one after the other.

The estimate is an upper bound of the tensors the call allocates, not of the process's
RSS: the budget is the part of the process's memory that calls may use, so the default
(``default_budget_bytes``) leaves 30% of what the process may use for the interpreter,
the libraries, gRPC's buffers and the allocator's slack. Domain module: no grpc, no torch.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import resource
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .errors import ResourceExhausted

log = logging.getLogger("hookwire.memory")

#: The part of the memory the process may use that calls may claim by default.
DEFAULT_FRACTION = 0.7
#: A claim of at most this part of the budget never waits behind larger ones when it fits
#: what is free (an ordinary small call is not held up by a tenant's large ones).
SMALL_FRACTION = 0.01
#: The setting that sets the budget (a Limits field: [server] memory_budget_bytes,
#: HOOKWIRE_MEMORY_BUDGET_BYTES).
SETTING = "memory_budget_bytes"

_CGROUP_FILES = (
    Path("/sys/fs/cgroup/memory.max"),  # cgroup v2
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),  # cgroup v1
)


def format_bytes(count: float) -> str:
    """``count`` bytes in the largest binary unit that keeps it at 1 or more ("17.2 GiB")."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def process_memory_limit() -> tuple[int, str]:
    """The most memory this process may use and what sets it: the least of the physical
    memory, the cgroup's ``memory.max`` and RLIMIT_AS (the address-space ceiling)."""
    limits: list[tuple[int, str]] = []
    try:
        limits.append((os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "physical memory"))
    except (ValueError, OSError):  # not POSIX enough to tell
        pass
    for path in _CGROUP_FILES:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # "max" (v2) means no limit; v1 says "no limit" with a huge number
            limits.append((int(text), f"the cgroup's memory limit ({path})"))
        break
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        limits.append((soft, "RLIMIT_AS"))
    if not limits:
        return 1 << 62, "nothing"
    return min(limits)


def default_budget_bytes() -> int:
    """DEFAULT_FRACTION of the memory this process may use (process_memory_limit)."""
    return int(process_memory_limit()[0] * DEFAULT_FRACTION)


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A call's estimated peak: bytes in all, and what they are made of (part -> bytes,
    e.g. {"activations": ..., "attention scores": ..., "KV cache": ..., "captures": ...})."""

    bytes: int
    parts: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def describe(self) -> str:
        """"17.2 GiB (attention scores 16.0 GiB, activations 1.1 GiB)": the largest parts first."""
        parts = sorted(((n, b) for n, b in self.parts.items() if b > 0), key=lambda item: -item[1])
        inner = ", ".join(f"{name} {format_bytes(b)}" for name, b in parts[:4])
        return f"{format_bytes(self.bytes)} ({inner})" if inner else format_bytes(self.bytes)


class Claim:
    """Bytes a running call holds in the budget until ``release`` (idempotent)."""

    def __init__(self, budget: MemoryBudget, nbytes: int) -> None:
        self._budget = budget
        self.bytes = nbytes
        self._released = False
        self._until: asyncio.Future[Any] | None = None

    def release(self) -> None:
        """Gives the bytes back (waiting calls may start); after ``hold_until``, only once
        its future is done. Event loop; idempotent."""
        if self._until is not None and not self._until.done():
            return
        if not self._released:
            self._released = True
            self._budget._give_back(self.bytes)

    def hold_until(self, future: asyncio.Future[Any]) -> None:
        """Keeps the bytes claimed until ``future`` is done (then gives them back), whatever
        ``release`` is called before: for a call whose caller left while the model still
        holds its memory (a Generate call's step in flight and its KV cache, until its
        engine ends it). Event loop."""
        self._until = future
        future.add_done_callback(lambda _: self.release())

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class MemoryBudget:
    """The budget (see the module docstring). Event loop, except ``peak``/``claimed`` reads."""

    def __init__(self, limit_bytes: int | None = None) -> None:
        #: The budget in bytes (``memory_budget_bytes``; None or 0: default_budget_bytes()).
        self.limit = int(limit_bytes) if limit_bytes else default_budget_bytes()
        #: Bytes that models keep for good (weights, KV caches), by model.
        self.resident: dict[str, int] = {}
        #: Bytes running calls hold now.
        self.claimed = 0
        #: The most ``claimed + resident`` has been (for metrics and tests).
        self.peak = 0
        #: Called once per refused call (the metrics' counter).
        self.on_refused: Callable[[], None] | None = None
        self._waiting: collections.deque[tuple[int, asyncio.Future[None], Estimate, str]] = collections.deque()

    @property
    def resident_bytes(self) -> int:
        """Bytes the models keep for good, all together."""
        return sum(self.resident.values())

    @property
    def waiting(self) -> int:
        """Calls waiting for room."""
        return sum(1 for entry in self._waiting if not entry[1].done())

    @property
    def available(self) -> int:
        """Bytes a call could claim now."""
        return self.limit - self.resident_bytes - self.claimed

    def keep(self, model: str, nbytes: int) -> None:
        """Records what ``model`` keeps for good (replacing what it kept before); logs a
        warning when the models keep more than the budget (every call is refused then)."""
        self.resident[model] = max(0, int(nbytes))
        self._note_peak()
        if self.resident_bytes > self.limit:
            log.warning("memory budget: the models keep %s, more than the budget of %s (%s): every call on a "
                        "model the budget estimates is refused; raise memory_budget_bytes",
                        format_bytes(self.resident_bytes), format_bytes(self.limit), SETTING)

    def check(self, estimate: Estimate, what: str) -> None:
        """ResourceExhausted when ``estimate`` can never fit: more than the budget less
        what the models keep. ``what`` names the call ("Infer on 'tiny-lm'")."""
        room = self.limit - self.resident_bytes
        if estimate.bytes > room:
            if self.on_refused is not None:
                self.on_refused()
            resident = f" less {format_bytes(self.resident_bytes)} the models keep" if self.resident_bytes else ""
            raise ResourceExhausted(
                f"{what}: an estimated peak of {estimate.describe()}, over the limit of "
                f"{format_bytes(self.limit)}{resident} ({SETTING}); send fewer rows or shorter "
                "sequences (split the batch), or raise memory_budget_bytes if the machine has the memory"
            )

    async def claim(self, estimate: Estimate, what: str) -> Claim:
        """Claims ``estimate`` for one call: at once when it fits what is free and no call
        waits before it, else after the claims before it are given back (first come,
        first served; cancelling the waiting task gives up its place). ResourceExhausted
        at once when it can never fit (``check``). Event loop; waits."""
        self.check(estimate, what)
        nbytes = estimate.bytes
        small = nbytes <= self.limit * SMALL_FRACTION
        if nbytes > self.available or (self._waiting and not small):
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            entry = (nbytes, future, estimate, what)
            self._waiting.append(entry)
            try:
                await future
            except BaseException:
                if entry in self._waiting:
                    self._waiting.remove(entry)
                elif future.done() and not future.cancelled() and future.exception() is None:
                    self.claimed -= nbytes  # granted as it was cancelled: hand it on
                # (refused by _wake, set_exception: it never claimed anything)
                self._wake()
                raise
        else:
            self.claimed += nbytes
        self._note_peak()
        return Claim(self, nbytes)

    def _give_back(self, nbytes: int) -> None:
        self.claimed -= nbytes
        self._wake()

    def _wake(self) -> None:
        """Grants waiting claims in order while they fit (the first that does not fit
        holds the rest back, so a large call is not starved by small ones)."""
        while self._waiting:
            nbytes, future, estimate, what = self._waiting[0]
            if future.done():  # cancelled while waiting
                self._waiting.popleft()
                continue
            if nbytes > self.available:
                if self.claimed:
                    return
                # Nothing left to wait for: what the models keep grew while it waited.
                self._waiting.popleft()
                try:
                    self.check(estimate, what)
                except ResourceExhausted as exc:
                    future.set_exception(exc)
                continue
            self._waiting.popleft()
            self.claimed += nbytes
            future.set_result(None)

    def _note_peak(self) -> None:
        self.peak = max(self.peak, self.claimed + self.resident_bytes)
