"""Compact readout stacks (hooks.compact): what stacks together, and how."""

from __future__ import annotations

from typing import Any

import torch

from hookwire._types import InterceptEvent
from hookwire.v1 import hook_pb2
from hookwire.wire import codec
from hookwire_server.hooks import compact

OUT = hook_pb2.PART_OUTPUT


def _items(value: Any) -> list[tuple[Any, ...]]:
    return [(OUT, "output", None, value)]


def test_readouts_of_equal_layout_stack_and_others_do_not() -> None:
    a, b = torch.ones(2, 3), torch.zeros(2, 3)
    assert compact.layout(_items(a)) == compact.layout(_items(b))
    assert compact.layout(_items(a)) != compact.layout(_items(torch.ones(2, 4)))  # shape
    assert compact.layout(_items(a)) != compact.layout(_items(a.half()))  # dtype
    lens = {"token_ids": torch.zeros(2, 5, dtype=torch.int64), "logits": torch.zeros(2, 5)}
    assert compact.layout(_items(lens)) != compact.layout(_items({**lens, "logits": torch.zeros(2, 4)}))
    assert compact.layout(_items((a, None))) != compact.layout(_items((a, 1)))


def test_a_stack_puts_each_module_along_a_new_first_dimension_and_the_sdk_takes_it_apart() -> None:
    lens = [{"token_ids": torch.full((1, 2, 3), i), "logits": torch.rand(1, 2, 3)} for i in range(3)]
    stack = compact.Stack(record=None, action=None, p=None, call_index=0, training=False, fired=None,
                          indices=[4, 0, 2], items=[_items(v) for v in lens])
    ((part, field, key, value),) = stack.stacked()
    assert (part, field, key) == (OUT, "output", None)
    assert value["token_ids"].shape == (3, 1, 2, 3)
    msg = hook_pb2.InterceptEvent(request_hook_index=1, module_indices=[4, 0, 2], seq=7, dropped=2)
    codec.encode_value_into(value, msg.output)
    events = InterceptEvent.expand(msg, modules=["m0", "m1", "m2", "m3"])
    assert [e.module for e in events] == ["#4", "m0", "m2"]  # one the SDK cannot name: by its index
    assert {e.seq for e in events} == {7}
    assert [e.dropped for e in events] == [2, 0, 0]  # the drops in front of the wire event, counted once
    for event, want in zip(events, lens):
        assert torch.equal(event.output["token_ids"], want["token_ids"])
        assert torch.equal(event.output["logits"], want["logits"])
