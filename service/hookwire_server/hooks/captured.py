"""What a capture sends, made where the hook fires (the front's own process, or the hook
runtime in a vLLM worker: runtime.step): the captured parts in an event's order, selected, cast or
summarized on their device, and the devices they were on."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Callable

import torch

from hookwire.wire import codec
from hookwire.v1 import hook_pb2

from ..errors import InvalidArgument, Unimplemented
from . import heads
from .hook_specs import _part_name

if TYPE_CHECKING:
    from .hook_specs import Action


#: One captured value: its part, the InterceptEvent field it goes to, its kwargs key
#: (else None), and the value.
Captured = tuple[int, str, "str | None", Any]
_FIELDS = {hook_pb2.PART_GRAD_INPUT: "grad_input", hook_pb2.PART_GRAD_OUTPUT: "grad_output"}


def captured(action: Action, parts: dict[str, Any]) -> Iterator[Captured]:
    """The values a capture sends, in the event's order (args, kwargs, output, grads)."""
    for part in action.capture:
        if part == hook_pb2.PART_ARGS:
            for value in parts["args"]:
                yield part, "args", None, value
        elif part == hook_pb2.PART_KWARGS:
            for key, value in parts["kwargs"].items():
                yield part, "kwargs", key, value
        elif part == hook_pb2.PART_OUTPUT:
            yield part, "output", None, parts["output"]
        else:
            field = _FIELDS[part]
            for value in parts[field]:
                yield part, field, None, value


def prepare(
    hook_id: str, action: Action, path: str, parts: dict[str, Any], then: Callable[[Any], Any] | None,
) -> tuple[list[Captured], list[str]]:
    """The captured values selected, cast or summarized (on their device), each passed
    through ``then`` (an asynchronous capture's host copies), and the devices the
    captured tensors were on (InterceptEvent.devices)."""
    options = action.options
    items: list[Captured] = []
    devices: list[str] = []
    if action.heads:  # the named heads only, where the module's heads are separate (hooks.heads)
        assert action.head_view is not None
        parts = heads.view_parts(parts, action.heads_target, action.heads, *action.head_view)
    for part, field, key, value in captured(action, parts):
        _devices_of(value, devices)
        try:
            value = options.prepare(value) if options.transforms else value
            if then is not None:
                value = then(value)
        except Exception as exc:
            raise capture_error(exc, hook_id, path, part) from None
        items.append((part, field, key, value))
    return items, devices


def capture_error(exc: BaseException, hook_id: str, path: str, part: int) -> BaseException:
    """What a capture that cannot be made raises: UNIMPLEMENTED for a value with no wire
    form, INVALID_ARGUMENT for a selection that does not fit and the like; anything else
    as it is."""
    if isinstance(exc, codec.CodecError):
        return Unimplemented(f"hook {hook_id} on module {path!r} cannot capture {_part_name(part)}: {exc}")
    if isinstance(exc, (IndexError, RuntimeError, ValueError, TypeError)):
        return InvalidArgument(
            f"hook {hook_id} on module {path!r} cannot capture {_part_name(part)}: {type(exc).__name__}: {exc}")
    return exc


def _devices_of(value: Any, out: list[str]) -> None:
    """Adds the devices of the tensors in ``value`` that ``out`` lacks, in order
    (InterceptEvent.devices). Plain walks of the few containers a hook sees."""
    if isinstance(value, torch.Tensor):
        name = str(value.device)
        if name not in out:
            out.append(name)
    elif isinstance(value, (tuple, list)):  # named tuples and torch.return_types too
        for v in value:
            _devices_of(v, out)
    elif isinstance(value, Mapping):
        for v in value.values():
            _devices_of(v, out)
