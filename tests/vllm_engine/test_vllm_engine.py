"""hookwire on vLLM (engine = "vllm"): the contract served by vLLM's CPU build in this
process, checked from outside with real clients against transformers in-process (the
oracle: the same folder, the same edits as torch hooks).

Tolerance: vLLM's CPU kernels (fused RMSNorm with residual, its attention) reduce in
other orders than transformers' eager code: measured on this model (4 prompts, 8 steps,
both decoder layers), the largest difference of a decoder layer's output is 6.0e-8 on
values up to 0.22; the bound below leaves a margin of 15x. Greedy tokens are compared
exactly (a wrong row or a leaked edit moves them).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

import hookwire
from hookwire import HookSpec, capture, edit, rules
from conftest import KV_CACHE_BYTES
from support import until

TOL = dict(rtol=1e-5, atol=1e-6)
PROMPTS = ["hello world", "the model sees", "a"]


def _ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text)["input_ids"]


def scaled_save_and_patch(oracle: Any, ids: list[int], n: int, saved: Any, patched: Any) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy generate() of ``n`` tokens with module ``saved``'s output
    tripled and kept, and the kept value's last position patched into module
    ``patched``'s output, every forward (the oracle of ``scale`` + ``save`` and
    ``patch(index="[:, -1]")`` hooks); the tokens and the last value kept."""
    kept: dict[str, torch.Tensor] = {}

    def save(module: Any, args: Any, output: Any) -> Any:
        out = (output[0] if isinstance(output, tuple) else output) * 3.0
        kept["s"] = out.clone()
        return (out, *output[1:]) if isinstance(output, tuple) else out

    def patch(module: Any, args: Any, output: Any) -> Any:
        out = (output[0] if isinstance(output, tuple) else output).clone()
        out[:, -1] = kept["s"][:, -1]
        return (out, *output[1:]) if isinstance(output, tuple) else out

    handles = [saved.register_forward_hook(save), patched.register_forward_hook(patch)]
    try:
        want, _ = _greedy(oracle, ids, n)
    finally:
        for h in handles:
            h.remove()
    return want, kept["s"]


def _greedy(oracle: Any, ids: list[int], n: int, edits: dict[str, torch.Tensor] | None = None) -> tuple[list[int], dict[str, list[torch.Tensor]]]:
    """transformers' greedy generate() of ``n`` tokens on one prompt, alone, with forward
    hooks adding ``edits[path]`` to that decoder layer's output; returns the new tokens and
    every layer's output per forward (prompt pass, then one per step)."""
    seen: dict[str, list[torch.Tensor]] = {}
    handles = []
    for i, layer in enumerate(oracle.model.layers):
        path = f"model.layers.{i}"

        def hook(module: Any, args: Any, output: Any, path: str = path) -> Any:
            out = output[0] if isinstance(output, tuple) else output
            if edits and path in edits:
                out = out + edits[path]
            seen.setdefault(path, []).append(out.detach().clone())
            return (out, *output[1:]) if isinstance(output, tuple) else out
        handles.append(layer.register_forward_hook(hook))
    try:
        with torch.no_grad():
            out = oracle.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  max_new_tokens=n, do_sample=False, pad_token_id=0)
    finally:
        for h in handles:
            h.remove()
    return out[0, len(ids):].tolist(), seen


def stop_case(oracle: Any, probe: torch.Tensor, prompts: list[str], steps: int = 8) -> tuple[float, list[int | None], list[list[int]]]:
    """A stop rule's case on two prompts: a threshold on the probe's score (layer 1, last
    position) far from every score transformers gives (vLLM's kernels differ by ~1e-7), at
    which the two sequences stop at different steps (or one never does); each sequence's
    first firing step (None: never) and transformers' greedy tokens."""
    tokenizer = oracle_tokenizer()
    runs = [_greedy(oracle, _ids(tokenizer, p), steps) for p in prompts]
    scores = [[float(seen["model.layers.1"][s][0, -1] @ probe) for s in range(steps)] for _, seen in runs]
    flat = sorted(v for row in scores for v in row)
    best = None
    for a, b in zip(flat, flat[1:]):
        t = (a + b) / 2
        firsts = [next((s for s, v in enumerate(row) if v > t), None) for row in scores]
        if firsts[0] != firsts[1] and any(f not in (None, 0) for f in firsts) and (best is None or b - a > best[0]):
            best = (b - a, t, firsts)
    assert best is not None and best[0] > 1e-3
    return best[1], best[2], [tokens for tokens, _ in runs]


def check_stops(result: Any, firsts: list[int | None], tokens: list[list[int]]) -> None:
    """Each sequence of a Generate result ended where stop_case says, or ran its length."""
    for row, first in enumerate(firsts):
        if first is None:
            assert list(result.token_ids[row]) == tokens[row] and result.finish_reasons[row] == "length"
        else:
            assert list(result.token_ids[row]) == tokens[row][:first] and result.finish_reasons[row] == "rule"
            assert result.stopped_by[row] == (result.hook_ids[0], "model.layers.1", first)


def token_gated_tokens(oracle: Any, ids: list[int], token: int, n: int) -> list[int]:
    """transformers' greedy tokens with layer 0's output zeroed wherever ``token`` is the
    position's input token (the ids generate() feeds each step)."""
    fed: list[torch.Tensor] = []

    def pre(module: Any, args: Any, kwargs: Any) -> None:
        fed.append(kwargs["input_ids"])

    def edit(module: Any, args: Any, output: Any) -> Any:
        out = output[0] if isinstance(output, tuple) else output
        new = torch.where((fed[-1] == token).unsqueeze(-1), torch.zeros_like(out), out)
        return (new, *output[1:]) if isinstance(output, tuple) else new

    handles = [oracle.register_forward_pre_hook(pre, with_kwargs=True), oracle.model.layers[0].register_forward_hook(edit)]
    try:
        with torch.no_grad():
            out = oracle.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  max_new_tokens=n, do_sample=False, pad_token_id=0)
    finally:
        for h in handles:
            h.remove()
    return out[0, len(ids):].tolist()


async def test_the_model_says_it_runs_on_vllm_and_what_it_refuses(vllm_server) -> None:
    async with hookwire.connect(vllm_server.target) as client:
        listed = {m.name: m for m in await client.list_models()}
        info = listed["llama"]
        assert listed["llama-torch"].engine == "torch" and not listed["llama-torch"].refused_features
        assert info.engine == "vllm" and info.can_generate and info.has_tokenizer
        assert {"backward", "train", "attention_probabilities"} <= set(info.refused_features)
        full = await client.model("llama").info()
        paths = {m.path for m in full.modules}
        assert {"model.layers.0", "model.layers.1.self_attn.qkv_proj", "model.layers.1.mlp.gate_up_proj",
                "model.norm", "model.embed_tokens"} <= paths


async def test_greedy_tokens_equal_transformers_generate(vllm_server, oracle) -> None:
    """Three prompts of different lengths in one call: each sequence's tokens equal
    transformers' greedy generate() of that prompt alone; finish reasons "length"."""
    tokenizer = oracle_tokenizer()
    async with hookwire.connect(vllm_server.target) as client:
        result = await client.model("llama").generate(PROMPTS, 8)
    assert result.finish_reasons == ("length",) * 3 and result.steps == 8
    for text, tokens in zip(PROMPTS, result.token_ids):
        want, _ = _greedy(oracle, _ids(tokenizer, text), 8)
        assert list(tokens) == want, text
    # The memory budget counts what vLLM keeps (its KV cache and weights) once; its calls
    # claim nothing of their own (vLLM's scheduler admits them within its KV cache).
    budget = vllm_server.call(lambda: vllm_server.server.state.budget)
    assert budget.resident["llama"] > KV_CACHE_BYTES and budget.claimed == 0


def oracle_tokenizer() -> Any:
    from hookwire_server.demo_models import tiny_lm_tokenizer

    return tiny_lm_tokenizer()


