"""GenerateRequest's decoding options on vLLM (logprobs, top_logprobs, prompt_logprobs,
ignore_eos, min_new_tokens), over real gRPC against the session's vLLM server, checked
against transformers in process (the oracle: the same folder): log-probabilities are the
float32 log-softmax of the model's raw logits at each position.

Tolerance: vLLM's CPU kernels reduce in other orders than transformers' eager code (a
decoder layer's output differs by ~6e-8, see test_vllm_engine.py); log-probabilities
are compared within 1e-4, token ids exactly.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import grpc
import pytest
import torch

import hookwire
from hookwire import HookSpec, capture
from hookwire._generation import generate_request
from hookwire.v1 import model_service_pb2
from hookwire.wire import codec

from test_vllm_engine import PROMPTS, _ids, oracle_tokenizer

LP_TOL = 1e-4
#: Limits.max_top_logprobs (the server's default limits).
MAX_TOP = 20


def _request(max_new_tokens: int, prompts: list[str] | None = None, ids: list[list[int]] | None = None,
             **fields: Any) -> model_service_pb2.GenerateRequest:
    """A greedy GenerateRequest on "llama" for text ``prompts`` or token ``ids`` (left-padded
    with an attention mask); ``fields``: GenerateRequest's other fields."""
    fields.setdefault("do_sample", False)
    request = model_service_pb2.GenerateRequest(model="llama", max_new_tokens=max_new_tokens, **fields)
    if prompts is not None:
        request.prompts.extend(prompts)
    if ids is not None:
        width = max(len(row) for row in ids)
        padded = torch.tensor([[0] * (width - len(row)) + row for row in ids], dtype=torch.int64)
        mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in ids], dtype=torch.int64)
        codec.encode_tensor_into(padded, request.input_ids)
        codec.encode_tensor_into(mask, request.attention_mask)
    return request


async def _generate(target: str, request: model_service_pb2.GenerateRequest
                    ) -> tuple[list[model_service_pb2.GeneratedTokens], model_service_pb2.GenerateDone]:
    """Runs one Generate over gRPC: each step's GeneratedTokens, in order, and its done."""
    async with hookwire.connect(target) as client:
        messages = [m async for m in client.model_stub.Generate(request)]
    steps: list[model_service_pb2.GeneratedTokens] = []
    done = None
    for m in messages:
        kind = m.WhichOneof("kind")
        if kind == "tokens":
            steps.append(m.tokens)
        elif kind == "steps":
            steps.extend(m.steps.steps)
        elif kind == "done":
            done = m.done
    assert done is not None
    assert [s.step for s in steps] == list(range(len(steps)))
    return steps, done


async def _status(target: str, request: model_service_pb2.GenerateRequest) -> grpc.aio.AioRpcError | None:
    try:
        await _generate(target, request)
    except grpc.aio.AioRpcError as exc:
        return exc
    return None


def _log_softmax(oracle: Any, ids: list[int]) -> torch.Tensor:
    """transformers' float32 log-softmax of the raw logits at every position of ``ids``."""
    with torch.no_grad():
        return torch.log_softmax(oracle(torch.tensor([ids])).logits[0].float(), dim=-1)


def _check_entry(entry: model_service_pb2.TokenLogprobs, token: int, want: torch.Tensor, k: int) -> None:
    """A position's TokenLogprobs against the oracle's log-softmax ``want`` there."""
    assert abs(entry.logprob - float(want[token])) < LP_TOL, (entry.logprob, float(want[token]))
    top = want.topk(k) if k else None
    assert list(entry.top_token_ids) == (top.indices.tolist() if top is not None else [])
    assert len(entry.top_logprobs) == k
    if top is not None:
        torch.testing.assert_close(torch.tensor(list(entry.top_logprobs)), top.values, rtol=0, atol=LP_TOL)


def _check_call(oracle: Any, prompts: list[list[int]], steps: list[model_service_pb2.GeneratedTokens],
                done: model_service_pb2.GenerateDone, top: int | None, prompt_top: int | None) -> None:
    """Each sequence's chosen tokens' log-probabilities (``top`` most likely beside them)
    and its prompt's (``prompt_top``) equal the oracle's on that sequence alone; finished
    sequences' entries are empty; prompt log-probabilities come in step 0 only."""
    rows = len(prompts)
    for row, prompt in enumerate(prompts):
        tokens = list(done.sequences[row].token_ids)
        want = _log_softmax(oracle, prompt + tokens)
        for step, message in enumerate(steps):
            assert len(message.logprobs) == (rows if top is not None else 0)
            if top is None:
                continue
            entry = message.logprobs[row]
            if message.token_ids[row] == -1:
                assert entry == model_service_pb2.TokenLogprobs()
                continue
            assert message.token_ids[row] == tokens[step]
            _check_entry(entry, tokens[step], want[len(prompt) - 1 + step], top)
        if prompt_top is None:
            assert all(not message.prompt_logprobs for message in steps)
            continue
        assert len(steps[0].prompt_logprobs) == rows and all(not m.prompt_logprobs for m in steps[1:])
        scored = steps[0].prompt_logprobs[row].tokens
        assert len(scored) == len(prompt) - 1
        for i, entry in enumerate(scored):
            _check_entry(entry, prompt[i + 1], want[i], prompt_top)


