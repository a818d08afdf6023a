"""Every Python block of docs/recipes.md runs against a real server (with shared rules allowed);
the generation recipes' results are checked against in-process transformers generate() with
the equivalent torch hooks on the same seeded tiny-lm."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
from typing import Any, Callable, Iterator

import pytest
import torch
from safetensors.torch import load_file

import lm_oracle as oracle
from support import ServerThread, serving

RECIPES = pathlib.Path(__file__).resolve().parents[2] / "docs" / "recipes.md"
#: Each recipe's title and its Python block, in document order.
SECTIONS = re.findall(r"^## ([^\n]+)\n(?:(?!^## ).)*?```python\n(.*?)```", RECIPES.read_text(), flags=re.S | re.M)
BLOCKS = [block for _, block in SECTIONS]
TITLES = [title for title, _ in SECTIONS]

Run = Callable[[str], "tuple[subprocess.CompletedProcess[str], pathlib.Path]"]


@pytest.fixture(scope="module")
def recipe_server() -> Iterator[ServerThread]:
    with serving(allow_shared_rules=True) as srv:
        yield srv


@pytest.fixture(scope="module")
def run_recipe(recipe_server: ServerThread, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """Runs a recipe by title (once per module), in a directory of its own; returns the
    finished process and that directory."""
    done: dict[str, tuple[subprocess.CompletedProcess[str], pathlib.Path]] = {}

    def run(title: str) -> tuple[subprocess.CompletedProcess[str], pathlib.Path]:
        if title not in done:
            cwd = tmp_path_factory.mktemp("recipe")
            env = {**os.environ, "HOOKWIRE_TARGET": recipe_server.target}
            proc = subprocess.run([sys.executable, "-c", BLOCKS[TITLES.index(title)]], env=env, cwd=cwd,
                                  capture_output=True, text=True, timeout=120)
            done[title] = (proc, cwd)
        return done[title]

    return run


def test_recipes_found() -> None:
    assert len(BLOCKS) == 13
    assert {"Steering a generation", "Capturing the residual stream of every new token",
            "Patching a prompt activation into a generation"} <= set(TITLES)


@pytest.mark.parametrize("title", TITLES)
def test_recipe_runs(run_recipe: Run, title: str) -> None:
    proc, _ = run_recipe(title)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip()


def _printed(stdout: str, label: str) -> list[int]:
    """The token ids a recipe printed as ``label: [..]``."""
    (line,) = [line for line in stdout.splitlines() if line.startswith(label + ":")]
    return json.loads(line.split(":", 1)[1])


def _ids(prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    return oracle.batch(prompts)


def test_steering_recipe_equals_an_in_process_steering_hook(run_recipe: Run) -> None:
    proc, _ = run_recipe("Steering a generation")
    assert proc.returncode == 0, proc.stderr
    ids, mask = _ids(["Once upon a time"])
    steering = 4.0 * torch.randn(64, generator=torch.Generator().manual_seed(1))
    # Firing k of the layer is step k of the cached generate(): steer from step 1 on.
    with oracle.forward_hook("model.layers.0", lambda step, out: out + steering if step >= 1 else None):
        (steered,) = oracle.generate(ids, mask, 12, do_sample=False)
    (plain,) = oracle.generate(ids, mask, 12, do_sample=False)
    assert _printed(proc.stdout, "plain tokens") == plain
    assert _printed(proc.stdout, "steered tokens") == steered
    assert steered != plain and steered[0] == plain[0]  # the first token comes from the prompt pass, unsteered
    assert f"steered: {oracle.text(steered)}\n" in proc.stdout  # streamed step by step, the same text


def test_gated_steering_recipe_equals_two_in_process_hooks(run_recipe: Run) -> None:
    proc, _ = run_recipe("Steering only where a probe fires, detected at one layer and applied at another")
    assert proc.returncode == 0, proc.stderr
    probe = torch.randn(64, generator=torch.Generator().manual_seed(7))
    vector = 4.0 * torch.randn(64, generator=torch.Generator().manual_seed(8))
    kept: dict[str, torch.Tensor] = {}

    def detect(step: int, out: torch.Tensor) -> None:
        kept["fires"] = (out @ probe).amax(dim=-1, keepdim=True)

    def steer(step: int, out: torch.Tensor) -> torch.Tensor:
        return torch.where((kept["fires"] > 0.15).expand(out.shape[:-1]).unsqueeze(-1), out + vector, out)

    ids, mask = _ids(["Once upon a time", "The cat"])
    with oracle.forward_hook("model.layers.0", detect), oracle.forward_hook("model.layers.1", steer):
        gated = oracle.generate(ids, mask, 10, do_sample=False)
    assert _printed(proc.stdout, "gated tokens") == gated
    assert gated != oracle.generate(ids, mask, 10, do_sample=False), "the probe must fire somewhere"


def test_sae_steering_recipe_equals_the_same_edit_in_a_torch_hook(run_recipe: Run) -> None:
    proc, _ = run_recipe("SAE feature steering during generation")
    assert proc.returncode == 0, proc.stderr
    g = torch.Generator().manual_seed(3)
    w_enc, w_dec = torch.randn(64, 128, generator=g) * 0.3, torch.randn(128, 64, generator=g) * 0.3

    def clamp(step: int, out: torch.Tensor) -> torch.Tensor:
        f = torch.relu(out @ w_enc)
        edited = f.clone()
        edited[..., [5, 17]] = 8.0
        return edited @ w_dec + (out - f @ w_dec)

    ids, mask = _ids(["Once upon a time"])
    with oracle.forward_hook("model.layers.0", clamp):
        (steered,) = oracle.generate(ids, mask, 12, do_sample=False)
    assert _printed(proc.stdout, "steered tokens") == steered
    assert steered != oracle.generate(ids, mask, 12, do_sample=False)[0]


def test_probe_gated_stop_recipe_equals_an_in_process_monitor(run_recipe: Run) -> None:
    proc, _ = run_recipe("A probe-gated stop")
    assert proc.returncode == 0, proc.stderr
    probe = torch.randn(64, generator=torch.Generator().manual_seed(31))
    ids, mask = _ids(["the cat sat", "a"])
    scores: list[torch.Tensor] = []
    with oracle.forward_hook("model.layers.1", lambda step, out: scores.append(out[:, -1] @ probe)):
        plain = oracle.generate(ids, mask, 8, do_sample=False)
    want = []
    for row in range(2):
        fired = [s for s, v in enumerate(scores) if float(v[row]) > 0.09]
        want.append(plain[row][:fired[0]] if fired else plain[row])
    assert _printed(proc.stdout, "tokens") == want
    assert "rule" in proc.stdout and want != plain


def test_logit_lens_recipe_equals_the_lens_in_process(run_recipe: Run) -> None:
    proc, _ = run_recipe("A logit-lens readout streamed per token")
    assert proc.returncode == 0, proc.stderr
    ids, mask = _ids(["Once upon a time"])
    model = oracle.model()
    want: dict[str, dict[str, list[int]]] = {}
    for layer in range(2):
        def lens(step: int, out: torch.Tensor, layer: int = layer) -> None:
            with torch.no_grad():
                top = model.lm_head(model.model.norm(out[:, -1])).topk(5, dim=-1).indices
            want.setdefault(str(step), {})[f"model.layers.{layer}"] = top[0].tolist()
        with oracle.forward_hook(f"model.layers.{layer}", lens):
            oracle.generate(ids, mask, 6, do_sample=False)
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("lens:")]
    assert json.loads(line.split(":", 1)[1]) == want


def test_head_ablation_recipe_equals_zeroing_the_heads_features_in_process(run_recipe: Run) -> None:
    proc, cwd = run_recipe("A head ablation sweep with a heatmap")
    assert proc.returncode == 0, proc.stderr
    assert (cwd / "heads.png").stat().st_size > 1000
    ids, _ = _ids(["Once upon a time"])
    model = oracle.model()
    with torch.no_grad():
        clean = model(ids).logits[0, -1]
    target = int(clean.argmax())
    want = torch.zeros(2, 4)
    for layer in range(2):
        for head in range(4):
            def ablate(module: Any, args: Any, head: int = head) -> Any:
                x = args[0].clone()
                x[..., head * 16:(head + 1) * 16] = 0
                return (x,)
            handle = model.model.layers[layer].self_attn.o_proj.register_forward_pre_hook(ablate)
            try:
                with torch.no_grad():
                    want[layer, head] = clean[target] - model(ids).logits[0, -1][target]
            finally:
                handle.remove()
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("drops:")]
    assert torch.equal(torch.tensor(json.loads(line.split(":", 1)[1])), want)
    assert bool((want != 0).any())


def test_residual_stream_recipe_equals_in_process_captures(run_recipe: Run) -> None:
    proc, cwd = run_recipe("Capturing the residual stream of every new token")
    assert proc.returncode == 0, proc.stderr
    ids, mask = _ids(["Once upon a time", "The cat"])
    layers = ("model.layers.0", "model.layers.1")
    with oracle.recording(*layers) as local:
        tokens = oracle.generate(ids, mask, 8, do_sample=False)
    assert _printed(proc.stdout, "new tokens") == tokens
    saved = load_file(str(cwd / "residual.safetensors"))  # tensors only: no code runs
    want = torch.stack([torch.stack([local[layer][step][:, 0] for layer in layers]) for step in range(1, 8)])
    assert saved["residual"].shape == (7, 2, 2, 64)
    assert torch.equal(saved["residual"], want)
    assert torch.equal(saved["input_ids"], ids)


def test_patching_recipe_equals_in_process_patching(run_recipe: Run) -> None:
    proc, _ = run_recipe("Patching a prompt activation into a generation")
    assert proc.returncode == 0, proc.stderr
    source_ids, source_mask = _ids(["The cat sat on the mat"])
    saved: list[torch.Tensor] = []
    with oracle.forward_hook("model.layers.0", lambda step, out: saved.append(out[:, -1].clone()) if step == 0 else None):
        oracle.generate(source_ids, source_mask, 8, do_sample=False)

    def patch(step: int, out: torch.Tensor) -> torch.Tensor | None:
        if step != 0:
            return None
        new = out.clone()
        new[:, -1] = saved[0]
        return new

    ids, mask = _ids(["Once upon a time"])
    with oracle.forward_hook("model.layers.0", patch):
        (patched,) = oracle.generate(ids, mask, 8, do_sample=False)
    (plain,) = oracle.generate(ids, mask, 8, do_sample=False)
    assert _printed(proc.stdout, "plain tokens") == plain
    assert _printed(proc.stdout, "patched tokens") == patched
    assert patched != plain
    assert "name='source'" in proc.stdout and "shape=(1, 64)" in proc.stdout
