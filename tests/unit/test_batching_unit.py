"""Unit tests of batching.py: join keys read from requests, padding, cutting a batch's
tensors per call and putting rule edits back."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hookwire.wire import codec
from hookwire.v1 import hook_service_pb2, model_service_pb2
from hookwire_server.engine import batching
from hookwire_server.engine import decoding
from hookwire_server.engine.batching import Batch, Segment, Unsplittable
from hookwire_server.engine.seam import GenerateCall, GenerateOptions, Running, StepResult
from hookwire_server.models.batch_settings import BatchSettings
from hookwire_server.hooks.event_bus import HeldBytes
from hookwire_server.hooks.passes import Pass
from support import build_test_registry


def _request(*args: object, **kwargs: object) -> model_service_pb2.InferRequest:
    request = model_service_pb2.InferRequest(model="m")
    for value in args:
        request.args.append(codec.encode_value(value))
    for key, value in kwargs.items():
        request.kwargs[key].CopyFrom(codec.encode_value(value))
    return request


def test_equal_shapes_share_a_key_and_rows_are_counted() -> None:
    settings = BatchSettings()
    a = batching.request_key(_request(torch.zeros(2, 8)), settings)
    b = batching.request_key(_request(torch.ones(5, 8)), settings)
    c = batching.request_key(_request(torch.ones(5, 9)), settings)
    assert a is not None and b is not None and c is not None
    assert a.key == b.key and (a.rows, b.rows) == (2, 5)
    assert c.key != a.key
    assert batching.request_key(_request(torch.zeros(2, 8, dtype=torch.float64)), settings).key != a.key  # type: ignore[union-attr]


def test_what_runs_alone() -> None:
    settings = BatchSettings()
    assert batching.request_key(_request([torch.zeros(1, 2)]), settings) is None  # a list
    assert batching.request_key(_request(torch.zeros(1, 2), labels=torch.zeros(1)), settings) is None  # reduces rows
    assert batching.request_key(_request(torch.zeros(1, 2), torch.zeros(3, 2)), settings) is None  # rows differ
    assert batching.request_key(_request(torch.tensor(1.0)), settings) is None  # no batch dimension
    assert batching.request_key(_request(torch.zeros(1, 2), flag=True), settings) != batching.request_key(
        _request(torch.zeros(1, 2), flag=False), settings)  # scalars must be equal


def test_token_inputs_of_different_lengths_join_only_with_a_pad_token() -> None:
    ids = lambda n: torch.ones(1, n, dtype=torch.int64)  # noqa: E731
    plain = BatchSettings()
    padded = BatchSettings(pad_token_id=0)
    short = _request(input_ids=ids(3), attention_mask=ids(3))
    long = _request(input_ids=ids(7), attention_mask=ids(7))
    assert batching.request_key(short, plain).key != batching.request_key(long, plain).key  # type: ignore[union-attr]
    a, b = batching.request_key(short, padded), batching.request_key(long, padded)
    assert a is not None and b is not None and a.key == b.key and (a.length, b.length) == (3, 7)


def test_padded_length_avoids_model_dimensions() -> None:
    assert batching.padded_length([3, 5], frozenset({5, 6, 8}), None) == 7
    assert batching.padded_length([3, 5], frozenset({5, 6}), 6) is None
    assert batching.padded_length([4, 4], frozenset(), None) == 4


def test_join_pads_on_the_right() -> None:
    calls = [([torch.tensor([[5, 6]])], {"attention_mask": torch.tensor([[1, 1]])}),
             ([torch.tensor([[7, 8, 9]])], {"attention_mask": torch.tensor([[1, 1, 1]])})]
    args, kwargs = batching.join_inputs(calls, [2, 3], dim=0, padded=4, pad_token_id=0)
    assert args[0].tolist() == [[5, 6, 0, 0], [7, 8, 9, 0]]
    assert kwargs["attention_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 0]]


def _batch(padded: int | None = None, side: str = "right") -> Batch:
    p1, p2 = Pass("r1", ""), Pass("r2", "")
    return Batch([Segment(p1, 0, 2, 3 if padded else None), Segment(p2, 2, 3, padded)], padded=padded, side=side)


def test_take_cuts_rows_and_own_length() -> None:
    x = torch.arange(3 * 5 * 2).reshape(3, 5, 2)
    batch = _batch(padded=5)
    first = batch.take({"out": (x, None)}, batch.segments[0], "here")
    assert torch.equal(first["out"][0], x[0:2, 0:3])
    assert first["out"][1] is None
    assert torch.equal(batch.take(x, batch.segments[1], "here"), x[2:3])
    left = _batch(padded=5, side="left")
    assert torch.equal(left.take(x, left.segments[0], "here"), x[0:2, 2:5])


def test_take_refuses_a_tensor_without_the_batch_rows() -> None:
    batch = _batch()
    with pytest.raises(Unsplittable, match="cannot be split per call"):
        batch.take(torch.zeros(4, 2), batch.segments[0], "module 'x'")


def test_put_writes_only_the_changed_rows_and_clones_once() -> None:
    x = torch.zeros(3, 4)
    batch = _batch()
    cloned: set[int] = set()
    parts = (x, "label")
    seg = batch.segments[1]
    before = batch.take(parts, seg, "w")
    after = (before[0] + 1, "label")
    merged = batch.put(parts, before, after, seg, "w", cloned)
    assert merged[0] is not x and torch.equal(x, torch.zeros(3, 4))  # out of place, as rules are
    assert merged[0][2].tolist() == [1.0] * 4 and merged[0][:2].abs().sum() == 0
    seg0 = batch.segments[0]
    before0 = batch.take(merged, seg0, "w")
    again = batch.put(merged, before0, (before0[0] - 1, "label"), seg0, "w", cloned)
    assert again[0] is merged[0]  # already a clone of this firing: written in place
    unchanged = batch.put(parts, before, before, seg, "w", set())
    assert unchanged[0] is x


# ------------------------------------------------------------------ a shared step's delivery failing one call


class _FullStream:
    """A stream that blocks for the call and is full: it takes no event without waiting."""

    def put_event(self, *args: Any, wait: bool = True, **kwargs: Any) -> bool | None:
        return None if not wait else False

    def put_call_ended(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def wake_producers(self) -> None:
        pass


class _KeepsTooMuch(Pass):
    """A call whose hook, in a shared pass, emitted one event for a full stream, over its budget."""

    def hold(self) -> None:
        super().hold()
        assert self._held is not None
        self._held.append(("stream", _FullStream(), hook_service_pb2.SessionMessage(), "h1", 1000, {}))


def _call(p: Pass) -> GenerateCall:
    """A new Generate call of one prompt (started by its first step)."""
    ids = torch.tensor([[1, 5, 6, 7]])
    options = GenerateOptions(max_new_tokens=8, overrides={}, seed=0, stop=())
    return GenerateCall(p, [], ids, torch.ones_like(ids), options, None, put=lambda item: None)


def test_a_call_over_its_byte_limit_in_a_shared_step_fails_alone() -> None:
    """Delivering a shared Generate step's held events puts one call over its principal's
    byte limit: only that call fails; the others' steps ran once (not again alone)."""
    host = build_test_registry().get("tiny-lm")
    bob = _call(Pass("bob", "", principal="bob", model="tiny-lm"))
    alice_p = _KeepsTooMuch("alice", "", principal="alice", model="tiny-lm")
    alice_p.held_bytes = HeldBytes(limit=10, buffers=lambda principal: 0)
    alice = _call(alice_p)
    for call in (bob, alice):  # the starts and prefills, alone
        decoding._run_step(host, call)
    assert bob.step == alice.step == 1
    results = decoding.run_step_batch(host, [bob, alice])  # one shared step
    assert bob.decoder.step_index == 2 and len(bob.decoder.tokens[0]) == 2, bob.decoder.tokens
    assert bob.step == 2 and alice.step == 1, "a failed step is not counted"
    assert isinstance(results[0], StepResult), results[0]
    assert isinstance(results[1], Exception) and "max_buffered_bytes_per_principal" in str(results[1])


class _FinishFails(Pass):
    """A call whose end fails (delivering its CallEnded markers raises)."""

    def finish(self, *, end: bool = True) -> None:
        raise RuntimeError("delivering the CallEnded markers failed")


def test_a_call_whose_end_fails_leaves_the_other_calls_of_its_plan_running() -> None:
    """One call's finish failing in a plan must not fail the plan: the other call's step
    is reported (it goes on), and the failing call's KV cache is freed all the same."""
    host = build_test_registry().get("tiny-lm")
    a = _call(_FinishFails("a", "", principal="a", model="tiny-lm"))
    b = _call(Pass("b", "", principal="b", model="tiny-lm"))
    for call in (a, b):
        decoding._run_step(host, call)
    a.ended = "cancelled"
    results = decoding.run_calls(host, [a, b])
    assert results[0] is None, results
    assert isinstance(results[1], Running), results
    assert b.step == 2 and b.decoder.model_kwargs is not None
    assert a.decoder.model_kwargs is None, "the ended call's KV cache was freed"
