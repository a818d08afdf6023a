"""hookwire on vLLM in worker processes, tensor parallel 2 (one core per rank): vLLM's
engine and its two workers run in processes of their own; the workers tap the modules
the server's hooks are on and the hooks, rules and events stay in the server
(engine/vllm_worker.py, engine/vllm_link.py). Checked from outside with real clients
against transformers in process, as the in-process tests are; the suite's one
multi-process engine (its start-up is the issue's bound: one multi-process test).

Tolerance: under tensor parallel each rank computes half of every projection and vLLM
adds the halves (an all-reduce), an order transformers' eager code does not have:
measured on this model, the largest difference of a decoder layer's output is below
3e-7 on values up to 0.22; the bound leaves a margin. Greedy tokens are compared exactly.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
from typing import Any, Iterator

import pytest
import torch

import hookwire
from hookwire import HookSpec, capture, rules

from conftest import MODES, mode_settings
from test_vllm_engine import (PROMPTS, _greedy, _ids, check_stops, oracle_tokenizer, scaled_save_and_patch, stop_case,
                              token_gated_tokens)

TOL = dict(rtol=1e-5, atol=5e-6)


#: The compiled engine's tap points here: the defaults' modules and the attention's and
#: MLP's projections (a test hooks qkv_proj), as globs.
TP_TAP_POINTS = ["model.embed_tokens", "model.layers.*", "model.layers.*.self_attn", "model.layers.*.self_attn.*_proj",
                 "model.layers.*.mlp", "model.norm"]


@pytest.fixture(scope="module", params=MODES)
def tp_server(request: pytest.FixtureRequest, llama_folder: pathlib.Path) -> Iterator[Any]:
    """A real server whose model "llama-tp" runs on vLLM in worker processes, tensor
    parallel 2, parameters readable; eager or compiled (``MODES``: each test runs in
    both), compiled with tap points of its own (``TP_TAP_POINTS``)."""
    from hookwire_server import ModelRegistry, ServerSettings
    from hookwire_server.engine.core import build_host
    from hookwire_server.models.model_loading import ModelConfig
    from support import ServerThread

    host = build_host(ModelConfig(
        name="llama-tp", transformers=str(llama_folder), engine="vllm", parameters_readable=True,
        vllm={"max_model_len": 128, "max_num_seqs": 8, "kv_cache_bytes": 32 << 20, "tensor_parallel_size": 2,
              **mode_settings(request.param, TP_TAP_POINTS)},
    ))
    # 16 KiB of slots per session: each of the two ranks' copies of a slot counts.
    srv = ServerThread(ModelRegistry([host]), ServerSettings(port=0, max_slot_bytes=16 << 10)).start()
    srv.host = host
    yield srv
    srv.stop()


async def test_captures_rules_and_concurrent_callers_across_worker_processes(tp_server, oracle) -> None:
    """In one go (each generate costs seconds here): a caller capturing both decoder
    layers at every step (step 0 left-padded over both prompts, later steps one token)
    gets transformers' layer outputs and greedy tokens; beside it, a caller steering
    layer 0 with a vector gets transformers' steered tokens, and a third with no hooks
    the unsteered ones: each call's hooks see and change its own rows only, on both
    ranks alike (the edit is broadcast)."""
    tokenizer = oracle_tokenizer()
    prompts = PROMPTS[:2]
    ids = [_ids(tokenizer, p) for p in prompts]
    longest = max(len(i) for i in ids)
    vector = torch.randn(128, generator=torch.Generator().manual_seed(3)) * 2.0
    steer_prompt = PROMPTS[1]
    steered_want, _ = _greedy(oracle, _ids(tokenizer, steer_prompt), 4, {"model.layers.0": vector})
    plain_want, _ = _greedy(oracle, _ids(tokenizer, steer_prompt), 4)
    assert steered_want != plain_want
    async with hookwire.connect(tp_server.target) as a, hookwire.connect(tp_server.target) as b:
        captured, steered, plain = await asyncio.gather(
            a.model("llama-tp").generate(prompts, 4, hooks=[HookSpec("model.layers.*", posthook=capture("output"))]),
            b.model("llama-tp").generate([steer_prompt], 4, hooks=[
                HookSpec("model.layers.0", posthook=[rules.add("output", vector)])]),
            b.model("llama-tp").generate([steer_prompt], 4),
        )
    assert list(steered.token_ids[0]) == steered_want
    assert list(plain.token_ids[0]) == plain_want
    events = {(e.module, e.step): torch.as_tensor(e.output) for e in captured.events}
    assert sorted({s for _, s in events}) == [0, 1, 2, 3]
    for row, prompt_ids in enumerate(ids):
        tokens, seen = _greedy(oracle, prompt_ids, 4)
        assert list(captured.token_ids[row]) == tokens
        for layer in ("model.layers.0", "model.layers.1"):
            step0 = events[(layer, 0)]
            assert list(step0.shape) == [2, longest, 128]
            pad = longest - len(prompt_ids)
            assert bool((step0[row, :pad] == 0).all())
            torch.testing.assert_close(step0[row, pad:], seen[layer][0][0], **TOL)
            for step in (1, 2, 3):
                torch.testing.assert_close(events[(layer, step)][row], seen[layer][step][0], **TOL)


async def test_a_call_whose_requests_reach_vllm_apart_still_starts_whole(tp_server, oracle) -> None:
    """vLLM's engine process takes requests one message at a time and steps on its own:
    with the second of a call's two requests held back, hookwire's scheduler (in vLLM's
    engine process) keeps the first waiting until the second arrives, so the call's
    first step runs both prompts whole: its captures and tokens equal transformers'."""
    tokenizer = oracle_tokenizer()
    engine = tp_server.host.loaded_engine
    client_add = engine._engine.add_request
    added = {"n": 0}

    def slow_second(*args: Any, **kwargs: Any) -> Any:
        added["n"] += 1
        if added["n"] == 2:  # the engine process steps meanwhile, with the first request
            import time
            time.sleep(0.5)
        return client_add(*args, **kwargs)

    engine._engine.add_request = slow_second
    try:
        async with hookwire.connect(tp_server.target) as client:
            result = await client.model("llama-tp").generate(
                PROMPTS[:2], 3, hooks=[HookSpec("model.layers.1", posthook=capture("output"))])
    finally:
        engine._engine.add_request = client_add
    assert added["n"] == 2
    ids = [_ids(tokenizer, p) for p in PROMPTS[:2]]
    step0 = torch.as_tensor(next(e.output for e in result.events if e.step == 0))
    assert [e.step for e in result.events] == [0, 1, 2]
    for row, prompt_ids in enumerate(ids):
        tokens, seen = _greedy(oracle, prompt_ids, 3)
        assert list(result.token_ids[row]) == tokens
        torch.testing.assert_close(step0[row, step0.shape[1] - len(prompt_ids):], seen["model.layers.1"][0][0], **TOL)


