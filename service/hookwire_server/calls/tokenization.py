"""Tokenizing texts for a model (its tokenizer is readied as it loads: models/tokenizers.py).

``tokenize_texts`` is what Tokenize runs, and what Generate's ``prompts`` will run
with the default fields, so both see the same ids. It equals transformers'
``tokenizer(texts, padding=True, return_tensors="pt", padding_side=...)`` (no
truncation), computed in two steps so that limits apply before the padded
tensors exist: the texts are tokenized unpadded, the longest is checked against
``max_prompt_tokens``, then the rows are padded with the tokenizer's pad id.

Tokenizers are not torch state, but a fast tokenizer must not be called from two
threads at once: each model's tokenizer runs on its own thread
(``ModelHost.run_tokenizer``), never on the event loop and never in the way of a
forward pass. Nothing here imports grpc or transformers.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from hookwire.wire import codec
from hookwire.v1 import model_service_pb2

from ..auth import ANONYMOUS, Principal
from ..errors import FailedPrecondition, InvalidArgument
from ..limits import Limits, exceeded
from .admission import Admission
from ..models.model_registry import ModelHost

#: TokenizeRequest.padding_side values; "" picks the model's default (``padding_side_for``).
PADDING_SIDES = ("", "left", "right")


def padding_side_for(host: ModelHost, requested: str) -> str:
    """The side to pad on: ``requested`` ("left" or "right"), or for "" "left" when the
    model generates (new tokens go on the right) and else the tokenizer's own side.
    InvalidArgument for anything else."""
    if requested not in PADDING_SIDES:
        raise InvalidArgument(f"padding_side: {requested!r} is not \"left\", \"right\" or \"\" (the model's default)")
    if requested:
        return requested
    if host.can_generate:
        return "left"
    return str(getattr(host.tokenizer, "padding_side", "right") or "right")


@dataclasses.dataclass(frozen=True)
class TokenizedBatch:
    """Texts tokenized and padded into one batch."""

    #: int64 [batch, seq], padded with the tokenizer's pad id.
    input_ids: torch.Tensor
    #: int64 [batch, seq]: 1 for a real token, 0 for padding.
    attention_mask: torch.Tensor
    #: Each text's token strings (convert_ids_to_tokens), padding excluded.
    pieces: list[list[str]]

    def to_proto(self) -> model_service_pb2.TokenizeResponse:
        """The TokenizeResponse carrying this batch."""
        response = model_service_pb2.TokenizeResponse()
        codec.encode_tensor_into(self.input_ids, response.input_ids)
        codec.encode_tensor_into(self.attention_mask, response.attention_mask)
        for row in self.pieces:
            response.tokens.add().pieces.extend(row)
        return response


def check_texts(texts: Sequence[str], limits: Limits, *, field: str = "texts") -> None:
    """InvalidArgument for no texts; ResourceExhausted (naming the limit) for too many
    texts or characters. ``field`` names them in messages (Generate's are "prompts").
    Cheap: run it on the event loop, before the tokenizer."""
    if not texts:
        raise InvalidArgument(f"{field}: no texts to tokenize")
    if len(texts) > limits.max_tokenize_texts:
        raise exceeded(field, f"{len(texts)} texts", limits.max_tokenize_texts, "max_tokenize_texts")
    chars = sum(len(text) for text in texts)
    if chars > limits.max_tokenize_chars:
        raise exceeded(field, f"{chars} characters in all", limits.max_tokenize_chars, "max_tokenize_chars")


def tokenize_texts(
    host: ModelHost, texts: Sequence[str], *, add_special_tokens: bool | None, padding_side: str, max_prompt_tokens: int,
    field: str = "texts",
) -> TokenizedBatch:
    """Tokenizes ``texts`` with the model's tokenizer into one padded batch. Blocks: run it
    on the model's tokenizer thread (``host.run_tokenizer``).

    ``add_special_tokens`` None uses the tokenizer's default; ``padding_side`` is "left"
    or "right" (see ``padding_side_for``). Raises FailedPrecondition when the model has
    no tokenizer, or texts of different lengths need padding and the tokenizer has no
    pad token; ResourceExhausted when the longest sequence has more than
    ``max_prompt_tokens`` tokens; InvalidArgument when the tokenizer refuses a text.
    ``field`` names the texts in messages.
    """
    tokenizer = host.tokenizer
    if tokenizer is None:
        raise FailedPrecondition(no_tokenizer_message(host))
    kwargs: dict[str, Any] = {"padding": False, "truncation": False, "return_attention_mask": False}
    if add_special_tokens is not None:
        kwargs["add_special_tokens"] = add_special_tokens
    try:
        rows: list[list[int]] = [list(ids) for ids in tokenizer(list(texts), **kwargs)["input_ids"]]
    except (ValueError, TypeError, RuntimeError) as exc:  # e.g. a tokenizer that refuses some input
        raise InvalidArgument(f"the tokenizer of model {host.name!r} refused the texts: {type(exc).__name__}: {exc}") from None
    longest = max(len(row) for row in rows)
    if longest > max_prompt_tokens:
        which = next(i for i, row in enumerate(rows) if len(row) == longest)
        raise exceeded(f"{field}[{which}]", f"{longest} tokens", max_prompt_tokens, "max_prompt_tokens")
    pad_id = getattr(tokenizer, "pad_token_id", None)
    if pad_id is None and any(len(row) != longest for row in rows):
        raise FailedPrecondition(
            f"the tokenizer of model {host.name!r} has no pad token (nor an EOS token to pad with), "
            "so texts of different lengths cannot be batched: tokenize them one at a time"
        )
    input_ids = torch.full((len(rows), longest), pad_id if pad_id is not None else 0, dtype=torch.int64)
    attention_mask = torch.zeros((len(rows), longest), dtype=torch.int64)
    for i, row in enumerate(rows):
        if not row:
            continue
        span = slice(longest - len(row), longest) if padding_side == "left" else slice(0, len(row))
        input_ids[i, span] = torch.tensor(row, dtype=torch.int64)
        attention_mask[i, span] = 1
    pieces = [list(tokenizer.convert_ids_to_tokens(row)) for row in rows]
    return TokenizedBatch(input_ids, attention_mask, pieces)


def no_tokenizer_message(host: ModelHost) -> str:
    """Why texts cannot be tokenized for a model without a tokenizer, and what to do."""
    why = f": {host.tokenizer_problem}" if host.tokenizer_problem else ""
    return (f"model {host.name!r} has no tokenizer{why}; tokenize on the client and send input_ids "
            "(Infer) instead")


class Tokenization:
    """Tokenize calls: limits, the model's tokenizer thread, the response."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self.limits = admission.state.limits
        #: Tokenize calls running or waiting, by model name.
        self._queued: dict[str, int] = {}

    async def tokenize(
        self, request: model_service_pb2.TokenizeRequest, principal: Principal = ANONYMOUS,
    ) -> model_service_pb2.TokenizeResponse:
        """Runs one Tokenize call. Raises PermissionDenied (role), InvalidArgument,
        NotFound, Unavailable (loading, shutting down), FailedPrecondition (failed to load; no
        tokenizer), ResourceExhausted (a limit, named)."""
        host = self._admission.enter("Tokenize", principal, request.model)
        side = padding_side_for(host, request.padding_side)
        if host.tokenizer is None:
            raise FailedPrecondition(no_tokenizer_message(host))
        texts = list(request.texts)
        check_texts(texts, self.limits)
        add_special_tokens = request.add_special_tokens if request.HasField("add_special_tokens") else None
        queued = self._queued.get(host.name, 0)  # the running call and the waiting ones
        if queued > self.limits.max_queued_tokenizes:
            raise exceeded(f"model {host.name!r}'s Tokenize queue", f"{queued} calls waiting with this one",
                           self.limits.max_queued_tokenizes, "max_queued_tokenizes", "retry later")
        self._queued[host.name] = queued + 1
        try:
            batch = await host.run_tokenizer(
                tokenize_texts, host, texts, add_special_tokens=add_special_tokens, padding_side=side,
                max_prompt_tokens=self.limits.max_prompt_tokens,
            )
        finally:
            self._queued[host.name] -= 1
        return batch.to_proto()
