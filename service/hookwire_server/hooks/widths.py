"""The width (last dimension) of the value a rule edits at a module, where the module
says it before any pass runs, and the registration check of rules' operands against it.

Known from the module itself: ``nn.Linear`` (``in_features`` in, ``out_features`` out;
GPT-2's ``Conv1D`` likewise), ``nn.LayerNorm`` and RMS norms (``normalized_shape``, or
their 1-D ``weight``), ``nn.Embedding`` (``embedding_dim`` out); from the model's config
(``hidden_size``, GPT-2's ``n_embd``): the residual stream in and out of a decoder or
encoder layer (an item of an ``nn.ModuleList`` whose class is a ``*Layer`` or ``*Block``, in a
list of the config's ``num_hidden_layers`` where it states one: a vision tower's blocks
are another stack, of another width).
The value is the module's first input (``args.0``, its gradient ``grad_input.0``) or its
output (``output``, a layer's ``output.0``, the gradient ``grad_output.0``). A rule with
``heads`` sees one head's width (hooks.heads). Elsewhere (activations, attention modules,
a rule with an index, which may select along the last dimension) nothing is known until
the pass, and a mismatch is worded at run time (rules.apply_rules).

Without this, an operand of the wrong width (a 63-wide steering vector on a 64-wide
layer) was accepted and failed in the first pass, in torch's words.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from hookwire.v1 import hook_pb2

from ..errors import InvalidArgument
from .rules import CompiledRule, Target, operand_widths

#: Class name endings of the layers of a model's stack (their values are the residual stream).
_LAYER_ENDINGS = ("Layer", "Block")
#: Class name endings of norms over the last dimension (not BatchNorm/GroupNorm: channels).
_NORM_ENDINGS = ("LayerNorm", "RMSNorm")
_INPUT_TARGETS: dict[int, tuple[str, ...]] = {hook_pb2.PHASE_FORWARD_PRE: ("args.0",), hook_pb2.PHASE_FORWARD: ("args.0",),
                  hook_pb2.PHASE_BACKWARD: ("grad_input.0",)}
_OUTPUT_TARGETS: dict[int, tuple[str, ...]] = {hook_pb2.PHASE_FORWARD: ("output",), hook_pb2.PHASE_BACKWARD_PRE: ("grad_output.0",),
                   hook_pb2.PHASE_BACKWARD: ("grad_output.0",)}


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _hidden_size(host: Any) -> int | None:
    config = getattr(host.module, "config", None)
    return _positive(getattr(config, "hidden_size", None)) or _positive(getattr(config, "n_embd", None))


def _is_layer(host: Any, path: str, module: nn.Module) -> bool:
    """Whether ``module`` is a layer of the stack whose width the config's hidden_size is:
    an item of a ModuleList as long as the config's num_hidden_layers, where it states one
    (a multimodal model's vision blocks are another stack, of another width)."""
    parent, _, item = path.rpartition(".")
    stack = host.modules.get(parent)
    if not (item.isdigit() and isinstance(stack, nn.ModuleList) and type(module).__name__.endswith(_LAYER_ENDINGS)):
        return False
    layers = _positive(getattr(getattr(host.module, "config", None), "num_hidden_layers", None))
    return layers is None or len(stack) == layers


#: (input width, where it was read), (output width, where it was read); None where unknown.
_Widths = tuple[tuple[int, str] | None, tuple[int, str] | None]


def _widths(host: Any, path: str, module: nn.Module) -> _Widths:
    """The widths of ``module``'s input and output, each with where it was read."""
    name = type(module).__name__
    if isinstance(module, nn.Linear):
        return (module.in_features, f"{name}.in_features"), (module.out_features, f"{name}.out_features")
    nx, nf = _positive(getattr(module, "nx", None)), _positive(getattr(module, "nf", None))
    if name == "Conv1D" and nx is not None and nf is not None:
        return (nx, f"{name}.nx"), (nf, f"{name}.nf")
    if isinstance(module, nn.Embedding):
        return None, (module.embedding_dim, f"{name}.embedding_dim")
    if name.endswith(_NORM_ENDINGS):
        shape = getattr(module, "normalized_shape", None)
        width, why = (_positive(shape[-1]) if isinstance(shape, tuple) and shape else None), f"{name}.normalized_shape"
        weight = getattr(module, "weight", None)
        if width is None and isinstance(weight, nn.Parameter) and weight.dim() == 1:
            width, why = _positive(int(weight.shape[0])), f"{name}.weight's shape"
        return ((width, why), (width, why)) if width is not None else (None, None)
    if _is_layer(host, path, module):
        hidden = _hidden_size(host)
        if hidden is not None:
            return (hidden, "the model config's hidden_size"), (hidden, "the model config's hidden_size")
    return None, None


def target_width(host: Any, path: str, phase: int, target: Target) -> tuple[int, str] | None:
    """The last dimension of ``target`` at module ``path`` in ``phase``, and a phrase saying
    where it was read ("its output is 64 wide (the model config's hidden_size)"), or None
    when the module does not say it."""
    module = host.modules.get(path)
    if module is None or path in host.output_views:
        return None  # an engine's module whose values hooks see otherwise (vLLM's views)
    given, made = _widths(host, path, module)
    if target.text in _INPUT_TARGETS.get(phase, ()) and given is not None:
        return given[0], f"its input is {given[0]} wide ({given[1]})"
    outputs = _OUTPUT_TARGETS.get(phase, ())
    if phase == hook_pb2.PHASE_FORWARD and _is_layer(host, path, module):
        outputs = ("output", "output.0")  # a layer returns its hidden states, or a tuple of them first
    if target.text in outputs and made is not None:
        return made[0], f"its output is {made[0]} wide ({made[1]})"
    return None


def check_operand_widths(host: Any, modules: tuple[str, ...], phase: int, rules: tuple[CompiledRule, ...],
                         field: str) -> None:
    """InvalidArgument when an operand of one of ``rules`` cannot fit the value it edits at
    one of ``modules`` (whose width the module states: target_width), naming the field,
    the module, the rule, the operand's shape and the width it needs."""
    for rule in rules:
        if rule.index is not None:
            continue  # the selection may take the last dimension: known only at run time
        entries = operand_widths(rule)
        if not entries:
            continue
        for path in modules:
            if rule.heads:
                if rule.head_view is None or rule.head_view[0] != -1:
                    break  # attention probabilities: their last dimension is the keys
                width, what = rule.head_view[1], f"each of its heads is {rule.head_view[1]} wide"
            else:
                known = target_width(host, path, phase, rule.target)
                if known is None:
                    continue
                width, what = known
            for name, shape, dim, broadcasts in entries:
                if shape[dim] == width or (broadcasts and shape[dim] == 1):
                    continue
                which = "last dimension" if dim == len(shape) - 1 else f"dimension {dim}"
                raise InvalidArgument(
                    f"{field}.rules[{rule.position}].{name}: shape {shape} does not fit module {path!r}: "
                    f"{rule.describe()} edits {rule.target.text}, and {what}, so the operand's {which} must be "
                    f"{width}{' (or 1, to broadcast)' if broadcasts else ''}"
                )
