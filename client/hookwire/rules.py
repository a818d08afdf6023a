"""Builders for modification rules: declarative edits the server applies inside a hook.

    hookwire.rules.zero("output.0", index="[:, :, 64:128]")
    hookwire.rules.add("output.0", steering_vector)
    hookwire.rules.save("output.0", slot="clean")
    hookwire.rules.patch("output.0", slot="clean", index="[:, 3]")
    hookwire.rules.when(hookwire.rules.probe(w, b, sigmoid=True) > 0.9, hookwire.rules.project_out("output", d))
    hookwire.rules.signal("output", "toxic", hookwire.rules.probe(w), reduce="max")   # at layer 4 ...
    hookwire.rules.when(hookwire.rules.stored("toxic") > 2.0, hookwire.rules.zero("output"))  # ... read at layer 9

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
from .v1 import hook_pb2, rule_pb2


@dataclasses.dataclass(frozen=True)
class Rule:
    """One rule: a target path, an optional numpy-style selection, and an operation."""

    target: str
    op: str
    index: str = ""
    params: tuple[tuple[str, Any], ...] = ()
    #: The operation's message, built already (the operations with several operands).
    message: Any = None
    #: Attention heads the rule sees and edits (see ``on_heads``); () for the whole target.
    heads: tuple[int, ...] = ()

    def on_heads(self, *heads: int) -> Rule:
        """This rule on the named attention heads only, where the model's heads are
        separate: a q/k/v projection's ``output``, the output projection's input
        (``args.0`` of its prehook), attention probabilities (``output.1``); the index,
        if any, selects within ``[..., len(heads), head_dim]``. E.g. ablate heads 0 and
        5: ``zero("args.0").on_heads(0, 5)`` in a prehook on ``...self_attn.o_proj``."""
        if not heads or any(not isinstance(h, int) or h < 0 for h in heads):
            raise ValueError("name at least one head, by a non-negative number")
        return dataclasses.replace(self, heads=tuple(heads))

    def to_proto(self) -> rule_pb2.Rule:
        """The wire form (tensors encoded now)."""
        msg = rule_pb2.Rule(target=self.target, index=self.index, heads=list(self.heads))
        params = dict(self.params)
        op = getattr(msg, self.op)
        op.SetInParent()
        if self.message is not None:
            op.CopyFrom(self.message)
            return msg
        for key, value in params.items():
            if key == "value":
                _operand_into(value, op.value)
            elif key == "direction":
                _tensor(value, op.direction)
            else:
                setattr(op, key, value)
        return msg


def _operand_into(value: Any, out: rule_pb2.Operand) -> None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        out.scalar = float(value)
    else:
        _tensor(value, out.tensor)


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


@dataclasses.dataclass(frozen=True)
class Operand:
    """A tensor operand uploaded to the server (``client.upload_operand``) or published
    there, by name: pass it wherever a rule or readout takes a tensor, e.g.
    ``add("output", operand("steer"))``; it travels as its name alone."""

    name: str


def operand(name: str) -> Operand:
    """The tensor operand ``name`` on the server (your own, else a published one)."""
    if not isinstance(name, str) or not name:
        raise ValueError("name the operand")
    return Operand(name)


def _tensor(value: Any, out: Any) -> None:
    if isinstance(value, Operand):
        out.operand = value.name
    else:
        codec.encode_tensor_into(value, out)


def affine(target: str, weight: Any, bias: Any = None, *, index: str | None = None) -> Rule:
    """``t @ weight.T + bias`` along the last dimension: a learned map (``weight``
    square [d, d], ``bias`` [d] or None)."""
    op = rule_pb2.AffineOp()
    _tensor(weight, op.weight)
    if bias is not None:
        _tensor(bias, op.bias)
    return _built(target, "affine", index, op)


def loreft(target: str, rotation: Any, weight: Any, bias: Any = None, *, index: str | None = None) -> Rule:
    """LoReFT's edit ``t + (t @ weight.T + bias - t @ rotation.T) @ rotation`` along the
    last dimension (``rotation`` [r, d] with orthonormal rows, ``weight`` [r, d], ``bias``
    [r] or None), as pyvene's LoreftIntervention computes it."""
    op = rule_pb2.LoreftOp()
    _tensor(rotation, op.rotation)
    _tensor(weight, op.weight)
    if bias is not None:
        _tensor(bias, op.bias)
    return _built(target, "loreft", index, op)


def norm_add(target: str, direction: Any, alpha: float, *, index: str | None = None) -> Rule:
    """``t + alpha * |t| * direction / |direction|``, ``|t|`` each position's norm along
    the last dimension: steering relative to the activation's own scale."""
    if not math.isfinite(alpha):
        raise ValueError(f"alpha {alpha} is not finite")
    op = rule_pb2.NormAddOp(alpha=float(alpha))
    _tensor(direction, op.direction)
    return _built(target, "norm_add", index, op)