async def test_steps_no_hook_touches_run_without_the_server_and_hooked_ones_keep_their_hooks(tp_server, oracle) -> None:
    """A step of calls no hook touched is not told to the server at all (the workers read
    each request's admission flag): no link message for its steps, transformers' tokens on
    both ranks; a hooked call's steps go over the link as before, with their captures."""
    tokenizer = oracle_tokenizer()
    engine = tp_server.host.loaded_engine
    want = [_greedy(oracle, _ids(tokenizer, p), 4)[0] for p in PROMPTS[:2]]
    async with hookwire.connect(tp_server.target) as client:
        model = client.model("llama-tp")
        before = engine.linked_steps
        plain = await asyncio.gather(*(model.generate([p], 4) for p in PROMPTS[:2]))
        unlinked = engine.linked_steps - before
        before = engine.linked_steps
        hooked = await model.generate([PROMPTS[0]], 4, hooks=[HookSpec("model.layers.1", posthook=capture("output"))])
        linked = engine.linked_steps - before
    assert [list(r.token_ids[0]) for r in plain] == want
    assert unlinked == 0
    assert list(hooked.token_ids[0]) == want[0] and [e.step for e in hooked.events] == [0, 1, 2, 3]
    assert linked >= 4


async def test_infer_and_parameters_from_worker_processes(tp_server, oracle) -> None:
    """Infer (a prompt pass) captures the final norm over every position and returns the
    last position's logits, as transformers computes them; GetParameters reads a weight
    every rank holds whole from the first worker, bit for bit, and says why a fused
    module's transformers names cannot be derived under tensor parallel."""
    tokenizer = oracle_tokenizer()
    ids = _ids(tokenizer, PROMPTS[0])
    async with hookwire.connect(tp_server.target) as client:
        model = client.model("llama-tp")
        result = await model.infer(torch.tensor([ids]), hooks=[HookSpec("model.norm", posthook=capture("output"))])
        with torch.no_grad():
            want = oracle(torch.tensor([ids]), output_hidden_states=True)
        (event,) = result.events
        torch.testing.assert_close(torch.as_tensor(event.output), want.hidden_states[-1], **TOL)
        torch.testing.assert_close(torch.as_tensor(result.output["logits"])[:, -1], want.logits[:, -1], **TOL)
        got = await model.parameters("model.norm.weight", "model.layers.0.self_attn.o_proj.weight")
        assert torch.equal(torch.as_tensor(got["model.norm.weight"]), oracle.model.norm.weight.detach())
        # A sharded linear weight: rank 0's half of o_proj's input columns, kept by the worker
        # (vLLM's CPU build would keep it only packed for its kernels).
        o_proj = oracle.model.layers[0].self_attn.o_proj.weight.detach()
        assert torch.equal(torch.as_tensor(got["model.layers.0.self_attn.o_proj.weight"]), o_proj[:, :64])
        with pytest.raises(hookwire.NotFoundError, match="tensor_parallel_size 2"):
            await model.parameters("model.layers.0.self_attn.q_proj.weight")
        # A module whose output is one rank's shard: captured on the first rank (its q
        # head, 64 rows, and the one k and v head every rank holds: 192 of qkv's 256),
        # never edited (the other rank's shard differs).
        sharded = await model.infer(torch.tensor([ids]), hooks=[
            HookSpec("model.layers.0.self_attn.qkv_proj", posthook=capture("output"))])
        assert list(torch.as_tensor(sharded.events[0].output).shape) == [1, len(ids), 192]
        with pytest.raises(hookwire.FailedPreconditionError, match="qkv_proj.* tensor_parallel_size 2 its value is one rank"):
            await model.infer(torch.tensor([ids]), hooks=[
                HookSpec("model.layers.0.self_attn.qkv_proj", posthook=[rules.scale("output", 2.0)])])


