"""hookwire on vLLM's pipeline parallel 2 (one core per stage): the seeded Llama's two
decoder layers run on two stages, each in a worker process of its own, each stage's
first rank linked to the server on a connection of its own (engine/vllm_worker.py). Each
stage runs the hooks of its own modules; checked from outside with real clients against
transformers in process.

Tolerance: a stage hands the next its hidden states and residual as they are, so the
values are those of one process; the bound is the processes tests' (test_vllm_processes).
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

from test_vllm_engine import PROMPTS, _greedy, _ids, oracle_tokenizer, scaled_save_and_patch

TOL = dict(rtol=1e-5, atol=5e-6)


@pytest.fixture(scope="module")
def pp_server(llama_folder: pathlib.Path) -> Iterator[Any]:
    """A real server whose model "llama-pp" runs on vLLM in worker processes, pipeline
    parallel 2, parameters readable."""
    from hookwire_server import ModelRegistry, ServerSettings
    from hookwire_server.engine.core import build_host
    from hookwire_server.models.model_loading import ModelConfig
    from support import ServerThread

    host = build_host(ModelConfig(
        name="llama-pp", transformers=str(llama_folder), engine="vllm", parameters_readable=True,
        vllm={"max_model_len": 128, "max_num_seqs": 8, "kv_cache_bytes": 32 << 20, "pipeline_parallel_size": 2,
              "enforce_eager": True},
    ))
    srv = ServerThread(ModelRegistry([host]), ServerSettings(port=0)).start()
    srv.host = host
    yield srv
    srv.stop()


async def test_each_pipeline_stage_runs_the_hooks_of_its_own_modules(pp_server, oracle) -> None:
    """Captures of the last position of both decoder layers (layer 0 on stage 0, layer 1 on
    stage 1) and a steering rule on layer 0 run in the stages' workers (no module value
    crosses the link) and give transformers' values and steered tokens, each step's events
    in module order; concurrent callers see and edit only their own rows; a readout (made
    in the server) runs on what each stage taps, with the same values; Infer returns the
    last stage's logits; GetParameters reads each stage's weights bit for bit."""
    tokenizer = oracle_tokenizer()
    engine = pp_server.host.loaded_engine
    vector = torch.randn(128, generator=torch.Generator().manual_seed(7)) * 2.0
    steered_want, seen = _greedy(oracle, _ids(tokenizer, PROMPTS[0]), 4, {"model.layers.0": vector})
    plain_want, plain_seen = _greedy(oracle, _ids(tokenizer, PROMPTS[1]), 4)
    last = HookSpec("model.layers.*", posthook=capture("output", select="[:, -1]"))
    steer = HookSpec("model.layers.0", posthook=[rules.add("output", vector)])
    async with hookwire.connect(pp_server.target) as client:
        model = client.model("llama-pp")
        taps, ran = engine.tapped_values, engine.worker_hook_steps
        steered, plain = await asyncio.gather(model.generate([PROMPTS[0]], 4, hooks=[steer, last]),
                                              model.generate([PROMPTS[1]], 4, hooks=[last]))
        assert engine.tapped_values == taps and engine.worker_hook_steps >= ran + 4
        assert list(steered.token_ids[0]) == steered_want
        assert list(plain.token_ids[0]) == plain_want
        for result, oracle_seen in ((steered, seen), (plain, plain_seen)):
            assert [(e.step, e.module) for e in result.events] == [
                (step, f"model.layers.{i}") for step in range(4) for i in range(2)]
            for event in result.events:
                want = oracle_seen[event.module][event.step][0][-1:]
                torch.testing.assert_close(torch.as_tensor(event.output), want, **TOL)
        taps = engine.tapped_values
        read = await model.generate([PROMPTS[0]], 4, hooks=[steer, last, HookSpec("model.norm", posthook=capture(
            "output", readout=rules.probe_scores(torch.ones(128))))])
        assert engine.tapped_values > taps
        assert list(read.token_ids[0]) == steered_want
        front = [torch.as_tensor(e.output) for e in read.events if e.module != "model.norm"]
        assert all(torch.equal(a, torch.as_tensor(b.output)) for a, b in zip(front, steered.events, strict=True))
        ids = _ids(tokenizer, PROMPTS[0])
        result = await model.infer(torch.tensor([ids]), hooks=[HookSpec("model.norm", posthook=capture("output"))])
        with torch.no_grad():
            want = oracle(torch.tensor([ids]), output_hidden_states=True)
        torch.testing.assert_close(torch.as_tensor(result.events[0].output), want.hidden_states[-1], **TOL)
        torch.testing.assert_close(torch.as_tensor(result.output["logits"])[:, -1], want.logits[:, -1], **TOL)
        got = await model.parameters("model.embed_tokens.weight", "model.norm.weight")
        assert torch.equal(torch.as_tensor(got["model.embed_tokens.weight"]), oracle.model.embed_tokens.weight.detach())
        assert torch.equal(torch.as_tensor(got["model.norm.weight"]), oracle.model.norm.weight.detach())


async def test_what_no_stage_can_run_alone_is_refused_at_registration(pp_server, oracle) -> None:
    """A hook on a module whose modules run on both stages (the model) is refused with
    FAILED_PRECONDITION naming it; a slot saved on stage 0 and patched on stage 1 is
    refused at registration, whichever comes second, as is a save on every layer, and
    nothing stays registered; a save and a patch on one stage work, against transformers
    with the same edits, the slot lives on that stage's rank alone and GetSlot reads it
    there; once its hooks are gone, a patch of it on the other stage is refused."""
    tokenizer = oracle_tokenizer()
    async with hookwire.connect(pp_server.target) as client:
        model = client.model("llama-pp")
        with pytest.raises(hookwire.FailedPreconditionError, match="'model' takes no hooks.*run on several stages"):
            await model.generate([PROMPTS[0]], 2, hooks=[HookSpec("model", posthook=capture("output"))])
        await model.hook("model.layers.0", posthook=[rules.save("output", slot="s")])
        with pytest.raises(hookwire.FailedPreconditionError, match="slot 's'.*stage 0.*stage 1"):
            await model.hook("model.layers.1", posthook=[rules.patch("output", slot="s", index="[:, -1]")])
        with pytest.raises(hookwire.FailedPreconditionError, match="slot 's'.*stage 0.*stage 1"):
            await model.generate([PROMPTS[0]], 2, hooks=[
                HookSpec("model.layers.1", posthook=[rules.patch("output", slot="s", index="[:, -1]")])])
        with pytest.raises(hookwire.FailedPreconditionError, match="slot 'all'.*stage 0.*stage 1"):
            await model.hook("model.layers.*", posthook=[rules.save("output", slot="all")])
        assert len(await client.list_hooks(session_id=client.session_id)) == 1
    # Saved and patched on stage 1: layer 1's output, tripled, into the final norm's last position.
    want, last_saved = scaled_save_and_patch(oracle, _ids(tokenizer, PROMPTS[1]), 4, oracle.model.layers[1],
                                             oracle.model.norm)
    async with hookwire.connect(pp_server.target) as client:
        model = client.model("llama-pp")
        saver = await model.hook("model.layers.1", posthook=[rules.scale("output", 3.0),
                                                             rules.save("output", slot="s")])
        patcher = await model.hook("model.norm", posthook=[rules.patch("output", slot="s", index="[:, -1]")])
        result = await model.generate([PROMPTS[1]], 4)
        assert list(result.token_ids[0]) == want
        # The slot lives on stage 1's rank (rank 1), which GetSlot reads.
        held = await asyncio.to_thread(pp_server.host.loaded_engine.call_workers, "hookwire_slots_held")
        assert held == [[0, 0], [1, last_saved.numel() * last_saved.element_size()]]
        torch.testing.assert_close(await client.get_slot("s"), last_saved, **TOL)
        # Its hooks gone, the slot stays on stage 1: a patch on stage 0 could not read it.
        await saver.remove()
        await patcher.remove()
        with pytest.raises(hookwire.FailedPreconditionError,
                           match=r"slot 's' lives on model 'llama-pp''s vLLM workers \(pipeline stage 1\).*"
                                 r"module 'model.layers.0' \(stage 0\)"):
            await model.hook("model.layers.0", posthook=[rules.patch("output", slot="s", index="[:, -1]")])
        assert await client.list_hooks(session_id=client.session_id) == []


async def test_a_later_stage_that_dies_fails_its_calls_and_the_model(pp_server) -> None:
    """Last (the model does not come back): killing the last stage's worker while a call
    whose hook runs on that stage generates fails the call (nothing waits for the stage
    that is gone), the model is listed as failed with the reason and refuses later calls;
    the server keeps serving."""
    engine = pp_server.host.loaded_engine
    pids = engine.worker_pids
    assert len(pids) == 2 and os.getpid() not in pids
    taps = engine.tapped_values
    async with hookwire.connect(pp_server.target) as client:
        model = client.model("llama-pp")
        stream = model.generate([PROMPTS[0]], 100, hooks=[HookSpec("model.layers.1", posthook=capture("output"))])
        seen: list[Any] = []
        with pytest.raises(hookwire.HookwireError) as failure:
            async with asyncio.timeout(120):  # a stage left waiting would hang here
                async for item in stream:
                    seen.append(item)
                    if len(seen) == 3:
                        os.kill(pids[-1], signal.SIGKILL)
        assert failure.value.code in ("FAILED_PRECONDITION", "UNAVAILABLE"), failure.value
        # The hook fired, on stage 1's worker (nothing it saw crossed the link).
        assert "model.layers.1" in {getattr(item, "module", None) for item in seen} and engine.tapped_values == taps
        for _ in range(200):  # the registry hears of it from the link thread (vLLM's own failure may come first)
            (info,) = await client.list_models()
            if info.state == "failed" and "went away" in info.state_message:
                break
            await asyncio.sleep(0.1)
        # The stage's death is the reason (stage 0's link, refused its next step, does not replace it).
        assert info.state == "failed" and "a vLLM worker process of model 'llama-pp' went away" in info.state_message \
            and "serves no more calls" not in info.state_message, info.state_message
        with pytest.raises(hookwire.FailedPreconditionError, match="failed while serving"):
            await model.generate([PROMPTS[0]], 2)
        assert [m.name for m in await client.list_models()] == ["llama-pp"]  # the server still answers
