"""The vLLM engine's sizes from a folder's config and [models.vllm] (engine/vllm_sizing.py):
plain arithmetic, no engine started."""

from __future__ import annotations

import pytest

from hookwire_server.engine.vllm_sizing import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS, SizingError, folder_positions, kv_bytes_per_token, kv_tokens, vllm_sizes,
)

#: The suite's seeded Llama: 2 layers, 1 KV head of 64: 1 KiB of float32 KV cache a token.
LLAMA = {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "hidden_size": 128,
         "max_position_embeddings": 256}


def test_max_model_len_defaults_to_the_least_of_positions_2048_and_the_kv_cache() -> None:
    # The folder's positions: a 512-position folder is not asked for 2048 (vLLM refuses that).
    assert vllm_sizes("m", {**LLAMA, "max_position_embeddings": 512}, {}, "float32").max_model_len == 512
    # 2048 where the folder allows more (a 131,072-position folder).
    long = vllm_sizes("m", {**LLAMA, "max_position_embeddings": 131072}, {}, "float32")
    assert long.max_model_len == 2048
    # The KV cache's tokens for one sequence: 1 MiB = 8 blocks of 128 tokens, one held back.
    small = vllm_sizes("m", {**LLAMA, "max_position_embeddings": 131072}, {"kv_cache_bytes": 1 << 20}, "float32")
    assert small.max_model_len == 7 * 128
    # float16 halves a token's bytes; tensor parallel splits the KV heads (8 heads over 2 ranks).
    assert kv_bytes_per_token(LLAMA, "float16") == 2 * 2 * 1 * 64 * 2
    assert kv_bytes_per_token({**LLAMA, "num_key_value_heads": 8, "num_attention_heads": 8, "head_dim": 16},
                              "float32", 2) == 2 * 2 * 4 * 16 * 4
    assert kv_bytes_per_token({**LLAMA, "num_key_value_heads": 1}, "float32", 2) == 1024  # replicated
    assert kv_tokens(1 << 20, 1024) == 896


def test_the_step_budget_is_sized_on_its_own_not_as_length_times_sequences() -> None:
    long = vllm_sizes("m", {**LLAMA, "max_position_embeddings": 131072}, {"max_model_len": 131072,
                                                                          "kv_cache_bytes": 1 << 30}, "float32")
    # One whole prompt per step (no chunked prefill), not 131,072 x 16 = 2M tokens.
    assert long.max_model_len == 131072 and long.max_num_batched_tokens == 131072
    default = vllm_sizes("m", {**LLAMA, "max_position_embeddings": 131072}, {}, "float32")
    assert default.max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS == 8192
    small = vllm_sizes("m", LLAMA, {"max_model_len": 128, "max_num_seqs": 8}, "float32")
    assert small.max_num_batched_tokens == 128 * 8  # all of it, where that is less
    assert vllm_sizes("m", LLAMA, {"max_model_len": 8, "max_num_seqs": 16}, "float32").max_num_batched_tokens == 128


def test_explicit_settings_win_and_impossible_ones_name_the_setting() -> None:
    sizes = vllm_sizes("m", LLAMA, {"max_model_len": 200, "max_num_seqs": 3, "max_num_batched_tokens": 300,
                                    "kv_cache_bytes": 64 << 20}, "float32")
    assert (sizes.max_model_len, sizes.max_num_seqs, sizes.max_num_batched_tokens, sizes.kv_cache_bytes) == (
        200, 3, 300, 64 << 20)
    # An explicit length past the folder's positions is vLLM's to refuse (it names both).
    assert vllm_sizes("m", LLAMA, {"max_model_len": 100000}, "float32").max_model_len == 100000
    with pytest.raises(SizingError, match=r"model 'm': vllm.max_num_batched_tokens 100 is less than max_model_len "
                                          r"200: a prompt runs in one vLLM step"):
        vllm_sizes("m", LLAMA, {"max_model_len": 200, "max_num_batched_tokens": 100}, "float32")
    with pytest.raises(SizingError, match=r"vllm.kv_cache_bytes 131072 holds no sequence: one token takes 1024 bytes"):
        vllm_sizes("m", LLAMA, {"kv_cache_bytes": 128 << 10}, "float32")
    # Smaller blocks (block_size) hold a sequence where 128-token ones do not: 128 KiB = 4 blocks of 32, one back.
    assert vllm_sizes("m", LLAMA, {"kv_cache_bytes": 128 << 10, "block_size": 32}, "float32").max_model_len == 96
    with pytest.raises(SizingError, match=r"vLLM keeps 32-token blocks, one of them back; give it at least 65536"):
        vllm_sizes("m", LLAMA, {"kv_cache_bytes": 32 << 10, "block_size": 32}, "float32")


def test_positions_and_sizes_come_from_wherever_the_config_keeps_them() -> None:
    assert folder_positions({"n_positions": 1024}) == 1024  # GPT-2
    assert folder_positions({"max_position_embeddings": 4096, "seq_length": 2048}) == 2048  # the least, as vLLM
    assert folder_positions({"text_config": {"max_position_embeddings": 8192}}) == 8192  # a multimodal folder
    assert folder_positions({}) is None
    # Without the sizes a config cannot bound the length: the other bounds still do.
    assert kv_bytes_per_token({"max_position_embeddings": 512}, "float32") is None
    assert vllm_sizes("m", {"max_position_embeddings": 512}, {}, "float32").max_model_len == 512
    assert vllm_sizes("m", {}, {}, "float32").max_model_len == 2048
