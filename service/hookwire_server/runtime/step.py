"""The hook runtime of a process that holds the model but not the hooks' records (a vLLM
worker): it runs a step's firings on the tensors themselves, as the front planned them,
and hands back what the firings captured, once, at the step's end.

The front decides every firing before the step runs (which hook fires on which call's
rows at which module, its call index, whether it captures: ``hook_record.plan_firing``)
and ships it as the step's plan (``plan.py``); the specs the firings need travel once, as
``HookSpec`` bytes, and are compiled here (``HookProgram``). What only the values decide
happens here, on the worker's device: each call's rows cut out of the packed step
(``engine.packed``), rules applied (conditions, signals, SAE edits, stops), captures
selected, cast or summarized and copied out. An edit goes back into the module's value
before the module goes on: no round trip. The front numbers, encodes and delivers the
captures (``hook_record.finish_firing``), so delivery, drops and notices are its own.

Slots live here once saved here (``RankSlots``: a session's saves and patches on this
rank, bounded by what the front says the session may still hold; the front learns each
save's name, dtype and shape with the step's results). What a firing cannot do here
(readouts, heads, sampling, harvest taps) the front keeps: a step whose hooks need any of
it runs as before, every tapped value sent to the front (``HookRecord.runs_elsewhere``,
``engine.vllm_runtime``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from hookwire.v1 import hook_pb2, rule_pb2, tensor_pb2

from ..engine.packed import PackedBatch, PackedSegment
from ..errors import HookwireServerError, InvalidArgument
from ..hooks.capture import CaptureOptions
from ..hooks.captured import Captured, prepare
from ..hooks.hook_specs import PHASES, Action
from ..hooks.slots import SlotStore
from ..limits import exceeded
from ..hooks.rules import (SHARED_CASTS, CompiledSae, OperandSource, RuleFailure, Signals, apply_rules, compile_rules,
                           compile_sae, decode_operand)
from . import views

#: The phases a worker's modules run (no backward pass on vLLM).
_PHASES = {"pre": hook_pb2.PHASE_FORWARD_PRE, "post": hook_pb2.PHASE_FORWARD}


@dataclasses.dataclass
class HookProgram:
    """One hook as a worker runs it: its actions compiled from the spec's bytes."""

    hook_id: str
    #: Whose signals its rules keep and read (Pass.signals is per owner).
    owner: str
    #: ON_ERROR_FAIL_CALL (or a request's own hook): a failing rule fails the call, and
    #: the hook goes on for the other calls; else the hook stops (the front disables it).
    fail_call: bool
    #: A request's own hook: a capture that cannot be made fails its call.
    request_scoped: bool
    actions: dict[int, Action]
    #: The key of its session's slots on the ranks ("" when it keeps none).
    slots: str = ""
    #: Why it could not be compiled here ("" when it was): its firings fail as its rules would.
    broken: str = ""
    broken_kind: str = ""


class ShippedOperands(OperandSource):
    """The named operands the front shipped to this rank (a plan's ``operands``), by the
    key the shipped specs name them with, on the rank's device: one copy each, shared by
    every program naming it (a tensor's casts too: rules.shared_cast)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.tensors: dict[str, torch.Tensor] = {}
        self.saes: dict[str, CompiledSae] = {}
        #: Why an operand could not be taken (its programs fail to compile, saying so).
        self.broken: dict[str, str] = {}

    def take(self, meta: dict[str, Any], blob: bytes) -> None:
        """An operand of the plan (never raises: a bad one breaks the programs naming it)."""
        key = str(meta.get("key", ""))
        where = f"operand {str(meta.get('name', key))!r}"
        try:
            if meta.get("kind") == "sae":
                sae = rule_pb2.Sae()
                sae.ParseFromString(blob)
                self.saes[key] = compile_sae(sae, where, OperandSource(self.device), {}, "")
            else:
                msg = tensor_pb2.Tensor()
                msg.ParseFromString(blob)
                tensor = decode_operand(msg, where, self.device)
                setattr(tensor, SHARED_CASTS, {})
                self.tensors[key] = tensor
        except Exception as exc:
            self.broken[key] = f"{where} could not be taken in a vLLM worker: {exc}"

    def drop(self, key: str) -> None:
        self.tensors.pop(key, None)
        self.saes.pop(key, None)
        self.broken.pop(key, None)

    def named_tensor(self, msg: tensor_pb2.Tensor, where: str) -> torch.Tensor:
        found = self.tensors.get(msg.operand)
        if found is None:
            raise InvalidArgument(self.broken.get(msg.operand) or f"{where}.operand: {msg.operand!r} is not on this worker")
        return found

    def sae(self, msg: Any, where: str) -> CompiledSae:
        found = self.saes.get(msg.operand)
        if found is None:
            raise InvalidArgument(self.broken.get(msg.operand) or f"{where}.operand: {msg.operand!r} is not on this worker")
        return found


class _SessionSlots(SlotStore):
    """One session's slots on this rank; remembers what the step saved (the front is told)."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(max_bytes)
        self.saved: set[str] = set()
        #: The session's max_slot_bytes and the ranks whose copies count against it (the
        #: plan's ``slot_budget``): for the words of a save past the budget.
        self.limit = max_bytes
        self.copies = 1

    def save(self, name: str, tensor: torch.Tensor) -> None:
        super().save(name, tensor)
        self.saved.add(name)

    def _check(self, name: str, size: int, total: int) -> None:
        if total > self.max_bytes:
            raise exceeded(f"slot {name!r}", f"saving {size} bytes on each of {self.copies} vLLM rank(s) would put the "
                           f"session's slots past the {self.max_bytes} bytes each rank may hold (every rank's copy "
                           "counts)", self.limit, "max_slot_bytes")


