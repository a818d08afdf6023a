"""Generate's reporting and length options through the SDK (``logprobs``,
``prompt_logprobs``, ``n``) on the torch engine: a real server on loopback, the real SDK,
and in-process transformers on the same seeded tiny-lm as the oracle. (ignore_eos and
min_new_tokens on the raw contract: test_generate.py.)"""

from __future__ import annotations

import pytest
import torch

import hookwire
import lm_oracle as oracle

PROMPTS = ["Hello world, the model", "the"]


def _step_logits(ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int) -> tuple[list[list[int]], torch.Tensor]:
    """In-process greedy generate(): the new tokens per sequence and the raw logits of each
    step [steps, sequences, vocabulary] (generate()'s output_logits: before the processors)."""
    with torch.no_grad():
        out = oracle.model().generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                      do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences[:, ids.shape[1]:].tolist(), torch.stack(out.logits)


async def test_logprobs_are_the_raw_log_softmax_of_each_step(client: hookwire.Client) -> None:
    ids, mask = oracle.batch(PROMPTS)
    tokens, logits = _step_logits(ids, mask, 6)
    want = torch.log_softmax(logits.float(), dim=-1)
    stream = client.model("tiny-lm").generate(PROMPTS, 6, do_sample=False, logprobs=3)
    steps = [item async for item in stream if isinstance(item, hookwire.GeneratedTokens)]
    result = await stream
    assert [list(t) for t in result.token_ids] == tokens  # none ends early (PROMPTS)
    for s, step in enumerate(steps):
        assert len(step.logprobs) == len(PROMPTS)
        for i, entry in enumerate(step.logprobs):
            assert entry is not None
            # Bit for bit: the server's step is in-process generate()'s (float32 on the wire).
            assert entry.logprob == want[s, i, tokens[i][s]].item()
            top = want[s, i].topk(3)
            assert [t for t, _ in entry.top] == top.indices.tolist()
            assert [v for _, v in entry.top] == top.values.tolist()
            assert entry.top[0][1] >= entry.top[1][1] >= entry.top[2][1]
    assert result.logprobs == tuple(tuple(step.logprobs[i] for step in steps) for i in range(len(PROMPTS)))
    assert result.prompt_logprobs == ()
    # logprobs=0: the chosen token's alone; without it nothing is reported.
    only = await client.model("tiny-lm").generate(PROMPTS, 2, do_sample=False, logprobs=0)
    assert all(entry.top == () for run in only.logprobs for entry in run)
    assert [e.logprob for e in only.logprobs[0]] == [e.logprob for e in result.logprobs[0][:2]]
    plain = await client.model("tiny-lm").generate(PROMPTS, 2, do_sample=False)
    assert plain.logprobs == () and plain.raw.sequences[0].token_ids == only.raw.sequences[0].token_ids


async def test_a_finished_sequence_reports_no_logprobs(client: hookwire.Client) -> None:
    # "the" ends on its stop string first: its later steps' entries are None (token -1).
    ids, mask = oracle.batch(PROMPTS)
    tokens, _ = _step_logits(ids, mask, 6)
    stop = oracle.text(tokens[1][:2])
    assert stop and stop not in oracle.text(tokens[0])
    stream = client.model("tiny-lm").generate(PROMPTS, 6, do_sample=False, logprobs=1, stop=stop)
    steps = [item async for item in stream if isinstance(item, hookwire.GeneratedTokens)]
    result = await stream
    assert result.finish_reasons[1] == "stop"
    ended = len(result.token_ids[1])
    assert all(step.logprobs[1] is None for step in steps[ended:]) and steps[ended:]
    assert len(result.logprobs[1]) == ended and len(result.logprobs[0]) == len(steps)


def _prompt_scores(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """In-process log-softmax over a prompt pass, positions as generate() gives them."""
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad():
        logits = oracle.model()(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    return torch.log_softmax(logits.float(), dim=-1)


async def test_prompt_logprobs_score_each_prompt_token_after_the_first(client: hookwire.Client) -> None:
    ids, mask = oracle.batch(PROMPTS)
    scores = _prompt_scores(ids, mask)
    result = await client.model("tiny-lm").generate(PROMPTS, 2, do_sample=False, prompt_logprobs=2, logprobs=0)
    assert len(result.prompt_logprobs) == len(PROMPTS)
    for i, run in enumerate(result.prompt_logprobs):
        real = mask[i].nonzero().squeeze(-1).tolist()  # its own tokens: padding skipped
        assert len(run) == len(real) - 1
        for entry, (before, at) in zip(run, zip(real, real[1:])):
            assert entry.logprob == pytest.approx(scores[i, before, ids[i, at]].item(), abs=1e-5)
            top = scores[i, before].topk(2)
            assert [t for t, _ in entry.top] == top.indices.tolist()
    # Scoring the prompt changes nothing else: the same tokens, and logprobs up to rounding
    # (the prefill's logits of every position are one matrix product, summed in another order).
    plain = await client.model("tiny-lm").generate(PROMPTS, 2, do_sample=False, logprobs=0)
    assert plain.token_ids == result.token_ids
    for got, want in zip(result.logprobs, plain.logprobs):
        assert [e.logprob for e in got] == pytest.approx([e.logprob for e in want], abs=1e-5)


async def test_n_samples_each_prompt_n_times_as_in_process_generate(client: hookwire.Client) -> None:
    ids, mask = oracle.batch(PROMPTS)
    result = await client.model("tiny-lm").generate(PROMPTS, 5, do_sample=True, seed=11, n=3)
    # A prompt's n sequences are consecutive rows: generate() of the prompts repeated.
    rows = oracle.generate(ids.repeat_interleave(3, 0), mask.repeat_interleave(3, 0), 5, seed=11, do_sample=True)
    assert [list(t) for t in result.token_ids] == rows
    assert result.input_ids.shape[0] == 6 and torch.equal(result.input_ids[0], result.input_ids[2])
    assert len(set(result.token_ids[:3])) > 1  # sampled apart


@pytest.mark.parametrize("kwargs, field", [
    ({"logprobs": 21}, "top_logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"n": 17}, "n"),
    ({"min_new_tokens": 5}, "min_new_tokens"),
])
async def test_options_past_their_limits_are_refused_naming_them(client: hookwire.Client, kwargs: dict,
                                                                   field: str) -> None:
    with pytest.raises(hookwire.InvalidArgumentError, match=field):
        await client.model("tiny-lm").generate("a", 4, **kwargs)


@pytest.mark.parametrize("kwargs", [{"logprobs": -1}, {"n": 0}, {"prompt_logprobs": True}, {"min_new_tokens": 1.5}])
async def test_the_sdk_refuses_what_it_cannot_send(client: hookwire.Client, kwargs: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        client.model("tiny-lm").generate("a", 4, **kwargs)
