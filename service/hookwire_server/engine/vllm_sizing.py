"""The vLLM engine's sizes from a transformers folder's config and its ``[models.vllm]``
settings: the longest sequence (``max_model_len``), the sequences at once
(``max_num_seqs``) and the tokens one step may run (``max_num_batched_tokens``). Plain
arithmetic on the config's numbers (no vLLM, no torch), so an engine never has to start
for a wrong default to show: vLLM refuses a ``max_model_len`` past the model's positions
or past what its KV cache holds, and a 131,072-position folder asked for
``max_model_len × max_num_seqs`` tokens a step would allocate its step buffers for 2M
tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

#: Defaults that start on a 2-core, 24 GiB machine (vLLM's own defaults want ~92% of
#: host memory free for its KV cache).
DEFAULT_KV_CACHE_BYTES = 512 << 20
DEFAULT_MAX_NUM_SEQS = 16
#: The longest default sequence, where the folder's positions and the KV cache allow more.
DEFAULT_MAX_MODEL_LEN = 2048
#: The default bound of a step's tokens (at least one sequence at max_model_len): vLLM sizes
#: its per-step buffers (token ids, positions, hidden states) by it.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192

#: Where a transformers config may give its positions (vLLM's own list for the length it
#: derives; it takes the least of those present).
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                 "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")

#: Tokens per KV-cache block on vLLM's CPU build (its platform's default; the CUDA build's
#: 16 makes the estimate below conservative).
KV_BLOCK_TOKENS = 128

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclasses.dataclass(frozen=True)
class VllmSizes:
    """What the engine asks vLLM for, each either set in ``[models.vllm]`` or derived."""

    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_bytes: int


class SizingError(ValueError):
    """Settings that cannot serve one sequence (the message names the setting)."""


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a folder's config.json (a multimodal folder nests it)."""
    inner = config.get("text_config")
    return inner if isinstance(inner, Mapping) else config


def folder_positions(config: Mapping[str, Any]) -> int | None:
    """The positions the folder's model takes (the least of those its config names), or
    None where it names none."""
    found = [v for v in (text_config(config).get(k) for k in POSITION_KEYS)
             if isinstance(v, int) and not isinstance(v, bool) and v > 0]
    return min(found) if found else None


def kv_bytes_per_token(config: Mapping[str, Any], dtype: str, tensor_parallel_size: int = 1) -> int | None:
    """Bytes of KV cache one token takes on one rank (keys and values of every layer's
    KV heads, in the model's dtype), or None where the config does not say its sizes."""
    text = text_config(config)
    layers, heads, hidden = (text.get(k) for k in ("num_hidden_layers", "num_attention_heads", "hidden_size"))
    if not all(isinstance(v, int) and v > 0 for v in (layers, heads)):
        return None
    assert isinstance(layers, int) and isinstance(heads, int)
    kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or (hidden // heads if isinstance(hidden, int) else None)
    if not (isinstance(kv_heads, int) and isinstance(head_dim, int) and kv_heads > 0 and head_dim > 0):
        return None
    per_rank = max(1, kv_heads // max(1, tensor_parallel_size))  # vLLM replicates heads fewer than the ranks
    return 2 * layers * per_rank * head_dim * _DTYPE_BYTES.get(dtype, 4)


def kv_tokens(kv_cache_bytes: int, per_token: int, block_tokens: int = KV_BLOCK_TOKENS) -> int:
    """The tokens of one sequence ``kv_cache_bytes`` holds: whole blocks, less the block
    vLLM keeps back (its null block)."""
    blocks = kv_cache_bytes // (per_token * block_tokens)
    return max(0, blocks - 1) * block_tokens


def vllm_sizes(name: str, config: Mapping[str, Any], settings: Mapping[str, Any], dtype: str,
               tensor_parallel_size: int = 1) -> VllmSizes:
    """The sizes model ``name`` asks vLLM for. A setting in ``settings`` wins; otherwise
    ``max_model_len`` is the least of the folder's positions, DEFAULT_MAX_MODEL_LEN and
    the tokens ``kv_cache_bytes`` holds for one sequence; ``max_num_batched_tokens`` is
    ``max_model_len × max_num_seqs`` bounded by DEFAULT_MAX_NUM_BATCHED_TOKENS, and never
    less than one sequence at ``max_model_len`` (a prompt runs in one step) or than
    ``max_num_seqs``. SizingError naming the setting where the KV cache holds no sequence
    or an explicit budget is less than a sequence. An explicit ``max_model_len`` past the
    folder's positions is left to vLLM, which refuses it naming both."""
    kv_bytes = int(settings.get("kv_cache_bytes", DEFAULT_KV_CACHE_BYTES))
    seqs = int(settings.get("max_num_seqs", DEFAULT_MAX_NUM_SEQS))
    per_token = kv_bytes_per_token(config, dtype, tensor_parallel_size)
    block = int(settings.get("block_size", KV_BLOCK_TOKENS))
    held = None
    if per_token is not None:
        held = kv_tokens(kv_bytes, per_token, block)
        if held < 1:
            raise SizingError(
                f"model {name!r}: vllm.kv_cache_bytes {kv_bytes} holds no sequence: one token takes {per_token} bytes "
                f"of KV cache and vLLM keeps {block}-token blocks, one of them back; give it at least "
                f"{2 * block * per_token}"
            )
    if "max_model_len" in settings:
        max_len = int(settings["max_model_len"])
    else:
        bounds = [DEFAULT_MAX_MODEL_LEN, folder_positions(config), held]
        max_len = min(b for b in bounds if b is not None)
    if "max_num_batched_tokens" in settings:
        budget = int(settings["max_num_batched_tokens"])
        if budget < max_len or budget < seqs:
            raise SizingError(
                f"model {name!r}: vllm.max_num_batched_tokens {budget} is less than "
                + (f"max_model_len {max_len}: a prompt runs in one vLLM step" if budget < max_len
                   else f"vllm.max_num_seqs {seqs}: each running sequence takes a token a step")
            )
    else:
        budget = max(max_len, seqs, min(max_len * seqs, DEFAULT_MAX_NUM_BATCHED_TOKENS))
    return VllmSizes(max_len, seqs, budget, kv_bytes)
