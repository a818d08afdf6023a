"""Modification rules: compiled (validated, operands decoded) at registration, applied
inside hooks out of place.

Each rule is exactly this in-process torch edit, which is also its definition:

    without index: new = op(t)
    with index:    new = t.clone(); new[index] = op(t[index])

with op one of: scale ``x * factor``; add ``x + v``; set ``v.expand(x.shape).clone()``;
zero ``torch.zeros_like(x)``; clamp ``x.clamp(min, max)``; noise ``x + std *
torch.randn(x.shape, generator=torch.Generator(x.device).manual_seed(seed), dtype=x.dtype,
device=x.device)``; project_out ``x - (x @ d).unsqueeze(-1) * d`` with ``d = dir /
torch.linalg.vector_norm(dir)``; patch ``s.expand(x.shape).clone()`` where ``s`` is the slot's
tensor, or ``slot[index]`` when the slot holds a tensor of the target's whole shape (a saved
activation patched at the same positions). Tensor operands are cast to the target's dtype and
device. ``save`` stores ``t[index]``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Callable

import torch

from hookwire.wire import codec
from hookwire.v1 import hook_pb2

from ..errors import FailedPrecondition, HookwireServerError, InvalidArgument
from .selection import Index, SelectionError, parse_selection
from .slots import SlotStore

#: Roots a rule can change, by phase (what the torch hook can return).
MODIFIABLE: dict[int, frozenset[str]] = {
    hook_pb2.PHASE_FORWARD_PRE: frozenset({"args", "kwargs"}),
    hook_pb2.PHASE_FORWARD: frozenset({"output"}),
    hook_pb2.PHASE_BACKWARD_PRE: frozenset({"grad_output"}),
    hook_pb2.PHASE_BACKWARD: frozenset({"grad_input"}),
}
#: Roots a `save` can read, by phase (what the hook sees).
READABLE: dict[int, frozenset[str]] = {
    hook_pb2.PHASE_FORWARD_PRE: frozenset({"args", "kwargs"}),
    hook_pb2.PHASE_FORWARD: frozenset({"args", "kwargs", "output"}),
    hook_pb2.PHASE_BACKWARD_PRE: frozenset({"grad_output"}),
    hook_pb2.PHASE_BACKWARD: frozenset({"grad_input", "grad_output"}),
}
_SEQUENCE_ROOTS = frozenset({"args", "grad_input", "grad_output"})


class RuleFailure(Exception):
    """A rule that failed at run time; ``error`` is the domain error the call fails with."""

    def __init__(self, error: HookwireServerError) -> None:
        super().__init__(str(error))
        self.error = error


@dataclasses.dataclass(frozen=True)
class Target:
    """A parsed target path: the root part and the keys/indices below it."""

    text: str
    root: str
    path: tuple[str, ...]


def parse_target(text: str, phase_field: str, phase: int, *, reading: bool, with_kwargs: bool) -> Target:
    """Validates a target for a phase; InvalidArgument (message without the field prefix)."""
    segments = text.split(".")
    root, path = segments[0], tuple(segments[1:])
    allowed = (READABLE if reading else MODIFIABLE)[phase]
    if root not in allowed:
        what = "read" if reading else "change"
        raise InvalidArgument(
            f"{text!r}: a {phase_field} can {what} {', '.join(sorted(allowed))} (targets like "
            f"{' or '.join(sorted(r + ('.0' if r in _SEQUENCE_ROOTS else '.NAME' if r == 'kwargs' else '') for r in allowed))})"
        )
    if any(seg == "" for seg in path):
        raise InvalidArgument(f"{text!r} is malformed (dot-separated indices or keys)")
    if root in _SEQUENCE_ROOTS and not (path and path[0].isdigit()):
        raise InvalidArgument(f"{text!r}: {root} is a tuple: name an item, e.g. {root}.0")
    if root == "kwargs":
        if not path:
            raise InvalidArgument(f"{text!r}: name a keyword argument, e.g. kwargs.attention_mask")
        if not with_kwargs:
            raise InvalidArgument(f"{text!r}: kwargs reach the hook only with with_kwargs")
    return Target(text, root, path)


def _get(value: Any, path: tuple[str, ...], where: str) -> Any:
    for seg in path:
        value = _child(value, seg, where)
    return value


def _child(value: Any, seg: str, where: str) -> Any:
    if isinstance(value, Mapping):
        if seg not in value:
            raise InvalidArgument(f"{where}: no key {seg!r} (keys: {list(value)})")
        return value[seg]
    if isinstance(value, (tuple, list)):
        if not (seg.isascii() and seg.isdigit() and len(seg) <= 9) or int(seg) >= len(value):
            raise InvalidArgument(f"{where}: no item {seg!r} in a sequence of {len(value)}")
        return value[int(seg)]
    raise InvalidArgument(f"{where}: cannot go inside a {type(value).__name__}")


def _replace(value: Any, path: tuple[str, ...], fn: Callable[[Any], Any], where: str) -> Any:
    """``value`` with the item at ``path`` replaced by fn(item); containers are copied, never mutated."""
    if not path:
        return fn(value)
    seg, rest = path[0], path[1:]
    item = _child(value, seg, where)
    new_item = _replace(item, rest, fn, where)
    if isinstance(value, Mapping):
        out: Any = copy.copy(value)
        out[seg] = new_item
        return out
    items = list(value)
    items[int(seg)] = new_item
    if isinstance(value, list):
        return items
    return type(value)(items) if type(value) is tuple else type(value)(*items)


@dataclasses.dataclass
class CompiledRule:
    """One validated rule with its operands decoded (on the model's device).

    ``tensor`` is the operand exactly as registered, and the server's only copy of
    it: the stored HookSpec keeps the operand's dtype and shape, not its bytes
    (see strip_operand_data); a listing that asks for the data encodes ``tensor``.
    """

    position: int
    kind: str
    target: Target
    index: Index | None
    index_text: str
    factor: float = 1.0
    scalar: float | None = None
    tensor: torch.Tensor | None = None
    lo: float | None = None
    hi: float | None = None
    std: float = 0.0
    seed: int = 0
    slot: str = ""
    #: project_out: ``tensor`` is the direction as registered; it is normalized as it is cast.
    normalize: bool = False
    _cast: dict[tuple[torch.dtype, torch.device], torch.Tensor] = dataclasses.field(default_factory=dict)

    @property
    def modifies(self) -> bool:
        """False for `save`, which only reads."""
        return self.kind != "save"

    def describe(self) -> str:
        """e.g. "rule 1 (zero on output.0[:, 3])"."""
        return f"rule {self.position} ({self.kind} on {self.target.text}{self.index_text})"

    def _operand(self, x: torch.Tensor) -> Any:
        if self.tensor is None:
            return self.scalar
        key = (x.dtype, x.device)
        cast = self._cast.get(key)
        if cast is None:
            # Decoded once at registration; cast once per target dtype (worker thread only).
            # For the operand's own dtype and device ``to`` returns ``tensor`` itself: no copy.
            base = self.tensor
            if self.normalize:  # d = dir / |dir|, in the direction's dtype (a 1-D vector)
                base = base / torch.linalg.vector_norm(base)
            cast = self._cast[key] = base.to(dtype=x.dtype, device=x.device)
        return cast

    def _op(self, x: torch.Tensor, slots: SlotStore | None) -> torch.Tensor:
        kind = self.kind
        if kind == "scale":
            return x * self.factor
        if kind == "add":
            return x + self._operand(x)
        if kind == "set":
            value = self._operand(x)
            if not isinstance(value, torch.Tensor):
                return torch.full_like(x, value)
            return value.expand(x.shape).clone()
        if kind == "zero":
            return torch.zeros_like(x)
        if kind == "clamp":
            return x.clamp(min=self.lo, max=self.hi)
        if kind == "noise":
            gen = torch.Generator(device=x.device)
            gen.manual_seed(self.seed)
            return x + self.std * torch.randn(x.shape, generator=gen, dtype=x.dtype, device=x.device)
        if kind == "project_out":
            d = self._operand(x)
            return x - (x @ d).unsqueeze(-1) * d
        raise AssertionError(kind)  # pragma: no cover

    def _patch(self, t: torch.Tensor, slots: SlotStore | None) -> torch.Tensor:
        assert slots is not None
        # On the target's device and in its dtype: moved once per saved value, not per firing.
        source = slots.get_as(self.slot, t.dtype, t.device)
        if source is None:
            raise FailedPrecondition(f"slot {self.slot!r} is empty (save into it first)")
        if self.index is not None and source.shape == t.shape:
            source = source[self.index]  # a whole saved activation: patch the same selection
        target = t if self.index is None else t[self.index]
        value = source.expand(target.shape).clone()
        if self.index is None:
            return value
        new = t.clone()
        new[self.index] = value
        return new

    def apply(self, x: Any, slots: SlotStore | None) -> Any:
        """The new value of the target (``x`` itself for save)."""
        if not isinstance(x, torch.Tensor):
            raise InvalidArgument(f"the target is a {type(x).__name__}, not a tensor")
        if self.kind == "save":
            assert slots is not None
            slots.save(self.slot, x if self.index is None else x[self.index])
            return x
        if self.kind == "patch":
            return self._patch(x, slots)
        if self.index is None:
            return self._op(x, slots)
        new = x.clone()
        new[self.index] = self._op(x[self.index], slots)
        return new


def compile_rules(
    rules: Any, *, phase: int, phase_field: str, with_kwargs: bool, device: torch.device,
) -> tuple[CompiledRule, ...]:
    """Validates and compiles a HookAction's rules; InvalidArgument naming rules[i] and the field."""
    compiled = []
    for i, rule in enumerate(rules):
        where = f"{phase_field}.rules[{i}]"
        kind = rule.WhichOneof("op")
        if kind is None:
            raise InvalidArgument(f"{where}: no operation (set one of scale, add, set, zero, clamp, noise, project_out, patch, save)")
        try:
            target = parse_target(rule.target, phase_field, phase, reading=kind == "save", with_kwargs=with_kwargs)
        except InvalidArgument as exc:
            raise InvalidArgument(f"{where}.target: {exc}") from None
        index = None
        if rule.index:
            try:
                index = parse_selection(rule.index)
            except SelectionError as exc:
                raise InvalidArgument(f"{where}.index: {exc}") from None
        out = CompiledRule(position=i, kind=kind, target=target, index=index, index_text=rule.index)
        op = getattr(rule, kind)
        if kind == "scale":
            out.factor = _finite(op.factor, f"{where}.scale.factor")
        elif kind in ("add", "set"):
            if not op.HasField("value"):
                raise InvalidArgument(f"{where}.{kind}.value: missing")
            if op.value.WhichOneof("kind") == "tensor":
                out.tensor = _decode(op.value.tensor, f"{where}.{kind}.value.tensor", device)
            else:
                out.scalar = _finite(op.value.scalar, f"{where}.{kind}.value.scalar")
        elif kind == "clamp":
            if not (op.HasField("min") or op.HasField("max")):
                raise InvalidArgument(f"{where}.clamp: set min, max or both")
            out.lo = _finite(op.min, f"{where}.clamp.min") if op.HasField("min") else None
            out.hi = _finite(op.max, f"{where}.clamp.max") if op.HasField("max") else None
            if out.lo is not None and out.hi is not None and out.lo > out.hi:
                raise InvalidArgument(f"{where}.clamp: min {out.lo} is above max {out.hi}")
        elif kind == "noise":
            out.std = _finite(op.std, f"{where}.noise.std")
            if out.std < 0:
                raise InvalidArgument(f"{where}.noise.std: {out.std} is negative")
            out.seed = op.seed
        elif kind == "project_out":
            direction = _decode(op.direction, f"{where}.project_out.direction", device)
            if direction.dim() != 1 or not direction.is_floating_point():
                raise InvalidArgument(f"{where}.project_out.direction: must be a 1-D floating-point tensor")
            norm = torch.linalg.vector_norm(direction)
            if not bool(torch.isfinite(norm)) or float(norm) == 0.0:
                raise InvalidArgument(f"{where}.project_out.direction: must be finite and not all zeros")
            out.tensor, out.normalize = direction, True
        elif kind in ("patch", "save"):
            if not op.slot:
                raise InvalidArgument(f"{where}.{kind}.slot: name a slot")
            out.slot = op.slot
        compiled.append(out)
    return tuple(compiled)


def operand_tensors(rules: Any) -> list[tuple[int, Any]]:
    """(rule position, Tensor message) of each tensor operand in a HookAction's ``rules``."""
    out = []
    for i, rule in enumerate(rules):
        kind = rule.WhichOneof("op")
        if kind in ("add", "set"):
            op = getattr(rule, kind)
            if op.HasField("value") and op.value.WhichOneof("kind") == "tensor":
                out.append((i, op.value.tensor))
        elif kind == "project_out" and rule.project_out.HasField("direction"):
            out.append((i, rule.project_out.direction))
    return out


def _finite(value: float, where: str) -> float:
    if not math.isfinite(value):
        raise InvalidArgument(f"{where}: {value} is not finite")
    return value


def _decode(msg: Any, where: str, device: torch.device) -> torch.Tensor:
    try:
        return codec.decode_tensor(msg, where=where).to(device)
    except codec.CodecError as exc:
        raise InvalidArgument(str(exc)) from None


def apply_rules(
    rules: tuple[CompiledRule, ...], parts: dict[str, Any], slots: SlotStore | None, where: str,
) -> tuple[dict[str, Any], set[str]]:
    """Applies rules in order to the hook's parts; returns the new parts and the roots changed.

    Raises RuleFailure carrying the domain error (naming ``where`` and the rule).
    """
    changed: set[str] = set()
    for rule in rules:
        root = rule.target.root
        try:
            new_root = _replace(parts[root], rule.target.path, lambda x: rule.apply(x, slots), rule.target.text)
        except HookwireServerError as exc:
            raise RuleFailure(type(exc)(f"{where}: {rule.describe()} failed: {exc}")) from None
        except (IndexError, RuntimeError, ValueError, TypeError) as exc:
            raise RuleFailure(InvalidArgument(f"{where}: {rule.describe()} failed: {type(exc).__name__}: {exc}")) from None
        if rule.modifies:
            parts = {**parts, root: new_root}
            changed.add(root)
    return parts, changed