def top_k(target: str, features: Any, k: int, *, mode: str = "keep", index: str | None = None) -> Rule:
    """Top-k ablation. Over a projection (``features`` a tensor ``P`` [n, d], one feature
    direction per row): ``f = t @ P.T``, ``t - (f * removed) @ P``. Over an SAE's features
    (``features`` an ``Sae``): ``f = encode(t)``, ``decode(f * kept) + (t - decode(f))``,
    the reconstruction error kept. ``mode="keep"`` removes every feature but the k
    largest, ``mode="zero"`` exactly the k largest."""
    modes = {"keep": rule_pb2.TOP_K_MODE_KEEP, "zero": rule_pb2.TOP_K_MODE_ZERO}
    if mode not in modes:
        raise ValueError(f"mode must be 'keep' or 'zero', not {mode!r}")
    if k < 1:
        raise ValueError(f"k must be at least 1, not {k}")
    op = rule_pb2.TopKOp(k=int(k), mode=modes[mode])
    if isinstance(features, Sae):
        op.sae.CopyFrom(features.message)
    else:
        _tensor(features, op.directions)
    return _built(target, "top_k", index, op)


@dataclasses.dataclass(frozen=True)
class Sae:
    """A sparse autoencoder as a rule operand (its tensors encoded once, when made), as
    SAELens' inference SAEs define it: ``Sae.from_sae_lens(sae)``, or its tensors."""

    message: rule_pb2.Sae

    @classmethod
    def of(cls, w_enc: Any, b_enc: Any, w_dec: Any, b_dec: Any, *, architecture: str = "standard",
           threshold: Any = None, k: int | None = None, normalize_activations: str = "none",
           apply_b_dec_to_input: bool = True) -> Sae:
        """``architecture``: "standard" (ReLU), "jumprelu" (needs ``threshold`` [d_sae]) or
        "topk" (needs ``k``); ``normalize_activations``: "none", "expected_average_only_in"
        (nothing at run time) or "layer_norm". The server checks the shapes."""
        msg = rule_pb2.Sae(architecture=architecture, normalize_activations=normalize_activations,
                           apply_b_dec_to_input=apply_b_dec_to_input, k=int(k or 0))
        for field, value in (("w_enc", w_enc), ("b_enc", b_enc), ("w_dec", w_dec), ("b_dec", b_dec),
                             ("threshold", threshold)):
            if value is not None:
                _tensor(value, getattr(msg, field))
        return cls(msg)

    @classmethod
    def named(cls, name: str) -> Sae:
        """The SAE operand ``name`` on the server (uploaded with ``client.upload_operand``,
        or published by its operator): rules carry its name, not its tensors."""
        if not isinstance(name, str) or not name:
            raise ValueError("name the operand")
        return cls(rule_pb2.Sae(operand=name))

    @property
    def is_named(self) -> bool:
        """Whether this is a reference to an operand on the server (``Sae.named``)."""
        return bool(self.message.operand)

    @classmethod
    def from_sae_lens(cls, sae: Any) -> Sae:
        """From a SAELens SAE object (StandardSAE, JumpReLUSAE, TopKSAE), read by its
        attributes: no SAELens import here. Its tensors are copied to the host."""
        cfg = sae.cfg
        architecture = cfg.architecture() if callable(getattr(cfg, "architecture", None)) else "standard"
        if getattr(cfg, "rescale_acts_by_decoder_norm", False):
            raise ValueError("this SAE rescales its activations by its decoder norms (rescale_acts_by_decoder_norm); "
                             "hookwire's SAE operand does not: fold them first (sae.fold_W_dec_norm())")
        if getattr(cfg, "reshape_activations", "none") not in ("none", None):
            raise ValueError(f"this SAE reshapes its activations ({cfg.reshape_activations!r}); hookwire's SAE "
                             "operand reads vectors along the last dimension only")

        def host(t: Any) -> Any:
            return t.detach().to("cpu") if t is not None else None
        return cls.of(host(sae.W_enc), host(sae.b_enc), host(sae.W_dec), host(sae.b_dec), architecture=architecture,
                      threshold=host(getattr(sae, "threshold", None)) if architecture == "jumprelu" else None,
                      k=getattr(cfg, "k", None) if architecture == "topk" else None,
                      normalize_activations=getattr(cfg, "normalize_activations", "none") or "none",
                      apply_b_dec_to_input=bool(getattr(cfg, "apply_b_dec_to_input", True)))