class RankSlots:
    """The sessions' slots on this rank, by the key the front names each session's store
    with (hooks.slots.SlotStore.key). Every rank of a tensor-parallel group keeps its own
    copy (rules run on every rank); the first tells the front what was saved."""

    def __init__(self) -> None:
        self.stores: dict[str, _SessionSlots] = {}

    def store(self, key: str) -> _SessionSlots:
        found = self.stores.get(key)
        if found is None:
            found = self.stores[key] = _SessionSlots(0)  # until the plan says what it may hold
        return found

    def drop(self, key: str, names: list[str] | None) -> None:
        """Frees ``names`` of session ``key`` (None: all of them)."""
        if names is None:
            self.stores.pop(key, None)
            return
        store = self.stores.get(key)
        if store is not None:
            for name in names:
                store.remove(name)
            if not store.describe():
                del self.stores[key]

    def put(self, key: str, name: str, tensor: torch.Tensor) -> None:
        """A slot the front sent (it counted its copies already)."""
        store = self.store(key)
        store.remove(name)
        store.max_bytes = max(store.max_bytes, store.total_bytes + tensor.numel() * tensor.element_size())
        SlotStore.save(store, name, tensor)

    def saved(self) -> list[list[Any]]:
        """What the step saved, as the front records it: [key, name, dtype, shape, bytes]
        each; forgotten here."""
        out = []
        for key, store in self.stores.items():
            for name in sorted(store.saved):
                tensor = store.get(name)
                if tensor is not None:
                    out.append([key, name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape),
                                tensor.numel() * tensor.element_size()])
            store.saved.clear()
        return out

    @property
    def held_bytes(self) -> int:
        return sum(store.total_bytes for store in self.stores.values())


def compile_program(meta: dict[str, Any], spec_bytes: bytes, device: torch.device,
                    source: OperandSource | None = None) -> HookProgram:
    """The hook ``meta`` describes (a plan's ``specs`` entry), compiled from its ``HookSpec`` bytes on
    ``device``, its named operands from ``source`` (the rank's ShippedOperands). The front
    validated the spec against the model at registration; what fails here (it should
    not) makes every firing of the hook fail as a rule would."""
    program = HookProgram(str(meta["hook_id"]), str(meta["owner"]), bool(meta["fail_call"]),
                          bool(meta["request_scoped"]), {}, str(meta.get("slots", "")))
    try:
        spec = hook_pb2.HookSpec()
        spec.ParseFromString(spec_bytes)
        for info in PHASES:
            if info.phase not in _PHASES.values() or not spec.HasField(info.field):  # type: ignore[arg-type]
                continue
            msg = getattr(spec, info.field)
            with_kwargs = bool(getattr(getattr(spec, info.options_field), "with_kwargs", False))
            program.actions[info.phase] = Action(
                phase=info.phase,
                capture=tuple(dict.fromkeys(msg.capture)),
                with_kwargs=with_kwargs,
                rules=compile_rules(msg.rules, phase=info.phase, phase_field=info.field, with_kwargs=with_kwargs,
                                    device=device, source=source),
                capture_before_rules=msg.capture_stage == rule_pb2.CAPTURE_STAGE_BEFORE_RULES,
                options=CaptureOptions.compile(msg, info.field),
            )
    except Exception as exc:  # never out of a step
        program.broken = f"hookwire could not compile hook {program.hook_id} in a vLLM worker: {exc}"
        program.broken_kind = type(exc).__name__ if isinstance(exc, HookwireServerError) else "InvalidArgument"
    return program


