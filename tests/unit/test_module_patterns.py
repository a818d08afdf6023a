"""hookwire_server.models.module_patterns: globs over dotted module paths."""

from __future__ import annotations

import pytest

from hookwire_server.models.module_patterns import is_glob, match_paths, matches

# named_modules() of a small encoder, in its order ("" is the root module).
PATHS = [
    "",
    "embed",
    "encoder",
    "encoder.layers",
    "encoder.layers.0",
    "encoder.layers.0.attn",
    "encoder.layers.0.linear1",
    "encoder.layers.0.linear2",
    "encoder.layers.1",
    "encoder.layers.1.attn",
    "encoder.layers.1.linear1",
    "encoder.layers.1.linear2",
    "encoder.layers.10",
    "encoder.layers.10.linear1",
    "encoder.norm",
    "head",
]


def test_exact_path():
    assert match_paths("encoder.layers.0.attn", PATHS) == ["encoder.layers.0.attn"]
    assert match_paths("head", PATHS) == ["head"]


def test_exact_path_must_match_whole_path():
    assert match_paths("encoder.layers.0.att", PATHS) == []
    assert match_paths("layers.0.attn", PATHS) == []
    assert match_paths("encoder.layers.0.attn.x", PATHS) == []


def test_unknown_path_matches_nothing():
    assert match_paths("decoder", PATHS) == []
    assert match_paths("decoder.*", PATHS) == []
    assert match_paths("anything", []) == []
    assert match_paths("**", []) == []


def test_root_path():
    assert match_paths("", PATHS) == [""]
    assert match_paths("", ["a", "b"]) == []
    assert not is_glob("")


def test_star_matches_within_one_segment():
    assert match_paths("encoder.layers.*", PATHS) == [
        "encoder.layers.0",
        "encoder.layers.1",
        "encoder.layers.10",
    ]
    assert match_paths("encoder.layers.*.linear1", PATHS) == [
        "encoder.layers.0.linear1",
        "encoder.layers.1.linear1",
        "encoder.layers.10.linear1",
    ]
    assert match_paths("encoder.layers.0.linear*", PATHS) == [
        "encoder.layers.0.linear1",
        "encoder.layers.0.linear2",
    ]
    assert match_paths("enc*", PATHS) == ["encoder"]


def test_star_does_not_cross_dots():
    assert match_paths("encoder.*", PATHS) == ["encoder.layers", "encoder.norm"]
    assert match_paths("encoder.*.attn", PATHS) == []
    assert match_paths("*.attn", PATHS) == []
    assert not matches("a.*", "a.b.c")
    assert not matches("a*c", "a.c")


def test_star_matches_top_level_segments():
    top = [p for p in match_paths("*", PATHS) if p]
    assert top == ["embed", "encoder", "head"]


def test_double_star_crosses_segments():
    assert match_paths("encoder.**", PATHS) == [p for p in PATHS if p.startswith("encoder.")]
    assert match_paths("**.attn", PATHS) == ["encoder.layers.0.attn", "encoder.layers.1.attn"]
    assert match_paths("**linear2", PATHS) == ["encoder.layers.0.linear2", "encoder.layers.1.linear2"]
    assert match_paths("encoder.**.linear1", PATHS) == [
        "encoder.layers.0.linear1",
        "encoder.layers.1.linear1",
        "encoder.layers.10.linear1",
    ]


def test_double_star_matches_everything():
    assert match_paths("**", PATHS) == PATHS


def test_question_mark_matches_one_character():
    assert match_paths("encoder.layers.?", PATHS) == ["encoder.layers.0", "encoder.layers.1"]
    assert match_paths("encoder.layers.??", PATHS) == ["encoder.layers.10"]
    assert match_paths("encoder.layers.?.linear?", PATHS) == [
        "encoder.layers.0.linear1",
        "encoder.layers.0.linear2",
        "encoder.layers.1.linear1",
        "encoder.layers.1.linear2",
    ]
    assert match_paths("hea?", PATHS) == ["head"]
    assert match_paths("head?", PATHS) == []
    assert match_paths("?", PATHS) == []


def test_mixed_wildcards():
    assert match_paths("**.layers.1?.*", PATHS) == ["encoder.layers.10.linear1"]
    assert match_paths("e*.**.?inear1", PATHS) == [
        "encoder.layers.0.linear1",
        "encoder.layers.1.linear1",
        "encoder.layers.10.linear1",
    ]


