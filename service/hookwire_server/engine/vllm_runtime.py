"""The front's half of the hook runtime in vLLM's worker processes (runtime/ has the
worker's half and the plan's format): per step, the firings planned from the hooks on
the stand-in modules and the step's layout, the specs the workers lack, and the
firings' outcomes taken back into the hooks' records at the step's end.

A step runs its hooks in the workers only when every hook on a tapped module can run
there (``HookRecord.runs_elsewhere``) and no call of the step is a harvest batch (whose
captures go to the job's writer, not to events); otherwise ``plan`` answers None and
the step's hooks run here, on what the workers send (vllm_link).

Sessions' slots follow their hooks (``WorkerSlots``, the ranks as a home of slots:
hooks.slots): a save in a worker's step leaves the slot on the ranks, a step there that
patches a slot held in the server takes it with its plan, and a step whose hooks run
here first reads back the slots of its sessions that live on the ranks (``pulls``).
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Callable

import torch
from torch import nn

from hookwire.v1 import rule_pb2, tensor_pb2
from hookwire.wire import codec

from ..errors import FailedPrecondition, HookwireServerError, InvalidArgument, NotFound, Unimplemented
from .. import errors
from ..hooks.hook_specs import SCOPE_REQUEST
from ..hooks.rules import named_references
from ..hooks.slots import SlotStore
from .vllm_link import on_link_thread
from ..models.model_registry import ModelHost
from .packed import PackedBatch, PackedSegment

log = logging.getLogger("hookwire.vllm")


class WorkerSlots:
    """One vLLM model's ranks as the home of sessions' slots (hooks.slots.SlotHome): what
    they hold is known by each session's store; this object frees and reads it there.

    ``call``: the engine's ``call_workers`` (vLLM's collective_rpc on every rank, between
    steps). Frees ride on the next plan (``take_drops``, in step order with the ranks'
    saves); a session's end also frees its slots at once."""

    def __init__(self, model: str, ranks: int, call: Callable[[str, tuple[Any, ...]], list[Any]],
                 stage: int = 0) -> None:
        self.label = f"model {model!r}'s vLLM workers" + (f" (pipeline stage {stage})" if stage else "")
        #: The model whose ranks these are.
        self.model = model
        #: The pipeline stage whose ranks these are (its first rank answers reads).
        self.stage = stage
        self.copies = ranks
        self._call = call
        self._lock = threading.Lock()
        self._drops: list[list[Any]] = []
        #: The stores whose slots may live here, by key (weak: a store ends with its session).
        self._stores: weakref.WeakValueDictionary[str, SlotStore] = weakref.WeakValueDictionary()
        self._gone = ""

    def remember(self, store: SlotStore) -> None:
        if store.key not in self._stores:
            self._stores[store.key] = store
            store.visited(self)

    def store(self, key: str) -> SlotStore | None:
        return self._stores.get(key)

    def read(self, key: str, name: str) -> torch.Tensor:
        if self._gone:
            raise NotFound(f"slot {name!r} was on {self.label}, which went away: {self._gone}")
        if on_link_thread():
            # A step of a vLLM model runs its hooks on a link thread: waiting there for
            # another model's ranks could wait for a step that waits for this one.
            raise FailedPrecondition(f"slot {name!r} lives on {self.label} (it was saved there): a step of another "
                                     "vLLM model in worker processes cannot read it; patch it in that model's calls, "
                                     "or save it again in this one's")
        answers = self._call("hookwire_slot", (key, name, self.stage))
        answer: list[Any] = next((a for a in answers if a), [])  # the first rank of the stage that holds it
        if not answer:
            raise NotFound(f"no slot {name!r} in this session (it is not on {self.label})")
        data, shape, dtype = answer
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        return flat.view(getattr(torch, str(dtype))).reshape([int(n) for n in shape]).clone()

    def discard(self, key: str, names: list[str] | None) -> None:
        with self._lock:
            self._drops.append([key, names])
        if names is None and not self._gone:
            # The session ended: its slots are freed on every rank now, not at the next step
            # (which may never come). Off this thread: the engine answers between steps.
            threading.Thread(target=self._free_now, args=(key,), name="vllm-slots-free", daemon=True).start()

    def _free_now(self, key: str) -> None:
        try:
            self._call("hookwire_drop_slots", ([[key, None]],))
        except Exception as exc:  # the next plan frees them (or the model is gone)
            log.debug("freeing a session's slots on the ranks: %r", exc)

    def keep(self, key: str, name: str) -> None:
        """A save of ``name`` on the ranks: a free asked for an older copy must not take it."""
        with self._lock:
            kept = []
            for k, names in self._drops:
                if k == key and names is not None:
                    names = [n for n in names if n != name]
                    if not names:
                        continue
                kept.append([k, names])
            self._drops = kept

    def take_drops(self) -> list[list[Any]]:
        """What the next plan frees on the ranks ([key, names or None] each)."""
        with self._lock:
            drops, self._drops = self._drops, []
        return drops

    def outgoing(self, stores: dict[str, SlotStore], patched: dict[str, set[str]]
                 ) -> tuple[list[tuple[SlotStore, str, torch.Tensor, bytes]], str, str]:
        """The slots a plan for these ranks sends: of each session's store (by key) those
        held in the server that the plan's hooks patch (``patched``), each with its wire
        form. When one cannot go (another home holds it, its copies would pass the
        session's bound, it has no wire form): nothing, the store's key and why (the
        step's hooks then run in the server)."""
        moving: list[tuple[SlotStore, str, torch.Tensor, bytes]] = []
        for key, store in stores.items():
            self.remember(store)
            candidates, blocked = store.ship_to(self, patched.get(key, set()))
            if blocked:
                return [], key, (f"slots {', '.join(map(repr, blocked))} cannot come to the ranks (another model's "
                                 "workers hold them, or their copies would pass max_slot_bytes)")
            for name, tensor in candidates:
                try:
                    out = tensor_pb2.Tensor()
                    codec.encode_tensor_into(tensor.detach().to("cpu"), out)
                    blob = out.SerializeToString()  # where protobuf's 2 GiB bound fails
                except Exception as exc:  # no wire form, or past protobuf's 2 GiB
                    return [], key, f"slot {name!r} cannot be sent to the ranks: {exc}"
                moving.append((store, name, tensor, blob))
        return moving, "", ""

    def settle(self, stores: dict[str, SlotStore], moving: list[tuple[SlotStore, str, torch.Tensor, bytes]]
               ) -> tuple[list[list[Any]], dict[str, list[int]]]:
        """A plan that sends ``moving`` is made: its frees (``take_drops``) and each
        session's per-rank budget (its ``slot_budget``: [bytes, max_slot_bytes, copies]).
        The frees are taken before the moves: a copy sent while its slot was saved again
        is freed by the next plan (the ranks free before they store, so this plan would
        free the old copy and keep the one sent). The budget is reckoned after them (a
        slot sent counts as the ranks', not also as the server's)."""
        drops = self.take_drops()
        for store, name, tensor, _ in moving:  # each still the tensor read when it was sent
            store.moved_to(name, tensor, self)
        return drops, {key: [store.budget_for(self), store.max_bytes, self.copies] for key, store in stores.items()}

    def lost(self, why: str) -> None:
        """The ranks are gone: the slots that lived there are lost."""
        self._gone = why
        for store in list(self._stores.values()):
            store.forget_home(self, why)