async def test_captures_of_every_step_equal_transformers_layer_outputs(vllm_server, oracle) -> None:
    """Posthooks on both decoder layers of a two-prompt call: step 0 is one event per
    layer over the whole prompt ([2, longest, hidden], the shorter prompt left-padded
    with zeros), later steps [2, 1, hidden]; each row equals transformers' decoder layer
    output (the residual stream) for that prompt alone, within the tolerance."""
    tokenizer = oracle_tokenizer()
    prompts = PROMPTS[:2]
    ids = [_ids(tokenizer, p) for p in prompts]
    longest = max(len(i) for i in ids)
    async with hookwire.connect(vllm_server.target) as client:
        result = await client.model("llama").generate(
            prompts, 4, hooks=[HookSpec("model.layers.*", posthook=capture("output"))])
    events = {(e.module, e.step): torch.as_tensor(e.output) for e in result.events}
    assert sorted({s for _, s in events}) == [0, 1, 2, 3]
    for row, prompt_ids in enumerate(ids):
        _, seen = _greedy(oracle, prompt_ids, 4)
        for layer in ("model.layers.0", "model.layers.1"):
            step0 = events[(layer, 0)]
            assert list(step0.shape) == [2, longest, 128]
            pad = longest - len(prompt_ids)
            assert bool((step0[row, :pad] == 0).all())
            torch.testing.assert_close(step0[row, pad:], seen[layer][0][0], **TOL)
            for step in (1, 2, 3):
                got = events[(layer, step)]
                assert list(got.shape) == [2, 1, 128]
                torch.testing.assert_close(got[row], seen[layer][step][0], **TOL)


async def test_a_steering_rule_equals_the_same_edit_in_transformers_and_stays_in_its_call(vllm_server, oracle) -> None:
    """Two callers at once on the same prompt: one steers layer 0's output (the residual
    stream) with a vector on every step, the other has no hooks. The steered tokens equal
    transformers' generate() with the same edit; the other's equal the unsteered run (no
    edit crossed between requests in vLLM's batch). A third call on the same prompt after
    them is unsteered too: no cached KV of the steered request was reused."""
    tokenizer = oracle_tokenizer()
    prompt = PROMPTS[1]
    vector = torch.randn(128, generator=torch.Generator().manual_seed(3)) * 2.0
    steered_want, _ = _greedy(oracle, _ids(tokenizer, prompt), 6, {"model.layers.0": vector})
    plain_want, _ = _greedy(oracle, _ids(tokenizer, prompt), 6)
    assert steered_want != plain_want, "the vector must change the tokens for this test to mean anything"
    async with hookwire.connect(vllm_server.target) as a, hookwire.connect(vllm_server.target) as b:
        steered, plain = await asyncio.gather(
            a.model("llama").generate([prompt], 6, hooks=[HookSpec("model.layers.0", posthook=[rules.add("output", vector)])]),
            b.model("llama").generate([prompt], 6),
        )
        again = await b.model("llama").generate([prompt], 6)
    assert list(steered.token_ids[0]) == steered_want
    assert list(plain.token_ids[0]) == plain_want
    assert list(again.token_ids[0]) == plain_want


async def test_concurrent_callers_each_see_only_their_own_rows(vllm_server, oracle) -> None:
    """Four callers with different prompts, each with its own session hook capturing the
    final norm's last position and a request hook on layer 1, at once: every event is the
    caller's own, equal to its prompt alone in transformers; step numbers are the call's."""
    tokenizer = oracle_tokenizer()
    prompts = ["one", "two words", "three words here", "and four words here"]
    async with contextlib_stack(4, vllm_server.target) as clients:
        hooks = [await c.model("llama").hook("model.layers.1", posthook=capture("output", select="[:, -1]"))
                 for c in clients]
        results = await asyncio.gather(*(
            c.model("llama").generate([p], 3, hooks=[HookSpec("model.layers.0", posthook=capture("output"))])
            for c, p in zip(clients, prompts)))
        session_events = [await _take(h, 3) for h in hooks]
    for prompt, result, mine in zip(prompts, results, session_events):
        _, seen = _greedy(oracle, _ids(tokenizer, prompt), 3)
        assert [e.request_id for e in mine] == [result.request_id] * 3 and [e.step for e in mine] == [0, 1, 2]
        for step, event in enumerate(mine):
            torch.testing.assert_close(torch.as_tensor(event.output)[0], seen["model.layers.1"][step][0, -1], **TOL)
        own = [e for e in result.events if e.module == "model.layers.0"]
        assert [e.step for e in own] == [0, 1, 2]
        torch.testing.assert_close(torch.as_tensor(own[0].output)[0], seen["model.layers.0"][0][0], **TOL)


class contextlib_stack:
    """``n`` connected clients."""

    def __init__(self, n: int, target: str) -> None:
        self._n, self._target = n, target
        self._clients: list[Any] = []

    async def __aenter__(self) -> list[Any]:
        for _ in range(self._n):
            self._clients.append(await hookwire.connect(self._target).__aenter__())
        return self._clients

    async def __aexit__(self, *exc: Any) -> None:
        for c in self._clients:
            await c.close()


async def _take(handle: Any, n: int) -> list[Any]:
    out = []
    async for event in handle.events():
        out.append(event)
        if len(out) == n:
            break
    return out


async def test_sampling_with_a_seed_reproduces_and_stop_strings_end_with_stop(vllm_server) -> None:
    async with hookwire.connect(vllm_server.target) as client:
        model = client.model("llama")
        one = await model.generate(["hello"], 6, do_sample=True, temperature=1.5, seed=7)
        two = await model.generate(["hello"], 6, do_sample=True, temperature=1.5, seed=7)
        assert one.token_ids == two.token_ids and one.do_sample and one.seed == 7
        greedy = await model.generate(["hello"], 6)
        stop = greedy.texts[0][1:3]
        stopped = await model.generate(["hello"], 6, stop=[stop])
    assert stopped.finish_reasons == ("stop",) and stop in stopped.texts[0]
    assert len(stopped.token_ids[0]) < 6


async def test_what_vllm_cannot_do_answers_unimplemented_naming_the_engine(vllm_server) -> None:
    async with hookwire.connect(vllm_server.target) as client:
        model = client.model("llama")
        with pytest.raises(hookwire.UnimplementedError, match="vllm engine, which does not support backward"):
            await model.hook("model.layers.0", backward_hook=capture("grad_output"))
        with pytest.raises(hookwire.UnimplementedError, match="mode: MODE_TRAIN: .*vllm engine"):
            await model.infer(torch.tensor([[1, 2, 3]]), mode="train")
        with pytest.raises(hookwire.UnimplementedError, match="Infer on the vllm engine takes input_ids"):
            await model.infer(torch.tensor([[1, 2, 3]]), inputs_embeds=torch.zeros(1, 3, 128))
        with pytest.raises(hookwire.UnimplementedError, match="padded on the right only"):
            await model.infer(torch.tensor([[1, 2, 3]]), attention_mask=torch.tensor([[0, 1, 1]]))
        with pytest.raises(hookwire.InvalidArgumentError, match=r"max_new_tokens: .* max_model_len 128 \(vllm.max_model_len\)"):
            await model.generate(["hello"], 200)
        # The server stays healthy: a call after the refusals runs.
        assert (await model.generate(["hello"], 2)).steps == 2


def test_a_setting_vllm_refuses_fails_the_model_with_vllms_reason(llama_folder) -> None:
    """vLLM's own validation (a max_model_len past the model's positions) makes the
    model fail to load with a ConfigError naming the model and quoting vLLM."""
    from hookwire_server.engine.core import build_host
    from hookwire_server.models.model_loading import ConfigError, ModelConfig

    with pytest.raises(ConfigError, match="model 'big': vLLM did not start: .*max_model_len"):
        build_host(ModelConfig(name="big", transformers=str(llama_folder), engine="vllm",
                               vllm={"max_model_len": 100000, "kv_cache_bytes": 16 << 20, "worker_processes": False,
                                     "enforce_eager": True}))