async def test_the_workers_tap_points_are_the_models(tp_server) -> None:
    """In worker processes the ranks tap the model (vLLM's worker class, TappedWorker)
    and tell the server which modules they tapped: Model.tap_points are TP_TAP_POINTS'
    modules inside the compiled graph; a module inside it that is no tap point (the MLP's
    fused projection here) or the compiled module itself is refused naming them; eagerly
    every module takes hooks and none is listed."""
    ids = torch.tensor([[1, 40, 50, 60]])
    async with hookwire.connect(tp_server.target) as client:
        model = client.model("llama-tp")
        info = await model.info()
        gate_up = HookSpec("model.layers.1.mlp.gate_up_proj", posthook=capture("output"))
        if tp_server.host.tap_points is None:
            assert not info.compiled and info.tap_points == ()
            assert (await model.infer(ids, hooks=[gate_up])).events
            return
        want = ["model.embed_tokens"] + [f"model.layers.{i}{part}" for i in range(2) for part in (
            "", ".self_attn", ".self_attn.qkv_proj", ".self_attn.o_proj", ".mlp")] + ["model.norm"]
        assert info.compiled and list(info.tap_points) == want
        with pytest.raises(hookwire.FailedPreconditionError,
                           match=r"module 'model.layers.1.mlp.gate_up_proj' takes no hooks: it runs inside vLLM's "
                                 r"compiled model, where hooks fire only at the model's tap points \(model.embed_tokens, "):
            await model.infer(ids, hooks=[gate_up])
        with pytest.raises(hookwire.FailedPreconditionError,
                           match=r"module 'model' takes no hooks: vLLM runs its compiled code without "
                                 r"nn.Module.__call__, where hooks fire; hook one of the model's tap points"):
            await model.infer(ids, hooks=[HookSpec("model", posthook=capture("output"))])
        # A glob takes its matches that are tap points, and is refused when none is.
        with pytest.raises(hookwire.FailedPreconditionError, match=r"module 'model.layers.1.mlp.gate_up_proj' takes no"):
            await model.infer(ids, hooks=[HookSpec("model.layers.1.mlp.*", posthook=capture("output"))])
        result = await model.infer(ids, hooks=[HookSpec("model.layers.1.**", posthook=capture("output"))])
        assert sorted(e.module for e in result.events) == sorted(
            ["model.layers.1.self_attn", "model.layers.1.self_attn.qkv_proj", "model.layers.1.self_attn.o_proj",
             "model.layers.1.mlp"])


