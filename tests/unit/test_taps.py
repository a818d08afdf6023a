"""Taps compiled into a model (runtime/taps.py): a module's torch hooks fire inside a
torch.compile'd graph through the ``hookwire::tap`` op, exactly as ``nn.Module.__call__``
fires them eagerly; with no hook a tap changes nothing; an edit the compiled code cannot
take is refused naming the module. The eager model is the oracle."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from hookwire_server.runtime import taps


class Block(nn.Module):
    """A module with a tensor, a None-able tensor and a number among its arguments and a
    tuple output (vLLM's decoder layers take and return a residual like this)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, scale: float = 1.0) -> Any:
        stream = x if residual is None else x + residual
        return self.linear(stream) * scale, stream


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = None
        for block in self.blocks:
            x, residual = block(x, residual, scale=0.5)
        return self.norm(x + residual)


def _model(tag: str) -> Stack:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Stack().eval()
    paths = ["blocks.0", "blocks.1", "blocks.2", "blocks.1.linear", "norm"]
    assert taps.install(tag, model, paths) == paths
    return model


@pytest.fixture(scope="module")
def compiled() -> tuple[Stack, Any]:
    """One tapped model and its compiled form (inductor, the compiler vLLM uses on CPUs;
    dynamic shapes, as vLLM compiles)."""
    torch._dynamo.reset()
    model = _model("unit")
    return model, torch.compile(model, fullgraph=True, dynamic=True)


def _x(rows: int = 5) -> torch.Tensor:
    return torch.randn(rows, 8, generator=torch.Generator().manual_seed(rows))


@torch.no_grad()
def test_a_tap_without_hooks_changes_nothing_and_hooks_fire_once_eagerly(compiled) -> None:
    model, fast = compiled
    x = _x()
    want = model(x)
    torch.testing.assert_close(fast(x), want, rtol=1e-5, atol=1e-6)
    # Eagerly a tapped module is the module as it was: __call__ fires its hooks, once.
    seen: list[int] = []
    handle = model.blocks[1].register_forward_hook(lambda m, a, out: seen.append(1))
    try:
        model(x)
        assert seen == [1]
    finally:
        handle.remove()


@torch.no_grad()
def test_hooks_inside_the_compiled_graph_see_and_edit_what_eager_hooks_do(compiled) -> None:
    """Pre-hooks (plain and with kwargs, None and numbers as traced), forward hooks on a
    tuple output and on a nested module: the compiled model's values and edits equal the
    eager model's with the same hooks, for two batch sizes (one graph)."""
    model, fast = compiled
    seen: dict[str, list[Any]] = {"eager": [], "compiled": []}
    into = ["eager"]

    def pre(module: nn.Module, args: Any, kwargs: Any) -> Any:
        seen[into[0]].append(("pre", args[1] is None, kwargs["scale"]))
        return (args[0] * 2.0, args[1]), kwargs

    def post(module: nn.Module, args: Any, output: Any) -> Any:
        seen[into[0]].append(("post", output[0].shape, output[1].clone()))
        return output[0] + 1.0, output[1]

    def inner(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        seen[into[0]].append(("inner", args[0].clone()))
        return output * -1.0

    handles = [model.blocks[0].register_forward_pre_hook(pre, with_kwargs=True),
               model.blocks[2].register_forward_hook(post),
               model.blocks[1].linear.register_forward_hook(inner)]
    try:
        for rows in (5, 3):
            x = _x(rows)
            into[0] = "eager"
            want = model(x)
            into[0] = "compiled"
            got = fast(x)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert want.abs().sum() > 0
    finally:
        for h in handles:
            h.remove()
    assert [s[0] for s in seen["compiled"]] == [s[0] for s in seen["eager"]] == ["pre", "inner", "post"] * 2
    for (kind, *a), (_, *b) in zip(seen["compiled"], seen["eager"]):
        if kind == "pre":
            assert a == b == [True, 0.5]  # residual None at the first block; the number as traced
        elif kind == "post":
            assert a[0] == b[0]
            torch.testing.assert_close(a[1], b[1], rtol=1e-5, atol=1e-5)
        else:
            torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-5)
    # The hooks are gone: the compiled model is the plain one again.
    x = _x()
    torch.testing.assert_close(fast(x), model(x), rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_an_edit_the_compiled_code_cannot_take_is_refused_naming_the_module(compiled) -> None:
    model, fast = compiled
    x = _x()
    cases = [
        (lambda m, a, out: (out[0][:2], out[1]), r"'blocks.0' .* shape \(2, 8\), torch.float32 on cpu where the model "
                                                 r"has \(5, 8\)"),
        (lambda m, a, out: (out[0].double(), out[1]), r"'blocks.0' .*torch.float64"),
        (lambda m, a, out: out[0], r"'blocks.0' .* replaced its output's tuple by Tensor"),
        (lambda m, a, out: (out[0], out[1], out[1]), r"'blocks.0' .* changed the number of its output's items from 2 to 3"),
    ]
    for hook, message in cases:
        handle = model.blocks[0].register_forward_hook(hook)
        try:
            with pytest.raises(taps.TapError, match=message):
                fast(x)
        finally:
            handle.remove()
    handle = model.blocks[0].register_forward_pre_hook(lambda m, a: (a[0], torch.zeros(5, 8)))
    try:
        with pytest.raises(taps.TapError, match=r"put a tensor where its input had None"):
            fast(x)
    finally:
        handle.remove()
    torch.testing.assert_close(fast(x), model(x), rtol=1e-5, atol=1e-6)  # and it still runs


@torch.no_grad()
def test_an_edit_that_returns_its_argument_or_a_view_of_it_is_copied(compiled) -> None:
    """The op's results may not alias its arguments (the compiler may reuse either's
    memory): a hook that returns its input, or a view of it, gets a copy through."""
    model, fast = compiled
    x = _x()
    handles = [model.blocks[1].register_forward_pre_hook(lambda m, a: (a[0][...], a[1])),
               model.norm.register_forward_hook(lambda m, a, out: out)]
    try:
        torch.testing.assert_close(fast(x), model(x), rtol=1e-5, atol=1e-6)
    finally:
        for h in handles:
            h.remove()


def test_layouts_carry_what_hooks_see() -> None:
    t = torch.zeros(1)
    assert taps._inputs_layout((t, None, 3, 0.5, True, "s"), {"k": t, "n": None}) == "T,N,i3,f0.5,b1,?;k=T,n=N"
    assert taps._output_layout((t, None)) == "(T,N)"
    assert taps._output_layout([t]) == "[T]"
    assert taps._output_layout(t) == "T"
    tag, path, phase, positional, keywords, output = taps._parse("m/a.b|post|T,N,i3;k=T|(T,N)")
    assert (tag, path, phase, positional, keywords, output) == ("m", "a.b", "post", ["T", "N", "i3"], [("k", "T")], "(T,N)")
    assert taps._rebuild(["T", "N", "i3", "f0.5", "b0", "?"], [t]) == [t, None, 3, 0.5, False, None]


def test_a_tap_of_a_model_that_went_away_changes_nothing() -> None:
    model = _model("gone")
    taps.forget("gone")
    x = _x()
    out = [torch.full_like(x, 7.0), torch.full_like(x, 7.0)]
    torch.ops.hookwire.tap("gone/blocks.0|post|T,N;|(T,T)", [x, x, x], out)
    torch.testing.assert_close(out[0], x)
    torch.testing.assert_close(out[1], x)
    assert taps.tapped(model.blocks[0]) and not taps.tapped(model.blocks[0].linear)


def test_the_op_passes_torchs_own_checks_of_a_custom_op() -> None:
    """torch.library.opcheck: the schema, the fake (meta) implementation and the
    mutation of ``out`` agree with what the op does, with and without a hook."""
    model = _model("opcheck")
    x = _x()
    name = "opcheck/blocks.0|post|T,N;|(T,T)"
    torch.library.opcheck(torch.ops.hookwire.tap.default, (name, [x, x, x], [torch.empty_like(x), torch.empty_like(x)]))
    handle = model.blocks[0].register_forward_hook(lambda m, a, out: (out[0] * 2.0, out[1]))
    try:
        out = [torch.empty_like(x), torch.empty_like(x)]
        torch.library.opcheck(torch.ops.hookwire.tap.default, (name, [x, x, x], out))
        torch.ops.hookwire.tap(name, [x, x, x], out)
        torch.testing.assert_close(out[0], x * 2.0)
    finally:
        handle.remove()


@torch.no_grad()
def test_edits_that_alias_inputs_or_change_strides_and_global_hooks_behave_as_eagerly(compiled) -> None:
    """A forward hook that returns the module's input (an ablation: "skip this block"),
    one that returns its output transposed twice (other strides), a global forward hook
    registered with kwargs, and a hook that changes a traced number (refused)."""
    model, fast = compiled
    x = _x()
    seen: list[float] = []
    handles = [model.blocks[1].register_forward_hook(lambda m, a, out: (a[0], out[1])),
               model.norm.register_forward_hook(lambda m, a, out: out.t().contiguous().t()),
               nn.modules.module.register_module_forward_hook(
                   lambda m, a, kw, out: seen.append(kw.get("scale", -1.0)) if m is model.blocks[2] else None,
                   with_kwargs=True)]
    try:
        want = model(x)
        n = len(seen)
        torch.testing.assert_close(fast(x), want, rtol=1e-5, atol=1e-5)
        assert seen[:n] == [0.5] and seen[n:] == [0.5]
    finally:
        for h in handles:
            h.remove()
    handle = model.blocks[0].register_forward_pre_hook(lambda m, a, kw: (a, {"scale": 3.0}), with_kwargs=True)
    try:
        with pytest.raises(taps.TapError, match=r"changed item 0 of its input, which the model was compiled with as "
                                                r"a constant \(0.5\), to 3.0"):
            fast(x)
    finally:
        handle.remove()


@torch.no_grad()
def test_a_model_name_with_slashes_and_bars_keeps_its_taps() -> None:
    """Model names are free text ("org/model|v2"): a tap's name carries them encoded."""
    torch._dynamo.reset()
    model = _model("org/model|v2")
    fast = torch.compile(model, fullgraph=True, dynamic=True, backend="aot_eager")
    x = _x()
    handle = model.norm.register_forward_hook(lambda m, a, out: out * 0.0)
    try:
        assert float(fast(x).abs().max()) == 0.0
    finally:
        handle.remove()
