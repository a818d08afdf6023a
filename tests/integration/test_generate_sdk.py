"""The SDK's Generate: a real server on loopback, the real SDK, and in-process transformers
``generate()`` on the same seeded tiny-lm (with real torch hooks) as the oracle, bit for bit."""

from __future__ import annotations

import asyncio
import gc
import os
import pathlib
import re
import subprocess
import sys
from typing import Any

import pytest
import torch
from google.protobuf import json_format

import hookwire
import lm_oracle as oracle
from hookwire import rules
from hookwire.v1 import hook_pb2
from support import LIVENESS, ServerThread, until

PROMPTS = ["Hello world, the model", "the"]
#: A liveness bound for waits that end on a condition, never a speed test.


def _generate_count(server: ServerThread) -> float:
    """Generate calls that have ended on the server (its Prometheus histogram's count)."""
    registry = server.server.metrics.registry
    return server.call(lambda: registry.get_sample_value("hookwire_generate_seconds_count", {"model": "tiny-lm", "front": "grpc"}) or 0.0)


def _generated_tokens(server: ServerThread) -> float:
    registry = server.server.metrics.registry
    return server.call(lambda: registry.get_sample_value("hookwire_generated_tokens_total", {"model": "tiny-lm"}) or 0.0)


async def test_model_info_says_which_models_generate(client: hookwire.Client) -> None:
    listed = {m.name: m for m in await client.list_models()}
    assert (listed["tiny-lm"].can_generate, listed["tiny-lm"].has_tokenizer) == (True, True)
    assert (listed["mlp"].can_generate, listed["mlp"].has_tokenizer) == (False, False)
    info = await client.model("tiny-lm").info()
    assert info.can_generate and info.has_tokenizer and info.modules


async def test_greedy_tokens_and_texts_equal_in_process_generate(client: hookwire.Client) -> None:
    model = client.model("tiny-lm")
    ids, mask = oracle.batch(PROMPTS)
    want = oracle.generate(ids, mask, 12, do_sample=False)
    stream = model.generate(PROMPTS, 12, do_sample=False)
    steps: list[hookwire.GeneratedTokens] = []
    async for item in stream:
        assert isinstance(item, hookwire.GeneratedTokens)  # no hooks: tokens only
        steps.append(item)
    result = await stream  # after the iteration: at once, from what was read
    assert torch.equal(result.input_ids, ids) and torch.equal(result.attention_mask, mask)
    assert [list(t) for t in result.token_ids] == want
    assert list(result.texts) == [oracle.text(t) for t in want]
    assert result.finish_reasons == tuple("eos" if t[-1] == oracle.EOS else "length" for t in want)
    assert result.do_sample is False and result.steps == len(steps) == max(len(t) for t in want)
    assert stream.request_id == result.request_id and result.request_id.startswith("req_")
    # The steps' tokens and text deltas add up to the result.
    for i, tokens in enumerate(want):
        assert [s.token_ids[i] for s in steps] == tokens + [hookwire.GeneratedTokens.FINISHED] * (len(steps) - len(tokens))
        assert "".join(s.texts[i] for s in steps) == result.texts[i]
    assert [s.step for s in steps] == list(range(len(steps)))
    # input_ids instead of texts: the same call.
    again = await model.generate(ids, 12, attention_mask=mask, do_sample=False)
    assert again.token_ids == result.token_ids and again.texts == result.texts
    alone = ids[1:, -int(mask[1].sum()):]  # "the" without its padding
    as_lists = await model.generate(alone.tolist(), 12, do_sample=False)
    assert torch.equal(as_lists.input_ids, alone)
    assert [list(t) for t in as_lists.token_ids] == oracle.generate(alone, torch.ones_like(alone), 12, do_sample=False)