@dataclasses.dataclass
class _Entry:
    """One planned firing: its number in the plan, the hook, the call's segment, whether
    it captures, the output view its hook sees, and the module path its hook names (the
    tapped module's, except lm_head's hooks, which fire in the logits processor)."""

    number: int
    key: str
    segment: int
    capture: bool
    view: str
    path: str


class StepRunner:
    """A worker's hooks: the programs shipped so far and the step being run. One per rank;
    ``captures``: whether this rank makes the captures (the first of its tensor-parallel
    group; the others only apply rules, whose values every rank holds whole)."""

    def __init__(self, device: torch.device, *, captures: bool = True) -> None:
        self.device = device
        self.captures = captures
        self.programs: dict[str, HookProgram] = {}
        self.operands = ShippedOperands(device)
        self.slots = RankSlots()
        self.active = False
        self._model = ""
        self._vocab = 0
        self._batch: PackedBatch | None = None
        self._fire: dict[tuple[str, str], list[_Entry]] = {}
        self._input_ids: Any = None
        self._token_ids: dict[int, torch.Tensor] = {}
        self._signals: dict[tuple[int, str], Signals] = {}
        self._stopped: set[str] = set()
        self._fired: list[list[Any]] = []
        self._values: list[Any] = []

    # ---------------------------------------------------------------- per step

    def configure(self, header: dict[str, Any], blobs: list[bytes], input_ids: Any = None) -> None:
        """Takes the step's plan (plan.unpack): new programs, dropped ones, and the
        firings; without ``run`` the step's hooks run in the front (``active`` False).
        ``input_ids``: a callable giving the step's token ids ([tokens]), for token-id
        signals (read only if a rule asks)."""
        for key in header.get("drop", ()):
            self.programs.pop(str(key), None)
        for key in header.get("drop_operands", ()):
            self.operands.drop(str(key))
        for key, names in header.get("drop_slots", ()):
            self.slots.drop(str(key), None if names is None else [str(n) for n in names])
        for key, name in header.get("pull_slots", ()):  # sent to the front (vllm_worker): they live there now
            self.slots.drop(str(key), [str(name)])
        specs = list(header.get("specs", ()))
        operands = list(header.get("operands", ()))
        for meta, blob in zip(operands, blobs[len(specs):]):
            self.operands.take(meta, blob)
        for meta, blob in zip(header.get("slots", ()), blobs[len(specs) + len(operands):]):
            self.slots.put(str(meta["key"]), str(meta["name"]), _slot_tensor(blob, self.device))
        for key, (budget, limit, copies) in (header.get("slot_budget") or {}).items():
            store = self.slots.store(str(key))
            store.max_bytes, store.limit, store.copies = int(budget), int(limit), int(copies)
        for meta, blob in zip(specs, blobs):
            self.programs[str(meta["key"])] = compile_program(meta, blob, self.device, self.operands)
        run = header.get("run")
        self._fired, self._values = [], []
        self._signals, self._token_ids, self._stopped = {}, {}, set()
        self.active = run is not None
        if run is None:
            self._batch, self._fire = None, {}
            return
        self._model = str(run.get("model", ""))
        self._vocab = int(run.get("vocab", 0))
        segments = [PackedSegment.of(None, [tuple(s) for s in spans], side, width, rows)  # type: ignore[arg-type]
                    for spans, rows, side, width in run["segments"]]
        batch = PackedBatch(segments, dim=0, tokens=int(run["tokens"]), rerun=False)
        batch.sequences = int(run["sequences"])
        batch.shared = bool(run["shared"])
        self._batch = batch
        self._fire = {}
        for path, phase, entries in run["fire"]:
            self._fire[(str(path), str(phase))] = [_Entry(int(n), str(k), int(s), bool(c), str(v), str(h))
                                                   for n, k, s, c, v, h in entries]
        self._input_ids = input_ids

    def results(self) -> tuple[list[list[Any]], list[Any]]:
        """The step's firings as they ran (plan.FIRED's fields each) and the captured
        values they name, in order; the step is over."""
        fired, values = self._fired, self._values
        self._fired, self._values = [], []
        self.active = False
        self._batch, self._fire, self._signals, self._token_ids = None, {}, {}, {}
        if any(isinstance(v, torch.Tensor) and v.device.type != "cpu" for v in values):
            # One copy to the host per tensor, after the step's kernels (on CUDA the copies
            # queue behind them; torch waits once, here).
            values = [v.to("cpu") if isinstance(v, torch.Tensor) else v for v in values]
        return fired, values

    def fire(self, path: str, phase: str, parts: dict[str, Any]) -> dict[str, Any] | None:
        """The planned firings at module ``path`` in ``phase`` ("pre": parts args and kwargs;
        "post": args, kwargs, output), in the plan's order; the parts as the rules left
        them, or None when none changed anything. Never raises: a firing's failure is
        recorded for the front."""
        entries = self._fire.get((path, phase))
        batch = self._batch
        if not entries or batch is None:
            return None
        changed_any = False
        i = 0
        while i < len(entries):
            j = i
            first = entries[i]
            while j < len(entries) and (entries[j].key, entries[j].view, entries[j].path) == (
                    first.key, first.view, first.path):
                j += 1
            group, i = entries[i:j], j
            recorded = len(self._fired)
            try:
                new = self._fire_group(batch, group, phase, parts)
            except Exception as exc:  # never out of the step: its calls fail, the model goes on
                done = {f[0] for f in self._fired[recorded:]}
                for entry in group:
                    if entry.number not in done:
                        self._record(entry, [], None, None, [], ("call", _kind(exc), f"{exc}"))
                continue
            if new is not None:
                parts, changed_any = new, True
        return parts if changed_any else None

    def _fire_group(self, batch: PackedBatch, group: list[_Entry], phase: str,
                    parts: dict[str, Any]) -> dict[str, Any] | None:
        """One hook's consecutive firings at a module (one per call), as its torch hook runs
        them in the front (hook_record._fire): the parts it left, or None."""
        first = group[0]
        program = self.programs.get(first.key)
        if program is None:
            return None  # (the front ships every program a plan names)
        action = program.actions.get(_PHASES[phase])
        view = views.by_name(first.view, self._vocab) if phase == "post" and first.view else None
        shown = dict(parts)
        if view is not None:
            shown["output"] = view[0](parts["output"])
        named = first.path
        where = f"hook {program.hook_id} on module {named!r} of {self._model!r}"
        cloned: set[int] = set()
        changed = False
        for entry in group:
            if entry.key in self._stopped:
                break  # a failing rule disabled it earlier in the step (on every rank alike)
            if program.broken or action is None:
                self._record(entry, [], None, None, [], ("rule", program.broken_kind or "InvalidArgument",
                                                        program.broken or f"{where}: no action for {phase}"))
                if not program.fail_call:
                    self._stopped.add(entry.key)
                continue
            seg = batch.segments[entry.segment]
            assert isinstance(seg, PackedSegment)
            try:
                mine = {**shown, **{root: batch.take(shown[root], seg, where) for root in action.roots if root in shown}}
            except Exception as exc:  # the call's failure: its hooks do not fire (counted nowhere)
                self._record(entry, [], None, None, [], ("call", _kind(exc), str(exc)))
                continue
            new = self._fire_one(program, action, named, entry, seg, mine, where)
            if new is None:
                continue
            try:
                shown = {**shown, **{root: batch.put(shown[root], mine[root], new[root], seg, where, cloned)
                                     for root in action.roots if root in shown}}
            except Exception as exc:  # the call's failure (its firing was counted, as in the front)
                self._record(entry, [], None, None, [], ("call", _kind(exc), str(exc)))
                continue
            changed = True
        if not changed:
            return None
        if phase == "post":
            return {**parts, "output": view[1](parts["output"], shown["output"]) if view else shown["output"]}
        return {**parts, **{k: shown[k] for k in ("args", "kwargs") if k in shown}}

    # ---------------------------------------------------------------- one firing

    def _fire_one(self, program: HookProgram, action: Action, path: str, entry: _Entry, seg: PackedSegment,
                  parts: dict[str, Any], where: str) -> dict[str, Any] | None:
        """One call's firing (hook_record._fire_call after its decisions, which the front
        made): captures before or after the rules, the rules, the stops they put.

        A capture that cannot be made is reported (the front disables the hook, or fails a
        request's own call) but changes nothing here: the firing's rules still apply, and
        the hook's later firings in the step too, because only the first rank captures and
        every rank must make the same edits."""
        fired_ns = time.time_ns()
        capture = entry.capture and self.captures
        before: list[Captured] | None = None
        devices: list[str] = []
        failed: tuple[str, str, str] | None = None
        if capture and (not action.rules or action.capture_before_rules):
            try:
                before, devices = self._capture(program, action, path, parts)
            except Exception as exc:
                failed = ("capture", _kind(exc), str(exc))
        if not action.rules:
            self._record(entry, devices, before, None, [], failed, fired_ns)
            return None
        signals = self._signals.get((entry.segment, program.owner))
        if signals is None:
            signals = self._signals[(entry.segment, program.owner)] = _StepSignals(self, entry.segment, seg)
        stops: list[int] = []
        try:
            slots = self.slots.store(program.slots) if program.slots else None
            new_parts, changed = apply_rules(action.rules, parts, slots, where, signals, stops)
        except RuleFailure as failure:
            # The same values on every rank: every rank fails alike and stops alike.
            self._record(entry, devices, before, None, [], failed or ("rule", _kind(failure.error), str(failure.error)),
                         fired_ns)
            if not program.fail_call:
                self._stopped.add(entry.key)
            return None
        after: list[Captured] | None = None
        if capture and not action.capture_before_rules:
            try:
                after, devices = self._capture(program, action, path, new_parts)
            except Exception as exc:
                failed = ("capture", _kind(exc), str(exc))
        self._record(entry, devices, before, after, stops, failed, fired_ns)
        return new_parts if changed else None

    def _capture(self, program: HookProgram, action: Action, path: str,
                 parts: dict[str, Any]) -> tuple[list[Captured], list[str]]:
        """The firing's captured values, selected and cast on the device, and copied out of
        the step's tensors (which the model goes on to change in place)."""
        return prepare(program.hook_id, action, path, parts, _snapshot)

    def _record(self, entry: _Entry, devices: list[str], before: list[Captured] | None, after: list[Captured] | None,
                stops: list[int], error: tuple[str, str, str] | None, fired_ns: int | None = None) -> None:
        def items(captured: list[Captured] | None) -> list[list[Any]] | None:
            if captured is None:
                return None
            out = []
            for part, field, key, value in captured:
                out.append([int(part), field, key])
                self._values.append(value)
            return out
        self._fired.append([entry.number, fired_ns or time.time_ns(), items(before), items(after), list(devices),
                            [int(r) for r in stops], list(error) if error is not None else None])

    def token_ids(self, segment: int, seg: PackedSegment) -> torch.Tensor | None:
        """The call's token ids at the step's positions in its layout (Pass.token_ids)."""
        ids = self._token_ids.get(segment)
        if ids is None and self._input_ids is not None and self._batch is not None:
            flat = self._input_ids()
            if flat is None:
                return None
            ids = self._token_ids[segment] = self._batch.take(flat[: self._batch.tokens].to(torch.int64), seg,
                                                              "token ids")
        return ids