@pytest.mark.parametrize(
    "literal",
    ["a+b", "a(b)", "a[0]", "a{1,2}", "a|b", "a^b", "a$b", "a\\b", "a.b", "x+"],
)
def test_regex_metacharacters_are_literal(literal):
    decoys = {
        "a+b": ["aab", "aaab", "ab"],
        "a(b)": ["ab", "a(b"],
        "a[0]": ["a0", "a[0"],
        "a{1,2}": ["a1", "a{1", "a12"],
        "a|b": ["a", "b"],
        "a^b": ["ab"],
        "a$b": ["ab", "a"],
        "a\\b": ["ab", "a\b"],
        "a.b": ["axb", "a-b"],
        "x+": ["x", "xx", "xxx"],
    }[literal]
    paths = decoys + [literal]
    # Exact (no wildcard) lookup.
    assert match_paths(literal, paths) == [literal]
    # The same characters inside a glob stay literal too.
    assert match_paths(literal + "*", paths + [literal + "z"]) == [literal, literal + "z"]
    assert match_paths("**" + literal, paths) == [literal]


def test_metacharacters_around_wildcards():
    paths = ["blocks[0].attn", "blocks[1].attn", "blocks0.attn", "blocks[0]xattn", "blocks(0).attn"]
    assert match_paths("blocks[?].attn", paths) == ["blocks[0].attn", "blocks[1].attn"]
    assert match_paths("blocks[*].*", paths) == ["blocks[0].attn", "blocks[1].attn"]


def test_order_of_paths_is_preserved():
    paths = ["z.a", "a.a", "m.a", "b.a", "a"]
    assert match_paths("*.a", paths) == ["z.a", "a.a", "m.a", "b.a"]
    assert match_paths("*.a", list(reversed(paths))) == ["b.a", "m.a", "a.a", "z.a"]
    assert match_paths("**", paths) == paths


def test_is_glob():
    assert is_glob("a.*")
    assert is_glob("**")
    assert is_glob("a?")
    assert not is_glob("encoder.layers.0")
    assert not is_glob("a[0]+b")


def test_match_is_full_match_only():
    assert matches("a.*", "a.b")
    assert not matches("a.*", "xa.b")
    assert match_paths("layers.*", ["encoder.layers.0"]) == []
    assert match_paths("*.layers", ["encoder.layers.0"]) == []


def test_adversarial_patterns_match_in_linear_time(monkeypatch):
    """Patterns that make a backtracking matcher take exponential time: the automaton's work
    is counted, not timed. Each pattern's walk steps the automaton at most once per edge
    of the paths' trie (a step it has seen is a DFA lookup), and a step examines at most
    one state per pattern token: len(pattern) * len(paths) in all, whatever the pattern."""
    from hookwire_server.models import module_patterns

    paths = [f"encoder.layers.{i}.attention.self.query.weight{i}" for i in range(200)]
    edges = len(module_patterns.PathIndex(paths)._children) - 1  # one per trie node but the root
    work = {"steps": 0, "states": 0}
    real_step = module_patterns._step

    def counting_step(tokens, states, ch):
        assert len(states) <= len(tokens) + 1
        work["steps"] += 1
        work["states"] += len(states)
        return real_step(tokens, states, ch)

    monkeypatch.setattr(module_patterns, "_step", counting_step)
    for pattern in ("**" * 50 + "X", "*.*." * 100 + "?", ("**.a" * 60), "*?" * 300 + "X"):
        before = dict(work)
        assert match_paths(pattern, paths) == []
        steps, states = work["steps"] - before["steps"], work["states"] - before["states"]
        tokens = len(module_patterns._tokens(pattern))
        assert 0 < steps <= edges, f"{pattern[:12]}...: {steps} automaton steps for {edges} trie edges"
        assert states <= (tokens + 1) * steps, f"{pattern[:12]}...: {states} states examined in {steps} steps"


def test_runs_of_wildcards_collapse():
    assert match_paths("encoder.***.attn", PATHS) == match_paths("encoder.**.attn", PATHS)
    assert match_paths("**", ["", "a", "a.b"]) == ["", "a", "a.b"]
    assert matches("a.**", "a.") and matches("a**b", "a.x.b") and not matches("a*b", "a.x.b")


def test_overlong_patterns_are_refused():
    import pytest

    with pytest.raises(ValueError, match="at most 1024"):
        match_paths("a" * 1025 + "*", ["a"])