async def test_logprobs_of_chosen_and_prompt_tokens_equal_transformers(vllm_server, oracle) -> None:
    """Three prompts of different lengths, with and without hooks of their own (a hooked
    call runs apart from vLLM's prefix cache) and beside a call that asked for nothing,
    in one vLLM batch: each chosen token's log-probability and the 5 most likely tokens,
    and each prompt token's after the first with the 3 most likely, equal transformers';
    the call that asked for nothing gets none."""
    tokenizer = oracle_tokenizer()
    ids = [_ids(tokenizer, p) for p in PROMPTS]
    asked = dict(logprobs=True, top_logprobs=5, prompt_logprobs=3)
    hooked = generate_request("llama", PROMPTS, 5, stop=[], attention_mask=None,
                              hooks=[HookSpec("model.layers.1", posthook=capture("output"))], do_sample=False,
                              temperature=None, top_k=None, top_p=None, seed=None, tags=(), session_id="",
                              max_response_message_bytes=0)
    hooked.logprobs, hooked.top_logprobs, hooked.prompt_logprobs = True, 5, 3
    plain, touched, nothing = await asyncio.gather(
        _generate(vllm_server.target, _request(5, PROMPTS, **asked)),
        _generate(vllm_server.target, hooked),
        _generate(vllm_server.target, _request(5, PROMPTS)),
    )
    for steps, done in (plain, touched):
        assert len(steps) == 5
        _check_call(oracle, ids, steps, done, 5, 3)
    _check_call(oracle, ids, *nothing, None, None)
    assert [list(s.token_ids) for s in nothing[1].sequences] == [list(s.token_ids) for s in plain[1].sequences]


async def test_top_logprobs_zero_and_a_stream_interval_give_the_chosen_tokens_alone(vllm_server, oracle) -> None:
    """top_logprobs 0: each chosen token's log-probability alone (prompt_logprobs 0 the
    prompt tokens' alone), also when steps go out several at a time (stream_interval)."""
    tokenizer = oracle_tokenizer()
    ids = [_ids(tokenizer, p) for p in PROMPTS[:2]]
    steps, done = await _generate(vllm_server.target, _request(
        6, PROMPTS[:2], logprobs=True, top_logprobs=0, prompt_logprobs=0, stream_interval=3))
    _check_call(oracle, ids, steps, done, 0, 0)


async def test_a_cached_prompt_still_gets_every_prompt_logprob(vllm_server, oracle) -> None:
    """A prompt of three KV blocks that vLLM's prefix cache holds (a call no hook touches
    ran it): a call asking for prompt_logprobs reads nothing from the cache (every
    position is scored again) and gets one entry per prompt token after the first,
    equal to transformers'; the next plain call still reads the cache."""
    tokenizer = oracle_tokenizer()
    prompt = _ids(tokenizer, "prompt logprobs: interpretability researchers harvest activations " * 3)[:100]
    engine = vllm_server.server.registry.get("llama").loaded_engine
    await _generate(vllm_server.target, _request(2, ids=[prompt]))
    before = engine.prefix_cached_tokens
    steps, done = await _generate(vllm_server.target, _request(2, ids=[prompt], prompt_logprobs=2))
    assert engine.prefix_cached_tokens == before
    _check_call(oracle, [prompt], steps, done, None, 2)
    await _generate(vllm_server.target, _request(2, ids=[prompt]))
    assert engine.prefix_cached_tokens >= before + 64


@pytest.fixture(scope="module")
def eos_prompt(oracle) -> list[int]:
    """A prompt (BOS and random tokens) whose greedy next token is the model's EOS, by a
    margin vLLM's kernels cannot cross: searched in transformers, deterministically."""
    return eos_prompt_of(oracle)


