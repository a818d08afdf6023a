"""Compact readout events (Readout.compact, issue 25): a hook's readouts of all the
modules that fired in one pass of a call, stacked into one event sent when the pass ends.

Why: a readout is a few numbers per position (4 probe scores are 16 bytes), and an
event per module and step carries about 140 bytes of metadata besides (hook id, request
id, module path, timestamp, model). A monitor reading every block at every token pays
mostly for that. One event per pass, with the modules as positions in the hook's
resolved modules (``InterceptEvent.module_indices``) and, in the call's own stream,
without what the call already says, costs the metadata once per pass.

The hook prepares its readout when it fires, as any capture (selection, cast, readout,
on the device), and adds it here (``CompactReadouts.add``), keyed by hook, call, phase,
call index and the readout's layout (shapes and dtypes: modules whose readouts differ
go in events of their own). The pass runner sends the stacks when the pass ends
(``send``), after the pass's other events, in the order their first module fired; a
failed shared pass drops them with its held events (``drop``). Worker thread only.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any, Callable

import torch

log = logging.getLogger("hookwire.hooks")


@dataclasses.dataclass
class Stack:
    """One compact event in the making: one hook's readouts of one call's pass."""

    record: Any
    action: Any
    p: Any
    call_index: int
    training: bool
    #: When its first module fired (the event's time).
    fired: Any
    #: Positions of the modules in the hook's resolved modules, in firing order.
    indices: list[int] = dataclasses.field(default_factory=list)
    #: Per module, its prepared captures: (part, field, kwargs key, value).
    items: list[list[tuple[Any, ...]]] = dataclasses.field(default_factory=list)
    devices: list[str] = dataclasses.field(default_factory=list)

    def stacked(self) -> list[tuple[Any, ...]]:
        """The captures with each value stacked over the modules along a new first dimension."""
        first = self.items[0]
        return [(part, field, key, _stack([module[i][3] for module in self.items]))
                for i, (part, field, key, _) in enumerate(first)]


class CompactReadouts:
    """A pass's compact readout events in the making (see the module docstring)."""

    def __init__(self) -> None:
        self._stacks: dict[tuple[Any, ...], Stack] = {}

    def __len__(self) -> int:
        return len(self._stacks)

    def stack_for(self, record: Any, action: Any, p: Any, call_index: int, layout: Any) -> Stack | None:
        """The stack a readout of this hook, call, phase, call index and layout joins; None
        when there is none yet (``start`` one)."""
        return self._stacks.get(_key(record, action, p, call_index, layout))

    def start(self, stack: Stack, layout: Any) -> Stack:
        self._stacks[_key(stack.record, stack.action, stack.p, stack.call_index, layout)] = stack
        return stack

    def send(
        self, *, raise_errors: bool = True, record: Any = None, fail: Callable[[Any, BaseException], bool] | None = None,
    ) -> None:
        """Sends every stack (only ``record``'s: a hook about to be disabled, whose notice
        must follow its readouts), in the order each was started. A stack that cannot be
        sent fails its call alone where ``fail`` (Batch.fail_call) keeps the failure for
        it; otherwise the first error (a request-scoped hook's event that cannot be sent
        fails its call) is raised after the rest are sent, unless ``raise_errors`` is
        false (a pass that already failed)."""
        if record is None:
            stacks, self._stacks = list(self._stacks.values()), {}
        else:
            mine = [key for key, stack in self._stacks.items() if stack.record is record]
            stacks = [self._stacks.pop(key) for key in mine]
        error: BaseException | None = None
        for stack in stacks:
            try:
                stack.record.send_compact(stack)
            except Exception as exc:
                if fail is not None and fail(stack.p, exc):
                    continue
                error = error or exc
        if error is not None:
            if raise_errors:
                raise error
            log.info("a compact readout event of a failed pass was not sent: %s", error)

    def drop(self) -> None:
        """Forgets the stacks (a failed shared pass: its calls run again alone)."""
        self._stacks.clear()


def _key(record: Any, action: Any, p: Any, call_index: int, layout: Any) -> tuple[Any, ...]:
    return (id(record), id(p), action.phase, call_index, layout)


def layout(items: list[tuple[Any, ...]]) -> tuple[Any, ...]:
    """What must be equal for two modules' readouts to stack: parts, keys, and each
    value's structure, shapes, dtypes and devices."""
    return tuple((part, field, key, _shape(value)) for part, field, key, value in items)


def _shape(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("t", tuple(value.shape), value.dtype, value.device)
    if isinstance(value, Mapping):
        return ("m", tuple((k, _shape(v)) for k, v in value.items()))
    if isinstance(value, (tuple, list)):
        return ("s", tuple(_shape(v) for v in value))
    return ("v", type(value).__name__, value if value is None or isinstance(value, (bool, int, float, str)) else id(value))


def _stack(values: list[Any]) -> Any:
    """Values of equal layout stacked: tensors along a new first dimension, containers
    element by element; anything else (a None) as the first one's."""
    first = values[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(values)
    if isinstance(first, Mapping):
        return {k: _stack([v[k] for v in values]) for k in first}
    if isinstance(first, (tuple, list)):
        return tuple(_stack([v[i] for v in values]) for i in range(len(first)))
    return first
