"""Built-in demo models: small, seeded, CPU. `hookwire serve` hosts them by default.

- ``mlp``: float input (batch, 8) -> (batch, 4), with dropout.
- ``tiny-transformer``: a two-layer encoder. forward(input_ids, attention_mask=None,
  inputs_embeds=None) returns a dict (``last_hidden_state``, ``logits``); each
  attention block returns a tuple (output, weights); the LayerNorm ``norm`` is
  called twice per pass (on the embeddings and on the final hidden state); dropout
  makes train and eval differ.
- ``tiny-lm``: a causal language model that generates, with its tokenizer (needs
  ``transformers``): a 2-layer Llama (hidden size 64, 4 heads, 2 key/value heads)
  built from a ``LlamaConfig`` in code, and a byte-level BPE tokenizer built offline
  in code with the ``tokenizers`` library (``tiny_lm_tokenizer``). Its weights are
  random (seeded), so the text it writes is gibberish: it exists to exercise
  Tokenize, generation and hooks on a real transformers decoder without downloads.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import torch
from torch import nn

VOCAB = 64
MAX_LEN = 32
D_MODEL = 32


class MLP(nn.Module):
    """Two hidden layers with ReLU and dropout."""

    def __init__(self, d_in: int = 8, d_hidden: int = 32, d_out: int = 4, p_drop: float = 0.2) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.act = nn.ReLU()
        self.drop = nn.Dropout(p_drop)
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.out = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.act(self.fc1(x)))
        x = self.act(self.fc2(x))
        return self.out(x)


class SelfAttention(nn.Module):
    """Multi-head self-attention returning (output, attention weights)."""

    def __init__(self, d_model: int, n_heads: int, p_drop: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.drop = nn.Dropout(p_drop)

    def forward(
        self, x: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, d = x.shape
        h = self.n_heads
        q, k, v = self.qkv(x).view(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // h)
        if attention_mask is not None:
            keep = attention_mask.to(torch.bool)[:, None, None, :]
            scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
        weights = self.drop(scores.softmax(dim=-1))
        out = (weights @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(out), weights


class EncoderLayer(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, d_model: int, n_heads: int, p_drop: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = SelfAttention(d_model, n_heads, p_drop)
        self.norm2 = nn.LayerNorm(d_model)
        self.ff = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
        self.drop = nn.Dropout(p_drop)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        attended, _weights = self.attn(self.norm1(x), attention_mask=attention_mask)
        x = x + self.drop(attended)
        return x + self.drop(self.ff(self.norm2(x)))


class Encoder(nn.Module):
    """A stack of encoder layers."""

    def __init__(self, n_layers: int, d_model: int, n_heads: int, p_drop: float) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(d_model, n_heads, p_drop) for _ in range(n_layers))

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, attention_mask=attention_mask)
        return x


class TinyTransformer(nn.Module):
    """A tiny encoder with a classification head, shaped like a transformers model."""

    #: Its learned position table's length: longer inputs are refused before the pass
    #: (models/positions.py), as a transformers config's max_position_embeddings is.
    max_positions = MAX_LEN

    def __init__(
        self, vocab: int = VOCAB, d_model: int = D_MODEL, n_layers: int = 2, n_heads: int = 4,
        n_classes: int = 3, p_drop: float = 0.1,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.position = nn.Embedding(MAX_LEN, d_model)
        self.drop = nn.Dropout(p_drop)
        self.norm = nn.LayerNorm(d_model)
        self.encoder = Encoder(n_layers, d_model, n_heads, p_drop)
        self.head = nn.Linear(d_model, n_classes)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        x = x + self.position(torch.arange(x.shape[1], device=x.device))
        x = self.norm(self.drop(x))
        x = self.norm(self.encoder(x, attention_mask=attention_mask))
        if attention_mask is None:
            pooled = x.mean(dim=1)
        else:
            m = attention_mask.to(x.dtype).unsqueeze(-1)
            pooled = (x * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
        return {"last_hidden_state": x, "logits": self.head(pooled)}


def _seeded(build: Callable[[], nn.Module], seed: int) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build().eval()


def mlp() -> nn.Module:
    """The demo MLP with seeded weights."""
    return _seeded(MLP, 0)


def tiny_transformer() -> nn.Module:
    """The demo transformer with seeded weights."""
    return _seeded(TinyTransformer, 1)


# --------------------------------------------------------------------------- tiny-lm

#: Longest sequence tiny-lm handles (prompt and new tokens).
TINY_LM_MAX_POSITIONS = 512


#: The special tokens of tiny-lm's tokenizer, with their ids 0, 1, 2.
TINY_LM_SPECIALS = ("<pad>", "<bos>", "<eos>")
#: Words whose byte-level spellings become tokens (with every prefix, one merge per
#: letter): a fixed list, so the vocabulary never changes. "Ġ" is the byte-level space.
_TINY_LM_WORDS = (
    "Ġthe", "Ġof", "Ġand", "Ġto", "Ġin", "Ġis", "Ġit", "Ġthat", "Ġwas", "Ġfor", "Ġon", "Ġare",
    "Ġwith", "Ġas", "Ġat", "Ġbe", "Ġthis", "Ġhave", "Ġfrom", "Ġor", "Ġone", "Ġby", "Ġnot",
    "Ġhook", "Ġmodel", "Ġtoken", "Ġlayer", "Ġtext", "Ġdata", "Ġcat", "Ġdog", "Ġhello", "Ġworld",
    "the", "ing", "ed", "er", "es", "ly", "ion", "Hello", "The",
)


#: tiny-lm's chat template (/v1/chat/completions formats messages with it): each message
#: as "role: content" on a line of its own after <bos>, and "assistant:" to answer.
TINY_LM_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def tiny_lm_tokenizer() -> Any:
    """tiny-lm's tokenizer: byte-level BPE (every text round-trips, any language) over the
    256 byte symbols plus the prefixes of a fixed word list, built in code with no files
    or downloads, as a ``transformers.PreTrainedTokenizerFast``. It adds ``<bos>`` in
    front of each text (``add_special_tokens``), pads with ``<pad>`` on the left (a
    causal LM generates on the right), and ends generations at ``<eos>``."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {token: i for i, token in enumerate((*TINY_LM_SPECIALS, *sorted(pre_tokenizers.ByteLevel.alphabet())))}
    merges: list[tuple[str, str]] = []
    for word in _TINY_LM_WORDS:
        for end in range(2, len(word) + 1):
            left, right = word[: end - 1], word[end - 1]
            if word[:end] not in vocab:
                merges.append((left, right))
                vocab[word[:end]] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", vocab["<bos>"])],
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        padding_side="left", model_max_length=TINY_LM_MAX_POSITIONS, chat_template=TINY_LM_CHAT_TEMPLATE,
    )