def eos_prompt_of(oracle: Any) -> list[int]:
    """eos_prompt's search (also for test_vllm_processes.py's engine)."""
    eos = oracle.config.eos_token_id
    vocab = oracle.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    best: tuple[float, list[int]] | None = None
    with torch.no_grad():
        for _ in range(8):
            ids = torch.randint(3, vocab, (256, 24), generator=generator)
            ids[:, 0] = oracle.config.bos_token_id
            logits = oracle(ids).logits
            others = logits.clone()
            others[..., eos] = -torch.inf
            margin = logits[..., eos] - others.max(-1).values
            for r, c in (margin > 1e-2).nonzero().tolist():
                if c >= 2 and (best is None or c < len(best[1]) - 1):
                    best = (float(margin[r, c]), ids[r, : c + 1].tolist())
            if best is not None:
                break
    assert best is not None, "no prompt whose greedy next token is EOS"
    return best[1]


def _greedy_loop(oracle: Any, ids: list[int], n: int, *, min_new: int = 0, ignore_eos: bool = False) -> list[int]:
    """transformers' greedy tokens of ``ids`` (EOS masked for the first ``min_new``, and
    not ending the sequence with ``ignore_eos``)."""
    eos = oracle.config.eos_token_id
    out: list[int] = []
    with torch.no_grad():
        for step in range(n):
            logits = oracle(torch.tensor([ids + out])).logits[0, -1]
            if step < min_new:
                logits[eos] = -torch.inf
            out.append(int(logits.argmax()))
            if out[-1] == eos and not ignore_eos:
                break
    return out


async def test_ignore_eos_and_min_new_tokens(vllm_server, oracle, eos_prompt) -> None:
    """A prompt whose greedy next token is EOS, beside one that runs its length: by
    default it ends at step 0 ("eos"; its later entries empty, token -1); with ignore_eos
    it runs to max_new_tokens, EOS emitted like any token, as transformers' greedy
    decoding without EOS; with min_new_tokens 3 EOS is masked until it has 3 tokens
    (transformers' min_new_tokens) while the log-probabilities stay the raw logits' (EOS
    the most likely at step 0, though not chosen)."""
    tokenizer = oracle_tokenizer()
    eos = oracle.config.eos_token_id
    other = _ids(tokenizer, PROMPTS[0])
    assert eos not in _greedy_loop(oracle, other, 6)
    prompts = [eos_prompt, other]
    lp = dict(logprobs=True, top_logprobs=2)
    (default, default_done), (ignored, ignored_done), (least, least_done) = await asyncio.gather(
        _generate(vllm_server.target, _request(6, ids=prompts, **lp)),
        _generate(vllm_server.target, _request(6, ids=prompts, ignore_eos=True, **lp)),
        _generate(vllm_server.target, _request(8, ids=[eos_prompt], min_new_tokens=3, **lp)),
    )
    assert list(default_done.sequences[0].token_ids) == [eos] and default_done.sequences[0].finish_reason == "eos"
    assert list(default_done.sequences[1].token_ids) == _greedy_loop(oracle, other, 6)
    assert default_done.sequences[1].finish_reason == "length"
    assert len(default) == 6 and all(s.token_ids[0] == -1 for s in default[1:])
    _check_call(oracle, prompts, default, default_done, 2, None)

    want = _greedy_loop(oracle, eos_prompt, 6, ignore_eos=True)
    assert want[0] == eos
    assert list(ignored_done.sequences[0].token_ids) == want and ignored_done.sequences[0].finish_reason == "length"
    assert list(ignored_done.sequences[1].token_ids) == list(default_done.sequences[1].token_ids)
    _check_call(oracle, prompts, ignored, ignored_done, 2, None)

    want = _greedy_loop(oracle, eos_prompt, 8, min_new=3)
    got = list(least_done.sequences[0].token_ids)
    assert got == want and eos not in got[:3]
    assert least_done.sequences[0].finish_reason == ("eos" if got[-1] == eos else "length")
    assert least[0].logprobs[0].top_token_ids[0] == eos != least[0].token_ids[0]  # raw: before the mask
    _check_call(oracle, [eos_prompt], least, least_done, 2, None)


async def test_logprob_options_are_checked(vllm_server) -> None:
    """INVALID_ARGUMENT naming the field: top_logprobs or prompt_logprobs past
    Limits.max_top_logprobs, top_logprobs without logprobs, min_new_tokens past
    max_new_tokens, and (an engine started with a smaller max_logprobs) past what vLLM
    reports; at the limit the call runs."""
    target = vllm_server.target
    cases = [
        (_request(2, ["hi"], logprobs=True, top_logprobs=MAX_TOP + 1), "top_logprobs"),
        (_request(2, ["hi"], top_logprobs=3), "top_logprobs"),
        (_request(2, ["hi"], prompt_logprobs=MAX_TOP + 1), "prompt_logprobs"),
        (_request(2, ["hi"], min_new_tokens=3), "min_new_tokens"),
    ]
    for request, field in cases:
        status = await _status(target, request)
        assert status is not None and status.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, status)
        assert field in (status.details() or ""), status.details()
    steps, done = await _generate(target, _request(2, ["hi"], logprobs=True, top_logprobs=MAX_TOP,
                                                   prompt_logprobs=MAX_TOP))
    assert all(len(s.logprobs[0].top_token_ids) == MAX_TOP for s in steps)
    engine = vllm_server.server.registry.get("llama").loaded_engine
    kept = engine.max_logprobs
    engine.max_logprobs = 4
    try:
        for request, field in ((_request(2, ["hi"], logprobs=True, top_logprobs=5), "top_logprobs"),
                               (_request(2, ["hi"], prompt_logprobs=5), "prompt_logprobs")):
            status = await _status(target, request)
            assert status is not None and status.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, status)
            assert field in (status.details() or "") and "max_logprobs 4" in (status.details() or "")
    finally:
        engine.max_logprobs = kept


