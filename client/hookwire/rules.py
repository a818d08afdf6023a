"""Builders for modification rules: declarative edits the server applies inside a hook.

    hookwire.rules.zero("output.0", index="[:, :, 64:128]")
    hookwire.rules.add("output.0", steering_vector)
    hookwire.rules.save("output.0", slot="clean")
    hookwire.rules.patch("output.0", slot="clean", index="[:, 3]")

Pass them as a hook's action: ``posthook=hookwire.edit(rule, ..., capture=("output",))``
or simply ``posthook=[rule, ...]``. Targets name what the phase can change:
``args.N`` / ``kwargs.NAME`` in a prehook, ``output[.path]`` in a posthook,
``grad_output.N`` in a backward prehook, ``grad_input.N`` in a backward hook.
Each rule equals this in-process torch edit, out of place:
``new = op(t)`` or, with ``index``, ``new = t.clone(); new[index] = op(t[index])``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from .wire import codec
from .v1 import rule_pb2


@dataclasses.dataclass(frozen=True)
class Rule:
    """One rule: a target path, an optional numpy-style selection, and an operation."""

    target: str
    op: str
    index: str = ""
    params: tuple[tuple[str, Any], ...] = ()

    def to_proto(self) -> rule_pb2.Rule:
        """The wire form (tensors encoded now)."""
        msg = rule_pb2.Rule(target=self.target, index=self.index)
        params = dict(self.params)
        op = getattr(msg, self.op)
        op.SetInParent()
        for key, value in params.items():
            if key == "value":
                _operand_into(value, op.value)
            elif key == "direction":
                codec.encode_tensor_into(value, op.direction)
            else:
                setattr(op, key, value)
        return msg


def _operand_into(value: Any, out: rule_pb2.Operand) -> None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        out.scalar = float(value)
    else:
        codec.encode_tensor_into(value, out.tensor)


def _rule(target: str, op: str, index: str | None, **params: Any) -> Rule:
    if not isinstance(target, str) or not target:
        raise ValueError("a rule needs a target, e.g. 'output' or 'args.0'")
    return Rule(target=target, op=op, index=index or "", params=tuple((k, v) for k, v in params.items() if v is not None))


def scale(target: str, factor: float, *, index: str | None = None) -> Rule:
    """``t * factor``."""
    if not math.isfinite(factor):
        raise ValueError(f"factor {factor} is not finite")
    return _rule(target, "scale", index, factor=float(factor))


def add(target: str, value: Any, *, index: str | None = None) -> Rule:
    """``t + value``: a number, or a tensor that broadcasts (a steering vector)."""
    return _rule(target, "add", index, value=value)


def set(target: str, value: Any, *, index: str | None = None) -> Rule:  # noqa: A001 - the operation's name
    """Replace with ``value`` (a number, or a tensor broadcast to the target's shape)."""
    return _rule(target, "set", index, value=value)


def zero(target: str, *, index: str | None = None) -> Rule:
    """Zero-ablation."""
    return _rule(target, "zero", index)


def clamp(target: str, min: float | None = None, max: float | None = None, *, index: str | None = None) -> Rule:  # noqa: A002
    """``t.clamp(min, max)``; at least one bound."""
    if min is None and max is None:
        raise ValueError("clamp needs min, max or both")
    return _rule(target, "clamp", index, min=min, max=max)


def noise(target: str, std: float, *, seed: int = 0, index: str | None = None) -> Rule:
    """``t + std * randn`` from a generator seeded with ``seed`` at every firing."""
    if not std >= 0:
        raise ValueError(f"std {std} must be >= 0")
    return _rule(target, "noise", index, std=float(std), seed=int(seed))


def project_out(target: str, direction: Any, *, index: str | None = None) -> Rule:
    """Remove the component along ``direction`` (1-D, over the last dimension)."""
    return _rule(target, "project_out", index, direction=direction)


def patch(target: str, slot: str, *, index: str | None = None) -> Rule:
    """Replace with the tensor saved in ``slot`` of the session (activation patching).

    With ``index``, a slot holding a tensor of the target's whole shape is indexed the
    same way: ``new[index] = slot[index]``; any other slot tensor is broadcast into it.
    """
    return _rule(target, "patch", index, slot=slot)


def save(target: str, slot: str, *, index: str | None = None) -> Rule:
    """Keep the target (or its selection) in ``slot`` of the session; changes nothing."""
    return _rule(target, "save", index, slot=slot)


__all__ = ["Rule", "add", "clamp", "noise", "patch", "project_out", "save", "scale", "set", "zero"]