def tiny_lm() -> nn.Module:
    """The demo causal LM (a ``transformers.LlamaForCausalLM``) with seeded random
    weights, in eval mode, on the CPU; its vocabulary is tiny_lm_tokenizer's."""
    import transformers

    vocab_size = len(tiny_lm_tokenizer())
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=TINY_LM_MAX_POSITIONS,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    model = _seeded(lambda: transformers.LlamaForCausalLM(config), 2)
    # Eager attention: its attention modules return their probabilities, so hooks on
    # model.layers.N.self_attn capture real attention patterns (with transformers'
    # default, sdpa, they return None there; docs/recipes/attention.md).
    model.set_attn_implementation("eager")  # type: ignore[operator]  # typed as a Tensor attribute by nn.Module
    return model


@dataclasses.dataclass(frozen=True)
class DemoModel:
    """A built-in demo model."""

    factory: Callable[[], nn.Module]
    description: str
    #: Builds its tokenizer; None for a model without one.
    tokenizer: Callable[[], Any] | None = None
    #: A package it needs beyond the server's own (skipped, with a log line, without it).
    needs: str | None = None


#: name -> the demo model
DEMO_MODELS: dict[str, DemoModel] = {
    "mlp": DemoModel(mlp, "Demo MLP: float32 (batch, 8) -> (batch, 4), with dropout."),
    "tiny-transformer": DemoModel(
        tiny_transformer,
        "Demo 2-layer encoder: input_ids int64 (batch, seq<=32, vocab 64), attention_mask kwarg; "
        "returns {last_hidden_state, logits}.",
    ),
    "tiny-lm": DemoModel(
        tiny_lm,
        "Demo causal LM (2-layer Llama, random seeded weights: its text is gibberish) with a byte-level "
        "BPE tokenizer: Tokenize, then input_ids int64 (batch, seq<=512), attention_mask; returns "
        "{logits, past_key_values} ({logits, cache} with transformers 5.24 and later).",
        tokenizer=tiny_lm_tokenizer,
        needs="transformers",
    ),
}
