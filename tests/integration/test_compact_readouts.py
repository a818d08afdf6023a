"""Compact readout events (Readout.compact, issue 25's readout bytes): one event per pass
for all of a hook's modules, their readouts stacked, which the SDK expands into the
per-module events the same hook without ``compact`` sends. Checked against those events
(which test_rules_expressive.py checks against the computation in process), in Generate
and Infer, for request-scoped, session and subscribed hooks, and in a pass shared by
two callers; and the bytes on the wire."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

import hookwire
import lm_oracle as oracle
from hookwire import rules
from hookwire.rules import Sae

G = torch.Generator().manual_seed(2604)
PROBES = torch.randn(3, 64, generator=G)
W_ENC, W_DEC = torch.randn(64, 32, generator=G), torch.randn(32, 64, generator=G)
LAYERS = "model.layers.*"


def _readouts(compact: bool) -> dict[str, rules.Readout]:
    sae = Sae.of(W_ENC, torch.zeros(32), W_DEC, torch.zeros(64))
    return {"probe": rules.probe_scores(PROBES, torch.tensor([0.1, 0.2, 0.3]), sigmoid=True, compact=compact),
            "lens": rules.logit_lens(5, compact=compact), "sae": rules.sae_top_k(sae, 3, compact=compact)}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return torch.equal(a, b)


def _key(event: hookwire.InterceptEvent) -> tuple[Any, ...]:
    return (event.step, event.module, event.call_index, event.phase)


def _wire_bytes(events: Any) -> int:
    """Bytes of the distinct wire events (the events one compact event expands into share it)."""
    return sum(raw.ByteSize() for raw in {id(e.raw): e.raw for e in events}.values())


@pytest.mark.parametrize("name", ["probe", "lens", "sae"])
async def test_compact_readouts_in_generate_expand_into_the_per_module_events(client, name: str) -> None:
    prompts = ["the cat sat", "a"]
    model = client.model("tiny-lm")
    plain = await model.generate(prompts, 4, do_sample=False, hooks=[
        hookwire.HookSpec(LAYERS, posthook=hookwire.capture("output", readout=_readouts(False)[name]))])
    compact = await model.generate(prompts, 4, do_sample=False, hooks=[
        hookwire.HookSpec(LAYERS, posthook=hookwire.capture("output", readout=_readouts(True)[name]))])
    assert compact.token_ids == plain.token_ids
    assert [_key(e) for e in compact.events] == [_key(e) for e in plain.events]  # firing order within each pass
    for mine, theirs in zip(compact.events, plain.events):
        assert _same(mine.output, theirs.output), (mine.module, mine.step)
        assert (mine.hook_id, mine.model, mine.request_id) == (compact.hook_ids[0], "tiny-lm", compact.request_id)
        assert mine.request_hook_index == 1 and mine.devices == theirs.devices
    raws = list({id(e.raw): e.raw for e in compact.events}.values())
    assert len(raws) == compact.steps  # one event per pass
    for raw in raws:
        assert list(raw.module_indices) == [0, 1] and raw.module == ""
        assert raw.hook_id == raw.request_id == raw.model == "" and raw.HasField("time")  # the call says them
    assert [raw.seq for raw in raws] == list(range(1, len(raws) + 1))
    assert _wire_bytes(compact.events) < _wire_bytes(plain.events)


async def test_compact_readouts_in_infer_and_their_modules_in_the_response(client) -> None:
    ids, mask = oracle.batch(["the cat sat on", "a dog"])
    model = client.model("tiny-lm")
    kwargs = {"input_ids": ids, "attention_mask": mask}
    plain = await model.infer(hooks=[hookwire.HookSpec(LAYERS, posthook=hookwire.capture(
        "output", readout=rules.probe_scores(PROBES)))], **kwargs)
    compact = await model.infer(hooks=[
        hookwire.HookSpec("model.layers.0", posthook=hookwire.capture("output", readout=rules.logit_lens(2))),
        hookwire.HookSpec(LAYERS, posthook=hookwire.capture("output", readout=rules.probe_scores(PROBES, compact=True)))],
        **kwargs)
    assert [tuple(m.modules) for m in compact.raw.hook_modules] == [(), ("model.layers.0", "model.layers.1")]
    assert not plain.raw.hook_modules  # no compact hook: nothing listed
    mine = [e for e in compact.events if e.request_hook_index == 2]
    assert [e.module for e in mine] == [e.module for e in plain.events] == ["model.layers.0", "model.layers.1"]
    assert all(torch.equal(a.output, b.output) for a, b in zip(mine, plain.events))
    assert {e.hook_id for e in mine} == {compact.hook_ids[1]} and {e.request_id for e in mine} == {compact.request_id}
    # The per-module event of the other hook fired first; the compact one leaves when the pass ends.
    assert [e.request_hook_index for e in compact.events] == [1, 2, 2]


async def test_compact_readouts_of_a_session_hook_name_their_hook_and_call(client) -> None:
    ids, mask = oracle.batch(["the cat"])
    model = client.model("tiny-lm")
    async with await model.hook(LAYERS, posthook=hookwire.capture(
            "output", readout=rules.probe_scores(PROBES, compact=True))) as hook:
        result = await model.infer(input_ids=ids, attention_mask=mask, use_session=True)
        events = [e async for e in hook.events(until=result)]
    assert [e.module for e in events] == ["model.layers.0", "model.layers.1"]
    assert {e.hook_id for e in events} == {hook.id} and {e.request_id for e in events} == {result.request_id}
    assert events[0].raw is events[1].raw and events[0].raw.hook_id == hook.id  # a session stream keeps the fields
    with oracle.recording("model.layers.0", "model.layers.1") as local, torch.no_grad():
        oracle.model()(input_ids=ids, attention_mask=mask)
    for event in events:
        assert torch.equal(event.output, local[event.module][0] @ PROBES.T)


async def test_a_subscriber_gets_the_modules_of_compact_events_from_the_listing(client) -> None:
    ids, mask = oracle.batch(["the cat"])
    spec = hookwire.HookSpec(LAYERS, scope="all", ttl_seconds=60, posthook=hookwire.capture(
        "output", readout=rules.probe_scores(PROBES, compact=True)))
    handle = await client.register_hook(spec, model="tiny-lm")
    try:
        async with client.subscribe([handle.id]) as sub:  # by id: the SDK lists the hook's modules
            result = await client.model("tiny-lm").infer(input_ids=ids, attention_mask=mask)
            events = [e async for e in sub.events(until=result)]
        assert [e.module for e in events] == ["model.layers.0", "model.layers.1"]
        assert all(e.output.shape == (1, ids.shape[1], 3) for e in events)
    finally:
        await handle.remove()


async def test_in_a_shared_pass_each_caller_gets_its_own_rows(client, other_client) -> None:
    """Two callers' Infer calls batched into one pass (tiny-lm batches): each compact
    event holds only its own call's rows, equal to the call alone."""
    prompts = [["the cat sat"], ["a dog ran far away"]]
    spec = hookwire.HookSpec(LAYERS, posthook=hookwire.capture("output", readout=rules.probe_scores(PROBES, compact=True)))
    alone = []
    for p in prompts:
        ids, mask = oracle.batch(p)
        alone.append(await client.model("tiny-lm").infer(input_ids=ids, attention_mask=mask, hooks=[spec]))
    for _ in range(3):
        together = await asyncio.gather(*(
            c.model("tiny-lm").infer(input_ids=oracle.batch(p)[0], attention_mask=oracle.batch(p)[1], hooks=[spec])
            for c, p in zip((client, other_client), prompts)))
        for mine, solo in zip(together, alone):
            assert [e.module for e in mine.events] == [e.module for e in solo.events]
            for a, b in zip(mine.events, solo.events):  # a batched matmul may round differently
                assert a.output.shape == b.output.shape
                torch.testing.assert_close(a.output, b.output, rtol=1e-5, atol=1e-5)