def sae(target: str, autoencoder: Sae, features: Any, *, edit: str = "clamp", value: float = 0.0,
        index: str | None = None) -> Rule:
    """Edits SAE features and keeps the reconstruction error, as SAELens does with
    ``use_error_term``: ``f = encode(t)``; the ``features`` (indices) clamped to ``value``
    (``edit="clamp"``), scaled by it ("scale") or zeroed ("zero"); ``new = decode(f') +
    (t - decode(f))``."""
    edits = {"clamp": rule_pb2.SAE_EDIT_CLAMP, "scale": rule_pb2.SAE_EDIT_SCALE, "zero": rule_pb2.SAE_EDIT_ZERO}
    if edit not in edits:
        raise ValueError(f"edit must be one of {', '.join(edits)}, not {edit!r}")
    if not math.isfinite(value):
        raise ValueError(f"value {value} is not finite")
    chosen = [int(i) for i in ([features] if isinstance(features, int) else features)]
    if not chosen or min(chosen) < 0:
        raise ValueError("name at least one feature, by a non-negative index")
    op = rule_pb2.SaeOp(sae=autoencoder.message, features=chosen, edit=edits[edit], value=float(value))
    return _built(target, "sae", index, op)


@dataclasses.dataclass(frozen=True)
class Signal:
    """A number per position of a rule's target (a vector along its last dimension), or
    one a ``signal`` rule kept earlier in the pass. Compare it with a number to make a
    condition: ``norm() > 10``, ``probe(w, b, sigmoid=True) >= 0.9``."""

    message: rule_pb2.Signal

    def _compare(self, cmp: Any, threshold: float) -> Condition:
        if not math.isfinite(threshold):
            raise ValueError(f"threshold {threshold} is not finite")
        return Condition(rule_pb2.Condition(signal=self.message, cmp=cmp, threshold=float(threshold)))

    def __gt__(self, threshold: float) -> Condition:  # type: ignore[override]
        return self._compare(rule_pb2.COMPARISON_GT, threshold)

    def __ge__(self, threshold: float) -> Condition:  # type: ignore[override]
        return self._compare(rule_pb2.COMPARISON_GE, threshold)

    def __lt__(self, threshold: float) -> Condition:  # type: ignore[override]
        return self._compare(rule_pb2.COMPARISON_LT, threshold)

    def __le__(self, threshold: float) -> Condition:  # type: ignore[override]
        return self._compare(rule_pb2.COMPARISON_LE, threshold)

    def eq(self, value: float) -> Condition:
        """``signal == value`` (meant for token ids: ``token_id().eq(42)``)."""
        return self._compare(rule_pb2.COMPARISON_EQ, value)

    def ne(self, value: float) -> Condition:
        """``signal != value``."""
        return self._compare(rule_pb2.COMPARISON_NE, value)


@dataclasses.dataclass(frozen=True)
class Condition:
    """``signal cmp threshold``, per position (see ``when``)."""

    message: rule_pb2.Condition


def norm() -> Signal:
    """Each position's L2 norm."""
    return Signal(rule_pb2.Signal(norm=rule_pb2.NormSignal()))


def projection(direction: Any) -> Signal:
    """Each position's scalar projection ``t @ direction / |direction|``."""
    msg = rule_pb2.Signal()
    _tensor(direction, msg.projection)
    return Signal(msg)


def probe(weight: Any, bias: float = 0.0, *, sigmoid: bool = False) -> Signal:
    """A linear probe's score ``t @ weight + bias`` per position, through a sigmoid with
    ``sigmoid``."""
    msg = rule_pb2.Signal(probe=rule_pb2.ProbeSignal(bias=float(bias), sigmoid=sigmoid))
    _tensor(weight, msg.probe.weight)
    return Signal(msg)


def sae_feature(autoencoder: Sae, feature: int) -> Signal:
    """An SAE feature's activation per position: ``encode(t)[..., feature]``."""
    return Signal(rule_pb2.Signal(sae_feature=rule_pb2.SaeFeatureSignal(sae=autoencoder.message, feature=int(feature))))


def token_id() -> Signal:
    """The token id at each position (the call's input_ids, a Generate call's prompt and
    then each new token): ``when(token_id().eq(42), zero("output"))``. The rule takes no
    index or heads with it."""
    return Signal(rule_pb2.Signal(token_id=rule_pb2.TokenIdSignal()))


def stored(name: str) -> Signal:
    """The signal a ``signal`` rule of a hook that fired earlier in the same pass of the
    same call kept under ``name`` (detect at one layer, edit at another)."""
    if not name:
        raise ValueError("name the stored signal")
    return Signal(rule_pb2.Signal(stored=name))


def when(condition: Condition, rule: Rule) -> Rule:
    """``rule`` applied only where ``condition`` holds, per position; elsewhere the
    target is left bit for bit. The conditional takes ``rule``'s target and index; the
    rule is one of scale, add, set, zero, clamp, noise, project_out, affine, loreft,
    norm_add, top_k, sae."""
    if not isinstance(condition, Condition):
        raise TypeError("when(condition, rule): make the condition by comparing a signal, e.g. norm() > 4")
    inner = rule.to_proto()
    inner.target, inner.index = "", ""
    del inner.heads[:]
    op = rule_pb2.ConditionalOp(when=condition.message, then=inner)
    return Rule(target=rule.target, op="conditional", index=rule.index, message=op, heads=rule.heads)