async def test_a_slow_reader_gets_each_steps_events_before_its_tokens(tp_server) -> None:
    """vLLM's engine process runs a call's steps without waiting for its reader; the
    server holds each step's events until that step's tokens go out, so the stream keeps
    the contract's order: a step's events, then its tokens."""
    async with hookwire.connect(tp_server.target) as client:
        stream = client.model("llama-tp").generate(["hello world"], 6, hooks=[
            HookSpec("model.layers.*", posthook=capture("output", select="[:, -1]"))])
        order = []
        async for item in stream:
            order.append(("event", item.step) if isinstance(item, hookwire.InterceptEvent) else ("tokens", item.step))
            await asyncio.sleep(0.05)
        result = await stream
    expected = []
    for step in range(result.steps):
        expected += [("event", step), ("event", step), ("tokens", step)]
    assert order == expected


async def test_a_stop_rule_in_worker_processes_ends_its_sequence_at_the_step_it_fired(tp_server, oracle) -> None:
    """vLLM's engine process may run a step before the server took the last one's tokens:
    a sequence a stop rule ends at step k still gets its tokens before k, and not k's;
    the call's other sequence goes on as transformers' generate() gives it."""
    probe = torch.randn(128, generator=torch.Generator().manual_seed(41))
    threshold, firsts, tokens = stop_case(oracle, probe, PROMPTS[:2])
    async with hookwire.connect(tp_server.target) as client:
        result = await client.model("llama-tp").generate(PROMPTS[:2], 8, hooks=[
            HookSpec("model.layers.1", posthook=[rules.stop("output", rules.probe(probe) > threshold)])])
    check_stops(result, firsts, tokens)


async def test_a_stopped_single_sequence_keeps_its_events_when_the_engine_runs_ahead(tp_server, oracle) -> None:
    """The server takes each step's outputs late (held back 0.3 s), so vLLM's engine
    process runs ahead and the stop is recorded before the earlier tokens are in: the
    call's only sequence still ends at the step the rule fired in, with that step's events
    (steps 0..s) and the same stream as in-process."""
    tokenizer = oracle_tokenizer()
    probe = torch.randn(128, generator=torch.Generator().manual_seed(41))
    text = PROMPTS[1]
    tokens, seen = _greedy(oracle, _ids(tokenizer, text), 8)
    scores = [float(seen["model.layers.1"][s][0, -1] @ probe) for s in range(8)]
    order = sorted(range(1, 8), key=lambda s: scores[s])
    fire = next(s for s in order[::-1] if all(scores[t] < scores[s] - 1e-3 for t in range(s)))
    threshold = scores[fire] - 1e-3 if fire else None
    assert threshold is not None and fire > 1
    engine = tp_server.host.loaded_engine
    real_step = engine._engine.step

    def late() -> Any:
        import time
        time.sleep(0.3)
        return real_step()

    engine._engine.step = late
    try:
        async with hookwire.connect(tp_server.target) as client:
            result = await client.model("llama-tp").generate([text], 8, hooks=[
                HookSpec("model.layers.0", posthook=capture("output", select="[:, -1]")),
                HookSpec("model.layers.1", posthook=[rules.stop("output", rules.probe(probe) > threshold)])])
    finally:
        engine._engine.step = real_step
    assert list(result.token_ids[0]) == tokens[:fire] and result.finish_reasons == ("rule",)
    assert [e.step for e in result.events] == list(range(fire + 1))


