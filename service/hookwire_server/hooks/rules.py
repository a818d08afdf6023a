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
activation patched at the same positions); affine ``F.linear(x, W, b)``; loreft ``x +
(F.linear(x, W, b) - F.linear(x, R)) @ R``; norm_add ``x + alpha * |x| * v / |v|`` (``|x|``
the norm along the last dimension, kept); top_k ``x - (f * m) @ P`` with ``f = x @ P.T``
and ``m`` the features removed (all but the k largest, or the k largest); conditional
``torch.where(mask[..., None], op(x), x)`` with ``mask = signal(x) cmp threshold`` per
position. Tensor operands are cast to the target's dtype and device. ``save`` stores
``t[index]``; ``signal`` keeps ``signal(t[index])`` (reduced over positions as it says) for
the call's later hooks in the same pass.

Every tensor operand of a rule is known by its field path in the Rule message (e.g.
``add.value.tensor``, ``conditional.then.affine.weight``): ``CompiledRule.operands``
holds the one decoded copy of each, and ``operand_tensors`` finds them in a message.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.nn.functional as F

from hookwire.wire import codec
from hookwire.v1 import hook_pb2, rule_pb2, tensor_pb2

from ..errors import FailedPrecondition, HookwireServerError, InvalidArgument
from . import heads
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
#: Rules that read their target and change nothing.
READERS = frozenset({"save", "signal", "stop"})
#: Operations a conditional may apply (it applies them to its own target and index).
CONDITIONAL_OPS = ("scale", "add", "set", "zero", "clamp", "noise", "project_out", "affine", "loreft", "norm_add",
                   "top_k", "sae")
#: Every operation, in the Rule.op oneof's order (named in error messages).
OPS = ("scale", "add", "set", "zero", "clamp", "noise", "project_out", "patch", "save", "affine", "loreft",
       "norm_add", "top_k", "conditional", "signal", "sae", "stop")
#: SAELens' architectures and activation normalizations an SAE operand may name.
SAE_ARCHITECTURES = ("standard", "jumprelu", "topk")
SAE_NORMALIZATIONS = ("", "none", "expected_average_only_in", "layer_norm")
#: How far LoReFT's rotation rows may be from orthonormal: |R R^T - I| (largest entry).
ORTHONORMAL_TOLERANCE = 1e-3
_COMPARE: dict[int, Callable[[torch.Tensor, float], torch.Tensor]] = {
    rule_pb2.COMPARISON_GT: torch.gt, rule_pb2.COMPARISON_GE: torch.ge,
    rule_pb2.COMPARISON_LT: torch.lt, rule_pb2.COMPARISON_LE: torch.le,
    rule_pb2.COMPARISON_EQ: torch.eq, rule_pb2.COMPARISON_NE: torch.ne,
}


