"""Module path globs: `*` within one dotted segment, `**` across segments, `?` one character.

Matching simulates the pattern as a small automaton over the path, in time
proportional to len(pattern) * len(path), whatever the pattern: client patterns
never reach a backtracking regex engine.
"""

from __future__ import annotations

import functools

MAX_PATTERN_LENGTH = 1024

_STAR, _GLOBSTAR, _ONE = object(), object(), object()


@functools.lru_cache(maxsize=1024)
def _tokens(pattern: str) -> tuple[object, ...]:
    out: list[object] = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            token: object = _GLOBSTAR
            i += 2
            while i < len(pattern) and pattern[i] == "*":
                i += 1
        elif pattern[i] == "*":
            token, i = _STAR, i + 1
        elif pattern[i] == "?":
            token, i = _ONE, i + 1
        else:
            token, i = pattern[i], i + 1
        # Runs of wildcards collapse: "***" == "**", "*" next to "**" adds nothing.
        if out and token in (_STAR, _GLOBSTAR) and out[-1] in (_STAR, _GLOBSTAR):
            if token is _GLOBSTAR:
                out[-1] = _GLOBSTAR
            continue
        out.append(token)
    return tuple(out)


def _closure(tokens: tuple[object, ...], states: set[int]) -> frozenset[int]:
    """``states`` and the states past wildcards there (a wildcard may match nothing)."""
    n = len(tokens)
    stack = list(states)
    while stack:
        s = stack.pop()
        if s < n and tokens[s] in (_STAR, _GLOBSTAR) and s + 1 not in states:
            states.add(s + 1)
            stack.append(s + 1)
    return frozenset(states)


def _step(tokens: tuple[object, ...], states: frozenset[int], ch: str) -> frozenset[int]:
    """The states after reading ``ch`` (empty: no match possible)."""
    n = len(tokens)
    following: set[int] = set()
    for s in states:
        if s == n:
            continue
        token = tokens[s]
        if token is _GLOBSTAR or (token is _STAR and ch != "."):
            following.add(s)
        elif (token is _ONE and ch != ".") or token == ch:
            following.add(s + 1)
    return _closure(tokens, following) if following else frozenset()


def matches(pattern: str, path: str) -> bool:
    """Whether the glob ``pattern`` matches the whole module ``path``."""
    tokens = _tokens(pattern)
    states = _closure(tokens, {0})
    for ch in path:
        states = _step(tokens, states, ch)
        if not states:
            return False
    return len(tokens) in states


def is_glob(pattern: str) -> bool:
    """Whether ``pattern`` has wildcards (else it names one path exactly)."""
    return "*" in pattern or "?" in pattern


def match_paths(pattern: str, paths: list[str]) -> list[str]:
    """The paths that ``pattern`` matches, in the given order."""
    return PathIndex(paths).match(pattern)


class PathIndex:
    """A model's module paths in a trie, matched against a pattern all at once.

    Paths share long prefixes ("encoder.layer.3.attention.self.query"), so the pattern's
    automaton steps once per trie edge instead of once per character of every path, and
    its state sets are turned into a DFA as they are met (one dict lookup per edge after
    the first pattern's walk). Safe to use from several threads: the DFA table is only
    ever added to, with whole entries.
    """

    def __init__(self, paths: list[str]) -> None:
        self.paths = list(paths)
        self._exact = {path: i for i, path in enumerate(self.paths)}
        #: children[node][char] -> node; terminal[node] -> index of the path ending there.
        self._children: list[dict[str, int]] = [{}]
        self._terminal: list[int] = [-1]
        for index, path in enumerate(self.paths):
            node = 0
            for ch in path:
                nxt = self._children[node].get(ch)
                if nxt is None:
                    nxt = len(self._children)
                    self._children[node][ch] = nxt
                    self._children.append({})
                    self._terminal.append(-1)
                node = nxt
            self._terminal[node] = index

    def match(self, pattern: str) -> list[str]:
        """The paths ``pattern`` matches, in the order given; ValueError for a pattern
        over MAX_PATTERN_LENGTH characters."""
        if len(pattern) > MAX_PATTERN_LENGTH:
            raise ValueError(f"a module pattern is at most {MAX_PATTERN_LENGTH} characters")
        if not is_glob(pattern):
            return [pattern] if pattern in self._exact else []
        tokens = _tokens(pattern)
        n = len(tokens)
        dfa: dict[tuple[frozenset[int], str], frozenset[int]] = {}

        def step(states: frozenset[int], ch: str) -> frozenset[int]:
            found = dfa.get((states, ch))
            if found is None:
                found = dfa[(states, ch)] = _step(tokens, states, ch)
            return found

        hits: list[int] = []
        stack = [(0, _closure(tokens, {0}))]
        while stack:
            node, states = stack.pop()
            if n in states and self._terminal[node] >= 0:
                hits.append(self._terminal[node])
            for ch, child in self._children[node].items():
                following = step(states, ch)
                if following:
                    stack.append((child, following))
        return [self.paths[i] for i in sorted(hits)]