async def test_a_token_id_condition_in_worker_processes(tp_server, oracle) -> None:
    """The step's input tokens come from the worker (the server may not have the last
    step's outputs yet): zeroing layer 0's output wherever a given token sits gives
    transformers' tokens with the same edit, at every step."""
    text = PROMPTS[0]
    ids = _ids(oracle_tokenizer(), text)
    want = token_gated_tokens(oracle, ids, ids[1], 6)
    async with hookwire.connect(tp_server.target) as client:
        result = await client.model("llama-tp").generate([text], 6, hooks=[
            HookSpec("model.layers.0", posthook=[rules.when(rules.token_id().eq(ids[1]), rules.zero("output"))])])
    assert list(result.token_ids[0]) == want


async def test_a_logit_lens_needs_the_weights_the_workers_hold(tp_server) -> None:
    """In worker processes the server holds no weights: a logit lens readout is refused
    at registration, naming why; a probe readout (its operand is the caller's) works."""
    async with hookwire.connect(tp_server.target) as client:
        model = client.model("llama-tp")
        with pytest.raises(hookwire.FailedPreconditionError, match="weights are not in the server's process"):
            await model.generate(["a"], 2, hooks=[HookSpec("model.layers.0", posthook=capture(
                "output", readout=hookwire.rules.logit_lens(3)))])
        result = await model.generate(["a"], 2, hooks=[HookSpec("model.layers.0", posthook=capture(
            "output", readout=hookwire.rules.probe_scores(torch.ones(128))))])
        assert [list(torch.as_tensor(e.output).shape) for e in result.events] == [[1, 2], [1, 1]]
        compact = await model.generate(["a"], 2, hooks=[HookSpec("model.layers.*", posthook=capture(
            "output", readout=hookwire.rules.probe_scores(torch.ones(128), compact=True)))])
        assert [(e.step, e.module) for e in compact.events] == [
            (0, "model.layers.0"), (0, "model.layers.1"), (1, "model.layers.0"), (1, "model.layers.1")]
        assert torch.equal(torch.as_tensor(compact.events[0].output), torch.as_tensor(result.events[0].output))
        assert len({id(e.raw) for e in compact.events}) == 2  # one wire event per step, from the worker processes' taps


async def test_hooks_run_in_the_workers_without_a_round_trip(tp_server, oracle) -> None:
    """The hook runtime in the workers (runtime/): a capture of the last position cast to
    float16 and a steering rule run on the ranks themselves, so no module value crosses
    the link for them, and give transformers' values and steered tokens; a hook that
    needs the server (a readout) runs there as before, with the same values; a
    request's own rule that fails at run time in a worker fails its call with the
    rule's words, and the server and the model stay healthy."""
    tokenizer = oracle_tokenizer()
    engine = tp_server.host.loaded_engine
    text = PROMPTS[0]
    ids = _ids(tokenizer, text)
    vector = torch.randn(128, generator=torch.Generator().manual_seed(5)) * 2.0
    steered_want, seen = _greedy(oracle, ids, 4, {"model.layers.0": vector})
    last = HookSpec("model.layers.1", posthook=capture("output", select="[:, -1]", cast="float16"))
    steer = HookSpec("model.layers.0", posthook=[rules.add("output", vector)])
    async with hookwire.connect(tp_server.target) as client:
        model = client.model("llama-tp")
        taps, ran = engine.tapped_values, engine.worker_hook_steps
        result = await model.generate([text], 4, hooks=[steer, last])
        assert engine.tapped_values == taps and engine.worker_hook_steps >= ran + 4
        assert list(result.token_ids[0]) == steered_want
        assert [e.step for e in result.events] == [0, 1, 2, 3]
        for event in result.events:
            got = torch.as_tensor(event.output)
            assert got.dtype == torch.float16 and list(got.shape) == [1, 128]
            want = seen["model.layers.1"][event.step][0][-1:].to(torch.float16)
            torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
        # A readout is made in the server (readouts.py): beside it, the steps run there.
        taps = engine.tapped_values
        read = await model.generate([text], 4, hooks=[steer, last, HookSpec("model.layers.0", posthook=capture(
            "output", readout=rules.probe_scores(torch.ones(128))))])
        assert engine.tapped_values > taps
        assert list(read.token_ids[0]) == steered_want
        front = [torch.as_tensor(e.output) for e in read.events if e.module == "model.layers.1"]
        assert all(torch.equal(a, torch.as_tensor(b.output)) for a, b in zip(front, result.events, strict=True))
        # A rule reading a signal no hook kept fails in the worker: the call fails, naming it.
        with pytest.raises(hookwire.HookwireError) as failed:
            await model.generate([text], 3, hooks=[HookSpec("model.layers.0", posthook=[
                rules.when(rules.stored("never") > 0.0, rules.zero("output"))])])
        assert failed.value.code == "FAILED_PRECONDITION" and "no signal 'never'" in str(failed.value)
        again = await model.generate([text], 4, hooks=[steer])
        assert list(again.token_ids[0]) == steered_want