def signal(target: str, name: str, of: Signal, *, reduce: str = "none", index: str | None = None) -> Rule:
    """Keeps ``of`` (a computed signal of the target) under ``name`` for the conditions of
    the call's hooks that fire later in the same pass; changes nothing. ``reduce``:
    "none" (per position), "max" or "last" (one per sequence)."""
    reduces = {"none": rule_pb2.SIGNAL_REDUCE_NONE, "max": rule_pb2.SIGNAL_REDUCE_MAX,
               "last": rule_pb2.SIGNAL_REDUCE_LAST}
    if reduce not in reduces:
        raise ValueError(f"reduce must be one of {', '.join(reduces)}, not {reduce!r}")
    if not name:
        raise ValueError("name the signal")
    op = rule_pb2.SignalOp(name=name, signal=of.message, reduce=reduces[reduce])
    return _built(target, "signal", index, op)


def stop(target: str, condition: Condition) -> Rule:
    """Ends each sequence of a Generate call whose row ``condition`` holds for at its last
    position (the one whose next token the step picks): finish reason "rule", that step's
    token not emitted, the other sequences go on; ``GenerateResult.stopped_by`` names the
    hook, module and step. E.g. ``stop("output", probe(w, b, sigmoid=True) > 0.9)``. Does
    nothing in Infer."""
    if not isinstance(condition, Condition):
        raise TypeError("stop(target, condition): make the condition by comparing a signal, e.g. norm() > 4")
    return _built(target, "stop", None, rule_pb2.StopOp(when=condition.message))


@dataclasses.dataclass(frozen=True)
class Readout:
    """A small value sent instead of each captured tensor: ``capture("output",
    readout=logit_lens(5))``. Built by ``probe_scores``, ``logit_lens``, ``sae_top_k``."""

    message: hook_pb2.Readout


def probe_scores(weight: Any, bias: Any = None, *, sigmoid: bool = False, compact: bool = False) -> Readout:
    """Linear probes' scores per position: ``t @ weight.T + bias`` (``weight`` [d] for one
    probe, [n, d] for n), through a sigmoid with ``sigmoid``.

    ``compact``: the server sends the hook's readouts of all its modules in one event per
    pass (Readout.compact: about 5x fewer bytes than an event per module for 4 probes on
    every block of a 512-wide model); the SDK expands it, so the events read the same."""
    msg = hook_pb2.Readout(probe=hook_pb2.ProbeReadout(sigmoid=sigmoid), compact=compact)
    _tensor(weight, msg.probe.weight)
    if bias is not None:
        _tensor(bias, msg.probe.bias)
    return Readout(msg)


def logit_lens(k: int, *, norm: str = "", unembedding: str = "", compact: bool = False) -> Readout:
    """The top-``k`` tokens per position through the model's own final norm and
    unembedding (module paths found by the server unless given): a dict
    ``{"token_ids": [..., k], "logits": [..., k]}``, largest first. ``compact``: as
    ``probe_scores``'s."""
    if not 1 <= k:
        raise ValueError(f"k must be at least 1, not {k}")
    return Readout(hook_pb2.Readout(
        logit_lens=hook_pb2.LogitLensReadout(k=int(k), norm=norm, unembedding=unembedding), compact=compact))


def sae_top_k(autoencoder: Sae, k: int, *, compact: bool = False) -> Readout:
    """An SAE's ``k`` most active features per position: a dict ``{"features": [..., k],
    "values": [..., k]}``, largest first. ``compact``: as ``probe_scores``'s."""
    if not 1 <= k:
        raise ValueError(f"k must be at least 1, not {k}")
    return Readout(hook_pb2.Readout(sae_top_k=hook_pb2.SaeTopKReadout(sae=autoencoder.message, k=int(k)), compact=compact))


def _built(target: str, op: str, index: str | None, message: Any) -> Rule:
    if not isinstance(target, str) or not target:
        raise ValueError("a rule needs a target, e.g. 'output' or 'args.0'")
    return Rule(target=target, op=op, index=index or "", message=message)


__all__ = ["Condition", "Operand", "Readout", "Rule", "Sae", "Signal", "add", "affine", "clamp", "logit_lens",
           "loreft", "noise", "norm", "norm_add", "operand", "patch", "probe", "probe_scores", "project_out",
           "projection", "sae", "sae_feature", "sae_top_k", "save", "scale", "set", "signal", "stop", "stored",
           "token_id", "top_k", "when", "zero"]
