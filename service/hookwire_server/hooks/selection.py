"""Numpy basic-indexing selections ("[:, -1]", "[..., 10:20]", "[0, None, 3]") parsed by a
small grammar into index tuples. Nothing is evaluated.

    selection := "[" item ("," item)* ","? "]"
    item      := int | slice | "..." | "None"
    slice     := int? ":" int? (":" int?)?      (step > 0: torch has no negative steps)
    int       := ("+" | "-")? digit+
"""

from __future__ import annotations

import functools
import re
from typing import Union

Index = tuple[Union[int, slice, "ellipsis", None], ...]  # noqa: F821 - ellipsis is Ellipsis' type

_INT = re.compile(r"[+-]?[0-9]+")
MAX_ITEMS = 64
#: Digits of an int64 (19) plus leading zeros a person might write; longer is refused
#: before conversion (Python's int() refuses over 4300 digits with its own ValueError).
MAX_INT_DIGITS = 24


class SelectionError(ValueError):
    """A malformed selection; the message says what and where."""


def _int(text: str, where: str) -> int:
    if not _INT.fullmatch(text):  # linear: the pattern cannot backtrack
        raise SelectionError(f"{where}: {text[:40]!r}{'...' if len(text) > 40 else ''} is not an integer")
    if len(text) > MAX_INT_DIGITS + 1:
        raise SelectionError(f"{where}: an integer of {len(text.lstrip('+-'))} digits is out of range (int64)")
    try:
        value = int(text)
    except ValueError:  # pragma: no cover - the pattern admits only ASCII digits of bounded length
        raise SelectionError(f"{where}: {text!r} is not an integer") from None
    if not -(2**63) <= value < 2**63:
        raise SelectionError(f"{where}: {text} is out of range")
    return value


@functools.lru_cache(maxsize=512)
def parse_selection(text: str) -> Index:
    """The index tuple ``text`` denotes; SelectionError when malformed."""
    body = text.strip()
    if not (body.startswith("[") and body.endswith("]")):
        raise SelectionError(f"{text!r} must be enclosed in [ ]")
    body = body[1:-1]
    if not body.strip():
        raise SelectionError(f"{text!r} selects nothing: write e.g. [:, -1]")
    parts = [p.strip() for p in body.split(",")]
    if parts[-1] == "" and len(parts) > 1:
        parts.pop()  # a trailing comma, as in numpy's [0,]
    if len(parts) > MAX_ITEMS:
        raise SelectionError(f"{text!r} has more than {MAX_ITEMS} items")
    out: list[int | slice | type(Ellipsis) | None] = []  # type: ignore[valid-type]
    for i, part in enumerate(parts):
        where = f"item {i} of {text!r}"
        if part == "...":
            if Ellipsis in out:
                raise SelectionError(f"{where}: only one ... is allowed")
            out.append(Ellipsis)
        elif part == "None":
            out.append(None)
        elif ":" in part:
            pieces = [p.strip() for p in part.split(":")]
            if len(pieces) > 3:
                raise SelectionError(f"{where}: {part!r} has too many colons")
            start, stop, step = (pieces + [""] * 3)[:3]
            step_value = _int(step, where) if step else None
            if step_value is not None and step_value <= 0:
                raise SelectionError(f"{where}: step {step_value} must be positive")
            out.append(slice(_int(start, where) if start else None, _int(stop, where) if stop else None, step_value))
        elif part == "":
            raise SelectionError(f"{where}: empty item")
        else:
            out.append(_int(part, where))
    return tuple(out)
