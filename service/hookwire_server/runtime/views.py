"""How hooks see a vLLM module's output, by name (``ModelHost.output_views`` holds them
in the front; a worker's runtime looks them up by the name the step plan gives): vLLM's
modules return what transformers' would in another shape, and a hook sees and edits
transformers' shape, wherever it runs."""

from __future__ import annotations

from typing import Any, Callable

import torch


def _pair(output: Any) -> bool:
    return (isinstance(output, tuple) and len(output) == 2 and isinstance(output[0], torch.Tensor)
            and isinstance(output[1], torch.Tensor))


def show_stream(output: Any) -> Any:
    """A decoder layer's output as transformers' layer returns it: vLLM's layer returns
    ``(hidden, residual)`` and the next layer's fused norm adds them first."""
    return output[0] + output[1] if _pair(output) else output


def put_stream(output: Any, new: Any) -> Any:
    """The layer's output once a rule edited the stream: ``(stream, 0)``, which the next
    layer's fused norm turns back into the same stream (it adds the residual first)."""
    return (new, torch.zeros_like(output[1])) if _pair(output) else new


def show_first(output: Any) -> Any:
    """An output projection's output without vLLM's ``(out, bias)`` tuple (a norm given
    the residual: its normed tensor)."""
    return output[0] if isinstance(output, tuple) else output


def put_first(output: Any, new: Any) -> Any:
    return (new, *output[1:]) if isinstance(output, tuple) else new


def vocabulary(vocab: int) -> tuple[Callable[[Any], Any], Callable[[Any, Any], Any]]:
    """The logits processor's output (hooks on lm_head) without vLLM's padded vocabulary
    rows past ``vocab`` (0: none)."""
    def show(out: Any) -> Any:
        return out[..., :vocab] if vocab else out

    def put(out: Any, new: Any) -> Any:
        return torch.cat([new, out[..., new.shape[-1]:]], dim=-1) if vocab else new
    return show, put


def by_name(name: str, vocab: int = 0) -> tuple[Callable[[Any], Any], Callable[[Any, Any], Any]] | None:
    """The (show, put) pair called ``name`` ("stream", "first", "vocabulary"); None for
    "" (the output as the module returns it). KeyError for another name."""
    if not name:
        return None
    if name == "vocabulary":
        return vocabulary(vocab)
    return {"stream": (show_stream, put_stream), "first": (show_first, put_first)}[name]
