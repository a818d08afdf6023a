"""vLLM's compiled mode (engine/vllm_taps.py, runtime/taps.py): the session's server runs
"llama" eagerly and then compiled (conftest.MODES), and these tests say what differs: a
compiled model lists its tap points and refuses a hook elsewhere inside the compiled
graph, naming them; and its captures and edits at the taps equal the eager model's
within twice what compilation alone changes (compiled kernels reorder floating-point
sums: measured here, on the same calls without hooks)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import pytest
import torch

import hookwire
from hookwire import HookSpec, capture, rules

from test_vllm_engine import PROMPTS, _ids, oracle_tokenizer

#: What the default tap points of the test model are (the issue's list: every decoder
#: layer, its attention and MLP, the attention's output projection, the final norm, the
#: embeddings).
DEFAULT_POINTS = ["model.embed_tokens"] + [
    f"model.layers.{i}{part}" for i in range(2) for part in ("", ".self_attn", ".self_attn.o_proj", ".mlp")
] + ["model.norm"]

#: Each mode's results of the same calls (the session runs every eager test first).
RUNS: dict[str, dict[str, Any]] = {}

#: The smallest relative tolerance the comparison allows, where compilation changes the
#: logits by nothing at all: float32's resolution (one unit in the last place).
EPS = float(torch.finfo(torch.float32).eps)


def _mode(server: Any) -> str:
    return "compiled" if server.server.registry.get("llama").tap_points is not None else "eager"


async def test_a_compiled_model_lists_its_tap_points_and_refuses_hooks_elsewhere(vllm_server) -> None:
    """Model.tap_points and Model.compiled tell a client where hooks go. In the compiled
    model a hook on a module inside the graph that is no tap point (the fused qkv_proj)
    fails at registration with FAILED_PRECONDITION naming the tap points and the two
    settings, and leaves nothing registered; a glob takes the matches that take hooks;
    modules outside the graph (lm_head, in the logits processor) take hooks as ever. The
    eager model takes hooks everywhere and lists no tap points."""
    mode = _mode(vllm_server)
    ids = torch.tensor([[1, 40, 50, 60]])
    async with hookwire.connect(vllm_server.target) as client:
        model = client.model("llama")
        info = await model.info()
        qkv = HookSpec("model.layers.0.self_attn.qkv_proj", posthook=capture("output"))
        if mode == "eager":
            assert not info.compiled and info.tap_points == ()
            result = await model.infer(ids, hooks=[qkv])
            assert [e.module for e in result.events] == ["model.layers.0.self_attn.qkv_proj"]
            return
        assert info.compiled and list(info.tap_points) == DEFAULT_POINTS
        for hooks in ([qkv], [HookSpec("model.norm", posthook=capture("output")), qkv]):
            with pytest.raises(hookwire.FailedPreconditionError,
                               match=r"module 'model.layers.0.self_attn.qkv_proj' takes no hooks: it runs inside vLLM's "
                                     r"compiled model, where hooks fire only at the model's tap points "
                                     r"\(model.embed_tokens, model.layers.0, .*model.norm; Model.tap_points lists them\); "
                                     r"add it to tap_points in \[models.vllm\], or set enforce_eager = true"):
                await model.infer(ids, hooks=hooks)
        with pytest.raises(hookwire.FailedPreconditionError, match=r"module 'model.layers.1.mlp.act_fn' takes no hooks"):
            await model.hook("model.layers.1.mlp.act_fn", posthook=capture("output"))
        assert await client.list_hooks(model="llama") == []
        result = await model.infer(ids, hooks=[HookSpec("model.layers.0.**", posthook=capture("output")),
                                                HookSpec("lm_head", posthook=capture("output"))])
    assert sorted({e.module for e in result.events}) == sorted(
        ["model.layers.0.self_attn", "model.layers.0.self_attn.o_proj", "model.layers.0.mlp", "lm_head"])
    # The CLI says so too, marking the tap points in the module tree.
    out = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "hookwire._cli", "inspect", "llama",
                                                  "--target", vllm_server.target], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "compiled: hooks at 10 tap points (marked ^ below) and on modules outside the graph" in out.stdout
    marked = [line.rsplit("[", 1)[1].split("]")[0] for line in out.stdout.splitlines() if line.endswith("^")]
    assert marked == DEFAULT_POINTS


async def test_captures_and_edits_at_taps_equal_the_eager_models(vllm_server) -> None:
    """The same calls in both modes: Infer without hooks (the last logits: how much
    compilation alone changes them, d), Infer capturing every tap point's input and
    output, and a steered Generate (a vector added to layer 0's output, an edit of the
    MLP's input, the logits captured). Compiled captures equal eager ones within 2 d,
    taken relative to the values' scale (d over the largest logit, times each capture's
    largest value; at least float32's resolution); steered greedy tokens equal eager steered tokens for as long as
    each step's top-2 logit margin exceeds 2 d (past a smaller margin either token is
    right and the sequences may part); and the steering changed the tokens."""
    mode = _mode(vllm_server)
    tokenizer = oracle_tokenizer()
    rows = [_ids(tokenizer, p) for p in PROMPTS[:2]]
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    vector = torch.randn(128, generator=torch.Generator().manual_seed(11)) * 2.0
    steer = [HookSpec("model.layers.0", posthook=[rules.add("output", vector)]),
             HookSpec("model.layers.1.mlp", prehook=[rules.scale("args.0", 1.5)]),
             HookSpec("lm_head", posthook=capture("output"))]
    async with hookwire.connect(vllm_server.target) as client:
        model = client.model("llama")
        plain = await model.infer(ids, attention_mask=mask)
        captured = await model.infer(ids, attention_mask=mask, hooks=[
            HookSpec(point, prehook=capture("args"), posthook=capture("output")) for point in DEFAULT_POINTS])
        steered = await model.generate(PROMPTS[:2], 8, hooks=steer)
        unsteered = await model.generate(PROMPTS[:2], 8)
    run = {
        "logits": torch.as_tensor(plain.output["logits"]),
        "captures": {(e.module, e.phase): [torch.as_tensor(v) for v in _tensors(e)] for e in captured.events},
        "tokens": [list(t) for t in steered.token_ids],
        "steered_logits": [torch.as_tensor(e.output) for e in steered.events],
    }
    assert len(run["captures"]) == 2 * len(DEFAULT_POINTS)
    assert run["tokens"] != [list(t) for t in unsteered.token_ids]
    RUNS[mode] = run
    if mode == "eager":
        return
    if "eager" not in RUNS:
        pytest.skip("the eager run of this test did not run in this session (a -k or node selection): nothing to compare")
    eager = RUNS["eager"]
    d = float((run["logits"] - eager["logits"]).abs().max())
    # Relative to the values' scale: a capture of hidden states (|x| ~ 5) carries a rounding
    # error that much larger than the logits' (|x| ~ 0.1), compiled or not.
    relative = d / float(eager["logits"].abs().max())
    print(f"compiled against eager, no hooks: largest logit difference {d:.3g} ({relative:.3g} of the largest logit)")
    assert run["captures"].keys() == eager["captures"].keys()
    worst = 0.0
    for key, values in run["captures"].items():
        for got, want in zip(values, eager["captures"][key]):
            assert got.shape == want.shape, key
            if not want.numel():
                continue
            scale = float(want.abs().max())
            tolerance = max(2 * relative, EPS) * scale
            diff = float((got - want).abs().max())
            assert diff <= tolerance, (key, diff, tolerance)
            worst = max(worst, diff / scale)
    print(f"largest capture difference {worst:.3g} of the capture's largest value (bound: {max(2 * relative, EPS):.3g})")
    for row in range(2):
        for step, (got, want) in enumerate(zip(run["tokens"][row], eager["tokens"][row])):
            top = eager["steered_logits"][step][row, 0].topk(2).values
            if float(top[0] - top[1]) <= 2 * d:
                break  # either token is right from here on
            assert got == want, (row, step)


def _tensors(event: Any) -> list[Any]:
    """An event's captured tensors, in order (args and output both)."""
    value = event.args if event.phase == "forward_pre" else event.output
    if isinstance(value, (list, tuple)):
        return [v for v in value if v is not None]
    return [value]
