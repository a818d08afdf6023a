"""A Generate call's mailbox (calls/generation.py): the worker thread puts each step's
events and its end ("step"); the stream takes them step by step. On vLLM a call's next step can
end before the stream took this one's messages (vLLM advances every request in each
step): what follows a step's end must wait for the next take, not be dropped."""

from __future__ import annotations

import asyncio

from hookwire.v1 import hook_pb2
from hookwire_server.calls.generation import _Mailbox, _messages


def _event(step: int, seq: int) -> hook_pb2.InterceptEvent:
    return hook_pb2.InterceptEvent(module=f"layer{seq}", step=step, seq=seq)


async def test_messages_of_a_step_that_ended_ahead_wait_for_the_next_take() -> None:
    mailbox = _Mailbox(asyncio.get_running_loop())
    for step in (0, 1, 2):  # three steps ended before the stream took anything
        for seq in (1, 2):
            mailbox.put(("event", _event(step, seq), None))
        mailbox.put(("step", step))
    seen = []
    for _ in range(3):
        items = await mailbox.take()
        assert items[-1][0] == "step"
        step_items = []
        for message in _messages(items, 1 << 20):
            events = [message.event] if message.HasField("event") else list(message.batch.events)
            step_items += [(e.step, e.seq) for e in events]
        seen.append((items[-1][1], step_items))
    assert seen == [(0, [(0, 1), (0, 2)]), (1, [(1, 1), (1, 2)]), (2, [(2, 1), (2, 2)])]
    assert await mailbox.take(timeout=0.01) == [], "nothing more came"


async def test_the_end_of_a_call_ends_a_take() -> None:
    """The engine ended the call (its failure, after the events it put): a take stops there."""
    mailbox = _Mailbox(asyncio.get_running_loop())
    failure = RuntimeError("the step failed")
    mailbox.put(("event", _event(0, 1), None))
    mailbox.put(("ended", failure))
    mailbox.put(("event", _event(1, 1), None))  # (nothing follows an end; a take stops there all the same)
    items = await mailbox.take()
    assert [item[0] for item in items] == ["event", "ended"] and items[-1][1] is failure