async def test_infer_is_a_prompt_pass_whose_captures_and_last_logits_equal_transformers(vllm_server, oracle) -> None:
    """Infer of two right-padded sequences: every decoder layer's capture is
    [2, length, hidden] with the padding zeros and each row equal to transformers on that
    sequence alone; the output's logits are each sequence's last position (vLLM computes
    no others): [2, 1, vocabulary]."""
    tokenizer = oracle_tokenizer()
    rows = [_ids(tokenizer, "the model sees"), _ids(tokenizer, "a")]
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    async with hookwire.connect(vllm_server.target) as client:
        result = await client.model("llama").infer(
            ids, attention_mask=mask, hooks=[HookSpec("model.layers.*", posthook=capture("output")),
                                             HookSpec("model.norm", posthook=capture("output"))])
    logits = torch.as_tensor(result.output["logits"])
    assert list(logits.shape) == [2, 1, oracle.config.vocab_size]
    for i, r in enumerate(rows):
        with torch.no_grad():
            want = oracle(torch.tensor([r]), output_hidden_states=True)
        torch.testing.assert_close(logits[i, 0], want.logits[0, -1], **TOL)
        event = {e.module: torch.as_tensor(e.output) for e in result.events}["model.layers.0"]
        assert list(event.shape) == [2, width, 128] and bool((event[i, len(r):] == 0).all())
        torch.testing.assert_close(event[i, :len(r)], want.hidden_states[1][0], **TOL)
        # The final norm shows the normed tensor (vLLM's fused norm returns it with the stream).
        norm = {e.module: torch.as_tensor(e.output) for e in result.events}["model.norm"]
        torch.testing.assert_close(norm[i, :len(r)], want.hidden_states[-1][0], **TOL)


async def test_run_with_cache_on_vllm_equals_the_torch_engine(vllm_server) -> None:
    """The SDK's run_with_cache over the decoder layers on the vLLM model equals the same
    call on the torch engine's copy of the folder."""
    ids = torch.tensor([[1, 40, 50, 60, 70]])
    async with hookwire.connect(vllm_server.target) as client:
        _, on_vllm = await client.model("llama").run_with_cache(ids, modules="model.layers.*")
        _, on_torch = await client.model("llama-torch").run_with_cache(ids, modules="model.layers.*")
    assert sorted(on_vllm) == sorted(on_torch) == ["model.layers.0", "model.layers.1"]
    for key in on_vllm:
        torch.testing.assert_close(torch.as_tensor(on_vllm[key]), torch.as_tensor(on_torch[key]), **TOL)


async def test_a_harvest_job_on_vllm_writes_the_torch_engines_dataset(vllm_server, harvest_roots) -> None:
    """The same harvest job (packed contexts, two modules) on the vLLM model and on the
    torch engine's copy: the same tokens, sequences and positions, values within the
    tolerance."""
    import grpc

    from hookwire.v1 import harvest_service_pb2 as hv
    from hookwire.v1 import harvest_service_pb2_grpc as hv_grpc

    _, out = harvest_roots

    def request(model: str, path: str) -> hv.StartHarvestRequest:
        return hv.StartHarvestRequest(
            model=model, modules=["model.layers.1", "model.norm"],
            source=hv.HarvestSource(text=hv.TextSource(path="docs.jsonl")),
            contexts=hv.HarvestContexts(length=12, batch_size=3, packing=hv.PACKING_PACK),
            output=hv.HarvestOutput(path=path, shard_tokens=64, overwrite=path == "on-torch"),
        )

    from support import read_dataset as read

    # The session runs it eagerly and compiled (conftest.MODES): a folder for each; the
    # torch engine's dataset is written again the second time (overwrite).
    on_vllm = "on-vllm-compiled" if vllm_server.server.registry.get("llama").tap_points is not None else "on-vllm"
    async with grpc.aio.insecure_channel(vllm_server.target) as channel:
        stub = hv_grpc.HarvestServiceStub(channel)
        for model, path in (("llama", on_vllm), ("llama-torch", "on-torch")):
            job = await stub.StartHarvest(request(model, path))
            last = job
            async for last in stub.WatchHarvest(hv.WatchHarvestRequest(job_id=job.job_id, interval_ms=50)):
                pass
            assert last.state == hv.HARVEST_STATE_SUCCEEDED, last.error
    got, want = read(out / on_vllm), read(out / "on-torch")
    assert sorted(got) == sorted(want) and got["token_ids"].numel() > 20
    for key in want:
        if want[key].is_floating_point():
            torch.testing.assert_close(got[key], want[key], **TOL)
        else:
            assert torch.equal(got[key], want[key]), key


async def test_a_hook_that_fails_its_call_inside_a_vllm_step_fails_only_that_call(vllm_server) -> None:
    """A rule that cannot apply (a vector of the wrong size) with on_error="fail_call"
    fails its own Generate call with the rule's error; a call in the same vLLM steps
    finishes with its tokens; the engine serves the next call (an exception out of a
    vLLM step would leave every request of the step stuck)."""
    bad = HookSpec("model.layers.0", posthook=[rules.add("output", torch.ones(7))], on_error="fail_call")
    async with hookwire.connect(vllm_server.target) as a, hookwire.connect(vllm_server.target) as b:
        failed, fine = await asyncio.gather(
            a.model("llama").generate(["hello world"], 5, hooks=[bad]),
            b.model("llama").generate(["the model sees"], 5),
            return_exceptions=True,
        )
        assert isinstance(failed, hookwire.HookwireError) and "model.layers.0" in str(failed), failed
        assert not isinstance(fine, BaseException), fine
        assert len(fine.token_ids[0]) == 5
        assert (await b.model("llama").generate(["hello"], 3)).steps == 3


def _same_bits(got: Any, want: torch.Tensor) -> bool:
    want = want.detach().contiguous()
    return (isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape
            and torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)))


