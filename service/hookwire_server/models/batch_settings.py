"""How a model's calls may share a pass: the batching settings in force for a model (the
server's defaults under its config's keys) and the sizes a padded token length must
avoid. Read by the engine (batching.py, scheduler.py); set by the model config."""

from __future__ import annotations

import dataclasses

import torch

from hookwire.v1 import model_service_pb2


#: Inputs that make a call run alone unless the model's config names others: a loss
#: over ``labels`` is a mean over the batch's rows, so it would mix callers.
DEFAULT_REDUCING_INPUTS = ("labels",)


#: Keyword inputs that make a model keep only the last positions' outputs (transformers'
#: causal LMs): after right padding those would be pads', so such calls join only calls
#: of their own length.
KEEPS_LAST_TOKENS = ("logits_to_keep", "num_logits_to_keep")


#: The most rows one batched pass holds unless configured.
DEFAULT_MAX_BATCH_SIZE = 32


#: How long the first call of a pass may wait for expected company (scheduler.py) unless configured.
#: 10 ms (Ray Serve's batch_wait_timeout_s default): 8 closed-loop MiniLM callers on a
#: loaded 2-core machine took longer than 5 ms to send again, the waits ran out, and their
#: passes fell back to two groups of 4 (docs/benchmarks.md, issue 26's final round).
DEFAULT_MAX_BATCH_DELAY_MS = 10.0


#: Bounds of the settings (config and flags are checked against them).
LIMIT_MAX_BATCH_SIZE = 4096


LIMIT_MAX_BATCH_DELAY_MS = 10_000.0


@dataclasses.dataclass(frozen=True)
class BatchSettings:
    """How a model joins concurrent calls into one pass (the model config's batching keys)."""

    #: Whether calls are joined at all (false for a model whose forward mixes rows).
    enabled: bool = True
    #: Most rows (summed over the joined calls) in one pass.
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    #: How long the first call of a pass may wait for company when more callers were seen
    #: lately than wait now (see engine/scheduler.py); 0: only what is already queued.
    max_batch_delay_ms: float = DEFAULT_MAX_BATCH_DELAY_MS
    #: The dimension along which calls' rows are stacked and sliced.
    batch_dim: int = 0
    #: Keyword inputs whose presence makes a call run alone (they reduce across rows).
    reducing_inputs: tuple[str, ...] = DEFAULT_REDUCING_INPUTS
    #: The pad token id that lets token inputs of different lengths join (None: only
    #: calls of equal shapes join). From the config, else the tokenizer or model config.
    pad_token_id: int | None = None
    #: Whether token inputs of different lengths join padded (false for a model whose
    #: outputs at a token depend on the tokens after it, e.g. last-position pooling that
    #: ignores the attention mask).
    padding: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.max_batch_size <= LIMIT_MAX_BATCH_SIZE:
            raise ValueError(f"max_batch_size {self.max_batch_size} is outside 1..{LIMIT_MAX_BATCH_SIZE}")
        if not 0.0 <= self.max_batch_delay_ms <= LIMIT_MAX_BATCH_DELAY_MS:
            raise ValueError(f"max_batch_delay_ms {self.max_batch_delay_ms} is outside 0..{LIMIT_MAX_BATCH_DELAY_MS:g}")
        if not 0 <= self.batch_dim <= 7:
            raise ValueError(f"batch_dim {self.batch_dim} is outside 0..7")

    def to_proto(self) -> model_service_pb2.Batching:
        """The settings as the wire describes them (Model.batching)."""
        return model_service_pb2.Batching(
            enabled=self.enabled, max_batch_size=self.max_batch_size, max_batch_delay_ms=self.max_batch_delay_ms,
            batch_dim=self.batch_dim, reducing_inputs=list(self.reducing_inputs),
            pads_tokens=self.enabled and self.padding and self.pad_token_id is not None and self.batch_dim == 0,
        )


def model_dimensions(module: torch.nn.Module) -> frozenset[int]:
    """Sizes a padded token length must avoid: every dimension of the model's
    parameters and buffers, its config's head counts (attention tensors carry them) and
    head sizes (a rotary embedding's output is [rows, tokens, head size], and no
    parameter need have that size: tiny-lm's is 16)."""
    sizes: set[int] = set()
    for tensor in (*module.parameters(), *module.buffers()):
        sizes.update(int(s) for s in tensor.shape)
    config = getattr(module, "config", None)
    for name in ("num_attention_heads", "num_key_value_heads", "n_head", "num_heads", "n_heads", "head_dim"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            sizes.add(value)
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        sizes.add(hidden // heads)  # the head size of configs that do not name it
    for child in module.modules():  # kept on modules (nn.MultiheadAttention, transformers' attention, custom ones)
        for name in ("num_heads", "n_heads", "num_attention_heads", "head_dim", "attention_head_size"):
            value = getattr(child, name, None)
            if isinstance(value, int):
                sizes.add(value)
    return frozenset(sizes)
