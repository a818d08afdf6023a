"""hookwire's scheduler for vLLM (engine/vllm_scheduler.py), step by step: vLLM's own
scheduler class with hookwire's rules, fed requests as vLLM's engine core feeds it and
the outputs a model runner returns (one token per request whose prompt is done), with a
KV cache of 7 usable blocks of 32 tokens, 64 tokens and 4 requests a step. Nothing runs
a model here; the engine tests (test_vllm_engine.py) run the same scheduler under a real
engine.
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch

from hookwire_server.engine.vllm_scheduler import HookwireScheduler
from hookwire_server.engine.vllm_worker import CALL, SEQUENCES, TOUCHED

BLOCK = 32


@pytest.fixture(scope="module")
def vllm_config(llama_folder: pathlib.Path) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    config = EngineArgs(model=str(llama_folder), max_model_len=64, block_size=BLOCK, enable_chunked_prefill=True,
                        max_num_batched_tokens=64, max_num_seqs=4, scheduling_policy="priority",
                        enable_prefix_caching=True, enforce_eager=True).create_engine_config()
    config.cache_config.num_gpu_blocks = 8
    return config


class Engine:
    """The scheduler and a stand-in for vLLM's model runner: each step, every scheduled
    request whose prompt is done gets token 5."""

    def __init__(self, config: Any) -> None:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float32)
        kv = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
        self.scheduler = HookwireScheduler(config, kv, StructuredOutputManager(config), block_size=BLOCK)
        hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(hash_fn)
        self._hasher = get_request_block_hasher(BLOCK, hash_fn)
        self.tokens: dict[str, int] = {}

    def add(self, rid: str, prompt: int, *, touched: bool, call: str | None = None, sequences: int = 1,
            new_tokens: int = 8, first: int = 3) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True,
                                extra_args={TOUCHED: touched, CALL: call or rid, SEQUENCES: sequences})
        ids = list(range(first, first + prompt))
        self.scheduler.add_request(Request(rid, ids, params, None, block_hasher=self._hasher))

    def step(self) -> dict[str, int]:
        """One step: the tokens scheduled per request."""
        from vllm.v1.outputs import ModelRunnerOutput

        out = self.scheduler.schedule()
        ids = list(out.num_scheduled_tokens)
        requests = self.scheduler.requests
        sampled = [[5] if requests[r].num_computed_tokens >= requests[r].num_tokens else [] for r in ids]
        for rid, got in zip(ids, sampled):
            self.tokens[rid] = self.tokens.get(rid, 0) + len(got)
        self.scheduler.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled))
        return dict(out.num_scheduled_tokens)

    def running(self) -> list[str]:
        return [r.request_id for r in self.scheduler.running]


def test_untouched_prompts_are_chunked_and_a_touched_call_starts_whole_once_all_its_requests_arrived(vllm_config):
    """Two untouched prompts of 50 tokens: vLLM chunks the second (64 tokens a step). A
    touched call of two requests does not start while one of them has not arrived; then
    both start in one step, each prompt whole, beside the untouched decodes."""
    engine = Engine(vllm_config)
    engine.add("u1", 50, touched=False)
    engine.add("u2", 50, touched=False, first=100)
    assert engine.step() == {"u1": 50, "u2": 14}
    assert engine.step() == {"u1": 1, "u2": 36}
    engine.add("t1", 20, touched=True, call="t", sequences=2)
    assert engine.step() == {"u1": 1, "u2": 1}  # t2 is not there yet
    engine.add("t2", 30, touched=True, call="t", sequences=2)
    assert engine.step() == {"u1": 1, "u2": 1, "t1": 20, "t2": 30}
    assert engine.step() == {"u1": 1, "u2": 1, "t1": 1, "t2": 1}
    s = engine.scheduler
    assert (s.chunked_prefills, s.touched_chunked, s.preempted_for_touched) == (1, 0, 0)


def test_a_touched_prompt_is_never_chunked_it_waits_for_the_steps_room(vllm_config):
    """An untouched prompt of 60 tokens takes most of a step: a touched prompt of 30 that
    arrives with it waits whole for the next step (vLLM would run 4 of its tokens), while
    an untouched one beside it is chunked into the room left."""
    engine = Engine(vllm_config)
    engine.add("t", 30, touched=True)
    engine.add("u", 60, touched=False, first=100)
    # The touched call comes first (priority), then the untouched prompt's first chunk.
    assert engine.step() == {"t": 30, "u": 34}
    engine.add("t2", 40, touched=True, first=200)
    engine.add("u2", 40, touched=False, first=300)
    # u's remaining 26 and t's decode leave 37: t2 (40) waits whole; u2 is not started
    # ahead of it either (a waiting touched call holds the room).
    assert engine.step() == {"t": 1, "u": 26}
    assert engine.step() == {"t": 1, "u": 1, "t2": 40, "u2": 22}
    assert engine.scheduler.touched_chunked == 0


def test_untouched_requests_are_preempted_newest_first_to_start_a_touched_call(vllm_config):
    """Untouched requests that hold nearly all 7 blocks: a touched call of two prompts that
    needs 4 blocks preempts the newest untouched requests (only as many as needed), starts
    whole, and the preempted ones resume from vLLM's prefix cache and finish."""
    engine = Engine(vllm_config)
    for i in range(3):
        engine.add(f"u{i}", 40, touched=False, first=100 * (i + 1), new_tokens=10)
    for _ in range(10):  # their prompts, chunked: a few steps
        if len(engine.running()) == 3 and all(
                engine.scheduler.requests[f"u{i}"].num_computed_tokens >= 40 for i in range(3)):
            break
        engine.step()
    else:
        raise AssertionError("the untouched prompts did not finish in 10 steps")
    free = engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    assert free == 1  # 2 blocks each
    engine.add("t1", 33, touched=True, call="t", sequences=2, first=1000)
    engine.add("t2", 20, touched=True, call="t", sequences=2, first=2000)
    scheduled = engine.step()
    assert scheduled["t1"] == 33 and scheduled["t2"] == 20
    assert engine.scheduler.preempted_for_touched == 1
    assert "u2" not in engine.running() and {"u0", "u1"} <= set(engine.running())
    for _ in range(40):
        engine.step()
    assert engine.tokens == {"u0": 10, "u1": 10, "u2": 10, "t1": 8, "t2": 8}
    assert engine.scheduler.touched_chunked == 0