async def test_get_parameters_answers_to_the_transformers_names_bit_for_bit(vllm_server, oracle) -> None:
    """GetParameters on the vLLM model answers to transformers' names: q_proj, k_proj and
    v_proj (rows of vLLM's fused qkv_proj), gate_proj and up_proj (of gate_up_proj), and
    the embeddings trimmed to the vocabulary (vLLM pads them to 384 rows), each with
    transformers' shape and bits; every transformers name is answered, by exact name and
    by glob; vLLM's own fused names keep answering with vLLM's shapes (the parts stacked)."""
    named = dict(oracle.named_parameters(remove_duplicate=False))
    split = [f"model.layers.{i}.{part}.weight" for i in range(2)
             for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")]
    async with hookwire.connect(vllm_server.target) as client:
        model = client.model("llama")
        got = await model.parameters(*split, "model.embed_tokens.weight", "lm_head.weight")
        assert sorted(got) == sorted([*split, "model.embed_tokens.weight", "lm_head.weight"])
        for name, tensor in got.items():
            assert _same_bits(tensor, named[name]), (name, getattr(tensor, "shape", None), named[name].shape)
        assert list(got["model.embed_tokens.weight"].shape) == [oracle.config.vocab_size, 128]
        # Every transformers name, by glob too (vLLM's fused names come along with theirs).
        everything = await model.parameters("**")
        assert set(named) <= set(everything)
        assert all(_same_bits(everything[name], want) for name, want in named.items())
        assert list(await model.parameters("model.layers.*.self_attn.k_proj.weight")) == [
            "model.layers.0.self_attn.k_proj.weight", "model.layers.1.self_attn.k_proj.weight"]
        fused = await model.parameters("model.layers.1.self_attn.qkv_proj.weight", "model.layers.1.mlp.gate_up_proj.weight")
        layer = "model.layers.1"
        assert _same_bits(fused[f"{layer}.self_attn.qkv_proj.weight"], torch.cat(
            [named[f"{layer}.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")]))
        assert _same_bits(fused[f"{layer}.mlp.gate_up_proj.weight"], torch.cat(
            [named[f"{layer}.mlp.{p}.weight"] for p in ("gate_proj", "up_proj")]))
        # GetModel lists the embedding with the shape GetParameters reads.
        info = {m.path: m for m in (await model.info()).modules}
        assert [list(p.shape) for p in info["model.embed_tokens"].parameters] == [[oracle.config.vocab_size, 128]]


async def test_a_slow_reader_on_vllm_gets_every_event_of_every_step_in_order(vllm_server) -> None:
    """vLLM advances every request it holds in each step, so the steps of a call whose
    reader is slow end before its stream took the earlier ones' messages (another call's
    steps drive vLLM meanwhile). Every event still arrives, in step order, with its
    step's tokens after it: nothing queued behind a step's end is lost."""
    hooks = [HookSpec("model.layers.*", posthook=capture("output", select="[:, -1]"))]
    async with hookwire.connect(vllm_server.target) as a, hookwire.connect(vllm_server.target) as b:
        async def slow() -> list[Any]:
            items = []
            async for item in a.model("llama").generate(["hello world"], 8, hooks=hooks):
                items.append(item)
                await asyncio.sleep(0.05)  # the reader lags: b's steps run its call ahead
            return items

        items, _ = await asyncio.gather(slow(), b.model("llama").generate(["the model sees"], 8))
    order = [(type(i).__name__, getattr(i, "step", None), getattr(i, "module", None)) for i in items]
    expected = []
    for step in range(8):
        expected += [("InterceptEvent", step, "model.layers.0"), ("InterceptEvent", step, "model.layers.1")]
        expected.append(("GeneratedTokens", step, None))
    assert order == expected, order


async def test_eight_callers_with_their_own_rules_each_change_only_their_own_tokens(vllm_server, oracle) -> None:
    """8 callers at once, one prompt each (lengths 2 to 9): callers 0-5 steer layer 0's
    residual stream with vectors of their own (callers 4 and 5 only at their last
    position, by index), 6 and 7 do not; each also captures layer 1's last position.
    Every caller's tokens equal transformers' generate() with that caller's own edit
    (or none), and its captures equal that run's layer-1 output: no edit and no row
    crossed between the requests vLLM batched together."""
    tokenizer = oracle_tokenizer()
    words = "one two three four five six seven eight nine".split()
    prompts = [" ".join(words[: 1 + c]) for c in range(8)]
    g = torch.Generator().manual_seed(11)
    vectors = [torch.randn(128, generator=g) * 1.5 for _ in range(6)]
    async with contextlib_stack(8, vllm_server.target) as clients:
        calls = []
        for c, (client, prompt) in enumerate(zip(clients, prompts)):
            hooks = [HookSpec("model.layers.1", posthook=capture("output", select="[:, -1]"))]
            if c < 6:
                index = "[:, -1]" if c in (4, 5) else None
                hooks.append(HookSpec("model.layers.0", posthook=[rules.add("output", vectors[c], index=index)]))
            calls.append(client.model("llama").generate([prompt], 5, hooks=hooks))
        results = await asyncio.gather(*calls)
    changed = 0
    for c, (prompt, result) in enumerate(zip(prompts, results)):
        ids = _ids(tokenizer, prompt)
        edits = None
        if c < 6:
            if c in (4, 5):
                seen_steps: list[int] = []

                def last_only(module: Any, args: Any, output: Any, v: torch.Tensor = vectors[c]) -> Any:
                    out = output[0] if isinstance(output, tuple) else output
                    edit = torch.zeros_like(out)
                    edit[:, -1] = v
                    seen_steps.append(1)
                    return (out + edit, *output[1:]) if isinstance(output, tuple) else out + edit
                handle = oracle.model.layers[0].register_forward_hook(last_only)
                try:
                    want, seen = _greedy(oracle, ids, 5)
                finally:
                    handle.remove()
            else:
                want, seen = _greedy(oracle, ids, 5, {"model.layers.0": vectors[c]})
        else:
            want, seen = _greedy(oracle, ids, 5, edits)
        assert list(result.token_ids[0]) == want, f"caller {c}"
        if c < 6:
            changed += want != _greedy(oracle, ids, 5)[0]
        layer1 = [e for e in result.events if e.module == "model.layers.1"]
        assert [e.step for e in layer1] == [0, 1, 2, 3, 4]
        for step, event in enumerate(layer1):
            torch.testing.assert_close(torch.as_tensor(event.output)[0], seen["model.layers.1"][step][0, -1], **TOL)
    assert changed >= 3, "the vectors must change most steered callers' tokens for this test to mean anything"


def test_vllm_finish_reasons_map_to_hookwires() -> None:
    """vLLM says "stop" for both the end-of-sequence token (stop_reason None, or the
    token id) and a stop string (stop_reason the string): hookwire says "eos" and
    "stop", as the torch engine does; "length" stays "length"."""
    from vllm.outputs import CompletionOutput

    from hookwire_server.engine.vllm_engine import _reason

    def out(reason: str, stop: Any) -> CompletionOutput:
        return CompletionOutput(index=0, text="", token_ids=[1], cumulative_logprob=None, logprobs=None,
                                finish_reason=reason, stop_reason=stop)

    assert _reason(out("stop", None)) == "eos"
    assert _reason(out("stop", 2)) == "eos"
    assert _reason(out("stop", "the")) == "stop"
    assert _reason(out("length", None)) == "length"


async def test_a_long_prompt_is_one_step_0_event_and_too_many_prompts_are_refused(vllm_server) -> None:
    """A prompt of 100 tokens runs in one vLLM step (no chunked prefill): one step-0 event
    per hook over the whole prompt. A call of more prompts than vllm.max_num_seqs (8) is
    refused before anything runs, naming the setting."""
    ids = torch.randint(3, 300, (1, 100), generator=torch.Generator().manual_seed(2))
    async with hookwire.connect(vllm_server.target) as client:
        model = client.model("llama")
        result = await model.generate(ids, 2, hooks=[HookSpec("model.layers.0", posthook=capture("output"))])
        step0 = [e for e in result.events if e.step == 0]
        assert len(step0) == 1 and list(torch.as_tensor(step0[0].output).shape) == [1, 100, 128]
        with pytest.raises(hookwire.InvalidArgumentError, match=r"prompts: 9 sequences .* vllm.max_num_seqs 8"):
            await model.generate(["hi"] * 9, 2)
        with pytest.raises(hookwire.InvalidArgumentError, match=r"input_ids: 9 sequences .* vllm.max_num_seqs 8"):
            await model.infer(torch.ones(9, 3, dtype=torch.long))


async def test_when_vllm_fails_inside_a_step_its_calls_fail_and_the_model_turns_failed(llama_folder) -> None:
    """A second engine, small (7 KV blocks of 32 tokens, 64 tokens a step). While it is
    healthy: touched calls start whole and wait for room instead of being preempted or
    split, each stream equal to its call alone, and one that could never run at once
    is refused; calls no hook touches get vLLM's own admission (more sequences running
    than full-length reservations allow), chunked prefill and preemption, with the tokens
    they would have alone (the scheduler's own cases: tests/vllm_engine/test_vllm_scheduler.py).

    Then fault injection (vLLM's own step raises, as when its worker dies): the calls in
    flight fail at once with FAILED_PRECONDITION naming the failure (none is left
    waiting), the model is listed as failed with the reason, and later calls are refused
    with it; the server stays up, its health says so (the model's own service, readiness
    and liveness turn NOT_SERVING: the pod must be restarted), and Generate's time to
    first token and inter-token latency were observed on this engine too. (It does not
    restart: docs/vllm.md.)"""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from hookwire_server import ModelRegistry, ServerSettings
    from hookwire_server.engine.core import build_host
    from hookwire_server.models.model_loading import ModelConfig
    from support import ServerThread, until

    # 256 KiB of KV cache: 8 blocks of 32 tokens (1 KiB a token here), one of them vLLM's;
    # 64 tokens a step.
    host = build_host(ModelConfig(name="fragile", transformers=str(llama_folder), engine="vllm",
                                  vllm={"max_model_len": 64, "max_num_seqs": 8, "kv_cache_bytes": 256 << 10,
                                        "block_size": 32, "max_num_batched_tokens": 64, "worker_processes": False,
                                        "enforce_eager": True}))
    srv = ServerThread(ModelRegistry([host]), ServerSettings(port=0)).start()
    engine = host.loaded_engine
    assert engine.capacity_blocks == 7
    scheduler = engine.scheduler
    assert type(scheduler).__name__ == "HookwireScheduler"
    # Touched calls: two of 4 sequences each (4 blocks each at full length) cannot run at
    # once; the second waits for room instead of being preempted or split, and both
    # stream one event per hook and step, equal to each call alone.
    async with hookwire.connect(srv.target) as client:
        model = client.model("fragile")
        hooks = [HookSpec("model.layers.1", posthook=capture("output", select="[:, -1]"))]
        prompts = [["one", "two words", "a", "three words here"], ["b", "c d", "e f g", "h"]]
        together = await asyncio.gather(*(model.generate(p, 6, hooks=hooks) for p in prompts))
        alone = [await model.generate(p, 6, hooks=hooks) for p in prompts]
        for both, one in zip(together, alone):
            assert both.token_ids == one.token_ids
            assert [e.step for e in both.events] == list(range(6))
            for a, b in zip(both.events, one.events):
                torch.testing.assert_close(torch.as_tensor(a.output), torch.as_tensor(b.output), **TOL)
        with pytest.raises(hookwire.ResourceExhaustedError, match=r"prompts: .* KV cache; model 'fragile' has 224"):
            await model.generate(["x"] * 8, 6, hooks=hooks)
    metrics = srv.server.metrics.registry
    assert metrics.get_sample_value("hookwire_time_to_first_token_seconds_count", {"model": "fragile", "front": "grpc"}) == 4
    assert metrics.get_sample_value("hookwire_inter_token_latency_seconds_count", {"model": "fragile", "front": "grpc"}) == 4 * 5
    assert srv.call(srv.server.health_statuses)["hookwire.live"]
    async with hookwire.connect(srv.target) as client:
        model = client.model("fragile")
        # The same call without hooks is vLLM's: it runs (7 sequences at once, the eighth
        # when one is preempted or ends); with a rule of its session it is touched again,
        # and refused when it enters vLLM.
        untouched = await model.generate(["x"] * 8, 6)
        assert len(set(untouched.token_ids)) == 1
        async with hookwire.connect(srv.target) as other:
            session = other.model("fragile")
            await session.hook("model.layers.0", posthook=[rules.scale("output", 1.0)])
            with pytest.raises(hookwire.ResourceExhaustedError, match=r"prompts: .* KV cache; model 'fragile' has 224"):
                await session.generate(["x"] * 8, 6)
        # vLLM's admission: 6 untouched sequences of 41 tokens (12 blocks at full length,
        # refused if touched) all start at once, and are preempted and recomputed as their
        # cache runs out, with each sequence's tokens alone.
        plain = ["a b", "c d", "e f", "g h", "i j", "k l"]
        scheduler.most_running = 0
        crowd = await model.generate(plain, 40)
        assert scheduler.most_running == 6
        assert list(crowd.token_ids) == [(await model.generate([p], 40)).token_ids[0] for p in plain]
    async with hookwire.connect(srv.target) as client:
        model = client.model("fragile")
        # The step's token budget: 45 prompt tokens, then 25 (vLLM would run the second
        # call's first two prompts beside the first call's and leave its third for the next
        # step): the touched second call waits for room whole; one over the budget is refused.
        first, second = ["the cat sat on the mat and the dog"] * 3, ["a", "b", "hello world the model sees every layer of it"]
        together = await asyncio.gather(model.generate(first, 4, hooks=hooks), model.generate(second, 4, hooks=hooks))
        for both, prompts in zip(together, (first, second)):
            one = await model.generate(prompts, 4, hooks=hooks)
            assert both.token_ids == one.token_ids and [e.step for e in both.events] == list(range(4))
        with pytest.raises(hookwire.InvalidArgumentError, match=r"prompts: the call's 84 prompt tokens pass model "
                                                                 r"'fragile''s vllm.max_num_batched_tokens 64"):
            await model.generate([second[2]] * 4, 2, hooks=hooks)
        # Without hooks the same prompts are chunked across steps; a touched call sent with
        # them runs its prompt whole in its step 0 (its capture equals the call alone).
        chunked = scheduler.chunked_prefills
        steer = [HookSpec("model.layers.1", posthook=capture("output"))]
        mixed = await asyncio.gather(model.generate([second[2]] * 4, 2), model.generate(first[:1], 2, hooks=steer))
        assert scheduler.chunked_prefills > chunked
        assert mixed[0].token_ids == (await model.generate([second[2]] * 4, 2)).token_ids
        hooked_alone = await model.generate(first[:1], 2, hooks=steer)
        assert mixed[1].token_ids == hooked_alone.token_ids
        assert list(torch.as_tensor(mixed[1].events[0].output).shape)[:2] == [1, len(hooked_alone.events[0].output[0])]
        torch.testing.assert_close(torch.as_tensor(mixed[1].events[0].output),
                                   torch.as_tensor(hooked_alone.events[0].output), **TOL)
        assert scheduler.touched_chunked == 0
    real_step = engine._engine.step
    steps = {"n": 0}

    def dying_step() -> Any:
        steps["n"] += 1
        if steps["n"] > 3:
            raise RuntimeError("the engine core died")
        return real_step()

    engine._engine.step = dying_step
    try:
        async with hookwire.connect(srv.target) as client:
            model = client.model("fragile")
            outcomes = await asyncio.wait_for(asyncio.gather(
                model.generate(["hello"], 20), model.generate(["the cat"], 20), return_exceptions=True), 60)
            for outcome in outcomes:
                assert isinstance(outcome, hookwire.FailedPreconditionError), outcome
                assert "vLLM engine of model 'fragile' failed in a step" in str(outcome)
                assert "the engine core died" in str(outcome)
            (info,) = await client.list_models()
            assert info.state == "failed" and "the engine core died" in info.state_message
            with pytest.raises(hookwire.FailedPreconditionError, match="model 'fragile' failed while serving"):
                await model.generate(["hello"], 2)
        async with grpc.aio.insecure_channel(srv.target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for service in ("hookwire.model.fragile", "", "hookwire.v1.ModelService", "hookwire.live"):
                async def down() -> bool:
                    reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                    return reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
                await until(down, f"{service!r} turns NOT_SERVING")
    finally:
        srv.stop()


async def test_lm_head_hooks_see_and_steer_the_logits_vllm_samples_from(vllm_server, oracle) -> None:
    """vLLM's lm_head runs inside its logits processor, for each sequence's last position
    only: a hook on "lm_head" fires there and sees [sequences, 1, vocabulary] logits
    (vLLM's padding cut), equal to transformers' logits of the same positions; a rule on
    them changes what vLLM samples (a large bonus on one token makes greedy decoding pick
    it every step)."""
    tokenizer = oracle_tokenizer()
    prompts = PROMPTS[:2]
    async with hookwire.connect(vllm_server.target) as client:
        model = client.model("llama")
        seen = await model.generate(prompts, 3, hooks=[HookSpec("lm_head", posthook=capture("output"))])
        bonus = torch.zeros(oracle.config.vocab_size)
        bonus[42] = 1000.0
        forced = await model.generate(prompts, 4, hooks=[HookSpec("lm_head", posthook=[rules.add("output", bonus)])])
    assert forced.token_ids == ((42, 42, 42, 42), (42, 42, 42, 42))
    events = [torch.as_tensor(e.output) for e in seen.events]
    assert [e.step for e in seen.events] == [0, 1, 2]
    assert all(list(e.shape) == [2, 1, oracle.config.vocab_size] for e in events)
    for row, prompt in enumerate(prompts):
        ids = _ids(tokenizer, prompt) + list(seen.token_ids[row])
        with torch.no_grad():
            logits = oracle(torch.tensor([ids])).logits[0]
        start = len(_ids(tokenizer, prompt)) - 1
        for step in range(3):
            torch.testing.assert_close(events[step][row, 0], logits[start + step], **TOL)


async def test_a_calls_own_save_and_patch_slots_work_within_its_vllm_steps(vllm_server, oracle) -> None:
    """A call that saves layer 0's residual stream into a slot, scaled, and patches it
    into layer 1's output at the last position, every step: its tokens equal
    transformers' generate() with the same edits (the save and the patch of each step
    are the call's own, in firing order). Tokenize answers with the folder's tokenizer."""
    tokenizer = oracle_tokenizer()
    prompt = "the model sees"
    want, _ = scaled_save_and_patch(oracle, _ids(tokenizer, prompt), 5, oracle.model.layers[0], oracle.model.layers[1])
    async with hookwire.connect(vllm_server.target) as client:
        model = client.model("llama")
        # Slots live in the session: session hooks, then a call in that session.
        await model.hook("model.layers.0", posthook=[rules.scale("output", 3.0), rules.save("output", slot="s")])
        await model.hook("model.layers.1", posthook=[rules.patch("output", slot="s", index="[:, -1]")])
        result = await model.generate([prompt], 5)
        (ids,) = (await model.tokenize([prompt])).input_ids
    assert list(result.token_ids[0]) == want
    assert list(ids) == _ids(tokenizer, prompt)



async def test_bad_input_fails_its_own_call_and_the_model_keeps_serving(vllm_server) -> None:
    """A token id outside the vocabulary (Infer and Generate), an Infer whose request
    rule fails with on_error="fail_call", and two Generate calls whose sequences together
    pass vllm.max_num_seqs (8): each bad call fails alone with a clear status, the
    crowded calls both finish (vLLM runs what fits), and the model answers after
    every one of them."""
    bad_rule = HookSpec("model.layers.0", posthook=[rules.add("output", torch.ones(7))], on_error="fail_call")
    async with hookwire.connect(vllm_server.target) as client:
        model = client.model("llama")
        with pytest.raises(hookwire.InvalidArgumentError, match="input_ids: token id 1000000 is outside"):
            await model.infer(torch.tensor([[1, 40, 10**6]]))
        with pytest.raises(hookwire.InvalidArgumentError, match="token id"):
            await model.generate(torch.tensor([[1, 40, 50], [1, 40, 10**6]]), 3)
        for _ in range(2):
            with pytest.raises(hookwire.HookwireError, match="model.layers.0"):
                await model.infer(torch.tensor([[1, 40, 50]]), hooks=[bad_rule])
        ok = await model.infer(torch.tensor([[1, 40, 50]]))
        assert list(torch.as_tensor(ok.output["logits"]).shape)[:2] == [1, 1]
        crowd = [["one"] * 6, ["two", "three", "four", "five"]]
        results = await asyncio.wait_for(asyncio.gather(*(model.generate(p, 4) for p in crowd)), 120)
        alone = [await model.generate(p, 4) for p in crowd]
        assert [r.token_ids for r in results] == [r.token_ids for r in alone]


async def test_steps_kept_ahead_of_a_stalled_reader_count_against_the_principals_held_bytes(vllm_server) -> None:
    """On vLLM a call whose reader stalls runs ahead (vLLM steps every request it holds,
    here for another caller's call): once the stream's transport is full, the events of
    steps it has not taken count against max_buffered_bytes_per_principal, and past it
    the call fails with RESOURCE_EXHAUSTED naming the setting instead of holding more
    memory; the other caller's call finishes, and nothing stays counted afterwards."""
    import grpc

    from hookwire._generation import generate_request
    from hookwire.v1 import model_service_pb2_grpc
    from hookwire_server.auth import ANONYMOUS
    from support import slow_reader_channel

    held = vllm_server.server.hooks.held_bytes
    old = held.limit
    held.limit = held._buffers(ANONYMOUS.name) + 64 * 1024  # 64 KiB ahead of the stream
    hooks = [HookSpec("**", posthook=capture("output"))]
    request = generate_request("llama", ["hello world"], 60, stop=[], attention_mask=None, hooks=hooks,
                               do_sample=None, temperature=None, top_k=None, top_p=None, seed=None, tags=(),
                               session_id="", max_response_message_bytes=0)
    try:
        async with slow_reader_channel(vllm_server.target) as channel, hookwire.connect(vllm_server.target) as b:
            call = model_service_pb2_grpc.ModelServiceStub(channel).Generate(request)
            await call.read()  # started; then the reader stalls while b's call drives vLLM
            fine = await b.model("llama").generate(["the model sees"], 60)
            status = None
            try:
                while await call.read() is not grpc.aio.EOF:
                    pass
            except grpc.aio.AioRpcError as exc:
                status = exc
        assert status is not None and status.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, status
        assert "max_buffered_bytes_per_principal" in (status.details() or "")
        assert len(fine.token_ids[0]) == 60
        assert held.held(ANONYMOUS.name) == 0
    finally:
        held.limit = old


def test_hookwire_inspect_names_the_engine_and_what_it_refuses(vllm_server) -> None:
    """The CLI's inspect says which engine runs a model and what it refuses."""
    import pathlib
    import subprocess
    import sys

    hookwire_cli = pathlib.Path(sys.executable).with_name("hookwire")  # the installed command
    out = subprocess.run([str(hookwire_cli), "inspect", "llama", "--target", vllm_server.target],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "engine: vllm; refuses attention_probabilities, backward, train" in out.stdout


async def test_a_cancelled_call_that_ran_ahead_leaves_nothing_counted(vllm_server) -> None:
    """A stalled reader's call that ran ahead (events counted against its principal's
    held bytes) is cancelled while another call still drives vLLM: once both ended,
    nothing stays counted, round after round (steps still in flight when the call
    ended must not count again)."""
    import grpc

    from hookwire._generation import generate_request
    from hookwire.v1 import model_service_pb2_grpc
    from hookwire_server.auth import ANONYMOUS
    from support import slow_reader_channel, until

    held = vllm_server.server.hooks.held_bytes
    hooks = [HookSpec("**", posthook=capture("output"))]
    request = generate_request("llama", ["hello world"], 100, stop=[], attention_mask=None, hooks=hooks,
                               do_sample=None, temperature=None, top_k=None, top_p=None, seed=None, tags=(),
                               session_id="", max_response_message_bytes=0)
    for round_ in range(3):
        async with slow_reader_channel(vllm_server.target) as channel, hookwire.connect(vllm_server.target) as b:
            call = model_service_pb2_grpc.ModelServiceStub(channel).Generate(request)
            await call.read()
            other = asyncio.ensure_future(b.model("llama").generate(["the model sees"], 100))
            await until(lambda: held.held(ANONYMOUS.name) > 0, "the stalled call's steps ran ahead and were counted")
            call.cancel()
            await other
        await until(lambda: held.held(ANONYMOUS.name) == 0, f"nothing counted after round {round_}")


async def test_a_probe_gated_edit_at_a_later_layer_equals_the_same_hooks_in_transformers(vllm_server, oracle) -> None:
    """Issue 25's conditions and signals on vLLM: layer 0 keeps a probe's score (its
    largest over each step's positions), layer 1 adds a vector where it is high, at every
    step of two prompts in one call; tokens equal transformers' generate() with the same
    two torch hooks (each prompt alone: its own rows only), and a conditional scale on the
    final norm leaves the rows where its condition fails bit for bit (captured after it)."""
    tokenizer = oracle_tokenizer()
    probe = torch.randn(128, generator=torch.Generator().manual_seed(21))
    vector = torch.randn(128, generator=torch.Generator().manual_seed(22)) * 3.0
    prompts = PROMPTS[:2]
    scores: list[float] = []
    with torch.no_grad():
        for text in prompts:
            out = oracle(torch.tensor([_ids(tokenizer, text)]), output_hidden_states=True)
            scores.append(float((out.hidden_states[1][0] @ probe).max()))
    threshold = sum(scores) / 2  # fires for one prompt's prompt step, not the other's

    def gated(ids: list[int]) -> list[int]:
        kept: dict[str, torch.Tensor] = {}

        def detect(module: Any, args: Any, output: Any) -> None:
            out = output[0] if isinstance(output, tuple) else output
            kept["s"] = (out @ probe).amax(dim=-1, keepdim=True)

        def steer(module: Any, args: Any, output: Any) -> Any:
            out = output[0] if isinstance(output, tuple) else output
            new = torch.where((kept["s"] > threshold).expand(out.shape[:-1]).unsqueeze(-1), out + vector, out)
            return (new, *output[1:]) if isinstance(output, tuple) else new
        handles = [oracle.model.layers[0].register_forward_hook(detect), oracle.model.layers[1].register_forward_hook(steer)]
        try:
            with torch.no_grad():
                out = oracle.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                      max_new_tokens=6, do_sample=False, pad_token_id=0)
        finally:
            for h in handles:
                h.remove()
        return out[0, len(ids):].tolist()

    async with hookwire.connect(vllm_server.target) as client:
        result = await client.model("llama").generate(prompts, 6, hooks=[
            HookSpec("model.layers.0", posthook=[rules.signal("output", "s", rules.probe(probe), reduce="max")]),
            HookSpec("model.layers.1", posthook=[rules.when(rules.stored("s") > threshold, rules.add("output", vector))]),
        ])
        changed = False
        for row, text in enumerate(prompts):
            want = gated(_ids(tokenizer, text))
            assert list(result.token_ids[row]) == want, text
            changed = changed or want != _greedy(oracle, _ids(tokenizer, text), 6)[0]
        assert changed, "the gated edit must change some tokens for this test to mean anything"
        plain = await client.model("llama").infer(torch.tensor([_ids(tokenizer, PROMPTS[1])]),
                                                  hooks=[HookSpec("model.norm", posthook=capture("output"))])
        before = torch.as_tensor(plain.events[0].output)
        norms = torch.linalg.vector_norm(before, dim=-1)
        cut = float(norms.median())
        edited = await client.model("llama").infer(torch.tensor([_ids(tokenizer, PROMPTS[1])]), hooks=[
            HookSpec("model.norm", posthook=hookwire.edit(rules.when(rules.norm() > cut, rules.scale("output", 0.0)),
                                                         capture=("output",)))])
        after = torch.as_tensor(edited.events[0].output)
        held = norms > cut
        assert bool(held.any()) and not bool(held.all())
        assert torch.equal(after[~held], before[~held]) and bool((after[held] == 0).all())


async def test_a_probe_gated_stop_on_vllm_ends_only_the_sequence_it_fires_for(vllm_server, oracle) -> None:
    """A stop rule on vLLM: the sequence whose probe score (layer 1, its last position)
    passes the threshold ends at that step with finish reason "rule", its token of that
    step not emitted, and its request leaves vLLM; the call's other sequence goes on as
    transformers' generate() gives it."""
    probe = torch.randn(128, generator=torch.Generator().manual_seed(41))
    threshold, firsts, tokens = stop_case(oracle, probe, PROMPTS[:2])
    async with hookwire.connect(vllm_server.target) as client:
        result = await client.model("llama").generate(PROMPTS[:2], 8, hooks=[
            HookSpec("model.layers.1", posthook=[rules.stop("output", rules.probe(probe) > threshold)])])
    check_stops(result, firsts, tokens)


async def test_readouts_on_vllm_equal_transformers(vllm_server, oracle) -> None:
    """A logit lens readout (vLLM's own final norm and lm_head, its vocabulary padding cut)
    and a probe readout of layer 0 at every step equal the same computation on
    transformers' layer outputs, within the tolerance (the top-5 token ids exactly)."""
    tokenizer = oracle_tokenizer()
    probes = torch.randn(2, 128, generator=torch.Generator().manual_seed(61))
    text = PROMPTS[0]
    _, seen = _greedy(oracle, _ids(tokenizer, text), 3)
    async with hookwire.connect(vllm_server.target) as client:
        lens = await client.model("llama").generate([text], 3, hooks=[
            HookSpec("model.layers.0", posthook=capture("output", readout=rules.logit_lens(5)))])
        scored = await client.model("llama").generate([text], 3, hooks=[
            HookSpec("model.layers.0", posthook=capture("output", readout=rules.probe_scores(probes)))])
    for event, probe_event in zip(lens.events, scored.events):
        x = seen["model.layers.0"][event.step]
        with torch.no_grad():
            logits = oracle.lm_head(oracle.model.norm(x))
        values, tokens = logits.topk(5, dim=-1)
        assert torch.equal(torch.as_tensor(event.output["token_ids"])[0], tokens[0])
        torch.testing.assert_close(torch.as_tensor(event.output["logits"])[0], values[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(torch.as_tensor(probe_event.output)[0], (x @ probes.T)[0], **TOL)


async def test_compact_readouts_on_vllm_equal_the_per_module_events(vllm_server) -> None:
    """Compact probe readouts on every layer (one event per vLLM step and call, expanded
    by the SDK) equal the per-module readout events of the same calls, for two calls that
    share vLLM's steps, each with its own rows."""
    probes = torch.randn(2, 128, generator=torch.Generator().manual_seed(62))

    def spec(compact: bool) -> HookSpec:
        return HookSpec("model.layers.*", posthook=capture("output", readout=rules.probe_scores(probes, compact=compact)))

    async with hookwire.connect(vllm_server.target) as client:
        model = client.model("llama")
        plain = await asyncio.gather(*(model.generate([text], 3, hooks=[spec(False)]) for text in PROMPTS[:2]))
        compact = await asyncio.gather(*(model.generate([text], 3, hooks=[spec(True)]) for text in PROMPTS[:2]))
    for mine, theirs in zip(compact, plain):
        assert mine.token_ids == theirs.token_ids
        assert [(e.step, e.module) for e in mine.events] == [(e.step, e.module) for e in theirs.events]
        for a, b in zip(mine.events, theirs.events):
            torch.testing.assert_close(torch.as_tensor(a.output), torch.as_tensor(b.output), **TOL)
        assert len({id(e.raw) for e in mine.events}) == mine.steps  # one wire event per step
        assert all(list(e.raw.module_indices) == [0, 1] for e in mine.events)


async def test_infer_logits_are_what_the_lm_head_rules_left(vllm_server, oracle) -> None:
    """A rule on lm_head changes the logits Infer returns (the engine keeps them after
    every hook on the logits processor), as transformers' lm_head hook would."""
    tokenizer = oracle_tokenizer()
    ids = _ids(tokenizer, PROMPTS[0])
    with torch.no_grad():
        want = oracle(torch.tensor([ids])).logits[0, -1] * 2.0
    async with hookwire.connect(vllm_server.target) as client:
        result = await client.model("llama").infer(torch.tensor([ids]), hooks=[
            HookSpec("lm_head", posthook=[rules.scale("output", 2.0)])])
    torch.testing.assert_close(torch.as_tensor(result.output["logits"])[0, 0], want, rtol=1e-5, atol=2e-6)


async def test_a_token_id_condition_on_vllm_equals_the_same_edit_in_transformers(vllm_server, oracle) -> None:
    """Zeroing layer 0's output wherever a given token sits (in the prompt, and wherever it
    is generated), on vLLM: tokens equal transformers' generate() with the same edit."""
    text = PROMPTS[0]
    ids = _ids(oracle_tokenizer(), text)
    want = token_gated_tokens(oracle, ids, ids[1], 6)
    assert want != _greedy(oracle, ids, 6)[0]
    async with hookwire.connect(vllm_server.target) as client:
        result = await client.model("llama").generate([text], 6, hooks=[
            HookSpec("model.layers.0", posthook=[rules.when(rules.token_id().eq(ids[1]), rules.zero("output"))])])
    assert list(result.token_ids[0]) == want


async def test_named_operands_steer_and_read_on_vllm_as_the_same_tensors_inline(vllm_server, oracle) -> None:
    """A steering vector and probe weights uploaded once and named by a session hook and
    a readout: the tokens equal transformers' generate() with the same edit, and the
    probe scores equal the inline readout's (the engine sees the same tensors)."""
    tokenizer = oracle_tokenizer()
    prompt = PROMPTS[1]
    vector = torch.randn(128, generator=torch.Generator().manual_seed(3)) * 2.0
    probes = torch.randn(2, 128, generator=torch.Generator().manual_seed(61))
    steered_want, _ = _greedy(oracle, _ids(tokenizer, prompt), 6, {"model.layers.0": vector})
    async with hookwire.connect(vllm_server.target) as client:
        await client.upload_operand("steer", vector)
        await client.upload_operand("probes", probes)
        async with client.model("llama").hook("model.layers.0", posthook=[rules.add("output", rules.operand("steer"))]):
            named = await client.model("llama").generate([prompt], 6, hooks=[
                HookSpec("model.layers.1", posthook=capture("output", readout=rules.probe_scores(rules.operand("probes"))))])
            inline = await client.model("llama").generate([prompt], 6, hooks=[
                HookSpec("model.layers.1", posthook=capture("output", readout=rules.probe_scores(probes)))])
        (listed,) = [op for op in await client.list_operands() if op.name == "steer"]
        assert listed.used_by == ()  # the session hook is gone: the name is free to delete
        assert await client.delete_operand("steer") == 128 * 4
    assert list(named.token_ids[0]) == steered_want == list(inline.token_ids[0])
    assert len(named.events) == len(inline.events) == 6
    for a, b in zip(named.events, inline.events):
        assert torch.equal(torch.as_tensor(a.output), torch.as_tensor(b.output))


async def test_the_models_thread_runs_every_core_but_the_fronts(vllm_server) -> None:
    """In-process the model runs on its worker thread with all cores but one (vllm_threads:
    with torch's default, a busy neighbour collapsed throughput tenfold), whatever vLLM's
    CPU worker did to torch.set_num_threads; the server's other threads keep torch's default."""
    from hookwire_server.engine import vllm_threads

    async with hookwire.connect(vllm_server.target) as client:
        await client.model("llama").generate("hello world", 2)
    host = vllm_server.server.registry.get("llama")
    want = vllm_threads.model_threads()
    assert host.loaded_engine.model_threads == want
    assert host._executor.submit(torch.get_num_threads).result() == want
    other: list[int] = []
    vllm_threads._in_fresh_thread(lambda: other.append(torch.get_num_threads()))
    assert vllm_threads.process_default is not None and other == [vllm_threads.process_default]


#: A prompt of whole 32-token KV blocks and more (the shared engine's block_size), which
#: vLLM's prefix cache can share.
LONG_PROMPT = " ".join(["the model sees a hello world"] * 9)


async def test_calls_no_hook_touches_share_the_prefix_cache_and_a_hooked_call_never_does(vllm_server, oracle) -> None:
    """Unhooked calls reuse the prompt blocks an earlier unhooked call of the prompt left in
    vLLM's prefix cache (vLLM's own count of cached tokens), with transformers' tokens; a
    steered call of the same prompt reuses nothing (its own cache salt): its step-0 capture
    is the whole prompt, its tokens transformers' steered ones; and no later unhooked call
    inherits its edits."""
    tokenizer = oracle_tokenizer()
    ids = _ids(tokenizer, LONG_PROMPT)
    assert 64 < len(ids) <= 120, len(ids)
    vector = torch.randn(128, generator=torch.Generator().manual_seed(5)) * 2.0
    plain_want, _ = _greedy(oracle, ids, 4)
    steered_want, seen = _greedy(oracle, ids, 4, {"model.layers.0": vector})
    assert plain_want != steered_want
    engine = vllm_server.server.registry.get("llama").loaded_engine
    async with hookwire.connect(vllm_server.target) as client:
        model = client.model("llama")
        first = await model.generate([LONG_PROMPT], 4)
        before = engine.prefix_cached_tokens
        second = await model.generate([LONG_PROMPT], 4)
        reused = engine.prefix_cached_tokens - before
        before = engine.prefix_cached_tokens
        steer = HookSpec("model.layers.0", posthook=edit(rules.add("output", vector), capture=("output",)))
        steered = await model.generate([LONG_PROMPT], 4, hooks=[steer])
        steered_reused = engine.prefix_cached_tokens - before
        after = await model.generate([LONG_PROMPT], 4)
    assert [list(r.token_ids[0]) for r in (first, second, after)] == [plain_want] * 3
    assert reused >= 64, "the second unhooked call did not reuse the first one's cached prompt"
    assert steered_reused == 0
    assert list(steered.token_ids[0]) == steered_want
    step0 = steered.events_by_step[0][0].output
    assert list(step0.shape) == [1, len(ids), 128]
    torch.testing.assert_close(step0[0], seen["model.layers.0"][0][0], **TOL)


async def test_a_hooked_and_an_unhooked_call_share_a_step_and_each_gets_its_own(vllm_server, oracle) -> None:
    """A call with hooks of its own (every decoder layer captured, a steering rule) and an
    unhooked call on a cached prompt, at once: the hooked call's captures and tokens equal
    transformers' steered run, the unhooked call's tokens transformers' plain ones, and
    its prompt came from the prefix cache (it was not held to the hooked call's rules)."""
    tokenizer = oracle_tokenizer()
    hooked_prompt = PROMPTS[0]
    vector = torch.randn(128, generator=torch.Generator().manual_seed(6)) * 2.0
    steered_want, seen = _greedy(oracle, _ids(tokenizer, hooked_prompt), 5, {"model.layers.1": vector})
    plain_want, _ = _greedy(oracle, _ids(tokenizer, LONG_PROMPT), 5)
    engine = vllm_server.server.registry.get("llama").loaded_engine
    hooks = [HookSpec("model.layers.1", posthook=edit(rules.add("output", vector))),
             HookSpec("model.layers.*", posthook=capture("output"))]
    async with hookwire.connect(vllm_server.target) as a, hookwire.connect(vllm_server.target) as b:
        await b.model("llama").generate([LONG_PROMPT], 1)  # its prompt in the cache
        before = engine.prefix_cached_tokens
        hooked, plain = await asyncio.gather(a.model("llama").generate([hooked_prompt], 5, hooks=hooks),
                                             b.model("llama").generate([LONG_PROMPT], 5))
    assert engine.prefix_cached_tokens - before >= 64
    assert list(hooked.token_ids[0]) == steered_want
    assert list(plain.token_ids[0]) == plain_want
    for step, events in enumerate(hooked.events_by_step):
        for event in events:
            torch.testing.assert_close(event.output[0], seen[event.module][step][0], **TOL)


async def test_a_hook_registered_while_an_unhooked_call_runs_applies_from_the_next_call(vllm_server) -> None:
    """Whether a hook can fire on a call is decided when the call enters vLLM: a SCOPE_ALL
    observer registered while an unhooked call runs sees none of that call's steps (its
    prompt may have come from the prefix cache), and every step of the next call."""
    async with hookwire.connect(vllm_server.target) as client, hookwire.connect(vllm_server.target) as watcher:
        model = client.model("llama")
        running = model.generate(["hello world"], 20, do_sample=False)
        first = None
        async for item in running:  # its first tokens: it runs (and waits for its reader)
            first = item
            break
        assert isinstance(first, hookwire.GeneratedTokens)
        handle = await watcher.register_hook(
            HookSpec("model.layers.0", posthook=capture("output"), scope="all", ttl_seconds=600), model="llama")
        try:
            seen: list[hookwire.InterceptEvent] = []
            async with watcher.subscribe([handle.id], policy="block") as sub:
                async def read() -> None:
                    async for event in sub:
                        seen.append(event)

                reader = asyncio.ensure_future(read())
                rest = [item async for item in running]
                assert len([i for i in rest if isinstance(i, hookwire.GeneratedTokens)]) == 19
                nxt = await model.generate(["hello world"], 3, do_sample=False)
                await until(lambda: len(seen) >= 3, "the next call's events")
                reader.cancel()
        finally:
            await watcher.deregister_hook(handle.id)
    assert {e.request_id for e in seen} == {nxt.request_id}
    assert sorted(e.step for e in seen) == [0, 1, 2]
