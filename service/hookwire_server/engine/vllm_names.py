"""The transformers names of a vLLM model's parameters (GetParameters, docs/vllm.md).

vLLM fuses some of a model's linear layers and pads its embeddings: its Llama holds
``model.layers.N.self_attn.qkv_proj.weight`` (transformers' ``q_proj``, ``k_proj`` and
``v_proj`` weights stacked along dim 0), ``model.layers.N.mlp.gate_up_proj.weight``
(``gate_proj`` and ``up_proj``), and ``model.embed_tokens.weight`` / ``lm_head.weight``
with rows past the vocabulary (padded to a multiple of 64). ``add_transformers_names``
gives the model's host the transformers names as views of vLLM's tensors
(ModelHost.parameter_views: ``narrow``, no copy), with the shapes transformers' model of
the same folder has; the embeddings answer to their own names trimmed to
``config.vocab_size``. vLLM's own names keep answering (the fused ones with vLLM's shapes).

Sizes come from the transformers config the folder has (``num_attention_heads``,
``num_key_value_heads``, ``head_dim`` or ``hidden_size / num_attention_heads``,
``intermediate_size``, ``vocab_size``), and which transformers modules a fused module
packs from vLLM's own ``packed_modules_mapping`` of the model class (Llama, Mistral,
Qwen2/3, Gemma: ``qkv_proj`` packs ``q_proj, k_proj, v_proj``; Phi-3's fused modules are
fused in transformers too and are not split). A fused tensor whose shape is not the
config's sizes (a tensor-parallel shard, a quantized layout) or that vLLM emptied is not
split: its transformers names are ``ModelHost.parameter_gaps``, with why.

vLLM's CPU build keeps a linear layer's weight only packed for its GEMM kernels (oneDNN)
and leaves an empty tensor in the module: ``keep_cpu_linear_weights`` (called before the
model loads) keeps the module's copy for a model whose parameters are readable.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

import torch

from ..models.model_registry import ModelHost, ParameterView

log = logging.getLogger("hookwire.vllm")

#: A fused module's parts (the transformers modules, in the order vLLM stacks them).
QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")
FUSED = {"qkv_proj": QKV, "gate_up_proj": GATE_UP}
#: The modules whose rows are the vocabulary (vLLM pads them).
EMBEDDINGS = ("embed_tokens", "lm_head")
#: The tensors of a linear layer that are split by rows.
SPLIT = ("weight", "bias")


def transformers_views(
    parameters: Mapping[str, torch.Tensor], config: Any, packed: Mapping[str, Any] | None,
    *, tensor_parallel_size: int = 1,
) -> tuple[dict[str, ParameterView], dict[str, str]]:
    """The transformers names of a vLLM model's parameters (``parameters``: vLLM's
    names), as views of them, and the transformers names that cannot be derived, with
    why. ``config`` is the folder's transformers config; ``packed`` the vLLM model's
    ``packed_modules_mapping`` (fused module -> the modules it packs). Pure: no vLLM."""
    views: dict[str, ParameterView] = {}
    gaps: dict[str, str] = {}
    sizes, why_not = _part_sizes(config)
    vocab = getattr(config, "vocab_size", None)
    for name, tensor in parameters.items():
        module, _, leaf = name.rpartition(".")
        prefix, _, last = module.rpartition(".")
        parts = FUSED.get(last)
        if parts is not None and leaf in SPLIT:
            if tuple((packed or {}).get(last, ())) != parts:
                continue  # fused in transformers too (Phi-3), or a layout this module does not know
            names = [f"{prefix}.{part}.{leaf}" if prefix else f"{part}.{leaf}" for part in parts]
            problem = why_not or _split_problem(name, tensor, sizes[last], tensor_parallel_size)
            if problem:
                gaps.update(dict.fromkeys(names, problem))
                continue
            start = 0
            for part, length in zip(names, sizes[last]):
                views[part] = ParameterView(name, 0, start, length)
                start += length
        elif last in EMBEDDINGS and leaf == "weight" and isinstance(vocab, int) and tensor.dim() == 2:
            if tensor_parallel_size == 1 and tensor.shape[0] > vocab:
                views[name] = ParameterView(name, 0, 0, vocab)  # vLLM's padding rows trimmed
    return views, gaps


def _part_sizes(config: Any) -> tuple[dict[str, tuple[int, ...]], str]:
    """Each fused module's parts' rows from the config, or why they cannot be known."""
    def size(key: str) -> int | None:
        value = getattr(config, key, None)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    heads, hidden, intermediate = size("num_attention_heads"), size("hidden_size"), size("intermediate_size")
    if heads is None or hidden is None or intermediate is None:
        missing = [k for k, v in (("num_attention_heads", heads), ("hidden_size", hidden),
                                  ("intermediate_size", intermediate)) if v is None]
        return {}, f"the model's config has no {', '.join(missing)} to size the parts by"
    kv_heads = size("num_key_value_heads") or heads
    head_dim = size("head_dim") or hidden // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    return {"qkv_proj": (q, kv, kv), "gate_up_proj": (intermediate, intermediate)}, ""


def _split_problem(name: str, tensor: torch.Tensor, parts: tuple[int, ...], tensor_parallel_size: int) -> str:
    """Why ``tensor`` (vLLM's fused ``name``) cannot be split into ``parts`` rows, or ""."""
    if tensor_parallel_size > 1:
        return (f"under tensor_parallel_size {tensor_parallel_size} vLLM's {name} is one rank's shard "
                "(not run yet by hookwire)")
    if tensor.numel() == 0:
        return (f"vLLM dropped the module's copy of {name} (its CPU build keeps linear weights packed for its "
                "GEMM kernels only; hookwire keeps the copy for a model with parameters_readable)")
    if tensor.dim() == 0 or tensor.shape[0] != sum(parts):
        shape = list(tensor.shape)
        return (f"vLLM's {name} is {shape}, whose rows are not the config's {' + '.join(map(str, parts))} "
                "(a tensor-parallel shard or a quantized layout)")
    return ""


def add_transformers_names(host: ModelHost, *, tensor_parallel_size: int = 1) -> None:
    """Gives ``host`` (a vLLM model's) the transformers names of its parameters (see the
    module docstring); logs the names that cannot be derived. Before the model serves."""
    model = host.module
    views, gaps = transformers_views(host.parameters, getattr(model, "config", None),
                                     getattr(model, "packed_modules_mapping", None),
                                     tensor_parallel_size=tensor_parallel_size)
    host.add_parameter_views(views, gaps)
    if gaps:
        first = next(iter(gaps.items()))
        log.info("model %r: %d transformers parameter names cannot be derived from vLLM's tensors (%s: %s)",
                 host.name, len(gaps), *first)


_keeping = threading.local()


def keep_cpu_linear_weights(keep: bool) -> None:
    """Whether the next vLLM model this thread loads keeps its linear layers' weights in
    its modules on vLLM's CPU build (which otherwise keeps them only packed for its GEMM
    kernels, one more copy of them in memory when kept): call before ``LLM(...)``, with
    the model's parameters_readable. Nothing to do on other builds, or where vLLM has no
    such step (a vLLM other than the pinned one): the weights are then what vLLM leaves."""
    _keeping.on = keep
    if not keep:
        return
    try:
        from vllm.model_executor.layers import utils
    except ImportError:
        return
    dispatch = getattr(utils, "dispatch_cpu_unquantized_gemm", None)
    if dispatch is None or getattr(dispatch, "hookwire_keeps_weights", False):
        return

    def keeping(layer: torch.nn.Module, remove_weight: bool) -> None:
        # vLLM looks the function up in its module at each call (a function-local import).
        dispatch(layer, remove_weight=remove_weight and not getattr(_keeping, "on", False))

    setattr(keeping, "hookwire_keeps_weights", True)
    utils.dispatch_cpu_unquantized_gemm = keeping
