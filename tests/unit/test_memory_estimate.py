"""The memory budget's ledger (memory_budget.py) and the estimates it admits
(models/memory_estimate.py): the closed form from a model's config is never below the
exact peak a probe pass on fake tensors measures; the ledger refuses what can never fit,
queues what fits later first come first served, and gives everything back."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import torch
import transformers

from hookwire_server.demo_models import tiny_lm, tiny_transformer
from hookwire_server.errors import ResourceExhausted
from hookwire_server.memory_budget import Estimate, MemoryBudget, process_memory_limit
from hookwire_server.models.memory_estimate import (
    Estimator,
    TensorShape,
    _bucket,
    decoder_forward,
    decoder_shape,
    probe_forward,
)
from support import minilm_folder

SHAPES = [(1, 4), (1, 16), (2, 32), (4, 64), (8, 128), (1, 512), (3, 200)]


def _forward_only(estimator: Estimator, rows: int, tokens: int) -> int:
    assert estimator.shape is not None
    return sum(decoder_forward(estimator.shape, rows, tokens).values())


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_the_config_estimate_of_a_causal_lm_is_never_below_the_measured_peak(attention: str) -> None:
    model = tiny_lm()
    model.set_attn_implementation(attention)
    estimator = Estimator(model)
    for rows, tokens in SHAPES:
        ids = TensorShape((rows, tokens), torch.long)
        measured, outputs = probe_forward(model, ((ids,), {"attention_mask": ids}))
        forward = _forward_only(estimator, rows, tokens)
        assert measured <= forward <= 4 * measured + (1 << 16), (attention, rows, tokens, measured, forward)
        assert estimator.infer(((ids,), {})).bytes >= measured + outputs


def test_the_config_estimate_of_an_encoder_is_never_below_the_measured_peak() -> None:
    model = transformers.BertModel.from_pretrained(str(minilm_folder()), local_files_only=True).eval()
    estimator = Estimator(model)
    assert estimator.shape is not None and not estimator.shape.logits
    for rows, tokens in [(1, 8), (4, 64), (2, 256)]:
        ids = TensorShape((rows, tokens), torch.long)
        measured, _ = probe_forward(model, ((ids,), {"attention_mask": ids}))
        assert measured <= _forward_only(estimator, rows, tokens) <= 4 * measured + (1 << 20), (rows, tokens)


def test_the_request_that_killed_the_server_is_estimated_at_tens_of_gigabytes() -> None:
    estimator = Estimator(tiny_lm())
    estimate = estimator.infer(((TensorShape((4096, 512), torch.long),), {}))
    assert estimate.parts["attention scores"] > 40 << 30
    assert "attention scores" in estimate.describe() and "GiB" in estimate.describe()


def test_a_model_without_a_config_is_probed_once_per_rounded_signature() -> None:
    model = tiny_transformer()
    estimator = Estimator(model)
    assert estimator.shape is None
    inputs = ((TensorShape((3, 17), torch.long),), {"attention_mask": TensorShape((3, 17), torch.bool)})
    known, key = estimator.cached(inputs)
    assert not known
    estimator.probe(key)
    same_bucket = ((TensorShape((3, 20), torch.long),), {"attention_mask": TensorShape((3, 20), torch.bool)})
    assert estimator.cached(same_bucket)[0]
    measured, _ = probe_forward(model, ((TensorShape((3, 20), torch.long),), {}))
    assert estimator.infer(same_bucket).bytes >= measured
    assert [_bucket(n) for n in (1, 4, 5, 7, 13, 17, 24, 25, 100)] == [1, 4, 6, 8, 16, 24, 24, 32, 128]


def test_a_model_whose_forward_cannot_run_on_fake_tensors_is_estimated_from_its_inputs() -> None:
    class DataDependent(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[x > 0]  # the output's size depends on the data

    estimator = Estimator(DataDependent())
    inputs = ((TensorShape((10, 10), torch.float32),), {})
    estimator.probe(estimator.cached(inputs)[1])
    assert estimator.infer(inputs).bytes >= 8 * 400


def test_a_per_model_setting_replaces_the_estimate() -> None:
    estimator = Estimator(tiny_transformer(), bytes_per_input_element=1000.0)
    inputs = ((TensorShape((2, 5), torch.long),), {})
    assert estimator.cached(inputs)[0]
    assert estimator.infer(inputs).parts["activations"] == 10_000


def test_the_kv_cache_of_a_generate_call_is_counted() -> None:
    estimator = Estimator(tiny_lm())
    shape = decoder_shape(tiny_lm())
    assert shape is not None
    estimate = estimator.generate(4, 10, 100)
    assert estimate.parts["KV cache"] == 2 * shape.layers * 4 * shape.kv_heads * shape.head_dim * 110 * 4


async def test_the_ledger_refuses_what_never_fits_and_queues_what_fits_later_in_order() -> None:
    budget = MemoryBudget(1000)
    budget.keep("m", 100)
    with pytest.raises(ResourceExhausted) as info:
        await budget.claim(Estimate(901, {"activations": 901}), "Infer on 'm'")
    assert "memory_budget_bytes" in str(info.value) and "the models keep" in str(info.value)
    first = await budget.claim(Estimate(600), "a")
    order: list[str] = []

    async def wait(name: str, nbytes: int) -> None:
        claim = await budget.claim(Estimate(nbytes), name)
        order.append(name)
        await asyncio.sleep(0)
        claim.release()

    waiting = [asyncio.ensure_future(wait("b", 500)), asyncio.ensure_future(wait("c", 300))]
    await asyncio.sleep(0)
    assert order == [] and budget.claimed == 600
    # A small claim (at most 1% of the budget) that fits goes ahead of the waiting ones.
    tiny = await budget.claim(Estimate(10), "small")
    tiny.release()
    first.release()
    first.release()  # idempotent
    await asyncio.gather(*waiting)
    assert order == ["b", "c"]
    assert budget.claimed == 0 and budget.peak <= 1000


async def test_a_cancelled_wait_gives_up_its_place() -> None:
    budget = MemoryBudget(1000)
    held = await budget.claim(Estimate(900), "a")
    task = asyncio.ensure_future(budget.claim(Estimate(800), "b"))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    held.release()
    after = await budget.claim(Estimate(1000), "c")
    assert budget.claimed == 1000
    after.release()
    assert budget.claimed == 0


def test_the_default_is_seventy_percent_of_the_address_space_ceiling() -> None:
    code = ("import resource; resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30)); "
            "from hookwire_server.memory_budget import MemoryBudget, process_memory_limit; "
            "print(MemoryBudget().limit, process_memory_limit()[1])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    limit, _ = process_memory_limit()
    if limit < 8 << 30:  # this machine or its cgroup has less than the ceiling: that binds
        assert int(out[0]) == int(limit * 0.7)
    else:
        assert int(out[0]) == int((8 << 30) * 0.7) and out[1] == "RLIMIT_AS"


def test_inputs_that_are_not_tokens_are_estimated_without_a_token_shape() -> None:
    for shape, dtype in [((2,), torch.float32), ((), torch.float32), ((0, 3), torch.long)]:
        assert Estimator.token_shape(((TensorShape(shape, dtype),), {})) in (None, (0, 3))
        assert Estimator(tiny_lm()).infer(((TensorShape(shape, dtype),), {})).bytes >= 0


async def test_a_wait_refused_when_the_models_grew_claims_nothing() -> None:
    # A call waits for room; meanwhile a model's resident memory is recorded (its first
    # call) and the waiting call can never fit: it is refused, and claimed stays right.
    budget = MemoryBudget(1000)
    held = await budget.claim(Estimate(600), "a")
    task = asyncio.ensure_future(budget.claim(Estimate(800), "b"))
    await asyncio.sleep(0)
    budget.keep("other", 300)
    held.release()
    with pytest.raises(ResourceExhausted):
        await task
    assert budget.claimed == 0
    after = await budget.claim(Estimate(700), "c")
    assert budget.claimed == 700
    after.release()


def test_a_float_input_s_feature_width_is_probed_as_it_is() -> None:
    # A width outside the rounding steps (10 -> 12) made every probe fail (Linear(10, ...)
    # refuses 12 features) and the call fell back to 8x its input's bytes, far below
    # the 400 kB output this model makes.
    estimator = Estimator(torch.nn.Linear(10, 100_000))
    inputs = ((TensorShape((3, 10), torch.float32),), {})
    known, key = estimator.cached(inputs)
    assert not known
    estimator.probe(key)
    assert estimator.infer(inputs).bytes >= 3 * 100_000 * 4