async def test_slots_live_on_the_ranks_and_move_to_where_they_are_used(tp_server, oracle) -> None:
    """Session slots on the ranks (hooks/slots.py, runtime.step.RankSlots): a session hook
    saves layer 0's output, scaled by 3, and another patches it into layer 1's last
    position, every step. The steps run in the workers (no module value crosses the link)
    and give transformers' tokens with the same edits; ListSlots describes the slot as the
    server knows it while the tensor stays on the ranks, and GetSlot reads it from the
    first rank: the oracle's last saved value. A step whose hooks need the server (a
    readout beside them) reads the slot back first and patches it there, with the same
    tokens; the next worker step takes it along again. A save whose two rank copies pass
    max_slot_bytes (16 KiB here) fails as a save in the server does, naming the setting;
    when the session ends, every rank frees its copies."""
    tokenizer = oracle_tokenizer()
    engine = tp_server.host.loaded_engine
    text = PROMPTS[1]
    want, last_saved = scaled_save_and_patch(oracle, _ids(tokenizer, text), 5, oracle.model.layers[0],
                                             oracle.model.layers[1])

    async def held() -> list[list[int]]:
        return await asyncio.to_thread(engine.call_workers, "hookwire_slots_held")

    async with hookwire.connect(tp_server.target) as client:
        model = client.model("llama-tp")
        await model.hook("model.layers.0", posthook=[rules.scale("output", 3.0), rules.save("output", slot="s")])
        await model.hook("model.layers.1", posthook=[rules.patch("output", slot="s", index="[:, -1]")])
        taps, ran = engine.tapped_values, engine.worker_hook_steps
        result = await model.generate([text], 5)
        assert list(result.token_ids[0]) == want
        assert engine.tapped_values == taps and engine.worker_hook_steps >= ran + 5
        (info,) = await client.list_slots()
        assert (info.name, info.dtype, tuple(info.shape)) == ("s", "float32", tuple(last_saved.shape))
        nbytes = last_saved.numel() * last_saved.element_size()
        assert await held() == [[1, nbytes], [1, nbytes]]  # a copy on each rank, none in the server
        torch.testing.assert_close(await client.get_slot("s"), last_saved, **TOL)
        # Beside a readout the steps' hooks run in the server: the slot comes back first.
        taps = engine.tapped_values
        readout = HookSpec("model.layers.1", posthook=capture("output", readout=rules.probe_scores(torch.ones(128))))
        read = await model.generate([text], 5, hooks=[readout])
        assert engine.tapped_values > taps
        assert list(read.token_ids[0]) == want
        assert [rank[0] for rank in await held()] == [0, 0]
        torch.testing.assert_close(await client.get_slot("s"), last_saved, **TOL)
        taps = engine.tapped_values
        again = await model.generate([text], 5)
        assert list(again.token_ids[0]) == want and engine.tapped_values == taps
        assert await held() == [[1, nbytes], [1, nbytes]]
        # 40 prompt positions of 128 floats, twice: 40 KiB of copies, past 16 KiB.
        async with hookwire.connect(tp_server.target) as other:
            await other.model("llama-tp").hook("model.layers.0", posthook=[rules.save("output", slot="big")],
                                               on_error="fail_call")
            with pytest.raises(hookwire.ResourceExhaustedError, match="max_slot_bytes"):
                await other.model("llama-tp").generate([" ".join(["a"] * 39)], 2)
            assert await other.list_slots() == []
        again = await model.generate([text], 2)
        assert list(again.token_ids[0]) == want[:2]
    for _ in range(600):  # the session ended with the client: its slots go from every rank
        if [rank[0] for rank in await held()] == [0, 0]:
            break
        await asyncio.sleep(0.1)
    assert await held() == [[0, 0], [0, 0]]


