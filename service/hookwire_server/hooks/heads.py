"""Attention heads by number (Rule.heads, HookAction.heads): where a model's heads are
still separate, a rule or a capture sees only the heads it names.

Where heads are separate, found by the module's name and the model's config
(``num_attention_heads``, ``num_key_value_heads``, ``head_dim`` or ``hidden_size /
num_attention_heads``; GPT-2's ``n_head`` and ``n_embd``):

- a query/key/value projection's output (``q_proj``, ``k_proj``, ``v_proj``; BERT's
  ``query``, ``key``, ``value``): its last dimension is heads x head size (k and v count
  the key/value heads);
- the input of the attention output projection (``args.0`` of a prehook on ``o_proj``,
  BERT's ``attention.output.dense``, GPT-2's ``attn.c_proj``, ``out_proj``): the heads'
  outputs side by side;
- attention probabilities (``output.1`` of an attention module that returns them, as
  transformers' eager attention does): ``[batch, heads, queries, keys]``.

The view: the last dimension split into ``[..., heads, head_dim]`` and the named heads
taken (``[..., len(heads), head_dim]``), or the heads dimension of the probabilities
indexed (``[batch, len(heads), queries, keys]``). A rule's index selects within it; its
edit is written back to those heads only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from hookwire.v1 import hook_pb2

from ..errors import InvalidArgument

#: Module name endings whose output is heads x head size, and whether they are the
#: key/value projections (num_key_value_heads).
_PROJECTIONS = {"q_proj": False, "k_proj": True, "v_proj": True, "query": False, "key": True, "value": True}
#: Module path endings whose input is the heads' outputs side by side.
_OUTPUT_PROJECTIONS = ("o_proj", "attention.output.dense", "attn.c_proj", "out_proj")


@dataclasses.dataclass(frozen=True)
class HeadPoint:
    """Where a module's heads are separate: the phase, the value (a rule's target text),
    how the heads are laid out, and how many there are."""

    phase: int
    target: str
    #: -1: the last dimension is heads x head_dim; 1: dimension 1 is the heads.
    dim: int
    heads: int
    head_dim: int


def _sizes(config: Any) -> tuple[int, int, int] | None:
    """(heads, key/value heads, head size) from a transformers config, or None."""
    def get(*names: str) -> int | None:
        for name in names:
            value = getattr(config, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        return None
    heads = get("num_attention_heads", "n_head")
    hidden = get("hidden_size", "n_embd")
    if heads is None or hidden is None:
        return None
    head_dim = get("head_dim") or hidden // heads
    if head_dim <= 0:
        return None  # a config whose sizes do not describe heads: no head view
    return heads, get("num_key_value_heads") or heads, head_dim


def head_point(host: Any, path: str, phase: int) -> HeadPoint | None:
    """Where ``path``'s heads are separate in ``phase`` on ``host``'s model, or None."""
    sizes = _sizes(getattr(host.module, "config", None))
    if sizes is None:
        return None
    heads, kv_heads, head_dim = sizes
    last = path.rpartition(".")[2]
    if phase == hook_pb2.PHASE_FORWARD and last in _PROJECTIONS:
        return HeadPoint(phase, "output", -1, kv_heads if _PROJECTIONS[last] else heads, head_dim)
    if phase == hook_pb2.PHASE_FORWARD_PRE and any(path == p or path.endswith("." + p) for p in _OUTPUT_PROJECTIONS):
        return HeadPoint(phase, "args.0", -1, heads, head_dim)
    module = host.modules.get(path)
    if (phase == hook_pb2.PHASE_FORWARD and module is not None and type(module).__name__.endswith("Attention")
            and "attention_probabilities" not in host.refused):
        return HeadPoint(phase, "output.1", 1, heads, head_dim)
    return None


def check_heads(host: Any, modules: tuple[str, ...], phase: int, heads: tuple[int, ...], field: str,
                target: str | None) -> tuple[int, int]:
    """The (dim, head_dim) of the head view of ``heads`` at every one of ``modules`` in
    ``phase`` (of ``target``, a rule's, when given); InvalidArgument naming ``field`` where
    a module's heads are not separate, a head is out of range, or the modules' views differ."""
    view: tuple[int, int] | None = None
    for path in modules:
        point = head_point(host, path, phase)
        if point is None or (target is not None and target != point.target):
            where = f"{target} of " if target is not None else ""
            raise InvalidArgument(
                f"{field}: {where}module {path!r} has no separate attention heads in this phase (heads are separate "
                "in a q/k/v projection's output, the output projection's input (args.0 of its prehook) and "
                "attention probabilities (output.1))")
        bad = [h for h in heads if h >= point.heads]
        if bad:
            raise InvalidArgument(f"{field}: head {bad[0]} of module {path!r}, which has {point.heads}")
        if view is not None and view != (point.dim, point.head_dim):
            raise InvalidArgument(f"{field}: the modules' heads are laid out differently; hook them separately")
        view = (point.dim, point.head_dim)
    assert view is not None
    return view


def take(x: torch.Tensor, heads: tuple[int, ...], dim: int, head_dim: int) -> torch.Tensor:
    """The named heads of ``x`` (a copy)."""
    index = torch.tensor(heads, device=x.device)
    if dim == 1:
        return x.index_select(1, index)
    if x.shape[-1] % head_dim:
        raise InvalidArgument(f"the value's last dimension {x.shape[-1]} is not a multiple of the head size {head_dim}")
    return x.unflatten(-1, (x.shape[-1] // head_dim, head_dim)).index_select(-2, index)


def put(x: torch.Tensor, heads: tuple[int, ...], dim: int, head_dim: int, new: torch.Tensor) -> torch.Tensor:
    """``x`` with the named heads replaced by ``new`` (out of place)."""
    index = torch.tensor(heads, device=x.device)
    if dim == 1:
        return x.index_copy(1, index, new.to(x.dtype))
    split = x.unflatten(-1, (x.shape[-1] // head_dim, head_dim))
    return split.index_copy(-2, index, new.to(x.dtype)).flatten(-2)


def view_parts(parts: dict[str, Any], target: str, heads: tuple[int, ...], dim: int, head_dim: int) -> dict[str, Any]:
    """A hook's parts with the value at ``target`` ("output", "args.0", "output.1")
    replaced by its named heads (for a capture)."""
    root, _, item = target.partition(".")
    value = parts.get(root)
    if not item:
        return {**parts, root: take(value, heads, dim, head_dim)} if isinstance(value, torch.Tensor) else parts
    i = int(item)
    if not isinstance(value, (tuple, list)) or i >= len(value) or not isinstance(value[i], torch.Tensor):
        return parts  # nothing there to view (e.g. sdpa attention returns no probabilities)
    items = list(value)
    items[i] = take(value[i], heads, dim, head_dim)
    return {**parts, root: type(value)(items) if type(value) in (tuple, list) else tuple(items)}
