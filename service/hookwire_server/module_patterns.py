"""Module path globs: `*` within one dotted segment, `**` across segments, `?` one character."""

from __future__ import annotations

import functools
import re


@functools.lru_cache(maxsize=1024)
def compile_pattern(pattern: str) -> re.Pattern[str]:
    """A regex matching exactly the module paths the glob ``pattern`` names."""
    out: list[str] = []
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if ch == "*":
            out.append("[^.]*")
        elif ch == "?":
            out.append("[^.]")
        else:
            out.append(re.escape(ch))
        i += 1
    return re.compile("".join(out))


def is_glob(pattern: str) -> bool:
    """Whether ``pattern`` has wildcards (else it names one path exactly)."""
    return "*" in pattern or "?" in pattern


def match_paths(pattern: str, paths: list[str]) -> list[str]:
    """The paths that ``pattern`` matches, in the given order."""
    if not is_glob(pattern):
        return [pattern] if pattern in paths else []
    regex = compile_pattern(pattern)
    return [p for p in paths if regex.fullmatch(p)]
