"""Sessions' slots between the server and a vLLM model's ranks (hooks/slots.py's SlotStore,
engine/vllm_runtime.py's WorkerSlots, runtime/step.py's RankSlots): where a slot lives,
what it counts against the session's bound, and the order in which a plan frees and
stores copies on the ranks. The ranks here are real RankSlots objects, one per rank,
updated as a worker applies a plan (frees first, then the slots the plan carries);
tests/vllm_engine runs the same with vLLM's worker processes.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from hookwire_server.engine.vllm_runtime import WorkerSlots
from hookwire_server.errors import NotFound, ResourceExhausted
from hookwire_server.hooks.slots import SlotStore
from hookwire_server.runtime.step import RankSlots


class Ranks:
    """A tensor-parallel group's slots, one RankSlots per rank, answering what
    ``VllmEngine.call_workers`` asks of them (the workers' ``hookwire_slot`` and
    ``hookwire_drop_slots``)."""

    def __init__(self, copies: int) -> None:
        self.ranks = [RankSlots() for _ in range(copies)]
        self.calls: list[str] = []
        self.done = threading.Event()

    def call(self, method: str, args: tuple[Any, ...]) -> list[Any]:
        self.calls.append(method)
        if method == "hookwire_slot":
            key, name, _stage = args
            answers: list[Any] = []
            for rank in self.ranks:
                store = rank.stores.get(key)
                tensor = store.get(name) if store is not None else None
                answers.append([] if tensor is None else [
                    tensor.reshape(-1).view(torch.uint8).numpy().tobytes(), list(tensor.shape),
                    str(tensor.dtype).removeprefix("torch.")])
            return answers
        if method == "hookwire_drop_slots":
            (drops,) = args
            self.apply(drops, [])
            self.done.set()
            return [None] * len(self.ranks)
        raise AssertionError(f"unexpected call {method}")

    def apply(self, drops: list[list[Any]], puts: list[tuple[str, str, torch.Tensor]]) -> None:
        """A plan on every rank, as runtime/step.py applies it: its frees, then its slots."""
        for rank in self.ranks:
            for key, names in drops:
                rank.drop(key, names)
            for key, name, tensor in puts:
                rank.put(key, name, tensor.clone())

    def held(self, key: str, name: str) -> list[torch.Tensor | None]:
        return [r.stores[key].get(name) if key in r.stores else None for r in self.ranks]


def _plan(store: SlotStore, home: WorkerSlots, ranks: Ranks, names: set[str]) -> str:
    """One plan whose hooks patch ``names``, made as RuntimePlanner.plan makes its slots'
    part (``WorkerSlots.outgoing``, then ``settle``) and applied on every rank. Returns
    why a slot could not go ("" when the plan was made)."""
    moving, _, why = home.outgoing({store.key: store}, {store.key: names})
    if why:
        return why
    drops, budget = home.settle({store.key: store}, moving)
    ranks.apply(drops, [(s.key, name, tensor) for s, name, tensor, _ in moving])
    assert budget == {store.key: [store.budget_for(home), store.max_bytes, home.copies]}
    return ""


def _setup(copies: int = 2, max_bytes: int = 1000) -> tuple[SlotStore, WorkerSlots, Ranks]:
    ranks = Ranks(copies)
    return SlotStore(max_bytes), WorkerSlots("m", copies, ranks.call), ranks


def test_a_slot_sent_to_the_ranks_counts_each_copy_once_and_leaves_the_server() -> None:
    store, home, ranks = _setup()
    a, b = torch.arange(25, dtype=torch.float32), torch.ones(10)  # 100 and 40 bytes
    store.save("a", a)
    store.save("b", b)
    # Before the move 'a' is the server's: one rank's share of what is left.
    assert home.store(store.key) is None and store.budget_for(home) == (1000 - 140) // 2
    moving, _, why = home.outgoing({store.key: store}, {store.key: {"a"}})
    assert why == "" and [(name, len(blob) > 100) for _, name, _, blob in moving] == [("a", True)]
    drops, budget = home.settle({store.key: store}, moving)
    ranks.apply(drops, [(s.key, name, tensor) for s, name, tensor, _ in moving])
    assert store.homes() == {"a": home} and store.placed_on(home) == ["a"]
    assert store.total_bytes == 2 * 100 + 40  # each rank's copy counts
    # After it, 'a' is the ranks' (not also the server's): the budget the plan sends them.
    assert budget == {store.key: [(1000 - 40) // 2, 1000, 2]}
    assert all(torch.equal(t, a) for t in ranks.held(store.key, "a"))
    assert [(s.name, s.home) for s in store.describe()] == [("a", "model 'm''s vLLM workers"), ("b", "")]
    assert [name for name, _ in store.items()] == ["b"]


def test_a_slot_saved_again_while_its_copy_is_sent_is_freed_on_the_ranks_by_the_next_plan() -> None:
    store, home, ranks = _setup()
    old, new = torch.zeros(4), torch.full((4,), 7.0)
    store.save("a", old)
    moving, _, why = home.outgoing({store.key: store}, {store.key: {"a"}})
    assert why == "" and [name for _, name, _, _ in moving] == ["a"]
    store.save("a", new)  # saved again (another model's step) while the plan is made
    drops, _ = home.settle({store.key: store}, moving)
    ranks.apply(drops, [(s.key, name, tensor) for s, name, tensor, _ in moving])
    # The server's copy is the slot; the one sent is stale and is freed by the next plan
    # (had the frees been taken after the moves, this plan would have freed it before
    # storing it, and the stale copy would have stayed on the ranks for good).
    assert store.homes() == {} and torch.equal(store.read("a"), new)
    assert all(torch.equal(t, old) for t in ranks.held(store.key, "a"))
    assert _plan(store, home, ranks, set()) == ""
    assert ranks.held(store.key, "a") == [None, None] and all(r.held_bytes == 0 for r in ranks.ranks)


def test_a_slot_on_the_ranks_saved_in_the_server_frees_the_ranks_copy_and_a_save_there_keeps_it() -> None:
    store, home, ranks = _setup()
    store.save("a", torch.zeros(4))
    store.save("b", torch.zeros(2))
    assert _plan(store, home, ranks, {"a", "b"}) == ""
    assert sorted(store.homes()) == ["a", "b"]
    store.save("a", torch.ones(4))  # a step whose hooks ran in the server saved it
    store.save("b", torch.ones(2))
    assert store.homes() == {}
    # The ranks then save 'a' again in a step of theirs (the worker reports it: place):
    # the free asked for the old copy must not take the new one; 'b's still goes.
    home.keep(store.key, "a")
    for rank in ranks.ranks:
        rank.put(store.key, "a", torch.full((4,), 3.0))
    assert store.place("a", home, torch.float32, (4,), 16)
    assert home.take_drops() == [[store.key, ["b"]]]
    assert store.homes() == {"a": home} and store.total_bytes == 2 * 16 + 8


def test_what_cannot_go_to_the_ranks_is_named() -> None:
    store, home, ranks = _setup(copies=2, max_bytes=100)
    other = WorkerSlots("n", 1, Ranks(1).call)
    store.save("c", torch.zeros(2))
    assert _plan(store, other, Ranks(1), {"c"}) == ""  # 'c' lives on another model's ranks
    store.save("d", torch.zeros(14))  # 56 bytes: two copies and 'c' pass the bound of 100
    assert "'c' cannot come to the ranks" in _plan(store, home, ranks, {"c"})
    assert "'d' cannot come to the ranks" in _plan(store, home, ranks, {"d"})
    assert store.homes() == {"c": other} and ranks.held(store.key, "d") == [None, None]
    with pytest.raises(ResourceExhausted, match="max_slot_bytes"):
        store.save("e", torch.zeros(20))


def test_reading_a_slot_on_the_ranks_reads_the_first_rank_and_taking_it_back_frees_them() -> None:
    store, home, ranks = _setup()
    value = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    store.save("a", value)
    assert _plan(store, home, ranks, {"a"}) == ""
    ranks.ranks[1].put(store.key, "a", torch.zeros(2, 3))  # only the first rank's copy is read
    assert torch.equal(store.read("a"), value) and store.homes() == {"a": home}  # GetSlot: it stays there
    assert torch.equal(store.get("a"), value) and store.homes() == {}  # a patch in the server: it comes back
    assert store.total_bytes == 24 and home.take_drops() == [[store.key, ["a"]]]
    with pytest.raises(NotFound, match="no slot 'z'"):
        store.read("z")


def test_a_session_that_ends_frees_every_ranks_copy_at_once() -> None:
    store, home, ranks = _setup()
    store.save("a", torch.zeros(4))
    assert _plan(store, home, ranks, {"a"}) == ""
    store.clear()
    assert ranks.done.wait(30), "the ranks were not asked to free the session's slots"
    assert ranks.held(store.key, "a") == [None, None] and store.total_bytes == 0
    assert home.take_drops() == [[store.key, None]]  # and the next plan frees them again (idempotent)


def test_slots_on_ranks_that_went_away_are_lost_with_the_reason() -> None:
    store, home, ranks = _setup()
    store.save("a", torch.zeros(4))
    store.save("b", torch.zeros(1))
    assert _plan(store, home, ranks, {"a"}) == ""
    home.lost("worker 1 died")
    assert store.homes() == {} and store.total_bytes == 4 and store.get("a") is None
    with pytest.raises(NotFound, match="went away: worker 1 died"):
        home.read(store.key, "a")


def test_a_slot_without_a_wire_form_keeps_the_plan_from_sending_any() -> None:
    """The first store whose slot cannot be encoded refuses the whole plan's moves (the
    step's hooks then run in the server), naming the slot; nothing moved, nothing freed."""
    store, home, ranks = _setup()
    other = SlotStore(1000)
    store.save("a", torch.zeros(4))
    other.save("z", torch.zeros(2, dtype=torch.complex64))
    moving, refused, why = home.outgoing({store.key: store, other.key: other},
                                         {store.key: {"a"}, other.key: {"z"}})
    assert (moving, refused) == ([], other.key) and "slot 'z' cannot be sent to the ranks" in why and "wire" in why
    assert store.homes() == {} and other.homes() == {} and home.take_drops() == []
