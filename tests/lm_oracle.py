"""In-process oracles for Generate: transformers' own ``generate()`` on the demo causal LM
(the same seeded weights and tokenizer as the server's ``tiny-lm``), with real torch hooks."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch

from hookwire_server.demo_models import tiny_lm, tiny_lm_tokenizer

EOS = 2
PAD = 0


@functools.lru_cache(maxsize=1)
def model() -> Any:
    """A local tiny-lm (built once: tests only read it and hook it temporarily)."""
    return tiny_lm()


@functools.lru_cache(maxsize=1)
def tokenizer() -> Any:
    return tiny_lm_tokenizer()


def batch(prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts as the server tokenizes them: special tokens added, padded on the left."""
    enc = tokenizer()(prompts, padding=True, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def generate(
    ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, *, seed: int | None = None, **settings: Any,
) -> list[list[int]]:
    """Each sequence's new tokens from in-process ``generate()``, up to and including the
    EOS that ended it (generate() pads a finished sequence with the pad token after it).
    With ``stop_strings``, a sequence a stop string ended is padded too: its trailing pad
    tokens are cut (the demo LM's texts are deterministic, and none ends in a real pad).
    With ``seed``: ``torch.manual_seed(seed)`` first, on a forked RNG."""
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        if seed is not None:
            torch.manual_seed(seed)
        out = model().generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, **settings)
    rows = []
    for row in out[:, ids.shape[1]:].tolist():
        row = row[: row.index(EOS) + 1] if EOS in row else row
        while settings.get("stop_strings") and row and row[-1] == PAD:
            row.pop()
        rows.append(row)
    return rows


def text(tokens: list[int]) -> str:
    return tokenizer().decode(tokens, skip_special_tokens=True)


@contextlib.contextmanager
def forward_hook(path: str, fn: Callable[[int, Any], Any]) -> Iterator[None]:
    """A torch forward hook on ``path`` for the duration: ``fn(firing, output)`` gets the
    0-based firing count (in a cached generate() the module fires once per step, so the
    firing count is the step) and returns a replacement output or None."""
    firings = iter(range(1 << 30))

    def hook(module: Any, args: Any, output: Any) -> Any:
        return fn(next(firings), output)

    handle = model().get_submodule(path).register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def recording(*paths: str) -> Iterator[dict[str, list[torch.Tensor]]]:
    """Clones each module's output at every firing: ``recorded[path][step]``."""
    recorded: dict[str, list[torch.Tensor]] = {path: [] for path in paths}
    with contextlib.ExitStack() as stack:
        for path in paths:
            stack.enter_context(forward_hook(path, lambda step, out, p=path: recorded[p].append(out.detach().clone())))
        yield recorded