class RuntimePlanner:
    """Plans the steps of one model's workers (link thread, under the engine's lock)."""

    def __init__(self, host: ModelHost, vocab: int, ranks: int = 1,
                 call: Callable[[str, tuple[Any, ...]], list[Any]] | None = None, paths: set[str] | None = None,
                 stage: int = 0) -> None:
        """``ranks``: the ranks each plan reaches (one pipeline stage's); ``paths``: the
        modules its workers run (pipeline stage ``stage``'s; None: all)."""
        self._host = host
        self._paths = paths
        self._vocab = vocab
        #: The ranks as a home of sessions' slots.
        self.slots = WorkerSlots(host.name, ranks, call or _no_call, stage)
        #: The ranks every plan reaches (each holds its own copy of what it ships).
        self._ranks = ranks
        #: Keys of the programs the workers hold.
        self._shipped: set[str] = set()
        #: The named operands the workers hold, by their key there: the operand
        #: (operands.StoredOperand) and the keys of the programs that name it.
        self._operands: dict[str, tuple[Any, set[str]]] = {}
        #: Operands whose copies could not go to the ranks (logged once each).
        self._refused: set[str] = set()
        #: The open step's firings, by number: (record, action, path, Pass, call index, training).
        self._firings: list[tuple[Any, Any, str, Any, int, bool]] = []

    def plan(self, batch: PackedBatch) -> tuple[dict[str, Any], list[bytes]] | None:
        """The step's plan (header fields taps, run, specs, drop: runtime.plan), or None when
        its hooks must run here. Decides every firing (``HookRecord.plan_firing``)."""
        self._firings = []
        if any(getattr(seg.p, "tap", None) is not None for seg in batch.segments):
            return None
        phases: list[tuple[str, str, nn.Module, list[Any]]] = []
        live: dict[str, Any] = {}
        for path, module in self._modules():
            for phase, hooks in (("pre", module._forward_pre_hooks), ("post", module._forward_hooks)):
                if not hooks:
                    continue
                firings = [getattr(fn, "hookwire_firing", None) for fn in hooks.values()]
                for firing in firings:
                    if firing is None:
                        return None  # not a hookwire hook's
                    record, action, hook_path = firing
                    if not record.runs_elsewhere(action):
                        return None
                    view = self._host.output_views.get(hook_path) if phase == "post" else None
                    if view is not None and not view.name:
                        return None
                    live[_key(record)] = record
                phases.append((path, phase, module, firings))
        # The programs the workers lack, with the named operands they name, before any
        # firing is decided (deciding counts: a step that falls back must not have counted).
        shipping = self._programs([(key, record) for key, record in live.items() if key not in self._shipped])
        if shipping is None:
            return None
        specs, blobs, operands, named, reserved = shipping
        stores: dict[str, SlotStore] = {}
        patched: dict[str, set[str]] = {}
        for record in live.values():
            if record.compiled.uses_slots and record.slots is not None:
                stores[record.slots.key] = record.slots
                patched.setdefault(record.slots.key, set()).update(_patched(record))
        moving, refused, why = self.slots.outgoing(stores, patched)
        if why:  # the step's hooks run here (which reads them)
            for stored in reserved:
                stored.add_rank_copies(-self._ranks)
            self._refuse(f"slot:{refused}", f"model {self._host.name!r}: {why}; the steps of this model's hooks run "
                                            "in the server while they need them")
            return None
        try:
            header = self._decide(batch, phases, specs, operands)
        except BaseException:
            for stored in reserved:
                stored.add_rank_copies(-self._ranks)
            raise
        header["slots"] = []
        for store, name, tensor, blob in moving:
            header["slots"].append({"key": store.key, "name": name, "size": len(blob)})
            blobs.append(blob)
        # Counted as the workers' only once the whole plan is made (a failure before sends none).
        self._shipped.update(meta["key"] for meta in specs)
        for okey, (stored, users) in named.items():
            self._operands.setdefault(okey, (stored, set()))[1].update(users)
        header["drop"] = self._dropped(set(live))
        header["drop_operands"] = self._unused_operands()
        header["drop_slots"], header["slot_budget"] = self.slots.settle(stores, moving)
        return header, blobs

    def _programs(self, records: list[tuple[str, Any]]) -> tuple[Any, ...] | None:
        """The specs (plan ``specs`` and their blobs) of ``records`` and the named operands
        they name that the workers lack (``operands``, their blobs after the specs'), with
        each operand's users and the operands whose rank copies were counted; None (nothing
        counted) when one cannot go: a name not resolved when it compiled, or copies past
        the owner's or the server's operand quota (the step's hooks then run here)."""
        specs: list[dict[str, Any]] = []
        blobs: list[bytes] = []
        named: dict[str, tuple[Any, set[str]]] = {}
        for key, record in records:
            spec = record.to_proto(include_operand_data=True).spec
            for ref in named_references(spec):
                # A named operand travels once per rank, on its own (``operands``); the
                # spec names it by its key there.
                stored = record.compiled.named.get(ref.operand)
                if stored is None:
                    return None
                okey = _operand_key(stored)
                ref.operand = okey
                named.setdefault(okey, (stored, set()))[1].add(key)
            blob = spec.SerializeToString()
            specs.append({"key": key, "size": len(blob), "hook_id": record.hook_id, "owner": record.owner.name,
                          "fail_call": bool(record.compiled.fail_call_on_error),
                          "request_scoped": record.compiled.scope == SCOPE_REQUEST,
                          "slots": record.slots.key if record.compiled.uses_slots and record.slots is not None else ""})
            blobs.append(blob)
        operands: list[dict[str, Any]] = []
        reserved: list[Any] = []
        for okey, (stored, _) in named.items():
            if okey in self._operands:
                continue
            why = ""
            if not stored.add_rank_copies(self._ranks):  # each rank's copy counts against the quotas
                why = f"its copies on {self._ranks} rank(s) would pass the operand quotas"
            else:
                reserved.append(stored)
                try:
                    blob = _operand_bytes(stored)
                except Exception as exc:  # (a protobuf message holds at most 2 GiB)
                    why = f"it cannot be sent to the ranks: {exc}"
            if why:
                for done in reserved:
                    done.add_rank_copies(-self._ranks)
                self._refuse(okey, f"model {self._host.name!r}: operand {stored.name!r}: {why}; the steps of this "
                                   "model's hooks run in the server while a hook names it")
                return None
            operands.append({"key": okey, "kind": stored.kind, "name": stored.name, "size": len(blob)})
            blobs.append(blob)
        return specs, blobs, operands, named, reserved

    def _modules(self) -> list[tuple[str, nn.Module]]:
        """The stand-in modules its workers run."""
        return [(p, m) for p, m in self._host.modules.items() if self._paths is None or p in self._paths]

    def _refuse(self, okey: str, why: str) -> None:
        """Logs, once per operand, why its hooks' steps run in the server."""
        if okey not in self._refused:
            self._refused.add(okey)
            log.warning("%s", why)

    def _decide(self, batch: PackedBatch, phases: list[tuple[str, str, nn.Module, list[Any]]],
                specs: list[dict[str, Any]], operands: list[dict[str, Any]]) -> dict[str, Any]:
        """The step's firings (``HookRecord.plan_firing`` for each hook and call) and the
        plan's header but for its drops."""
        fire: list[list[Any]] = []
        taps: list[list[Any]] = []
        for path, phase, module, firings in phases:
            entries: list[list[Any]] = []
            roots: set[str] = set()
            edits = False
            for record, action, hook_path in firings:
                view = self._host.output_views.get(hook_path) if phase == "post" else None
                for i, seg in enumerate(batch.segments):
                    decided = record.plan_firing(action, hook_path, module, seg.p)
                    if decided is None:
                        continue
                    call_index, capture = decided
                    entries.append([len(self._firings), _key(record), i, capture, view.name if view is not None else "",
                                    hook_path])
                    self._firings.append((record, action, hook_path, seg.p, call_index, bool(module.training)))
                    roots.update(action.roots)
                    edits = edits or bool(action.rules)
            if entries:
                fire.append([path, phase, entries])
                taps.append([path, phase, sorted(roots), edits])
        segments = []
        for seg in batch.segments:
            assert isinstance(seg, PackedSegment)
            segments.append([[list(s) for s in seg.spans], list(seg.rows), seg.side, seg.length])
        run = {"model": self._host.name, "vocab": self._vocab, "tokens": batch.tokens, "sequences": batch.sequences,
               "shared": bool(batch.shared), "segments": segments, "fire": fire}
        return {"taps": taps, "run": run, "specs": specs, "operands": operands}

    def sweep(self) -> list[str]:
        """For a step whose hooks run here: the programs the workers may forget (their hooks
        are gone), so that a removed hook's operands do not stay on the ranks."""
        firings = [getattr(fn, "hookwire_firing", None) for _, module in self._modules()
                   for hooks in (module._forward_pre_hooks, module._forward_hooks) for fn in hooks.values()]
        live = {_key(firing[0]) for firing in firings if firing is not None}
        return self._dropped(live)

    def pulls(self) -> list[list[str]]:
        """For a step whose hooks run here: the slots of its slot-keeping hooks' sessions
        that live on the ranks ([key, name] each), which the worker sends back before the
        step (``restore``) and the ranks then free."""
        out: list[list[str]] = []
        seen: set[str] = set()
        for _, module in self._modules():
            for hooks in (module._forward_pre_hooks, module._forward_hooks):
                for fn in hooks.values():
                    firing = getattr(fn, "hookwire_firing", None)
                    if firing is None:
                        continue
                    record = firing[0]
                    store = getattr(record, "slots", None)
                    if store is None or not record.compiled.uses_slots or store.key in seen:
                        continue
                    seen.add(store.key)
                    self.slots.remember(store)
                    out.extend([store.key, name] for name in store.placed_on(self.slots))
        return out

    def restore(self, pairs: list[list[str]], values: list[Any]) -> None:
        """The slots a worker sent back (``pulls``): they live here again."""
        for (key, name), value in zip(pairs, values):
            store = self.slots.store(key)
            if store is not None:
                store.restore(name, value if isinstance(value, torch.Tensor) else None, self.slots)

    def saved(self, saved: list[list[Any]]) -> None:
        """The slots the workers' step saved ([key, name, dtype, shape, bytes] each): they
        live on the ranks."""
        for key, name, dtype, shape, nbytes in saved:
            self.slots.keep(str(key), str(name))
            store = self.slots.store(str(key))
            if store is None:
                self.slots.discard(str(key), [str(name)])
                continue
            store.place(str(name), self.slots, getattr(torch, str(dtype)), tuple(int(n) for n in shape), int(nbytes))

    def sweep_operands(self) -> list[str]:
        """After ``sweep``: the named operands the workers may free (no program they keep
        names them)."""
        return self._unused_operands()

    def _dropped(self, live: set[str]) -> list[str]:
        drop = sorted(self._shipped - live)
        self._shipped -= set(drop)
        return drop

    def _unused_operands(self) -> list[str]:
        """The operands no program the workers keep names any more: forgotten here, and
        their copies on the ranks no longer count against their owners' quotas."""
        unused = []
        for okey, (stored, users) in list(self._operands.items()):
            users &= self._shipped
            if not users:
                del self._operands[okey]
                stored.add_rank_copies(-self._ranks)
                unused.append(okey)
        return sorted(unused)

    def forget(self, why: str = "its workers went away") -> None:
        """The workers are gone: nothing they held counts any more."""
        self.slots.lost(why)
        for stored, _ in self._operands.values():
            stored.add_rank_copies(-self._ranks)
        self._operands.clear()
        self._shipped.clear()

    def finish(self, batch: PackedBatch, fired: list[list[Any]], values: list[Any],
               bad: dict[int, str] | None = None) -> None:
        """The open step's firings as the workers ran them (runtime.plan's ``fired``), into
        their records, in the order they ran: events, counts, stops, failures (a call's
        failure is kept for it: PackedBatch.fail_call). ``bad``: the values the worker
        could not encode (by index), each its firing's capture failure."""
        firings, self._firings = self._firings, []
        bad = bad or {}
        at = 0
        unencoded: list[str] = []

        def take(meta: list[list[Any]] | None) -> list[Any] | None:
            nonlocal at
            if meta is None:
                return None
            items = []
            for part, field, key in meta:
                if at in bad:
                    unencoded.append(bad[at])
                items.append((int(part), str(field), key, values[at]))
                at += 1
            return items

        for number, fired_ns, before_meta, after_meta, devices, stops, error in fired:
            unencoded.clear()
            before, after = take(before_meta), take(after_meta)
            record, action, path, p, call_index, training = firings[int(number)]
            failure = None
            if error is not None:
                failure = (str(error[0]), _error(str(error[1]), str(error[2])))
            elif unencoded:
                failure = ("capture", Unimplemented(f"hook {record.hook_id} on module {path!r} cannot capture a "
                                                    f"value: {unencoded[0]}"))
                before = after = None
            try:
                record.finish_firing(action, path, p, call_index, training, int(fired_ns), before, after,
                                     [str(d) for d in devices], [int(r) for r in stops], failure)
            except Exception as exc:
                if not batch.fail_call(p, exc):
                    raise

    def abandon(self) -> None:
        """The open step ended without results (its worker went away)."""
        self._firings = []


