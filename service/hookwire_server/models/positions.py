"""A model's position limit: the longest sequence it takes, and the one check that
Infer, Generate (prompt plus new tokens) and harvest contexts make against it before a
pass runs. Past it a learned position table fails in the pass (an index error, after the
call was queued and admitted) and rotary positions quietly degrade, so a call over it is
refused up front, naming the length and the limit."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import InvalidArgument

#: Config fields that state the limit, in the order they are read (GPT-2's name first).
CONFIG_FIELDS = ("n_positions", "max_position_embeddings")
#: The attribute a model without a transformers config states its limit with (an int;
#: the demo encoder's learned position table).
MODULE_ATTRIBUTE = "max_positions"


@dataclasses.dataclass(frozen=True)
class PositionLimit:
    """The longest sequence a model takes, and where that was read (for messages)."""

    positions: int
    #: e.g. "its config's max_position_embeddings".
    source: str


def position_limit(module: Any) -> PositionLimit | None:
    """``module``'s position limit: its transformers config's ``n_positions`` or
    ``max_position_embeddings``, else its own ``max_positions``; None when nothing
    states one (the model takes any length)."""
    config = getattr(module, "config", None)
    for name in CONFIG_FIELDS:
        value = _positive(getattr(config, name, None))
        if value is not None:
            return PositionLimit(value, f"its config's {name}")
    value = _positive(getattr(module, MODULE_ATTRIBUTE, None))
    if value is not None:
        return PositionLimit(value, f"its {MODULE_ATTRIBUTE}")
    return None


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def check_positions(limit: PositionLimit | None, model: str, length: int, what: str) -> None:
    """InvalidArgument when ``length`` positions pass ``limit`` (of model ``model``);
    ``what`` says what the length is, in the request's words (e.g. "input_ids: 4000
    positions", "max_new_tokens: the prompt's 10 tokens and 600 new tokens")."""
    if limit is not None and length > limit.positions:
        raise InvalidArgument(
            f"{what} pass the {limit.positions} positions of model {model!r} ({limit.source})"
        )
