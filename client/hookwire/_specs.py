"""What users build: hook actions, hook specs and backward requests, and their wire form."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping

from . import _codec
from .v1 import hook_pb2, model_service_pb2

PartName = Literal["args", "kwargs", "output", "grad_input", "grad_output"]
ScopeName = Literal["session", "all"]

_PARTS: dict[str, hook_pb2.Part] = {
    "args": hook_pb2.PART_ARGS,
    "kwargs": hook_pb2.PART_KWARGS,
    "output": hook_pb2.PART_OUTPUT,
    "grad_input": hook_pb2.PART_GRAD_INPUT,
    "grad_output": hook_pb2.PART_GRAD_OUTPUT,
}
_SCOPES: dict[str, hook_pb2.Scope] = {"session": hook_pb2.SCOPE_SESSION, "all": hook_pb2.SCOPE_ALL}
_OPTIONS: dict[str, tuple[type, frozenset[str]]] = {
    "prehook_kwargs": (hook_pb2.PreHookOptions, frozenset({"with_kwargs", "prepend"})),
    "posthook_kwargs": (hook_pb2.PostHookOptions, frozenset({"with_kwargs", "prepend", "always_call"})),
    "backward_prehook_kwargs": (hook_pb2.BackwardHookOptions, frozenset({"prepend"})),
    "backward_hook_kwargs": (hook_pb2.BackwardHookOptions, frozenset({"prepend"})),
}


@dataclasses.dataclass(frozen=True)
class HookAction:
    """What a hook does when it fires: the parts it sends back (possibly none)."""

    capture: tuple[PartName, ...] = ()

    def to_proto(self) -> hook_pb2.HookAction:
        """The wire form; ValueError for an unknown part name."""
        try:
            return hook_pb2.HookAction(capture=[_PARTS[p] for p in self.capture])
        except KeyError as exc:
            raise ValueError(f"unknown part {exc.args[0]!r}; parts are {sorted(_PARTS)}") from None


def capture(*parts: PartName) -> HookAction:
    """A hook action that sends back ``parts``: "args", "kwargs", "output", "grad_input", "grad_output".

    ``capture()`` with no parts fires without sending anything.
    """
    action = HookAction(tuple(parts))
    action.to_proto()  # fail early on a typo
    return action


@dataclasses.dataclass(frozen=True)
class HookSpec:
    """A hook on the modules ``module`` names (a path or a glob: ``*``, ``**``, ``?``).

    Mirrors a local ``Hook(prehook, posthook, *, prehook_kwargs, posthook_kwargs,
    train_update, eval_update)`` plus full backward hooks. The ``*_kwargs`` are
    torch's registration options as dicts, e.g. ``{"with_kwargs": True, "prepend": True}``.
    """

    module: str
    prehook: HookAction | None = None
    posthook: HookAction | None = None
    backward_prehook: HookAction | None = None
    backward_hook: HookAction | None = None
    prehook_kwargs: Mapping[str, bool] | None = None
    posthook_kwargs: Mapping[str, bool] | None = None
    backward_prehook_kwargs: Mapping[str, bool] | None = None
    backward_hook_kwargs: Mapping[str, bool] | None = None
    train_update: bool = True
    eval_update: bool = True
    scope: ScopeName = "session"
    model: str = ""

    def to_proto(self, model: str = "") -> hook_pb2.HookSpec:
        """The wire form; ValueError / TypeError for unknown names or options."""
        msg = hook_pb2.HookSpec(
            model=self.model or model, module=self.module,
            train_update=self.train_update, eval_update=self.eval_update,
        )
        if self.scope not in _SCOPES:
            raise ValueError(f"scope must be one of {sorted(_SCOPES)}, not {self.scope!r}")
        msg.scope = _SCOPES[self.scope]
        for name in ("prehook", "posthook", "backward_prehook", "backward_hook"):
            action = getattr(self, name)
            if action is not None:
                getattr(msg, name).CopyFrom(action.to_proto())
        for name, (cls, allowed) in _OPTIONS.items():
            options = getattr(self, name)
            if options:
                unknown = set(options) - allowed
                if unknown:
                    raise TypeError(f"{name}: unknown option(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
                getattr(msg, name).CopyFrom(cls(**{k: bool(v) for k, v in options.items()}))
        return msg


@dataclasses.dataclass(frozen=True)
class Backward:
    """A backward pass after the forward pass of an Infer call.

    ``output_path`` selects the tensor to differentiate ("" the output, "0" a tuple
    item, "logits" a dict entry, "0.1" nested); ``grad`` is its gradient (default:
    ones, i.e. the gradient of its sum); ``return_input_grads`` asks for the
    gradients of the floating-point inputs.
    """

    output_path: str = ""
    grad: Any = None
    return_input_grads: bool = False

    def to_proto(self) -> model_service_pb2.Backward:
        """The wire form."""
        msg = model_service_pb2.Backward(output_path=self.output_path, return_input_grads=self.return_input_grads)
        if self.grad is not None:
            _codec.encode_tensor_into(self.grad, msg.grad)
        return msg