class _StepSignals(Signals):
    """A call's signals in a worker's step, whose token ids are made when a rule's
    token-id signal first reads them (most steps have none)."""

    def __init__(self, runner: StepRunner, segment: int, seg: PackedSegment) -> None:
        super().__init__()
        self._of = (runner, segment, seg)

    @property  # type: ignore[override]
    def token_ids(self) -> Any:
        runner, segment, seg = self._of
        return runner.token_ids(segment, seg)


def _slot_tensor(blob: bytes, device: torch.device) -> torch.Tensor:
    """A slot the front sent (a ``Tensor`` message), on this rank's device."""
    from hookwire.wire import codec

    msg = tensor_pb2.Tensor()
    msg.ParseFromString(blob)
    return codec.decode_tensor(msg).to(device)


def _snapshot(value: Any) -> Any:
    """A captured value copied out of the step's tensors (a selection is a view of them)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_snapshot(v) for v in value) if type(value) in (tuple, list) else tuple(
            _snapshot(v) for v in value)
    if isinstance(value, dict):
        return {k: _snapshot(v) for k, v in value.items()}
    return value


def _kind(exc: BaseException) -> str:
    """The domain error's class name the front raises again (errors.py), else InvalidArgument."""
    return type(exc).__name__ if isinstance(exc, HookwireServerError) else InvalidArgument.__name__