def test_a_touched_call_waits_for_touched_ones_without_preempting_them_or_holding_up_the_rest(vllm_config):
    """Three touched requests hold 3 of the 4 seats: a touched call of two waits for them
    to end (nothing touched is preempted), while an untouched request arriving after it
    starts at once (only touched requests ending can make the call's room, so it does
    not wait for it); the call starts when the touched ones end."""
    engine = Engine(vllm_config)
    for i in range(3):
        engine.add(f"t{i}", 5, touched=True, first=10 * (i + 1), new_tokens=3)
    assert len(engine.step()) == 3
    engine.add("w1", 5, touched=True, call="w", sequences=2, first=500)
    engine.add("w2", 5, touched=True, call="w", sequences=2, first=550)
    engine.add("u", 5, touched=False, first=600, new_tokens=6)
    assert engine.step() == {"t0": 1, "t1": 1, "t2": 1, "u": 5}
    assert set(engine.step()) == {"t0", "t1", "t2", "u"}  # the touched ones' last token
    assert engine.step() == {"u": 1, "w1": 5, "w2": 5}
    assert engine.scheduler.preempted_for_touched == 0


def test_vllms_own_preemption_takes_an_untouched_request_first(vllm_config):
    """When a running touched request needs a block and none is free, vLLM's priority
    policy preempts an untouched request, not the touched one (the newest)."""
    engine = Engine(vllm_config)
    for i in range(3):
        engine.add(f"u{i}", 40, touched=False, first=100 * (i + 1), new_tokens=20)
    engine.step()
    engine.step()
    engine.add("t", 30, touched=True, first=1000, new_tokens=20)
    preempted: set[str] = set()
    for _ in range(60):
        engine.step()
        preempted |= {rid for rid, r in engine.scheduler.requests.items() if r.num_preemptions}
    assert preempted == {"u2"}  # 7 blocks: u0-u2 hold 2 each, t needs its second at token 33
    assert engine.tokens == {"u0": 20, "u1": 20, "u2": 20, "t": 20}
    assert engine.scheduler.preempted_for_touched == 0
    assert engine.scheduler.touched_chunked == 0
    assert not engine.scheduler.requests  # all finished