async def test_named_operands_travel_to_the_ranks_once_and_count_per_rank(tp_server) -> None:
    """A steering vector and an SAE uploaded as named operands, named by a session hook
    and by a call's own hook: the steps run in the workers (no module value crosses the
    link), each operand is shipped once and held by both ranks, counted against its
    owner's quota once per rank while a program there names it (and no more once the
    hooks are gone), and the tokens equal the same hooks with the operands inline."""
    from hookwire.rules import Sae

    engine = tp_server.host.loaded_engine
    store = tp_server.server.hooks.operands
    g = torch.Generator().manual_seed(11)
    vector = torch.randn(128, generator=g) * 2.0
    sae = Sae.of(torch.randn(128, 16, generator=g) * 0.1, torch.zeros(16), torch.randn(16, 128, generator=g) * 0.1,
                 torch.zeros(128))
    text = PROMPTS[1]

    def hooks(steer: Any, autoencoder: Sae) -> tuple[HookSpec, HookSpec]:
        return (HookSpec("model.layers.0", posthook=[rules.add("output", steer)]),
                HookSpec("model.layers.1", posthook=[rules.sae("output", autoencoder, [1, 2], edit="clamp", value=4.0)]))

    async with hookwire.connect(tp_server.target) as client:
        model = client.model("llama-tp")
        await client.upload_operand("steer", vector)
        await client.upload_operand("sae", sae)
        (steer_op,) = [op for op in store._own.values() if op.name == "steer"]
        (sae_op,) = [op for op in store._own.values() if op.name == "sae"]
        own_hook = hooks(rules.operand("steer"), Sae.named("sae"))[1]
        inline = await model.generate([text], 4, hooks=list(hooks(vector, sae)))
        assert inline.token_ids != (await model.generate([text], 4)).token_ids
        taps, ran = engine.tapped_values, engine.worker_hook_steps
        async with model.hook("model.layers.0", posthook=[rules.add("output", rules.operand("steer"))]):
            named = await model.generate([text], 4, hooks=[own_hook])
            assert (steer_op.rank_copies, sae_op.rank_copies) == (2, 2)
            assert store.bytes_of(steer_op.owner) == 3 * (steer_op.nbytes + sae_op.nbytes)
            again = await model.generate([text], 4)  # the session hook alone: its operand stays
            assert (steer_op.rank_copies, sae_op.rank_copies) == (2, 0)
        assert engine.tapped_values == taps and engine.worker_hook_steps >= ran + 8
        assert named.token_ids == inline.token_ids
        steered_only = await model.generate([text], 4, hooks=[hooks(vector, sae)[0]])
        assert again.token_ids == steered_only.token_ids
        await model.generate([text], 2, hooks=[HookSpec("model.layers.0", posthook=capture("output"))])
        assert (steer_op.rank_copies, sae_op.rank_copies) == (0, 0)
        assert store.bytes_of(steer_op.owner) == steer_op.nbytes + sae_op.nbytes
        await client.delete_operand("steer")
        await client.delete_operand("sae")


async def test_logprobs_and_eos_options_in_worker_processes(tp_server, oracle) -> None:
    """GenerateRequest's logprobs, prompt_logprobs and ignore_eos in worker processes
    (tensor parallel 2; the RequestOutputs the front reads come from vLLM's engine
    process): a hooked call's (its hooks run in the workers) and a plain call's
    log-probabilities equal transformers', prompt log-probabilities included, and
    ignore_eos keeps an EOS prompt going (test_generate_options.py: the same in-process)."""
    from test_generate_options import _check_call, _generate, _greedy_loop, _request, eos_prompt_of

    from hookwire._generation import generate_request

    eos_prompt = eos_prompt_of(oracle)
    ids = [_ids(oracle_tokenizer(), p) for p in PROMPTS[:2]]
    hooked = generate_request("llama-tp", PROMPTS[:2], 4, stop=[], attention_mask=None,
                              hooks=[HookSpec("model.layers.1", posthook=capture("output"))], do_sample=False,
                              temperature=None, top_k=None, top_p=None, seed=None, tags=(), session_id="",
                              max_response_message_bytes=0, logprobs=3, prompt_logprobs=2)
    plain = _request(5, ids=[eos_prompt], ignore_eos=True, logprobs=True, top_logprobs=1, prompt_logprobs=1)
    plain.model = "llama-tp"
    (steps, done), (ignored, ignored_done) = await asyncio.gather(
        _generate(tp_server.target, hooked), _generate(tp_server.target, plain))
    _check_call(oracle, ids, steps, done, 3, 2)
    assert list(ignored_done.sequences[0].token_ids) == _greedy_loop(oracle, eos_prompt, 5, ignore_eos=True)
    _check_call(oracle, [eos_prompt], ignored, ignored_done, 1, 1)


