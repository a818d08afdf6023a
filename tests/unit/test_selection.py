"""The selection grammar: numpy basic indexing, parsed, never evaluated."""

from __future__ import annotations

import pytest
import torch

from hookwire_server.hooks.selection import SelectionError, parse_selection


@pytest.mark.parametrize(
    "text,expected",
    [
        ("[:, -1]", (slice(None), -1)),
        ("[..., 10:20]", (Ellipsis, slice(10, 20))),
        ("[0, :, 3]", (0, slice(None), 3)),
        ("[None, 1:]", (None, slice(1, None))),
        ("[::2]", (slice(None, None, 2),)),
        ("[-3:-1:1]", (slice(-3, -1, 1),)),
        ("[ 1 , +2 ]", (1, 2)),
        ("[0,]", (0,)),
    ],
)
def test_parses_like_numpy(text: str, expected: tuple) -> None:
    assert parse_selection(text) == expected
    t = torch.arange(4 * 5 * 30).reshape(4, 5, 30)
    assert torch.equal(t[parse_selection(text)], t[expected])


@pytest.mark.parametrize(
    "text,message",
    [
        (":, 1", "enclosed"),
        ("[]", "selects nothing"),
        ("[1,,2]", "empty item"),
        ("[a]", "not an integer"),
        ("[1.5]", "not an integer"),
        ("[__import__('os').system('x')]", "not an integer"),
        ("[1:2:3:4]", "too many colons"),
        ("[::0]", "must be positive"),
        ("[::-1]", "must be positive"),
        ("[..., ...]", "only one"),
        ("[99999999999999999999]", "out of range"),
        # Past Python's int-string limit (4300 digits), int() raises its own ValueError:
        # the parser must still answer SelectionError (it once escaped as INTERNAL).
        ("[" + "1" * 4301 + "]", "4301 digits is out of range"),
        ("[-" + "9" * 10000 + ":]", "10000 digits is out of range"),
        ("[::" + "1" * 5000 + "]", "out of range"),
        ("[\u0663]", "not an integer"),  # a non-ASCII digit: only 0-9 are digits here
        ("[" + ",".join(["0"] * 65) + "]", "more than 64"),
    ],
)
def test_rejects_malformed(text: str, message: str) -> None:
    with pytest.raises(SelectionError, match=message):
        parse_selection(text)