async def test_a_reader_that_stops_inside_a_compact_event_gets_the_rest_next_time(client) -> None:
    ids, mask = oracle.batch(["the cat"])
    model = client.model("tiny-lm")
    async with await model.hook(LAYERS, posthook=hookwire.capture(
            "output", readout=rules.probe_scores(PROBES, compact=True))) as hook:
        result = await model.infer(input_ids=ids, attention_mask=mask, use_session=True)
        async for first in hook.events():
            break
        rest = [e async for e in hook.events(until=result)]
    assert [e.module for e in [first, *rest]] == ["model.layers.0", "model.layers.1"]
    assert [first.dropped, rest[0].dropped] == [0, 0] and first.seq == rest[0].seq


async def test_a_hook_disabled_mid_pass_sends_its_readouts_so_far_then_its_notice(client) -> None:
    """A probe of width 64 on the attention projections: q_proj (64 wide) reads, k_proj
    (32 wide) fails and disables the hook; q_proj's compact readout still arrives, as its
    per-module event would have, before the notice."""
    ids, mask = oracle.batch(["the cat"])
    model = client.model("tiny-lm")
    for compact in (False, True):
        async with await model.hook("model.layers.0.self_attn.*_proj", posthook=hookwire.capture(
                "output", readout=rules.probe_scores(PROBES, compact=compact))) as hook:
            result = await model.infer(input_ids=ids, attention_mask=mask, use_session=True)
            events = [e async for e in hook.events(until=result)]
            (info,) = [h for h in await client.list_hooks() if h.hook_id == hook.id]
        assert [e.module for e in events] == ["model.layers.0.self_attn.q_proj"], compact
        assert info.disabled_reason and "could not capture" in info.disabled_reason