async def test_a_worker_process_that_dies_fails_its_calls_and_the_model(tp_server) -> None:
    """Last (the model does not come back): killing the first worker while a call
    generates fails that call with FAILED_PRECONDITION naming the failure, the model is
    listed as failed with the reason and refuses later calls; the server keeps serving."""
    pids = tp_server.host.loaded_engine.worker_pids
    assert len(pids) == 2 and os.getpid() not in pids
    async with hookwire.connect(tp_server.target) as client:
        model = client.model("llama-tp")
        stream = model.generate(["hello"], 100, hooks=[HookSpec("model.layers.0", posthook=capture("output"))])
        seen = 0
        with pytest.raises(hookwire.HookwireError) as failure:
            async for item in stream:
                seen += 1
                if seen == 3:
                    os.kill(pids[0], signal.SIGKILL)
        assert failure.value.code in ("FAILED_PRECONDITION", "UNAVAILABLE"), failure.value
        for _ in range(100):  # the registry hears of it from the worker thread
            (info,) = await client.list_models()
            if info.state == "failed":
                break
            await asyncio.sleep(0.1)
        assert info.state == "failed" and "vLLM" in info.state_message, info.state_message
        with pytest.raises(hookwire.FailedPreconditionError, match="failed while serving"):
            await model.generate(["hello"], 2)



async def test_workers_linked_over_tcp_serve_hooks_as_over_a_unix_socket(llama_folder: pathlib.Path, oracle) -> None:
    """vllm.link_address: the worker reaches the server over TCP (as ranks on another
    machine would: the link authenticates with the server's key either way); a captured
    and a steered call equal transformers, and a config that asks for the link without
    worker processes (worker_processes = false) is refused naming the setting; the
    model runs in worker processes without saying so (the default)."""
    from hookwire_server import ModelRegistry, ServerSettings
    from hookwire_server.engine.core import build_host
    from hookwire_server.models.model_loading import ConfigError, ModelConfig
    from support import ServerThread

    with pytest.raises(ConfigError, match=r"vllm.link_address is where vLLM's worker processes reach the server: it "
                                          r"needs worker_processes = true"):
        build_host(ModelConfig(name="x", transformers=str(llama_folder), engine="vllm",
                               vllm={"link_address": "127.0.0.1:0", "worker_processes": False}))
    host = build_host(ModelConfig(
        name="llama-tcp", transformers=str(llama_folder), engine="vllm",
        vllm={"max_model_len": 128, "max_num_seqs": 4, "kv_cache_bytes": 16 << 20,
              "link_address": "127.0.0.1:0", "enforce_eager": True},
    ))
    srv = ServerThread(ModelRegistry([host]), ServerSettings(port=0)).start()
    try:
        assert host.loaded_engine._link.address.startswith("tcp://127.0.0.1:")
        assert len(host.loaded_engine.worker_pids) == 1
        tokenizer = oracle_tokenizer()
        ids = _ids(tokenizer, PROMPTS[0])
        vector = torch.randn(128, generator=torch.Generator().manual_seed(4)) * 2.0
        want, seen = _greedy(oracle, ids, 3, {"model.layers.0": vector})
        async with hookwire.connect(srv.target) as client:
            result = await client.model("llama-tcp").generate([PROMPTS[0]], 3, hooks=[
                HookSpec("model.layers.0", posthook=[rules.add("output", vector)]),
                HookSpec("model.layers.1", posthook=capture("output"))])
        assert list(result.token_ids[0]) == want
        for event in result.events:
            torch.testing.assert_close(torch.as_tensor(event.output)[0], seen["model.layers.1"][event.step][0], **TOL)
    finally:
        srv.stop()