async def test_stop_strings_end_sequences_as_in_process_generate(client: hookwire.Client) -> None:
    ids, mask = oracle.batch(PROMPTS)
    plain = oracle.generate(ids, mask, 10, do_sample=False)
    want = oracle.generate(ids, mask, 10, do_sample=False, stop_strings=[" have", " of"], tokenizer=oracle.tokenizer())
    assert all(len(w) < len(p) for w, p in zip(want, plain))  # the stop strings end both sequences early
    result = await client.model("tiny-lm").generate(PROMPTS, 10, do_sample=False, stop=[" have", " of"])
    assert [list(t) for t in result.token_ids] == want
    assert list(result.texts) == [oracle.text(t) for t in want]
    assert result.finish_reasons == ("stop", "stop") and all(t.endswith((" have", " of")) for t in result.texts)
    one = await client.model("tiny-lm").generate(PROMPTS[:1], 10, do_sample=False, stop=" have")  # a str is one string
    assert one.token_ids == result.token_ids[:1]


async def test_events_of_a_step_come_before_its_tokens_and_equal_in_process_hooks(client: hookwire.Client) -> None:
    layers = ("model.layers.0", "model.layers.1")
    ids, mask = oracle.batch(PROMPTS)
    with oracle.recording(*layers) as local:
        want = oracle.generate(ids, mask, 6, do_sample=False)
    stream = client.model("tiny-lm").generate(
        PROMPTS, 6, do_sample=False, hooks=[hookwire.HookSpec("model.layers.*", posthook=hookwire.capture("output"))]
    )
    order = []
    async for item in stream:
        if isinstance(item, hookwire.InterceptEvent):
            order.append(("event", item.step, item.module))
            assert item.request_id == stream.request_id and item.hook_id == stream.hook_ids[0]
            assert torch.equal(item.output, local[item.module][item.step]), (item.module, item.step)
        else:
            order.append(("tokens", item.step, ""))
    result = await stream
    assert [list(t) for t in result.token_ids] == want
    expected = []
    for step in range(result.steps):
        expected += [("event", step, layer) for layer in layers] + [("tokens", step, "")]
    assert order == expected
    # Step 0 saw the prompt, each later step one new token per sequence.
    assert result.events_by_step[0][0].output.shape == (2, ids.shape[1], 64)
    assert all(e.output.shape == (2, 1, 64) for step in result.events_by_step[1:] for e in step)


async def test_seeded_sampling_equals_in_process_generate(client: hookwire.Client) -> None:
    model = client.model("tiny-lm")
    ids, mask = oracle.batch(PROMPTS)
    settings = dict(do_sample=True, temperature=0.8, top_k=40, top_p=0.9)
    want = oracle.generate(ids, mask, 10, seed=1234, **settings)
    result = await model.generate(PROMPTS, 10, seed=1234, **settings)  # type: ignore[arg-type]
    assert [list(t) for t in result.token_ids] == want
    assert result.seed == 1234 and result.do_sample is True
    # Without a seed the server draws one and reports it: sending it back reproduces the call.
    drawn = await model.generate(PROMPTS, 10, do_sample=True)
    assert drawn.seed is not None
    assert (await model.generate(PROMPTS, 10, do_sample=True, seed=drawn.seed)).token_ids == drawn.token_ids
    assert [list(t) for t in drawn.token_ids] == oracle.generate(ids, mask, 10, seed=drawn.seed, do_sample=True)


async def test_events_are_grouped_by_step_and_hooks_fire_in_their_steps(client: hookwire.Client) -> None:
    new_tokens = hookwire.HookSpec("model.layers.0", posthook=hookwire.capture("output"), steps=(1, None))
    prompt_only = hookwire.HookSpec("model.layers.1", posthook=hookwire.capture("output"),
                                    steps=hookwire.StepRange(0, 0))
    middle = hookwire.HookSpec("model.norm", posthook=hookwire.capture("output"), steps=hookwire.StepRange(2, 3))
    result = await client.model("tiny-lm").generate(
        "Hello world", 6, do_sample=False, hooks=[new_tokens, prompt_only, middle]
    )
    assert result.steps == 6 and len(result.events_by_step) == 6
    a, b, c = result.hook_ids
    fired = [[e.hook_id for e in step] for step in result.events_by_step]
    assert fired == [[b], [a], [a, c], [a, c], [a], [a]]
    assert all(e.step == s for s, step in enumerate(result.events_by_step) for e in step)
    assert list(result.events) == [e for step in result.events_by_step for e in step]
    # keep_events=False: the events are yielded but not kept.
    stream = client.model("tiny-lm").generate("Hello world", 3, do_sample=False, hooks=[new_tokens], keep_events=False)
    seen = [item for item in [i async for i in stream] if isinstance(item, hookwire.InterceptEvent)]
    lean = await stream
    assert len(seen) == 2 and lean.events == () and lean.events_by_step == ((), (), ())


