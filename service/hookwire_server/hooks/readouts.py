"""Readouts: a small value derived from a captured tensor, sent instead of it (issue 25):
linear probes' scores, a logit lens's top-k tokens through the model's own final norm and
unembedding, an SAE's top-k active features. Compiled when the hook is registered (with
the model: the logit lens finds its modules), applied in the hook on the tensor the
capture selected and cast, on its device; what leaves is a few numbers per position.

Each works on the vectors along the last dimension:

- probe: ``t @ W.T + b`` (``[..., n]``, or ``[...]`` for a 1-D W), through a sigmoid
  with ``sigmoid``;
- logit lens: ``logits = F.linear(norm.forward(t), U.weight, U.bias)[..., :vocab]`` with
  the model's modules called by their ``forward`` (their hooks do not fire), then
  ``{"token_ids", "logits"}`` of the k largest, largest first;
- SAE top-k: ``f = encode(t)`` (rules.CompiledSae), ``{"features", "values"}`` of the k
  largest, largest first.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from hookwire.v1 import hook_pb2

from ..errors import FailedPrecondition, InvalidArgument
from .rules import CompiledSae, OperandSource, compile_sae, shared_cast

#: The largest k of a top-k readout (a readout is meant to be small).
MAX_READOUT_K = 256
#: The most probes one probe readout scores.
MAX_PROBES = 1024
#: Positions a logit lens unembeds at once (its logits are that many x the vocabulary).
LOGIT_LENS_CHUNK = 64
#: Where transformers models keep their final norm, tried in order.
FINAL_NORMS = ("model.norm", "transformer.ln_f", "model.final_layernorm", "gpt_neox.final_layer_norm",
               "model.decoder.final_layer_norm", "transformer.norm_f", "backbone.norm_f")


@dataclasses.dataclass
class CompiledReadout:
    """A validated Readout (see the module docstring)."""

    kind: str
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    sigmoid: bool = False
    k: int = 0
    norm: Any = None
    unembedding: Any = None
    vocab: int | None = None
    sae: CompiledSae | None = None
    #: Readout.compact: one stacked event per pass for the hook's modules (hooks.compact).
    compact: bool = False
    #: Its tensor operands by field path in the HookAction (``readout.probe.weight``, ...):
    #: the one decoded copy (a listing with operand data encodes them).
    operands: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    def apply(self, t: torch.Tensor) -> Any:
        """The readout of ``t`` (its vectors along the last dimension)."""
        if not t.is_floating_point():
            raise InvalidArgument(f"a {self.kind} readout reads floating-point values, not {t.dtype}")
        if self.kind == "probe":
            assert self.weight is not None
            w = shared_cast(self.weight, "", t.dtype, t.device)  # a named probe matrix: one cast for all hooks
            scores = t @ w.T if w.dim() == 2 else t @ w
            if self.bias is not None:
                scores = scores + shared_cast(self.bias, "", t.dtype, t.device)
            return torch.sigmoid(scores) if self.sigmoid else scores
        if self.kind == "logit_lens":
            weight = self.unembedding.weight
            bias = getattr(self.unembedding, "bias", None)
            x = t.to(dtype=weight.dtype, device=weight.device)
            flat = x.reshape(-1, x.shape[-1])
            values_out, ids_out = [], []
            with torch.no_grad():
                # A chunk of positions at a time: [positions, vocabulary] logits stay bounded.
                for start in range(0, flat.shape[0], LOGIT_LENS_CHUNK):
                    part = flat[start:start + LOGIT_LENS_CHUNK]
                    normed = self.norm.forward(part) if self.norm is not None else part
                    logits = F.linear(normed, weight, bias if isinstance(bias, torch.Tensor) else None)
                    if self.vocab is not None:
                        logits = logits[..., : self.vocab]
                    values, ids = logits.topk(min(self.k, logits.shape[-1]), dim=-1)
                    values_out.append(values)
                    ids_out.append(ids)
            k = min(self.k, self.vocab or weight.shape[0], weight.shape[0])
            shape = (*x.shape[:-1], k)
            values = torch.cat(values_out) if values_out else x.new_zeros((0, k))
            ids = torch.cat(ids_out) if ids_out else torch.zeros((0, k), dtype=torch.int64, device=weight.device)
            return {"token_ids": ids.to(torch.int64).reshape(shape), "logits": values.reshape(shape)}
        assert self.sae is not None
        with torch.no_grad():
            f, _ = self.sae.encode(t)
        values, features = f.topk(self.k, dim=-1)
        return {"features": features.to(torch.int64), "values": values}


def compile_readout(msg: hook_pb2.Readout, where: str, host: Any, source: OperandSource | None = None) -> CompiledReadout:
    """A validated Readout for ``host``'s model, its operands from ``source`` (inline ones
    only without it); InvalidArgument naming the field (FailedPrecondition for a logit lens
    on a model whose weights are elsewhere)."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise InvalidArgument(f"{where}: set one of probe, logit_lens, sae_top_k")
    here = f"{where}.{kind}"
    source = source or OperandSource(host.device)
    if kind == "probe":
        op = msg.probe
        if not op.HasField("weight"):
            raise InvalidArgument(f"{here}.weight: missing")
        weight = source.tensor(op.weight, f"{here}.weight")
        finite = bool(op.weight.operand) or bool(torch.isfinite(weight).all())  # named: checked at upload
        if weight.dim() not in (1, 2) or not weight.is_floating_point() or not finite:
            raise InvalidArgument(f"{here}.weight: must be a finite floating-point [d] or [n, d] tensor")
        if weight.dim() == 2 and not 1 <= weight.shape[0] <= MAX_PROBES:
            raise InvalidArgument(f"{here}.weight: {weight.shape[0]} probes; at most {MAX_PROBES}")
        bias = None
        if op.HasField("bias"):
            bias = source.tensor(op.bias, f"{here}.bias")
            want = [] if weight.dim() == 1 else [int(weight.shape[0])]
            if list(bias.shape) not in ([], want) or not bias.is_floating_point():
                raise InvalidArgument(f"{here}.bias: must be a floating-point scalar or {want}, not {list(bias.shape)}")
        operands = {} if op.weight.operand else {"readout.probe.weight": weight}
        if bias is not None and not op.bias.operand:
            operands["readout.probe.bias"] = bias
        return CompiledReadout("probe", weight=weight, bias=bias, sigmoid=op.sigmoid, operands=operands)
    if kind == "logit_lens":
        lens = msg.logit_lens
        if not 1 <= lens.k <= MAX_READOUT_K:
            raise InvalidArgument(f"{here}.k: {lens.k} is outside 1..{MAX_READOUT_K}")
        unembedding = _module(host, lens.unembedding, f"{here}.unembedding", _output_embeddings(host))
        norm_path = lens.norm or next((p for p in FINAL_NORMS if p in host.modules), None)
        norm = _module(host, lens.norm, f"{here}.norm", norm_path)
        if next(norm.children(), None) is not None:
            # Its forward would run its children with their hooks (hookwire's too): a norm is a leaf.
            raise InvalidArgument(f"{here}.norm: module {norm_path} has submodules; name the final norm itself "
                                  "(a module without children)")
        matrix = getattr(unembedding, "weight", None)
        if not isinstance(matrix, torch.Tensor) or matrix.dim() != 2:
            raise InvalidArgument(f"{here}.unembedding: module {lens.unembedding or 'of the output embeddings'} "
                                  "has no 2-D weight")
        if matrix.device.type == "meta":
            raise FailedPrecondition(f"{here}: model {host.name!r}'s weights are not in the server's process (vLLM's "
                                     "worker processes, or offloaded): a logit lens runs where they are")
        vocab = getattr(getattr(host.module, "config", None), "vocab_size", None)
        return CompiledReadout("logit_lens", k=lens.k, norm=norm, unembedding=unembedding,
                               vocab=vocab if isinstance(vocab, int) else None)
    top = msg.sae_top_k
    if not top.HasField("sae"):
        raise InvalidArgument(f"{here}.sae: missing")
    sae_operands: dict[str, torch.Tensor] = {}
    sae = compile_sae(top.sae, f"{here}.sae", source, sae_operands, "readout.sae_top_k.sae.")
    if not 1 <= top.k <= min(MAX_READOUT_K, sae.d_sae):
        raise InvalidArgument(f"{here}.k: {top.k} is outside 1..{min(MAX_READOUT_K, sae.d_sae)}")
    return CompiledReadout("sae_top_k", k=top.k, sae=sae, operands=sae_operands)


def _output_embeddings(host: Any) -> str | None:
    """The path of the model's output embeddings (transformers' get_output_embeddings),
    or of a module named lm_head."""
    getter = getattr(host.module, "get_output_embeddings", None)
    if callable(getter):
        try:
            module = getter()
        except Exception:  # a model class that does not implement it
            module = None
        if module is not None:
            path = host.path_of(module)
            if path is not None:
                return str(path)
    return "lm_head" if "lm_head" in host.modules else None


def _module(host: Any, path: str, field: str, default: str | None) -> Any:
    chosen = path or default
    if chosen is None:
        raise InvalidArgument(f"{field}: model {host.name!r} has none that hookwire can find; name its module path")
    module = host.modules.get(chosen)
    if module is None:
        raise InvalidArgument(f"{field}: model {host.name!r} has no module {chosen!r}")
    return module