def _patched(record: Any) -> set[str]:
    """The slots ``record``'s rules patch (rules.CompiledRule.slot of each patch)."""
    names: set[str] = set()
    for action in record.compiled.actions:
        for rule in action.rules:
            while rule is not None:
                if rule.kind == "patch":
                    names.add(rule.slot)
                rule = getattr(rule, "inner", None)
    return names


def _no_call(method: str, args: tuple[Any, ...]) -> list[Any]:
    raise FailedPrecondition("this model's workers cannot be called")


def _key(record: Any) -> str:
    """The workers' name for a hook's program: its id and record (a hook id is never
    reused, but a record is the compiled spec's identity)."""
    return f"{record.hook_id}#{id(record):x}"


def _operand_key(stored: Any) -> str:
    """The workers' name for a named operand: its owner, name and identity (the same
    name uploaded again is another operand; the hooks holding one keep it alive, so its
    identity is not reused while the workers hold it)."""
    return f"{stored.owner}/{stored.name}@{id(stored):x}"


def _operand_bytes(stored: Any) -> bytes:
    """A named operand as the workers receive it: a tensor operand's ``Tensor`` message,
    an SAE's ``Sae`` message with its tensors inline (protobuf, data only)."""
    if stored.kind == "sae":
        msg = rule_pb2.Sae()
        msg.CopyFrom(stored.sae_config)
        for field, tensor in stored.tensors.items():
            part = getattr(msg, field)
            part.Clear()
            codec.encode_tensor_into(tensor, part)
        return msg.SerializeToString()
    out = tensor_pb2.Tensor()
    codec.encode_tensor_into(stored.tensor, out)
    return out.SerializeToString()


def _error(kind: str, message: str) -> HookwireServerError:
    """The domain error a worker named (errors.py's class), with its message."""
    cls = getattr(errors, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, HookwireServerError)):
        cls = InvalidArgument
    return cls(message)