class Signals(dict):  # type: ignore[type-arg]
    """One principal's signals of a call's running pass (name -> tensor), and the call's
    token ids at the pass's positions (Pass.token_ids), which token-id signals read."""

    token_ids: Any = None


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
    #: Every tensor operand of the rule by its field path in the Rule message (its one
    #: decoded copy, as registered; ``tensor`` is one of them).
    operands: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    #: The new operations' tensors by role (weight, bias, rotation, direction, directions).
    named: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    #: norm_add's alpha; top_k's k and mode.
    alpha: float = 0.0
    k: int = 0
    mode: int = 0
    #: conditional: the operation it applies, and when.
    inner: CompiledRule | None = None
    condition: CompiledCondition | None = None
    #: signal: what it keeps, and how it reduces it.
    signal: CompiledSignal | None = None
    reduce: int = 0
    #: Rule.heads, and their view at the hook's modules (heads.check_heads: dim, head size).
    heads: tuple[int, ...] = ()
    head_view: tuple[int, int] | None = None
    #: sae, and top_k over an SAE's features: the autoencoder; sae's features and edit.
    sae: CompiledSae | None = None
    features: tuple[int, ...] = ()
    edit: int = 0
    _cast: dict[tuple[torch.dtype, torch.device], torch.Tensor] = dataclasses.field(default_factory=dict)
    _cast_named: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = dataclasses.field(default_factory=dict)

    @property
    def modifies(self) -> bool:
        """False for `save` and `signal`, which only read."""
        return self.kind not in READERS

    def operand_bytes(self) -> int:
        """Bytes of the tensor operands the rule holds."""
        return sum(t.numel() * t.element_size() for t in self.operands.values())

    def _tensor(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """Operand ``name`` in ``x``'s dtype and on its device (cast once per dtype and device)."""
        key = (name, x.dtype, x.device)
        cast = self._cast_named.get(key)
        if cast is None:
            cast = self._cast_named[key] = shared_cast(self.named[name], "", x.dtype, x.device)
        return cast

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
            if self.normalize:  # d = dir / |dir|, in the direction's dtype (a 1-D vector)
                base = self.tensor / torch.linalg.vector_norm(self.tensor)
                cast = self._cast[key] = base.to(dtype=x.dtype, device=x.device)
            else:
                cast = self._cast[key] = shared_cast(self.tensor, "", x.dtype, x.device)
        return cast

    def _op(self, x: torch.Tensor, slots: SlotStore | None, signals: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
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
        if kind == "affine":
            return F.linear(x, self._tensor("weight", x), self._tensor("bias", x) if "bias" in self.named else None)
        if kind == "loreft":
            r = self._tensor("rotation", x)
            edited = F.linear(x, self._tensor("weight", x), self._tensor("bias", x) if "bias" in self.named else None)
            return x + (edited - F.linear(x, r)) @ r
        if kind == "norm_add":
            v = self._tensor("direction", x)
            return x + self.alpha * torch.linalg.vector_norm(x, dim=-1, keepdim=True) * v
        if kind == "top_k":
            if self.sae is not None:
                f, state = self.sae.encode(x)
                removed = self._top_k_removed(f)
                # The error term carries no gradient, as SAELens computes it (no_grad).
                return self.sae.decode(f * ~removed, state) + (x - self.sae.decode(f, state)).detach()
            p = self._tensor("directions", x)
            f = x @ p.T
            return x - (f * self._top_k_removed(f)) @ p
        if kind == "sae":
            assert self.sae is not None
            f, state = self.sae.encode(x)
            edited = f.clone()
            index = self._features_on(f.device)
            if self.edit == rule_pb2.SAE_EDIT_CLAMP:
                edited[..., index] = self.factor
            elif self.edit == rule_pb2.SAE_EDIT_SCALE:
                edited[..., index] = f[..., index] * self.factor
            else:
                edited[..., index] = 0
            return self.sae.decode(edited, state) + (x - self.sae.decode(f, state)).detach()
        if kind == "conditional":
            assert self.inner is not None and self.condition is not None
            mask = self.condition.holds(x, signals)
            return torch.where(mask.unsqueeze(-1), self.inner._op(x, slots, signals), x)
        raise AssertionError(kind)  # pragma: no cover

    def _features_on(self, device: torch.device) -> torch.Tensor:
        """The sae op's feature indices on ``device`` (made once per device)."""
        index = self._cast_named.get(("features", torch.int64, device))
        if index is None:
            index = self._cast_named[("features", torch.int64, device)] = torch.tensor(self.features, device=device)
        return index

    def _top_k_removed(self, f: torch.Tensor) -> torch.Tensor:
        """The features top_k removes: all but the k largest, or the k largest."""
        top = torch.zeros_like(f, dtype=torch.bool).scatter_(-1, f.topk(self.k, dim=-1).indices, True)
        return ~top if self.mode == rule_pb2.TOP_K_MODE_KEEP else top

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

    def apply(self, x: Any, slots: SlotStore | None, signals: dict[str, torch.Tensor] | None = None,
              stops: list[int] | None = None) -> Any:
        """The new value of the target (``x`` itself for save, signal and stop). ``signals``:
        the call's signals of the running pass (SignalOp writes them, conditions read
        them); ``stops``: where a stop rule puts the rows whose condition held. With
        ``heads``, the rule sees and edits the named heads only (hooks.heads)."""
        if not isinstance(x, torch.Tensor):
            raise InvalidArgument(f"the target is a {type(x).__name__}, not a tensor")
        if self.heads:
            assert self.head_view is not None
            dim, head_dim = self.head_view
            part = heads.take(x, self.heads, dim, head_dim)
            new = self._apply(part, slots, signals, stops)
            return x if new is part else heads.put(x, self.heads, dim, head_dim, new)
        return self._apply(x, slots, signals, stops)

    def _apply(self, x: torch.Tensor, slots: SlotStore | None, signals: dict[str, torch.Tensor] | None,
               stops: list[int] | None) -> torch.Tensor:
        if self.kind == "stop":
            assert self.condition is not None
            if x.dim() < 2:
                raise InvalidArgument(f"a stop rule needs rows (sequences) first and a vector per position; the target "
                                      f"is {list(x.shape)}")
            mask = self.condition.holds(x, signals)
            if mask.dim() >= 2:
                mask = mask[..., -1]  # each row's last position: the one whose next token the step picks
            rows = mask.reshape(mask.shape[0], -1).any(dim=1)
            if stops is not None:
                stops.extend(int(i) for i in torch.nonzero(rows).flatten().tolist())
            return x
        if self.kind == "save":
            assert slots is not None
            slots.save(self.slot, x if self.index is None else x[self.index])
            return x
        if self.kind == "signal":
            assert self.signal is not None
            if signals is None:
                raise FailedPrecondition("signals are kept per call and pass; this hook runs outside one")
            value = self.signal.value(x if self.index is None else x[self.index], signals)
            signals[self.slot] = _reduced(value, self.reduce).detach()
            return x
        if self.kind == "patch":
            return self._patch(x, slots)
        if self.index is None:
            return self._op(x, slots, signals)
        new = x.clone()
        new[self.index] = self._op(x[self.index], slots, signals)
        return new


def _reduced(value: torch.Tensor, reduce: int) -> torch.Tensor:
    """A signal per position reduced over positions (the last dimension of ``value``)."""
    if value.dim() == 0 or reduce in (rule_pb2.SIGNAL_REDUCE_UNSPECIFIED, rule_pb2.SIGNAL_REDUCE_NONE):
        return value
    if reduce == rule_pb2.SIGNAL_REDUCE_MAX:
        return value.amax(dim=-1, keepdim=True)
    return value[..., -1:]


@dataclasses.dataclass
class CompiledSignal:
    """A validated Signal (see rule.proto): what it computes from a target."""

    kind: str
    tensor: torch.Tensor | None = None
    bias: float = 0.0
    sigmoid: bool = False
    stored: str = ""
    sae: CompiledSae | None = None
    feature: int = 0
    _cast: dict[tuple[torch.dtype, torch.device], torch.Tensor] = dataclasses.field(default_factory=dict)

    def value(self, x: torch.Tensor, signals: dict[str, torch.Tensor] | None) -> torch.Tensor:
        """The signal of each position of ``x`` (its shape without the last dimension)."""
        if self.kind == "stored":
            kept = None if signals is None else signals.get(self.stored)
            if kept is None:
                raise FailedPrecondition(f"no signal {self.stored!r} was kept in this pass of the call "
                                         "(a SignalOp of a hook that fires earlier in the pass keeps it)")
            return kept.to(x.device)
        if self.kind == "norm":
            return torch.linalg.vector_norm(x, dim=-1)
        if self.kind == "token_id":
            ids = getattr(signals, "token_ids", None)
            if ids is None:
                raise FailedPrecondition("the call's token ids are not known here (an Infer call without input_ids)")
            if tuple(ids.shape) != tuple(x.shape[:-1]):
                raise InvalidArgument(f"the value's positions {list(x.shape[:-1])} are not the call's tokens "
                                      f"{list(ids.shape)} (token ids need [sequences, positions, ...])")
            return ids.to(x.device)
        if self.kind == "sae_feature":
            assert self.sae is not None
            return self.sae.encode(x)[0][..., self.feature]
        assert self.tensor is not None
        key = (x.dtype, x.device)
        w = self._cast.get(key)
        if w is None:
            base = ((self.tensor.double() / torch.linalg.vector_norm(self.tensor.double())).to(self.tensor.dtype)
                    if self.kind == "projection" else self.tensor)
            w = self._cast[key] = base.to(dtype=x.dtype, device=x.device)
        score = x @ w
        if self.kind == "probe":
            score = score + self.bias
            if self.sigmoid:
                score = torch.sigmoid(score)
        return score


@dataclasses.dataclass
class CompiledSae:
    """A validated Sae operand (see rule.proto), applied as SAELens' inference SAEs are."""

    tensors: dict[str, torch.Tensor]
    architecture: str
    k: int
    layer_norm: bool
    apply_b_dec: bool
    _cast: dict[tuple[torch.dtype, torch.device], dict[str, torch.Tensor]] = dataclasses.field(default_factory=dict)

    @property
    def d_sae(self) -> int:
        return int(self.tensors["w_enc"].shape[1])

    def _on(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        key = (x.dtype, x.device)
        cast = self._cast.get(key)
        if cast is None:
            cast = self._cast[key] = {name: t.to(dtype=x.dtype, device=x.device) for name, t in self.tensors.items()}
        return cast

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The features of ``x`` and what decode needs back (layer_norm's mean and std)."""
        w = self._on(x)
        state: Any = None
        if self.layer_norm:  # SAELens' run_time_activation_ln_in
            mu = x.mean(dim=-1, keepdim=True)
            x = x - mu
            std = x.std(dim=-1, keepdim=True)
            x = x / (std + 1e-5)
            state = (mu, std)
        sae_in = x - w["b_dec"] if self.apply_b_dec else x
        hidden = sae_in @ w["w_enc"] + w["b_enc"]
        if self.architecture == "topk":
            values, indices = torch.topk(hidden, k=self.k, dim=-1, sorted=False)
            return torch.zeros_like(hidden).scatter_(-1, indices, values.relu()), state
        acts = torch.relu(hidden)
        if self.architecture == "jumprelu":
            acts = acts * (hidden > w["threshold"]).to(acts.dtype)
        return acts, state

    def decode(self, f: torch.Tensor, state: Any) -> torch.Tensor:
        w = self._on(f)
        out = f @ w["w_dec"] + w["b_dec"]
        if state is not None:  # SAELens' run_time_activation_ln_out
            mu, std = state
            out = out * std + mu
        return out


@dataclasses.dataclass
class CompiledCondition:
    """A validated Condition: ``signal cmp threshold``."""

    signal: CompiledSignal
    cmp: int
    threshold: float

    def holds(self, x: torch.Tensor, signals: dict[str, torch.Tensor] | None) -> torch.Tensor:
        """Where the condition holds: a boolean per position of ``x`` (broadcast to them)."""
        value = self.signal.value(x, signals)
        mask = _COMPARE[self.cmp](value, self.threshold)
        while mask.dim() > x.dim() - 1 and mask.shape[-1] == 1:  # one per sequence, on an indexed target
            mask = mask.squeeze(-1)
        return mask.expand(x.shape[:-1]) if mask.shape != x.shape[:-1] else mask


class OperandSource:
    """Where a spec's tensor operands come from while it is compiled: the request's own
    data, decoded on ``device``. A source that knows named operands (Tensor.operand,
    Sae.operand) is operands.NamedSource; this one refuses them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def tensor(self, msg: tensor_pb2.Tensor, where: str) -> torch.Tensor:
        """The tensor ``msg`` holds or names, on the device."""
        if msg.operand:
            return self.named_tensor(msg, where)
        return decode_operand(msg, where, self.device)

    def named_tensor(self, msg: tensor_pb2.Tensor, where: str) -> torch.Tensor:
        """The tensor operand ``msg.operand`` names."""
        raise InvalidArgument(f"{where}.operand: named operands are not available here")

    def sae(self, msg: Any, where: str) -> CompiledSae:
        """The SAE operand ``msg.operand`` names."""
        raise InvalidArgument(f"{where}.operand: named operands are not available here")


#: The attribute a named operand's tensor carries: its casts, shared by every rule using it.
SHARED_CASTS = "hookwire_casts"


def shared_cast(base: torch.Tensor, variant: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``base`` in ``dtype`` on ``device``. A named operand's tensor keeps its casts itself
    (SHARED_CASTS), so the rules of every hook using it share one copy per device and dtype;
    for its own dtype and device ``to`` returns ``base`` itself (no copy)."""
    cache = getattr(base, SHARED_CASTS, None)
    if cache is None or (base.dtype == dtype and base.device == device):
        # Its own dtype and device: ``base`` itself, not cached (that would be a reference
        # cycle, keeping a deleted operand's memory until the next full collection).
        return base.to(dtype=dtype, device=device)
    key = (variant, dtype, device)
    cast = cache.get(key)
    if cast is None:
        cast = cache.setdefault(key, base.to(dtype=dtype, device=device))
    return cast


#: Elements checked for finiteness at a time (all_finite).
_FINITE_BLOCK = 1 << 22


def _orthonormality(rotation: torch.Tensor) -> float:
    """|R R^T - I| (largest entry), O(r^2 d): kept on a named operand's tensor (its shared
    cache), so that each call naming it does not pay for it again."""
    cache = getattr(rotation, SHARED_CASTS, None)
    if cache is not None and "orthonormality" in cache:
        return float(cache["orthonormality"])
    gram = rotation.double() @ rotation.double().T
    off = float((gram - torch.eye(rotation.shape[0], dtype=torch.float64, device=gram.device)).abs().max())
    if cache is not None:
        cache["orthonormality"] = off
    return off


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element is finite, checked a block at a time: a 256 MiB SAE's check
    would otherwise allocate a 64 MiB mask."""
    flat = t.reshape(-1)
    return all(bool(torch.isfinite(flat[i:i + _FINITE_BLOCK]).all()) for i in range(0, flat.numel(), _FINITE_BLOCK))


def compile_rules(
    rules: Any, *, phase: int, phase_field: str, with_kwargs: bool, device: torch.device,
    source: OperandSource | None = None,
) -> tuple[CompiledRule, ...]:
    """Validates and compiles a HookAction's rules; InvalidArgument naming rules[i] and the field.
    ``source``: where named operands come from (without one, only inline operands, decoded on
    ``device``)."""
    source = source or OperandSource(device)
    compiled = []
    for i, rule in enumerate(rules):
        where = f"{phase_field}.rules[{i}]"
        kind = rule.WhichOneof("op")
        if kind is None:
            raise InvalidArgument(f"{where}: no operation (set one of {', '.join(OPS)})")
        try:
            target = parse_target(rule.target, phase_field, phase, reading=kind in READERS, with_kwargs=with_kwargs)
        except InvalidArgument as exc:
            raise InvalidArgument(f"{where}.target: {exc}") from None
        index = None
        if rule.index:
            try:
                index = parse_selection(rule.index)
            except SelectionError as exc:
                raise InvalidArgument(f"{where}.index: {exc}") from None
        out = CompiledRule(position=i, kind=kind, target=target, index=index, index_text=rule.index)
        if rule.heads:
            if len(set(rule.heads)) != len(rule.heads):
                raise InvalidArgument(f"{where}.heads: a head is named twice")
            out.heads = tuple(int(h) for h in rule.heads)  # checked against the hook's modules by compile_spec
        _compile_op(out, rule, where, source, "")
        compiled.append(out)
    return tuple(compiled)


def _compile_op(out: CompiledRule, rule: Any, where: str, source: OperandSource, path: str) -> None:
    """Fills ``out`` with ``rule``'s operation, validated; ``path``: the rule's own field
    path in the top rule (operands are keyed by their full path)."""
    kind = out.kind
    op = getattr(rule, kind)
    here = f"{where}.{kind}"

    def tensor(field: str, *, required: bool = True) -> torch.Tensor | None:
        if not op.HasField(field):
            if required:
                raise InvalidArgument(f"{here}.{field}: missing")
            return None
        msg = getattr(op, field)
        value = source.tensor(msg, f"{here}.{field}")
        if msg.operand:  # checked once, when it was uploaded; listed by its name
            return value
        if not value.is_floating_point():
            raise InvalidArgument(f"{here}.{field}: must be a floating-point tensor, not {value.dtype}")
        if not bool(torch.isfinite(value).all()):
            raise InvalidArgument(f"{here}.{field}: must be finite")
        out.operands[f"{path}{kind}.{field}"] = value
        return value

    if kind == "scale":
        out.factor = _finite(op.factor, f"{here}.factor")
    elif kind in ("add", "set"):
        if not op.HasField("value"):
            raise InvalidArgument(f"{here}.value: missing")
        if op.value.WhichOneof("kind") == "tensor":
            out.tensor = source.tensor(op.value.tensor, f"{here}.value.tensor")
            if not op.value.tensor.operand:
                out.operands[f"{path}{kind}.value.tensor"] = out.tensor
        else:
            out.scalar = _finite(op.value.scalar, f"{here}.value.scalar")
    elif kind == "clamp":
        if not (op.HasField("min") or op.HasField("max")):
            raise InvalidArgument(f"{here}: set min, max or both")
        out.lo = _finite(op.min, f"{here}.min") if op.HasField("min") else None
        out.hi = _finite(op.max, f"{here}.max") if op.HasField("max") else None
        if out.lo is not None and out.hi is not None and out.lo > out.hi:
            raise InvalidArgument(f"{here}: min {out.lo} is above max {out.hi}")
    elif kind == "noise":
        out.std = _finite(op.std, f"{here}.std")
        if out.std < 0:
            raise InvalidArgument(f"{here}.std: {out.std} is negative")
        out.seed = op.seed
    elif kind == "project_out":
        direction = source.tensor(op.direction, f"{here}.direction")
        if direction.dim() != 1 or not direction.is_floating_point():
            raise InvalidArgument(f"{here}.direction: must be a 1-D floating-point tensor")
        norm = torch.linalg.vector_norm(direction)
        if not bool(torch.isfinite(norm)) or float(norm) == 0.0:
            raise InvalidArgument(f"{here}.direction: must be finite and not all zeros")
        out.tensor, out.normalize = direction, True
        if not op.direction.operand:
            out.operands[f"{path}project_out.direction"] = direction
    elif kind in ("patch", "save"):
        if not op.slot:
            raise InvalidArgument(f"{here}.slot: name a slot")
        out.slot = op.slot
    elif kind == "affine":
        weight = tensor("weight")
        assert weight is not None
        bias = tensor("bias", required=False)
        if weight.dim() != 2 or weight.shape[0] != weight.shape[1]:
            raise InvalidArgument(f"{here}.weight: must be square [d, d] (the target keeps its shape), not {list(weight.shape)}")
        out.named["weight"] = weight
        if bias is not None:
            if list(bias.shape) != [weight.shape[0]]:
                raise InvalidArgument(f"{here}.bias: must be [{weight.shape[0]}], not {list(bias.shape)}")
            out.named["bias"] = bias
    elif kind == "loreft":
        rotation, weight = tensor("rotation"), tensor("weight")
        assert rotation is not None and weight is not None
        if rotation.dim() != 2 or not 1 <= rotation.shape[0] <= rotation.shape[1]:
            raise InvalidArgument(f"{here}.rotation: must be [r, d] with 1 <= r <= d, not {list(rotation.shape)}")
        if list(weight.shape) != list(rotation.shape):
            raise InvalidArgument(f"{here}.weight: must be the rotation's shape {list(rotation.shape)}, not {list(weight.shape)}")
        off = _orthonormality(rotation)
        if off > ORTHONORMAL_TOLERANCE:
            raise InvalidArgument(f"{here}.rotation: its rows must be orthonormal (R R^T is {off:.3g} from the "
                                  f"identity; at most {ORTHONORMAL_TOLERANCE:g})")
        out.named["rotation"], out.named["weight"] = rotation, weight
        shift = tensor("bias", required=False)
        if shift is not None:
            if list(shift.shape) != [rotation.shape[0]]:
                raise InvalidArgument(f"{here}.bias: must be [{rotation.shape[0]}], not {list(shift.shape)}")
            out.named["bias"] = shift
    elif kind == "norm_add":
        vector = tensor("direction")
        assert vector is not None
        norm = torch.linalg.vector_norm(vector.double())  # in float64: a float16 vector's norm may overflow
        if vector.dim() != 1 or float(norm) == 0.0:
            raise InvalidArgument(f"{here}.direction: must be 1-D and not all zeros")
        out.named["direction"] = (vector.double() / norm).to(vector.dtype)
        out.alpha = _finite(op.alpha, f"{here}.alpha")
    elif kind == "top_k":
        features_from = op.WhichOneof("features")
        if features_from is None:
            raise InvalidArgument(f"{here}: set directions or sae (the features)")
        if features_from == "sae":
            out.sae = compile_sae(op.sae, f"{here}.sae", source, out.operands, f"{path}top_k.sae.")
            features = out.sae.d_sae
        else:
            directions = tensor("directions")
            assert directions is not None
            if directions.dim() != 2 or directions.shape[0] == 0:
                raise InvalidArgument(f"{here}.directions: must be [n, d] with n >= 1, not {list(directions.shape)}")
            out.named["directions"] = directions
            features = int(directions.shape[0])
        if not 1 <= op.k <= features:
            raise InvalidArgument(f"{here}.k: {op.k} is outside 1..{features} (the features)")
        if op.mode not in (rule_pb2.TOP_K_MODE_KEEP, rule_pb2.TOP_K_MODE_ZERO):
            raise InvalidArgument(f"{here}.mode: set TOP_K_MODE_KEEP or TOP_K_MODE_ZERO")
        out.k, out.mode = op.k, op.mode
    elif kind == "sae":
        if not op.HasField("sae"):
            raise InvalidArgument(f"{here}.sae: missing")
        out.sae = compile_sae(op.sae, f"{here}.sae", source, out.operands, f"{path}sae.sae.")
        if not op.features:
            raise InvalidArgument(f"{here}.features: name at least one feature")
        if len(op.features) > out.sae.d_sae or max(op.features) >= out.sae.d_sae:
            bad = max(op.features)
            raise InvalidArgument(f"{here}.features: feature {bad} is not below d_sae {out.sae.d_sae}"
                                  if bad >= out.sae.d_sae else f"{here}.features: more than the {out.sae.d_sae} features")
        if op.edit not in (rule_pb2.SAE_EDIT_CLAMP, rule_pb2.SAE_EDIT_SCALE, rule_pb2.SAE_EDIT_ZERO):
            raise InvalidArgument(f"{here}.edit: set SAE_EDIT_CLAMP, SAE_EDIT_SCALE or SAE_EDIT_ZERO")
        out.features, out.edit = tuple(int(i) for i in op.features), op.edit
        out.factor = _finite(op.value, f"{here}.value")
    elif kind == "conditional":
        if path:
            raise InvalidArgument(f"{here}: a conditional cannot be inside another")
        if not op.HasField("when"):
            raise InvalidArgument(f"{here}.when: missing")
        out.condition = _compile_condition(op.when, f"{here}.when", source, out, f"{path}conditional.when.")
        if not op.HasField("then"):
            raise InvalidArgument(f"{here}.then: missing")
        inner_kind = op.then.WhichOneof("op")
        if inner_kind not in CONDITIONAL_OPS:
            raise InvalidArgument(f"{here}.then: one of {', '.join(CONDITIONAL_OPS)}, not {inner_kind or 'no operation'}")
        if op.then.target or op.then.index or op.then.heads:
            raise InvalidArgument(f"{here}.then: the conditional's target, index and heads apply; set none of its own")
        inner = CompiledRule(position=out.position, kind=inner_kind, target=out.target, index=None, index_text="")
        _compile_op(inner, op.then, f"{here}.then", source, f"{path}conditional.then.")
        out.operands.update(inner.operands)
        out.inner = inner
    elif kind == "stop":
        if path:
            raise InvalidArgument(f"{here}: a stop rule cannot be inside a conditional (it has its own condition)")
        if out.index is not None:
            raise InvalidArgument(f"{where}.index: a stop rule reads whole rows (its sequences); set no index")
        if out.heads:
            raise InvalidArgument(f"{where}.heads: a stop rule reads whole rows (its sequences' positions); set no heads")
        if not op.HasField("when"):
            raise InvalidArgument(f"{here}.when: missing")
        out.condition = _compile_condition(op.when, f"{here}.when", source, out, f"{path}stop.when.")
    elif kind == "signal":
        if not op.name:
            raise InvalidArgument(f"{here}.name: name the signal")
        if not op.HasField("signal"):
            raise InvalidArgument(f"{here}.signal: missing")
        if op.signal.WhichOneof("kind") == "stored":
            raise InvalidArgument(f"{here}.signal: compute one (norm, projection, probe, sae_feature), not a stored one")
        if op.reduce not in rule_pb2.SignalReduce.values():
            raise InvalidArgument(f"{here}.reduce: unknown {op.reduce}")
        if op.reduce in (rule_pb2.SIGNAL_REDUCE_MAX, rule_pb2.SIGNAL_REDUCE_LAST) and (out.index is not None or out.heads):
            raise InvalidArgument(f"{here}.reduce: reducing over positions needs the target's [sequences, positions, "
                                  "...] layout: set no index or heads with it")
        out.slot, out.reduce = op.name, op.reduce
        out.signal = _compile_signal(op.signal, f"{here}.signal", source, out, f"{path}signal.signal.")


def compile_sae(msg: Any, where: str, source: OperandSource, operands: dict[str, torch.Tensor], path: str) -> CompiledSae:
    """A validated Sae operand (its tensors recorded in ``operands`` under ``path``), or the
    shared one a named SAE operand holds (Sae.operand; nothing recorded)."""
    if msg.operand:
        return source.sae(msg, where)
    if msg.architecture not in SAE_ARCHITECTURES:
        raise InvalidArgument(f"{where}.architecture: {msg.architecture!r} is not one of {', '.join(SAE_ARCHITECTURES)} "
                              "(SAELens' names)")
    if msg.normalize_activations not in SAE_NORMALIZATIONS:
        raise InvalidArgument(f"{where}.normalize_activations: {msg.normalize_activations!r} is not supported (none, "
                              "expected_average_only_in, layer_norm)")
    tensors: dict[str, torch.Tensor] = {}
    fields = ["w_enc", "b_enc", "w_dec", "b_dec"] + (["threshold"] if msg.architecture == "jumprelu" else [])
    for field in fields:
        if not msg.HasField(field):
            raise InvalidArgument(f"{where}.{field}: missing")
        named = bool(getattr(msg, field).operand)  # checked when it was uploaded; listed by its name
        value = source.tensor(getattr(msg, field), f"{where}.{field}")
        if not value.is_floating_point() or not (named or all_finite(value)):
            raise InvalidArgument(f"{where}.{field}: must be a finite floating-point tensor")
        tensors[field] = value
        if not named:
            operands[f"{path}{field}"] = value
    w_enc = tensors["w_enc"]
    if w_enc.dim() != 2 or 0 in w_enc.shape:
        raise InvalidArgument(f"{where}.w_enc: must be [d_in, d_sae], not {list(w_enc.shape)}")
    d_in, d_sae = (int(n) for n in w_enc.shape)
    want = {"b_enc": [d_sae], "w_dec": [d_sae, d_in], "b_dec": [d_in], "threshold": [d_sae]}
    for field, shape in want.items():
        if field in tensors and list(tensors[field].shape) != shape:
            raise InvalidArgument(f"{where}.{field}: must be {shape} (w_enc is [{d_in}, {d_sae}]), "
                                  f"not {list(tensors[field].shape)}")
    if msg.architecture == "topk" and not 1 <= msg.k <= d_sae:
        raise InvalidArgument(f"{where}.k: {msg.k} is outside 1..{d_sae}")
    return CompiledSae(tensors, msg.architecture, int(msg.k), msg.normalize_activations == "layer_norm",
                       msg.apply_b_dec_to_input if msg.HasField("apply_b_dec_to_input") else True)


def _compile_signal(msg: Any, where: str, source: OperandSource, out: CompiledRule, path: str) -> CompiledSignal:
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise InvalidArgument(f"{where}: set one of norm, projection, probe, stored, sae_feature, token_id")
    if kind == "norm":
        return CompiledSignal("norm")
    if kind == "token_id":
        if out.index is not None or out.heads:
            raise InvalidArgument(f"{where}.token_id: token ids are per position of [sequences, positions, ...]: set "
                                  "no index or heads on the rule")
        return CompiledSignal("token_id")
    if kind == "sae_feature":
        sae = compile_sae(msg.sae_feature.sae, f"{where}.sae_feature.sae", source, out.operands, f"{path}sae_feature.sae.")
        if msg.sae_feature.feature >= sae.d_sae:
            raise InvalidArgument(f"{where}.sae_feature.feature: {msg.sae_feature.feature} is not below d_sae {sae.d_sae}")
        return CompiledSignal("sae_feature", sae=sae, feature=int(msg.sae_feature.feature))
    if kind == "stored":
        if not msg.stored:
            raise InvalidArgument(f"{where}.stored: name the signal")
        if out.heads:
            raise InvalidArgument(f"{where}.stored: a kept signal is per position or per sequence, not per head: "
                                  "set no heads on the rule")
        return CompiledSignal("stored", stored=msg.stored)
    field = msg.projection if kind == "projection" else msg.probe.weight
    name = "projection" if kind == "projection" else "probe.weight"
    if kind == "probe" and not msg.probe.HasField("weight"):
        raise InvalidArgument(f"{where}.probe.weight: missing")
    vector = source.tensor(field, f"{where}.{name}")
    if vector.dim() != 1 or not vector.is_floating_point() or not bool(torch.isfinite(vector).all()):
        raise InvalidArgument(f"{where}.{name}: must be a finite 1-D floating-point tensor")
    if kind == "projection" and float(torch.linalg.vector_norm(vector)) == 0.0:
        raise InvalidArgument(f"{where}.projection: must not be all zeros")
    if not field.operand:
        out.operands[f"{path}{name}"] = vector
    if kind == "projection":
        return CompiledSignal("projection", tensor=vector)
    return CompiledSignal("probe", tensor=vector, bias=_finite(msg.probe.bias, f"{where}.probe.bias"),
                          sigmoid=msg.probe.sigmoid)


def _compile_condition(msg: Any, where: str, source: OperandSource, out: CompiledRule, path: str) -> CompiledCondition:
    if not msg.HasField("signal"):
        raise InvalidArgument(f"{where}.signal: missing")
    if msg.cmp not in _COMPARE:
        raise InvalidArgument(f"{where}.cmp: set one of COMPARISON_GT, _GE, _LT, _LE, _EQ, _NE")
    signal = _compile_signal(msg.signal, f"{where}.signal", source, out, f"{path}signal.")
    return CompiledCondition(signal, msg.cmp, _finite(msg.threshold, f"{where}.threshold"))


def operand_tensors(rules: Any) -> list[tuple[int, str, Any]]:
    """(rule position, field path, Tensor message) of each tensor operand in a
    HookAction's ``rules``: every Tensor message inside each rule's operation (the path
    CompiledRule.operands knows it by)."""
    out: list[tuple[int, str, Any]] = []
    for i, rule in enumerate(rules):
        kind = rule.WhichOneof("op")
        if kind is not None:
            _tensors_in(getattr(rule, kind), f"{kind}.", i, out)
    return out


def tensor_fields(msg: Any, prefix: str) -> list[tuple[str, Any]]:
    """(field path, Tensor message) of every tensor inside ``msg`` (a readout, ...), paths
    starting with ``prefix``."""
    found: list[tuple[int, str, Any]] = []
    _tensors_in(msg, prefix, 0, found)
    return [(path, tensor) for _, path, tensor in found]


def _tensors_in(msg: Any, path: str, position: int, out: list[tuple[int, str, Any]]) -> None:
    for field, value in msg.ListFields():
        if field.message_type is None or field.is_repeated:
            continue
        if field.message_type.full_name == tensor_pb2.Tensor.DESCRIPTOR.full_name:
            out.append((position, f"{path}{field.name}", value))
        elif field.message_type.full_name == rule_pb2.Rule.DESCRIPTOR.full_name:
            kind = value.WhichOneof("op")
            if kind is not None:
                _tensors_in(getattr(value, kind), f"{path}{field.name}.{kind}.", position, out)
        else:
            _tensors_in(value, f"{path}{field.name}.", position, out)


def operand_widths(rule: CompiledRule) -> list[tuple[str, list[int], int, bool]]:
    """(field path in the rule, operand shape, the dimension that must equal the width of
    the value the rule sees, whether a size of 1 broadcasts instead) of each tensor operand
    of ``rule`` whose fit depends on that width (hooks.widths checks them at registration;
    named operands included). Rules without such operands give []."""
    out: list[tuple[str, list[int], int, bool]] = []

    def last(name: str, t: torch.Tensor | None, broadcasts: bool = False) -> None:
        if t is not None and t.dim() >= 1:
            out.append((name, list(t.shape), t.dim() - 1, broadcasts))

    def sae(name: str, autoencoder: CompiledSae | None) -> None:
        if autoencoder is not None:  # w_enc is [d_in, d_sae]: d_in is the value's width
            out.append((f"{name}.w_enc", list(autoencoder.tensors["w_enc"].shape), 0, False))

    def signal(prefix: str, compiled: CompiledSignal | None) -> None:
        if compiled is None:
            return
        if compiled.kind in ("projection", "probe"):
            last(f"{prefix}{'projection' if compiled.kind == 'projection' else 'probe.weight'}", compiled.tensor)
        elif compiled.kind == "sae_feature":
            sae(f"{prefix}sae_feature.sae", compiled.sae)

    kind = rule.kind
    if kind in ("add", "set"):
        last(f"{kind}.value.tensor", rule.tensor, broadcasts=True)
    elif kind == "project_out":
        last("project_out.direction", rule.tensor)
    elif kind in ("affine", "loreft"):
        last(f"{kind}.{'weight' if kind == 'affine' else 'rotation'}", rule.named.get("weight" if kind == "affine" else "rotation"))
    elif kind == "norm_add":
        last("norm_add.direction", rule.named.get("direction"))
    elif kind == "top_k":
        last("top_k.directions", rule.named.get("directions"))
        sae("top_k.sae", rule.sae)
    elif kind == "sae":
        sae("sae.sae", rule.sae)
    elif kind == "conditional":
        if rule.inner is not None:
            out.extend((f"conditional.then.{name}", shape, dim, b) for name, shape, dim, b in operand_widths(rule.inner))
        if rule.condition is not None:
            signal("conditional.when.signal.", rule.condition.signal)
    elif kind == "stop" and rule.condition is not None:
        signal("stop.when.signal.", rule.condition.signal)
    elif kind == "signal":
        signal("signal.signal.", rule.signal)
    return out


def _finite(value: float, where: str) -> float:
    if not math.isfinite(value):
        raise InvalidArgument(f"{where}: {value} is not finite")
    return value


def decode_operand(msg: Any, where: str, device: torch.device) -> torch.Tensor:
    """An inline tensor operand, decoded on ``device``."""
    try:
        return codec.decode_tensor(msg, where=where).to(device)
    except codec.CodecError as exc:
        raise InvalidArgument(str(exc)) from None


def apply_rules(
    rules: tuple[CompiledRule, ...], parts: dict[str, Any], slots: SlotStore | None, where: str,
    signals: dict[str, torch.Tensor] | None = None, stops: list[int] | None = None,
) -> tuple[dict[str, Any], set[str]]:
    """Applies rules in order to the hook's parts; returns the new parts and the roots
    changed. ``signals``: the call's signals of the running pass (Pass.signals); ``stops``:
    where stop rules put the rows (sequences) whose condition held.

    Raises RuleFailure carrying the domain error (naming ``where`` and the rule).
    """
    changed: set[str] = set()
    for rule in rules:
        root = rule.target.root
        try:
            new_root = _replace(parts[root], rule.target.path, lambda x: rule.apply(x, slots, signals, stops), rule.target.text)
        except HookwireServerError as exc:
            raise RuleFailure(type(exc)(f"{where}: {rule.describe()} failed: {exc}")) from None
        except (IndexError, RuntimeError, ValueError, TypeError) as exc:
            if isinstance(exc, RuntimeError) and _SHAPE_MISMATCH.search(str(exc)):
                raise RuleFailure(InvalidArgument(f"{where}: {rule.describe()} failed: "
                                                  f"{_misfit(rule, parts, slots)}")) from None
            raise RuleFailure(InvalidArgument(f"{where}: {rule.describe()} failed: {type(exc).__name__}: {exc}")) from None
        if rule.modifies:
            parts = {**parts, root: new_root}
            changed.add(root)
    return parts, changed


#: torch's words for operands whose shapes do not fit (broadcasting, expand, matmul, linear).
_SHAPE_MISMATCH = re.compile(r"must match the size|expanded size|shapes cannot be multiplied|size mismatch|"
                             r"inconsistent tensor size|mat1 and mat2|shape mismatch|Expected size", re.IGNORECASE)


def _misfit(rule: CompiledRule, parts: dict[str, Any], slots: SlotStore | None) -> str:
    """A shape mismatch in hookwire's terms: the shape of the value the rule saw (after its
    heads and index) and its operands' shapes (or the slot's), with the width they need."""
    seen: list[int] | None = None
    try:
        value = _get(parts[rule.target.root], rule.target.path, rule.target.text)
        if isinstance(value, torch.Tensor):
            if rule.heads and rule.head_view is not None:
                value = heads.take(value, rule.heads, *rule.head_view)
            seen = list((value if rule.index is None else value[rule.index]).shape)
    except Exception:  # the wording must not fail: say what is known
        seen = None
    saw = f"the value it edits, {rule.target.text}{rule.index_text}, is {seen}" if seen is not None else \
        f"the value it edits, {rule.target.text}{rule.index_text}"
    if rule.kind == "patch":
        held = slots.get(rule.slot) if slots is not None else None
        have = f"slot {rule.slot!r} holds {list(held.shape)}" if held is not None else f"slot {rule.slot!r}"
        return f"{have} and {saw}: they do not fit (the slot's tensor must broadcast to the value)"
    operands = ", ".join(f"{name} is {shape}" for name, shape, _, _ in operand_widths(rule)) or "its operands"
    need = f" (the operand's width must be {seen[-1]})" if seen else ""
    return f"{operands} and {saw}: they do not fit{need}"


def named_references(msg: Any) -> list[Any]:
    """The Tensor and Sae messages inside protobuf message ``msg`` (a HookSpec, ...) that
    name an operand (their ``operand`` field), in field order."""
    out: list[Any] = []
    _named_in(msg, out)
    return out


def _named_in(msg: Any, out: list[Any]) -> None:
    for field, value in msg.ListFields():
        if field.type != field.TYPE_MESSAGE:
            if field.name == "operand" and value and field.containing_type.full_name in _REFERENCES:
                out.append(msg)
            continue
        items = value if field.is_repeated else [value]
        if field.message_type.GetOptions().map_entry:
            items = list(value.values()) if field.message_type.fields_by_name["value"].message_type else []
        for item in items:
            _named_in(item, out)


def names_operands(msg: Any) -> bool:
    """Whether protobuf message ``msg`` names an operand anywhere (a Tensor's or an
    SAE's ``operand`` field)."""
    return bool(named_references(msg))


_REFERENCES = frozenset({tensor_pb2.Tensor.DESCRIPTOR.full_name, rule_pb2.Sae.DESCRIPTOR.full_name})
