"""A model's tokenizer, readied when the model loads (model_loading): the models layer
owns it; calls/tokenization.py tokenizes with it. Imports neither torch nor transformers."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("hookwire.models")


def prepare_tokenizer(tokenizer: Any, model_name: str) -> Any:
    """Readies a tokenizer for batching, in place, and returns it: one without a pad
    token pads with its EOS token, as transformers users set it for GPT-2-like models
    (the attention mask marks the padding, so the id itself is never attended to)."""
    if getattr(tokenizer, "pad_token", None) is None and getattr(tokenizer, "eos_token", None) is not None:
        tokenizer.pad_token = tokenizer.eos_token
        log.info("model %r: its tokenizer has no pad token; padding with its EOS token %r",
                 model_name, tokenizer.eos_token)
    return tokenizer
