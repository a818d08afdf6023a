"""Hook specs checked against a model: what a HookSpec asks for, compiled once at
registration into the phases, parts, torch options and rules to install, and the
roles it needs. No torch hook is installed here (see hook_record)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Iterable, Mapping

from hookwire.v1 import hook_pb2, rule_pb2

from ..auth import MINIMUM_ROLE, Principal
from .capture import CaptureOptions, Sampler
from ..errors import FailedPrecondition, InvalidArgument, PermissionDenied
from ..limits import exceeded
from ..models.model_registry import ModelHost
from ..models.module_patterns import is_glob
from .heads import check_heads, head_point
from .readouts import compile_readout
from .rules import CompiledRule, OperandSource, compile_rules
from .widths import check_operand_widths

SCOPE_REQUEST = -1  # internal: InferRequest.hooks, which have no wire scope value


@dataclasses.dataclass(frozen=True)
class PhaseInfo:
    """What one hook phase is called and what it can see."""

    phase: hook_pb2.Phase
    field: str  # the HookSpec field holding its action
    options_field: str
    parts: frozenset[int]


PHASES: tuple[PhaseInfo, ...] = (
    PhaseInfo(hook_pb2.PHASE_FORWARD_PRE, "prehook", "prehook_kwargs", frozenset({hook_pb2.PART_ARGS, hook_pb2.PART_KWARGS})),
    PhaseInfo(
        hook_pb2.PHASE_FORWARD, "posthook", "posthook_kwargs",
        frozenset({hook_pb2.PART_ARGS, hook_pb2.PART_KWARGS, hook_pb2.PART_OUTPUT}),
    ),
    PhaseInfo(hook_pb2.PHASE_BACKWARD_PRE, "backward_prehook", "backward_prehook_kwargs", frozenset({hook_pb2.PART_GRAD_OUTPUT})),
    PhaseInfo(
        hook_pb2.PHASE_BACKWARD, "backward_hook", "backward_hook_kwargs",
        frozenset({hook_pb2.PART_GRAD_INPUT, hook_pb2.PART_GRAD_OUTPUT}),
    ),
)


def _part_name(part: int) -> str:
    try:
        return hook_pb2.Part.Name(part)
    except ValueError:
        return f"unknown part {part}"


@dataclasses.dataclass(frozen=True)
class Action:
    """One validated hook action: the phase, the parts to capture and the torch options."""

    phase: hook_pb2.Phase
    capture: tuple[hook_pb2.Part, ...]
    with_kwargs: bool = False
    prepend: bool = False
    always_call: bool = False
    rules: tuple[CompiledRule, ...] = ()
    capture_before_rules: bool = False
    options: CaptureOptions = CaptureOptions()
    #: HookAction.heads, the value they apply to (a head point's target) and its view
    #: (hooks.heads: dim, head size): captures send those heads only.
    heads: tuple[int, ...] = ()
    heads_target: str = ""
    head_view: tuple[int, int] | None = None

    @property
    def modifies(self) -> bool:
        """Whether a rule changes values, or the call's course (a stop rule ends its
        sequences); save and signal only read (a signal is its owner's: it gates only the
        owner's own rules). What needs --allow-shared-rules and the operator role on a
        shared hook."""
        return any(rule.modifies or rule.kind == "stop" for rule in self.rules)

    @property
    def reads_whole(self) -> bool:
        """Whether a rule must see the value every tensor-parallel rank holds whole: one
        that edits, stops, or keeps a signal (a signal of one rank's shard is wrong)."""
        return any(rule.modifies or rule.kind in ("stop", "signal") for rule in self.rules)

    @property
    def uses_slots(self) -> bool:
        """Whether a rule saves or patches."""
        return any(rule.kind in ("save", "patch") for rule in self.rules)

    @functools.cached_property
    def roots(self) -> tuple[str, ...]:
        """The parts of the hook's arguments (args, kwargs, output, grad_input,
        grad_output) its captures and rules read: what a shared pass cuts per call."""
        roots = {_PART_ROOTS[part] for part in self.capture} | {rule.target.root for rule in self.rules}
        return tuple(sorted(roots))


_PART_ROOTS = {
    hook_pb2.PART_ARGS: "args", hook_pb2.PART_KWARGS: "kwargs", hook_pb2.PART_OUTPUT: "output",
    hook_pb2.PART_GRAD_INPUT: "grad_input", hook_pb2.PART_GRAD_OUTPUT: "grad_output",
}


@dataclasses.dataclass(frozen=True)
class CompiledSpec:
    """A HookSpec checked against its model: what to install where."""

    modules: tuple[str, ...]
    actions: tuple[Action, ...]
    train_update: bool
    eval_update: bool
    scope: int
    tags: frozenset[str]
    fail_call_on_error: bool
    #: The steps it fires in (first, last or None for no end), inclusive; None for every step.
    steps: tuple[int, int | None] | None = None
    #: The named operands it uses, by the name it gives them (operands.StoredOperand; the
    #: hook holds them): what a vLLM worker is sent to run it (engine/vllm_runtime.py).
    named: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)

    @property
    def uses_slots(self) -> bool:
        """Whether a rule saves or patches (it then needs a session)."""
        return any(action.uses_slots for action in self.actions)

    @property
    def compact(self) -> bool:
        """Whether an action sends compact readout events (their modules are named by
        position: the call lists the hook's modules)."""
        return any(action.options.readout is not None and action.options.readout.compact for action in self.actions)


def hook_modules(records: Any) -> list[list[str]]:
    """InferResponse/GenerateStarted.hook_modules for a call's request-scoped hooks: each
    hook's resolved modules where a hook of the call sends compact readouts, else none
    (an empty list per hook: nothing to index)."""
    if not any(r.compiled.compact for r in records):
        return []
    return [list(r.compiled.modules) if r.compiled.compact else [] for r in records]


def _capture_options(action: hook_pb2.HookAction, field: str, host: ModelHost, source: OperandSource) -> CaptureOptions:
    """The action's capture options, with its readout compiled for ``host``'s model."""
    options = CaptureOptions.compile(action, field)
    if not action.HasField("readout"):
        return options
    if options.summary_bins is not None:
        raise InvalidArgument(f"{field}.readout: a readout and summarize both replace the tensor; set one")
    readout = compile_readout(action.readout, f"{field}.readout", host, source)
    readout.compact = action.readout.compact
    return dataclasses.replace(options, readout=readout)


def hookable_modules(host: ModelHost, pattern: str, field: str) -> tuple[str, ...]:
    """The modules ``pattern`` names on ``host`` that take hooks. NotFound when it names
    none; FailedPrecondition (``field``: the caller's word for the pattern) for a module
    no hook can fire on (``ModelHost.unhooked``: one every vLLM pipeline stage runs, one
    inside a compiled model's graph that is no tap point). In a compiled model a glob
    names those of its matches that take hooks (the tap points, the modules outside the
    graph), and is refused only when none does."""
    modules = tuple(host.resolve(pattern))
    if host.tap_points is not None and is_glob(pattern):
        modules = tuple(path for path in modules if path not in host.unhooked) or modules
    for path in modules:
        why = host.unhooked.get(path)
        if why:
            raise FailedPrecondition(f"{field}: model {host.name!r} runs on the {host.engine} engine, whose module "
                                     f"{path!r} takes no hooks: {why}")
    return modules


def compile_spec(
    spec: hook_pb2.HookSpec, host: ModelHost, *, request_scoped: bool, allow_shared_rules: bool = False,
    max_rules: int = 64, source: OperandSource | None = None,
) -> CompiledSpec:
    """Validates ``spec`` for ``host``; raises InvalidArgument, NotFound or PermissionDenied naming the field.
    ``source``: where its operands come from (operands.NamedSource resolves named ones; without
    one, only inline operands)."""
    source = source or OperandSource(host.device)
    actions: list[Action] = []
    for info in PHASES:
        if not spec.HasField(info.field):  # type: ignore[arg-type]
            continue
        action_msg: hook_pb2.HookAction = getattr(spec, info.field)
        if info.phase in (hook_pb2.PHASE_BACKWARD_PRE, hook_pb2.PHASE_BACKWARD):
            host.refuse("backward", info.field)  # an engine that runs no backward pass never fires it
        options = getattr(spec, info.options_field)
        with_kwargs = bool(getattr(options, "with_kwargs", False))
        parts: list[hook_pb2.Part] = []
        for i, part in enumerate(action_msg.capture):
            if part not in info.parts:
                visible = ", ".join(_part_name(p) for p in sorted(info.parts))
                raise InvalidArgument(
                    f"{info.field}.capture[{i}]: {_part_name(part)} is not visible to a {info.field} (it sees {visible})"
                )
            if part == hook_pb2.PART_KWARGS and not with_kwargs:
                raise InvalidArgument(
                    f"{info.field}.capture[{i}]: capturing PART_KWARGS needs {info.options_field}.with_kwargs "
                    "(without it, torch does not pass kwargs to the hook)"
                )
            if part not in parts:
                parts.append(part)
        if len(action_msg.rules) > max_rules:
            raise exceeded(f"{info.field}.rules", f"{len(action_msg.rules)} rules", max_rules, "max_rules_per_action",
                           error=InvalidArgument)
        if action_msg.capture_stage not in rule_pb2.CaptureStage.values():
            raise InvalidArgument(f"{info.field}.capture_stage: unknown stage {action_msg.capture_stage}")
        actions.append(
            Action(
                phase=info.phase,
                capture=tuple(parts),
                with_kwargs=with_kwargs,
                prepend=bool(options.prepend),
                always_call=bool(getattr(options, "always_call", False)),
                rules=compile_rules(
                    action_msg.rules, phase=info.phase, phase_field=info.field, with_kwargs=with_kwargs,
                    device=host.device, source=source,
                ),
                capture_before_rules=action_msg.capture_stage == rule_pb2.CAPTURE_STAGE_BEFORE_RULES,
                options=_capture_options(action_msg, info.field, host, source),
            )
        )
    if not actions:
        raise InvalidArgument(
            "the hook has no action: set at least one of prehook, posthook, backward_prehook, backward_hook"
        )
    if spec.scope not in hook_pb2.Scope.values():
        raise InvalidArgument(f"scope: unknown scope {spec.scope}")
    if request_scoped:
        if spec.scope not in (hook_pb2.SCOPE_UNSPECIFIED, hook_pb2.SCOPE_SESSION):
            raise InvalidArgument(
                f"scope: hooks in InferRequest.hooks fire for that call only; {hook_pb2.Scope.Name(spec.scope)} needs RegisterHook"
            )
        scope = SCOPE_REQUEST
    else:
        scope = spec.scope or hook_pb2.SCOPE_SESSION
    tags = frozenset(spec.tags)
    if scope == hook_pb2.SCOPE_TAGGED and not tags:
        raise InvalidArgument("tags: a SCOPE_TAGGED hook needs at least one tag")
    if tags and scope != hook_pb2.SCOPE_TAGGED:
        raise InvalidArgument("tags: only SCOPE_TAGGED hooks have tags")
    if "" in tags:
        raise InvalidArgument("tags: a tag cannot be empty")
    shared = scope in (hook_pb2.SCOPE_ALL, hook_pb2.SCOPE_TAGGED)
    if shared and not allow_shared_rules and spec.on_error == rule_pb2.ON_ERROR_FAIL_CALL:
        raise PermissionDenied(
            "on_error: ON_ERROR_FAIL_CALL on a shared hook would fail other callers' calls; this server does not "
            "allow it (start it with --allow-shared-rules)"
        )
    if shared and not allow_shared_rules and any(a.modifies for a in actions):
        raise PermissionDenied(
            f"rules on a {hook_pb2.Scope.Name(scope)} hook change other callers' results; this server does not "
            "allow them (start it with --allow-shared-rules)"
        )
    if spec.on_error not in rule_pb2.OnError.values():
        raise InvalidArgument(f"on_error: unknown policy {spec.on_error}")
    Sampler.compile(spec.sampling)  # validates
    fail_call = spec.on_error == rule_pb2.ON_ERROR_FAIL_CALL or (
        spec.on_error == rule_pb2.ON_ERROR_UNSPECIFIED and not shared
    )
    steps = None
    if spec.HasField("steps"):
        last = spec.steps.last if spec.steps.HasField("last") else None
        if last is not None and last < spec.steps.first:
            raise InvalidArgument(
                f"steps: last ({last}) is before first ({spec.steps.first}); the range is inclusive, "
                "e.g. first 0, last 0 for the prompt pass alone"
            )
        steps = (spec.steps.first, last)
    modules = hookable_modules(host, spec.module, "module")
    for i, action in enumerate(actions):
        field = next(info.field for info in PHASES if info.phase == action.phase)
        for rule in action.rules:
            if rule.heads:
                rule.head_view = check_heads(host, modules, action.phase, rule.heads,
                                             f"{field}.rules[{rule.position}].heads", rule.target.text)
        wanted = getattr(spec, field).heads
        if wanted:
            if len(set(wanted)) != len(wanted):
                raise InvalidArgument(f"{field}.heads: a head is named twice")
            chosen = tuple(int(h) for h in wanted)
            view = check_heads(host, modules, action.phase, chosen, f"{field}.heads", None)
            point = head_point(host, modules[0], action.phase)
            assert point is not None
            actions[i] = dataclasses.replace(action, heads=chosen, heads_target=point.target, head_view=view)
        # Operands checked against the modules' widths where they state them, so that a
        # wrong-width operand is refused here, not in the first pass.
        check_operand_widths(host, modules, action.phase, action.rules, field)
    for action in actions:
        if not action.reads_whole:
            continue
        for path in modules:  # where rules cannot act (vLLM's shards under tensor parallel)
            why = host.unedited.get((path, action.phase))
            if why:
                field = next(info.field for info in PHASES if info.phase == action.phase)
                raise FailedPrecondition(f"{field}.rules: model {host.name!r} runs on the {host.engine} engine, whose "
                                         f"module {path!r} rules cannot edit or read whole there: {why}")
    return CompiledSpec(
        modules=modules,
        actions=tuple(actions),
        train_update=spec.train_update if spec.HasField("train_update") else True,
        eval_update=spec.eval_update if spec.HasField("eval_update") else True,
        scope=scope,
        tags=tags,
        fail_call_on_error=fail_call,
        steps=steps,
        named=dict(getattr(source, "used", None) or {}),
    )


def check_slot_stages(host: Any, specs: Iterable[CompiledSpec], placed: Mapping[str, Any] | None = None) -> None:
    """FailedPrecondition where ``specs`` (a session's hooks, with a call's own) save or
    patch one slot on modules of more than one pipeline stage of ``host``, or patch a slot
    that lives on another stage's ranks (``placed``: the session's slots on ranks, by name:
    ``SlotStore.homes``): a slot lives on the ranks of one stage and does not travel between
    stages (vLLM under pipeline parallel: ``ModelHost.stage_of``)."""
    if not host.stage_of:
        return
    uses: dict[str, dict[int, str]] = {}
    patches: dict[str, dict[int, str]] = {}
    for compiled in specs:
        for action in compiled.actions:
            for rule in action.rules:
                if rule.kind in ("save", "patch"):
                    for path in compiled.modules:
                        stage = host.stage_of.get(path, -1)
                        uses.setdefault(rule.slot, {}).setdefault(stage, path)
                        if rule.kind == "patch":
                            patches.setdefault(rule.slot, {}).setdefault(stage, path)
    for name, stages in uses.items():
        if len(stages) > 1:
            where = ", ".join(f"module {path!r} (stage {stage})" for stage, path in sorted(stages.items()))
            raise FailedPrecondition(
                f"slot {name!r}: saved or patched on {where} of model {host.name!r}: under pipeline parallel a slot "
                "lives on one stage's ranks; save and patch it on modules of one stage")
    for name, home in (placed or {}).items():
        # An earlier hook (since removed) saved it on one stage: a patch on another stage
        # could not read it (every such step would run its hooks in the server, and fail).
        if getattr(home, "model", None) != host.name or name not in patches:
            continue
        elsewhere = {stage: path for stage, path in patches[name].items() if stage != home.stage}
        if elsewhere:
            stage, path = min(elsewhere.items())
            raise FailedPrecondition(
                f"slot {name!r} lives on {home.label} (an earlier hook saved it there): a patch on module {path!r} "
                f"(stage {stage}) cannot read it, since a slot does not travel between pipeline stages; patch it on "
                f"stage {home.stage}'s modules, or use another slot name (or a new session)")


def require_hook_roles(principal: Principal, spec: hook_pb2.HookSpec, compiled: CompiledSpec, *, sessionless: bool) -> None:
    """PermissionDenied unless ``principal``'s role allows this hook: checked when it is
    registered, and again when a token reload changes its owner's role."""
    principal.require(MINIMUM_ROLE["RegisterHook"], "registering a hook")
    if compiled.scope in (hook_pb2.SCOPE_ALL, hook_pb2.SCOPE_TAGGED):
        principal.require("observer", "a SCOPE_ALL or SCOPE_TAGGED hook (other callers' traffic)")
        if any(a.modifies for a in compiled.actions) or spec.on_error == rule_pb2.ON_ERROR_FAIL_CALL:
            principal.require("operator", "rules that change or fail other callers' calls")
    if sessionless:
        # A monitor that outlives its client is an observer's tool; one that acts on the
        # traffic it watches (any rule, stop included) stays an operator's.
        principal.require("observer", "a hook without a session (it outlives its client)")
        if any(a.rules for a in compiled.actions):
            principal.require("operator", "rules on a hook without a session (an observer's may only capture)")
