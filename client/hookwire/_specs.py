"""What users build: hook actions, hook specs and backward requests, and their wire form."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping, Sequence, Union

from .wire import codec
from .rules import Rule
from .v1 import hook_pb2, model_service_pb2, rule_pb2, tensor_pb2

PartName = Literal["args", "kwargs", "output", "grad_input", "grad_output"]
ScopeName = Literal["session", "all", "tagged"]
OnErrorName = Literal["default", "fail_call", "disable_hook"]

_PARTS: dict[str, hook_pb2.Part] = {
    "args": hook_pb2.PART_ARGS,
    "kwargs": hook_pb2.PART_KWARGS,
    "output": hook_pb2.PART_OUTPUT,
    "grad_input": hook_pb2.PART_GRAD_INPUT,
    "grad_output": hook_pb2.PART_GRAD_OUTPUT,
}
_SCOPES: dict[str, hook_pb2.Scope] = {
    "session": hook_pb2.SCOPE_SESSION, "all": hook_pb2.SCOPE_ALL, "tagged": hook_pb2.SCOPE_TAGGED,
}
_ON_ERROR: dict[str, rule_pb2.OnError] = {
    "default": rule_pb2.ON_ERROR_UNSPECIFIED,
    "fail_call": rule_pb2.ON_ERROR_FAIL_CALL,
    "disable_hook": rule_pb2.ON_ERROR_DISABLE_HOOK,
}
_OPTIONS: dict[str, tuple[type, frozenset[str]]] = {
    "prehook_kwargs": (hook_pb2.PreHookOptions, frozenset({"with_kwargs", "prepend"})),
    "posthook_kwargs": (hook_pb2.PostHookOptions, frozenset({"with_kwargs", "prepend", "always_call"})),
    "backward_prehook_kwargs": (hook_pb2.BackwardHookOptions, frozenset({"prepend"})),
    "backward_hook_kwargs": (hook_pb2.BackwardHookOptions, frozenset({"prepend"})),
}


_CASTS = {"float16": tensor_pb2.DTYPE_FLOAT16, "bfloat16": tensor_pb2.DTYPE_BFLOAT16, "float32": tensor_pb2.DTYPE_FLOAT32}
CastName = Literal["float16", "bfloat16", "float32"]


@dataclasses.dataclass(frozen=True)
class HookAction:
    """What a hook does when it fires: rules applied in order, then the parts it sends
    back (as the rules left them, or as it received them with ``capture_before_rules``).

    ``select`` (numpy basic indexing, e.g. "[:, -1]") and ``cast`` reduce every
    captured tensor on the server before it is sent; ``summarize`` sends statistics
    (hookwire.TensorSummary) instead of tensors, with ``histogram_bins`` bins.
    """

    capture: tuple[PartName, ...] = ()
    rules: tuple[Rule, ...] = ()
    capture_before_rules: bool = False
    select: str = ""
    cast: CastName | None = None
    summarize: bool = False
    histogram_bins: int = 0
    #: A small value sent instead of each captured tensor (hookwire.rules.probe_scores,
    #: logit_lens, sae_top_k), or None.
    readout: Any = None
    #: Attention heads the captures send (where the module's heads are separate); ().
    heads: tuple[int, ...] = ()

    def to_proto(self) -> hook_pb2.HookAction:
        """The wire form; ValueError for an unknown part name."""
        try:
            msg = hook_pb2.HookAction(capture=[_PARTS[p] for p in self.capture])
        except KeyError as exc:
            raise ValueError(f"unknown part {exc.args[0]!r}; parts are {sorted(_PARTS)}") from None
        for rule in self.rules:
            msg.rules.append(rule.to_proto())
        if self.capture_before_rules:
            msg.capture_stage = rule_pb2.CAPTURE_STAGE_BEFORE_RULES
        msg.select = self.select
        if self.cast is not None:
            if self.cast not in _CASTS:
                raise ValueError(f"cast must be one of {sorted(_CASTS)}, not {self.cast!r}")
            msg.cast = _CASTS[self.cast]
        if self.summarize:
            msg.summarize.histogram_bins = self.histogram_bins
        if self.readout is not None:
            msg.readout.CopyFrom(self.readout.message)
        msg.heads.extend(self.heads)
        return msg


def capture(
    *parts: PartName, select: str = "", cast: CastName | None = None, summarize: bool = False, histogram_bins: int = 0,
    readout: Any = None, heads: Sequence[int] = (),
) -> HookAction:
    """A hook action that sends back ``parts``: "args", "kwargs", "output", "grad_input", "grad_output".

    ``capture()`` with no parts fires without sending anything. ``select``, ``cast``
    and ``summarize`` (with ``histogram_bins``) reduce what is sent; ``readout``
    (``hookwire.rules.probe_scores``, ``logit_lens``, ``sae_top_k``) sends a small derived
    value instead of each tensor, computed on the server; ``heads`` sends only those
    attention heads where the module's heads are separate (a q/k/v projection's output,
    the output projection's input, attention probabilities), before ``select``; see
    HookAction.
    """
    action = HookAction(tuple(parts), select=select, cast=cast, summarize=summarize or bool(histogram_bins),
                        histogram_bins=histogram_bins, readout=readout, heads=tuple(int(h) for h in heads))
    action.to_proto()  # fail early on a typo
    return action


def edit(*rules: Rule, capture: tuple[PartName, ...] = (), capture_before_rules: bool = False) -> HookAction:
    """A hook action that applies ``rules`` in order and optionally captures parts."""
    action = HookAction(tuple(capture), tuple(rules), capture_before_rules)
    action.to_proto()
    return action


ActionLike = Union[HookAction, Rule, Sequence[Rule], None]


def as_action(value: ActionLike) -> HookAction | None:
    """A HookAction from an action, a rule, or a sequence of rules."""
    if value is None or isinstance(value, HookAction):
        return value
    if isinstance(value, Rule):
        return HookAction(rules=(value,))
    return HookAction(rules=tuple(value))

@dataclasses.dataclass(frozen=True)
class Sampling:
    """Which firings send events (rules apply at every firing): every ``every_n``-th,
    with ``probability`` from a generator seeded with ``seed``, at most ``max_events``."""

    every_n: int = 1
    probability: float | None = None
    seed: int = 0
    max_events: int = 0

    def to_proto(self) -> hook_pb2.Sampling:
        """The wire form."""
        msg = hook_pb2.Sampling(every_n=self.every_n, seed=self.seed, max_events=self.max_events)
        if self.probability is not None:
            msg.probability = self.probability
        return msg


@dataclasses.dataclass(frozen=True)
class StepRange:
    """The steps of a Generate call in which a hook fires and its rules apply: ``first``
    to ``last`` inclusive (``last`` None: to the end).

    Generate runs one pass per step: step 0 is the pass over the prompt (tensors
    ``[batch, prompt_len, ...]``), step s >= 1 the pass that consumes the s-th new token
    (``[batch, 1, ...]`` with the KV cache). So ``StepRange(first=1)`` is "the new tokens
    only" and ``StepRange(0, 0)`` "the prompt only". A rule's ``index`` selects within
    the tensor of the step it fires in, so prompt-position work (``index="[:, 3]"``,
    patching a prompt activation) belongs on ``StepRange(0, 0)``. An Infer call is a
    single pass, step 0. Hook builders also take a tuple: ``steps=(1, None)``.
    """

    first: int = 0
    last: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.first, int) or isinstance(self.first, bool) or self.first < 0:
            raise ValueError(f"steps: first must be an integer >= 0, not {self.first!r}")
        if self.last is not None and (
            not isinstance(self.last, int) or isinstance(self.last, bool) or self.last < self.first
        ):
            raise ValueError(
                f"steps: last ({self.last!r}) must be an integer >= first ({self.first}); the range is inclusive, "
                "e.g. StepRange(0, 0) for the prompt pass alone"
            )

    def to_proto(self) -> hook_pb2.StepRange:
        """The wire form."""
        msg = hook_pb2.StepRange(first=self.first)
        if self.last is not None:
            msg.last = self.last
        return msg


StepsLike = Union[StepRange, "tuple[int, int | None]", None]


def as_steps(value: StepsLike) -> StepRange | None:
    """A StepRange from a StepRange, a ``(first, last)`` tuple or None; ValueError / TypeError otherwise."""
    if value is None or isinstance(value, StepRange):
        return value
    if isinstance(value, tuple) and len(value) == 2:
        return StepRange(*value)
    raise TypeError(f"steps must be a hookwire.StepRange or a (first, last) tuple, not {value!r}")


@dataclasses.dataclass(frozen=True)
class HookSpec:
    """A hook on the modules ``module`` names (a path or a glob: ``*``, ``**``, ``?``).

    Mirrors a local ``Hook(prehook, posthook, *, prehook_kwargs, posthook_kwargs,
    train_update, eval_update)`` plus full backward hooks. The ``*_kwargs`` are
    torch's registration options as dicts, e.g. ``{"with_kwargs": True, "prepend": True}``.
    """

    module: str
    prehook: ActionLike = None
    posthook: ActionLike = None
    backward_prehook: ActionLike = None
    backward_hook: ActionLike = None
    prehook_kwargs: Mapping[str, bool] | None = None
    posthook_kwargs: Mapping[str, bool] | None = None
    backward_prehook_kwargs: Mapping[str, bool] | None = None
    backward_hook_kwargs: Mapping[str, bool] | None = None
    train_update: bool = True
    eval_update: bool = True
    scope: ScopeName = "session"
    model: str = ""
    #: For scope "tagged": the InferRequest tags it fires for.
    tags: tuple[str, ...] = ()
    #: What a rule failing at run time does: "fail_call", "disable_hook", or the scope's default.
    on_error: OnErrorName = "default"
    #: Which firings send events.
    sampling: Sampling | None = None
    #: For a hook registered without a session: its lifetime in seconds.
    ttl_seconds: int = 0
    #: The Generate steps it fires in (see StepRange; a ``(first, last)`` tuple is taken
    #: too); None for every step.
    steps: StepsLike = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", as_steps(self.steps))  # fail early, and compare equal

    def to_proto(self, model: str = "") -> hook_pb2.HookSpec:
        """The wire form; ValueError / TypeError for unknown names or options."""
        msg = hook_pb2.HookSpec(
            model=self.model or model, module=self.module,
            train_update=self.train_update, eval_update=self.eval_update,
        )
        if self.scope not in _SCOPES:
            raise ValueError(f"scope must be one of {sorted(_SCOPES)}, not {self.scope!r}")
        msg.scope = _SCOPES[self.scope]
        msg.tags.extend(self.tags)
        if self.on_error not in _ON_ERROR:
            raise ValueError(f"on_error must be one of {sorted(_ON_ERROR)}, not {self.on_error!r}")
        msg.on_error = _ON_ERROR[self.on_error]
        if self.sampling is not None:
            msg.sampling.CopyFrom(self.sampling.to_proto())
        msg.ttl_seconds = self.ttl_seconds
        steps = as_steps(self.steps)
        if steps is not None:
            msg.steps.CopyFrom(steps.to_proto())
        for name in ("prehook", "posthook", "backward_prehook", "backward_hook"):
            action = as_action(getattr(self, name))
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

    def to_proto(self, chunker: codec.Chunker | None = None) -> model_service_pb2.Backward:
        """The wire form (a large ``grad`` goes to ``chunker`` when given)."""
        msg = model_service_pb2.Backward(output_path=self.output_path, return_input_grads=self.return_input_grads)
        if self.grad is not None:
            codec.encode_tensor_into(self.grad, msg.grad, chunker)
        return msg


#: A hook for a call: a HookSpec, or its wire form (``hook_pb2.HookSpec``, e.g. read from
#: JSON with ``google.protobuf.json_format``) as an escape hatch.
HookSpecLike = Union[HookSpec, hook_pb2.HookSpec]


def spec_proto(spec: HookSpecLike, model: str) -> hook_pb2.HookSpec:
    """The wire form of a call's hook, on ``model`` unless the spec names one."""
    if isinstance(spec, hook_pb2.HookSpec):
        msg = hook_pb2.HookSpec()
        msg.CopyFrom(spec)
        msg.model = msg.model or model
        return msg
    if not isinstance(spec, HookSpec):
        raise TypeError(f"a hook is a hookwire.HookSpec, not {type(spec).__name__}")
    return spec.to_proto(model)