async def test_a_large_capture_arrives_in_chunks_and_is_reassembled_bit_identically(client: hookwire.Client) -> None:
    # 8 prompts of 320 tokens: up_proj's step-0 output is [8, 320, 128] float32, 1.25 MiB,
    # over one chunk (below 1 MiB at the smallest message limit the server accepts).
    ids = torch.randint(3, 357, (8, 320), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    path = "model.layers.0.mlp.up_proj"
    with oracle.recording(path) as local:
        want = oracle.generate(ids, mask, 2, do_sample=False)
    result = await client.model("tiny-lm").generate(
        ids, 2, do_sample=False, max_response_message_bytes=1024 * 1024,
        hooks=[hookwire.HookSpec(path, posthook=hookwire.capture("output"), steps=(0, 0))],
    )
    (event,) = result.events
    assert event.raw.output.tensor.chunk_id != 0, "the capture did not travel in chunks"
    assert event.output.numel() * 4 > 1024 * 1024 - 64 * 1024  # so more than one chunk
    assert event.output.dtype == torch.float32 and torch.equal(event.output, local[path][0])
    assert [list(t) for t in result.token_ids] == want


async def test_cancelling_stops_the_call_and_the_server_serves_other_calls(
    client: hookwire.Client, server: ServerThread
) -> None:
    model = client.model("tiny-lm")
    ended, tokens = _generate_count(server), _generated_tokens(server)
    stream = model.generate("Hello world", 500, do_sample=False)
    async for item in stream:
        assert isinstance(item, hookwire.GeneratedTokens) and item.step == 0
        break
    await stream.aclose()
    with pytest.raises(hookwire.CancelledError):
        await stream
    assert stream.done
    await until(lambda: _generate_count(server) == ended + 1, "the cancelled call to end on the server")
    assert _generated_tokens(server) - tokens < 500  # it stopped early, at a step boundary

    # Leaving `async with` cancels too, and so does cancelling the task that awaits the call.
    async with model.generate("Hello world", 500) as scoped:
        await scoped.start()
    with pytest.raises(hookwire.CancelledError):
        await scoped
    awaited = model.generate("Hello world", 500)
    await awaited.start()
    task = asyncio.ensure_future(awaited.result())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    with pytest.raises(hookwire.CancelledError):
        await awaited
    await until(lambda: _generate_count(server) == ended + 3, "the cancelled calls to end on the server")

    # The model is free: other calls run, and give what they should.
    ids, mask = oracle.batch(PROMPTS)
    result = await model.generate(PROMPTS, 4, do_sample=False)
    assert [list(t) for t in result.token_ids] == oracle.generate(ids, mask, 4, do_sample=False)
    out = await model.infer(ids, attention_mask=mask, use_cache=False)
    assert out.output["logits"].shape == (2, ids.shape[1], 357)


async def test_events_until_a_call_end_without_timeouts(client: hookwire.Client) -> None:
    model = client.model("tiny-lm")
    ids, mask = oracle.batch(PROMPTS)

    async def read(hook: hookwire.HookHandle, until: Any) -> list[hookwire.InterceptEvent]:
        return await asyncio.wait_for(_collect(hook.events(until=until)), LIVENESS)  # a hang guard

    async with model.hook("model.layers.*", posthook=hookwire.capture("output")) as hook:
        # An Infer call: one pass, the two layers' events, then its end.
        infer = await model.infer(ids, attention_mask=mask, use_cache=False)
        events = await read(hook, infer)
        assert [(e.request_id, e.module, e.step) for e in events] == [
            (infer.request_id, "model.layers.0", 0), (infer.request_id, "model.layers.1", 0)]

        # A Generate call: the session hook fires at every step.
        generated = await model.generate(PROMPTS, 3, do_sample=False)
        events = await read(hook, generated)
        assert {e.request_id for e in events} == {generated.request_id}
        assert [e.step for e in events] == [0, 0, 1, 1, 2, 2]
        assert events[0].output.shape == (2, ids.shape[1], 64)

        # While the call runs: the reader ends once its end arrives (by request id too).
        stream = model.generate(PROMPTS, 3, do_sample=False)
        await stream.start()
        reader = asyncio.ensure_future(read(hook, stream.request_id))
        await stream
        assert [e.step for e in await reader] == [0, 0, 1, 1, 2, 2]

        # Unread events of earlier calls come first; a call whose end was passed ends at once.
        first = await model.infer(ids, use_cache=False)
        second = await model.infer(ids, use_cache=False)
        events = await read(hook, second)
        assert [e.request_id for e in events] == [first.request_id] * 2 + [second.request_id] * 2
        assert await read(hook, first) == []

        # A session hook with a step range: its events, then the end of the call.
        async with model.hook("model.norm", posthook=hookwire.capture("output"), steps=(1, 2)) as late:
            generated = await model.generate(PROMPTS, 4, do_sample=False)
            assert [(e.step, e.request_id) for e in await read(late, generated)] == [
                (1, generated.request_id), (2, generated.request_id)]
            assert [e.step for e in await read(hook, generated)] == [0, 0, 1, 1, 2, 2, 3, 3]

        # A subscription stream carries the markers too.
        async with client.subscribe([hook.id]) as sub:
            third = await model.infer(ids, use_cache=False)
            events = await asyncio.wait_for(_collect(sub.events(until=third)), LIVENESS)
            assert [e.request_id for e in events] == [third.request_id] * 2

    with pytest.raises(ValueError, match="has not started"):
        hook.events(until=model.generate("x", 1))
    with pytest.raises(TypeError, match="until"):
        hook.events(until=42)  # type: ignore[arg-type]


async def _collect(events: Any) -> list[hookwire.InterceptEvent]:
    return [e async for e in events]


async def test_rules_on_steps_steer_exactly_as_an_in_process_hook(client: hookwire.Client) -> None:
    vector = torch.randn(64, generator=torch.Generator().manual_seed(1)) * 4
    ids, mask = oracle.batch(PROMPTS)
    with oracle.forward_hook("model.layers.0", lambda step, out: out + vector if step >= 1 else None):
        want = oracle.generate(ids, mask, 8, do_sample=False)
    plain = oracle.generate(ids, mask, 8, do_sample=False)
    assert want != plain  # the vector changes the text, so the comparison means something
    spec = hookwire.HookSpec("model.layers.0", posthook=[rules.add("output", vector)], steps=(1, None))
    result = await client.model("tiny-lm").generate(PROMPTS, 8, do_sample=False, hooks=[spec])
    assert [list(t) for t in result.token_ids] == want
    # The same spec in its wire form (as `hookwire generate --hook FILE` reads it from JSON).
    wire = json_format.Parse(json_format.MessageToJson(spec.to_proto()), hook_pb2.HookSpec())
    again = await client.model("tiny-lm").generate(PROMPTS, 8, do_sample=False, hooks=[wire])
    assert again.token_ids == result.token_ids


async def test_notices_about_the_calls_hooks_are_collected(client: hookwire.Client) -> None:
    ids, mask = oracle.batch(PROMPTS)
    # A module whose width is not known at registration (an activation): the wrong-width
    # operand fails when the hook fires (a decoder layer's would be refused at registration).
    broken = hookwire.HookSpec("model.layers.0.mlp.act_fn", posthook=[rules.add("output", torch.ones(3))],
                               on_error="disable_hook")
    stream = client.model("tiny-lm").generate(PROMPTS, 3, do_sample=False, hooks=[broken])
    items = [item async for item in stream]
    result = await stream
    assert all(isinstance(item, hookwire.GeneratedTokens) for item in items)  # notices are not yielded
    (notice,) = result.notices
    assert notice.kind == "hook_disabled" and notice.hook_id == result.hook_ids[0]
    assert stream.notices == [notice]
    # The failing firing changed nothing, and the hook did not fire again.
    assert [list(t) for t in result.token_ids] == oracle.generate(ids, mask, 3, do_sample=False)


async def test_bad_arguments_and_errors(client: hookwire.Client) -> None:
    model = client.model("tiny-lm")
    with pytest.raises(ValueError, match="last"):
        hookwire.HookSpec("model.layers.0", steps=(2, 1))
    with pytest.raises(ValueError, match="first"):
        hookwire.StepRange(-1)
    with pytest.raises(TypeError, match="StepRange"):
        hookwire.HookSpec("model.layers.0", steps=[1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate("hi", 0)
    with pytest.raises(ValueError, match="attention_mask"):
        model.generate("hi", 2, attention_mask=torch.ones(1, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="no prompt"):
        model.generate([], 2)
    with pytest.raises(TypeError, match="integer token ids"):
        model.generate([[1.5, 2.0]], 2)
    # The server's errors, mapped, where the stream is read.
    with pytest.raises(hookwire.UnimplementedError, match="'mlp' cannot generate"):
        await client.model("mlp").generate("hi", 2)
    with pytest.raises(hookwire.NotFoundError):
        await client.model("nope").generate("hi", 2)
    with pytest.raises(hookwire.InvalidArgumentError, match="temperature"):
        await model.generate("hi", 2, do_sample=True, temperature=-1.0)
    failing = model.generate("hi", 2, hooks=[hookwire.HookSpec("model.layers.0", posthook=[rules.add("output", torch.ones(3))])])
    with pytest.raises(hookwire.InvalidArgumentError):
        await failing
    with pytest.raises(hookwire.InvalidArgumentError):  # the same error again, without a new call
        await failing


def test_the_readme_generation_example_runs(server: ServerThread) -> None:
    readme = pathlib.Path(__file__).resolve().parents[2] / "README.md"
    section = readme.read_text().split("## Generation (Python SDK)", 1)[1]
    (block,) = re.findall(r"```python\n(.*?)```", section.split("\n## ", 1)[0], flags=re.S)
    proc = subprocess.run([sys.executable, "-c", block], env={**os.environ, "HOOKWIRE_TARGET": server.target},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    ids, mask = oracle.batch(["Once upon a time"])
    (greedy,) = oracle.generate(ids, mask, 16, do_sample=False)
    assert lines[0] == f"{oracle.text(greedy)!r} {'eos' if greedy[-1] == oracle.EOS else 'length'}"
    assert lines[-1].endswith("[2, 2, 2, 2, 2, 2, 2, 2]")  # both layers' events at each of the 8 steps


async def test_a_generate_stream_dropped_unread_no_longer_counts_as_its_sessions_own_call(server: ServerThread) -> None:
    # Left with `break` and never closed, then dropped: the session stream must meet
    # back-pressure again (its "block" bound holds), not be read past it for good.
    options = hookwire.ConnectOptions(session_policy="block")
    async with hookwire.connect(server.target, options=options) as client:
        session = await client.session()
        stream = client.model("tiny-lm").generate(torch.tensor([[1, 2, 3]]), 20)
        async for _ in stream:
            break
        assert session.router.own_calls == 1
        del stream

        def collected() -> bool:
            gc.collect()
            return session.router.own_calls == 0

        await until(collected, "the dropped stream's count given back")


async def test_stream_interval_sends_steps_together_after_their_events_and_the_sdk_yields_each(
        client: hookwire.Client) -> None:
    """GenerateRequest.stream_interval N: step 0's tokens alone, as soon as it ends (time to
    first token unchanged), then the tokens of N steps in one `steps` message (the last
    group shorter), each group after the events of its steps; the SDK hands out one
    GeneratedTokens per step, the same tokens and texts as without; over the limit,
    INVALID_ARGUMENT naming the field and the limit."""
    from hookwire.v1 import model_service_pb2

    model = client.model("tiny-lm")
    hooks = [hookwire.HookSpec("model.layers.0", posthook=hookwire.capture("output", select="[:, -1]"))]
    plain = [item async for item in model.generate(PROMPTS, 7, do_sample=False, hooks=hooks)]
    grouped = [item async for item in model.generate(PROMPTS, 7, do_sample=False, hooks=hooks, stream_interval=3)]
    assert [(type(i).__name__, i.step) for i in plain] == [(kind, s) for s in range(7)
                                                            for kind in ("InterceptEvent", "GeneratedTokens")]
    groups = [range(0, 1), range(1, 4), range(4, 7)]  # each group's events, then its steps' tokens
    assert [(type(i).__name__, i.step) for i in grouped] == [(kind, s) for g in groups
                                                              for kind in ("InterceptEvent", "GeneratedTokens")
                                                              for s in g]
    tokens = [(i.token_ids, i.texts) for i in plain if isinstance(i, hookwire.GeneratedTokens)]
    assert [(i.token_ids, i.texts) for i in grouped if isinstance(i, hookwire.GeneratedTokens)] == tokens

    request = model_service_pb2.GenerateRequest(model="tiny-lm", prompts=PROMPTS, max_new_tokens=7, do_sample=False,
                                                stream_interval=3, hooks=[h.to_proto() for h in hooks])
    seen: list[tuple[str, list[int]]] = []
    async for msg in client.model_stub.Generate(request):
        kind = msg.WhichOneof("kind")
        if kind == "steps":
            seen.append(("steps", [t.step for t in msg.steps.steps]))
        elif kind == "tokens":
            seen.append(("tokens", [msg.tokens.step]))
        elif kind in ("event", "batch"):
            events = [msg.event] if kind == "event" else list(msg.batch.events)
            seen += [("event", [e.step]) for e in events]
        else:
            assert kind in ("started", "done"), kind
    assert seen == [("event", [0]), ("tokens", [0]),
                    ("event", [1]), ("event", [2]), ("event", [3]), ("steps", [1, 2, 3]),
                    ("event", [4]), ("event", [5]), ("event", [6]), ("steps", [4, 5, 6])]

    limit = 64  # Limits.max_stream_interval's default
    with pytest.raises(hookwire.InvalidArgumentError, match=rf"^INVALID_ARGUMENT: stream_interval: {limit + 1} steps a message, "
                                                            rf"over the limit of {limit} \(max_stream_interval\)"):
        await model.generate(PROMPTS, 2, stream_interval=limit + 1)
    with pytest.raises(ValueError, match="stream_interval must be an integer >= 0"):
        model.generate(PROMPTS, 2, stream_interval=-1)


async def test_a_call_that_fails_mid_group_first_sends_the_steps_it_holds(client: hookwire.Client) -> None:
    """stream_interval 4, a rule that fails its call at step 3 (an index past a decoding
    step's one position, on_error fail_call): steps 1 and 2, held for their group, arrive
    before the call's error, as they would have one by one."""
    from hookwire.v1 import model_service_pb2

    bad = hookwire.HookSpec("model.layers.0", posthook=[rules.scale("output", 2.0, index="[:, 3]")],
                            on_error="fail_call", steps=(3, None))
    request = model_service_pb2.GenerateRequest(model="tiny-lm", prompts=PROMPTS, max_new_tokens=8, do_sample=False,
                                                stream_interval=4, hooks=[bad.to_proto()])
    got: list[tuple[str, list[int]]] = []
    with pytest.raises(Exception) as info:
        async for msg in client.model_stub.Generate(request):
            kind = msg.WhichOneof("kind")
            if kind == "tokens":
                got.append(("tokens", [msg.tokens.step]))
            elif kind == "steps":
                got.append(("steps", [t.step for t in msg.steps.steps]))
    assert "INVALID_ARGUMENT" in str(info.value) or "invalid" in str(info.value).lower(), info.value
    assert got == [("tokens", [0]), ("steps", [1, 2])]