async def test_random_option_mixes_in_one_batch_are_served_or_refused(vllm_server) -> None:
    """A fuzz of the options (logprobs, top_logprobs and prompt_logprobs around the
    limit, ignore_eos, min_new_tokens, n, sampling), all at once: each call is refused
    with INVALID_ARGUMENT exactly when it breaks a rule, and otherwise every step has one
    entry per sequence with the asked-for count of tokens most likely first, prompt
    log-probabilities at step 0 only, and no sequence shorter than min_new_tokens."""
    rng = random.Random(11)
    tokenizer = oracle_tokenizer()
    cases = []
    for _ in range(14):
        fields: dict[str, Any] = dict(logprobs=rng.random() < 0.6, top_logprobs=rng.choice([0, 0, 1, 4, MAX_TOP, 21]),
                                      ignore_eos=rng.random() < 0.3, min_new_tokens=rng.choice([0, 0, 2, 5]),
                                      n=rng.choice([0, 1, 2]), do_sample=rng.random() < 0.4, seed=rng.randrange(1 << 32))
        if rng.random() < 0.5:
            fields["prompt_logprobs"] = rng.choice([0, 2, MAX_TOP, 21])
        prompts = rng.sample(PROMPTS, rng.randint(1, 2))
        new = rng.randint(1, 4)
        bad = ((fields["top_logprobs"] and not fields["logprobs"]) or fields["top_logprobs"] > MAX_TOP
               or fields.get("prompt_logprobs", 0) > MAX_TOP or fields["min_new_tokens"] > new)
        cases.append((prompts, new, fields, bad))

    async def one(prompts: list[str], new: int, fields: dict[str, Any]) -> Any:
        try:
            return await _generate(vllm_server.target, _request(new, prompts, **fields))
        except grpc.aio.AioRpcError as exc:
            return exc

    results = await asyncio.gather(*(one(p, n, f) for p, n, f, _ in cases))
    assert any(bad for *_, bad in cases) and not all(bad for *_, bad in cases)
    for (prompts, new, fields, bad), result in zip(cases, results):
        if bad:
            assert isinstance(result, grpc.aio.AioRpcError), fields
            assert result.code() == grpc.StatusCode.INVALID_ARGUMENT, (fields, result)
            continue
        assert not isinstance(result, BaseException), (fields, result)
        steps, done = result
        each = max(1, fields["n"])
        rows = len(prompts) * each
        lengths = [len(_ids(tokenizer, p)) for p in prompts for _ in range(each)]
        assert len(done.sequences) == rows
        for seq in done.sequences:
            assert len(seq.token_ids) >= fields["min_new_tokens"]
            if fields["ignore_eos"]:
                assert len(seq.token_ids) == new
        for step, message in enumerate(steps):
            if not fields["logprobs"]:
                assert not message.logprobs
            else:
                assert len(message.logprobs) == rows
                for token, entry in zip(message.token_ids, message.logprobs):
                    if token == -1:
                        assert entry == model_service_pb2.TokenLogprobs()
                        continue
                    k = fields["top_logprobs"]
                    assert len(entry.top_token_ids) == len(entry.top_logprobs) == k
                    assert list(entry.top_logprobs) == sorted(entry.top_logprobs, reverse=True)
                    assert entry.logprob <= 0.0
                    if k:
                        assert entry.logprob <= entry.top_logprobs[0] + LP_TOL
                    if k and not fields["do_sample"] and not (fields["min_new_tokens"] > step):
                        assert entry.top_token_ids[0] == token
            if step == 0 and "prompt_logprobs" in fields:
                assert [len(s.tokens) for s in message.prompt_logprobs] == [n - 1 for n in lengths]
                assert all(len(e.top_token_ids) == fields["prompt_logprobs"] for s in message.prompt_logprobs
                           for e in s.tokens)
            else:
                assert not message.prompt_logprobs
