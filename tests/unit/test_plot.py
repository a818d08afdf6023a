"""hookwire.plot: each helper returns a matplotlib Figure whose images, ticks and lines
hold exactly the input (torch tensors, numpy arrays, lists alike), renders, and refuses
bad shapes with a message naming the helper and the shape."""

from __future__ import annotations

import io
import os
import pathlib
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("matplotlib", reason="hookwire.plot needs the plot extra (matplotlib), part of the dev extra")

from matplotlib.figure import Figure  # noqa: E402

import hookwire.plot as hwplot  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOKENS = ["[CLS]", "the", "cat", "sat", "[SEP]"]


def _kinds(value: torch.Tensor) -> list[Any]:
    """The same values as a torch tensor, a numpy array and nested lists."""
    return [value, value.numpy(), value.tolist()]


def _images(fig: Figure) -> list[Any]:
    return [im for ax in fig.axes for im in ax.images]


def _ticks(labels: list[Any]) -> list[str]:
    return [t.get_text() for t in labels]


def _renders(fig: Figure) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    assert buf.getvalue().startswith(b"\x89PNG")


# --- patching_heatmap ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", range(3), ids=["torch", "numpy", "list"])
def test_patching_heatmap_holds_the_sweep(kind: int) -> None:
    sweep = torch.linspace(-2.0, 1.0, 6 * 5).reshape(6, 5)
    rows = [f"layer {i}" for i in range(6)]
    fig = hwplot.patching_heatmap(_kinds(sweep)[kind], rows=rows, cols=TOKENS, title="sweep")
    assert isinstance(fig, Figure)
    (image,) = _images(fig)
    assert image.get_array().shape == (6, 5)
    assert np.array_equal(np.asarray(image.get_array()), sweep.numpy())
    # Diverging, centred on 0: the scale is symmetric around the largest absolute effect.
    assert (image.norm.vmin, image.norm.vmax) == (-2.0, 2.0)
    ax = image.axes
    assert _ticks(ax.get_xticklabels()) == TOKENS
    assert _ticks(ax.get_yticklabels()) == rows
    assert ax.get_title() == "sweep" and ax.get_xlabel() == "position" and ax.get_ylabel() == "layer"
    assert len(fig.axes) == 2  # the heatmap and its colorbar
    assert len(ax.texts) == 30  # a small sweep is annotated, one value per cell
    _renders(fig)


def test_patching_heatmap_options() -> None:
    sweep = np.zeros((3, 4))
    fig = hwplot.patching_heatmap(sweep, annotate=False)
    (image,) = _images(fig)
    assert (image.norm.vmin, image.norm.vmax) == (-1.0, 1.0)  # all zeros: still a valid scale
    assert not image.axes.texts
    fig = hwplot.patching_heatmap(np.ones((3, 4)), vmax=5.0)
    assert (_images(fig)[0].norm.vmin, _images(fig)[0].norm.vmax) == (-5.0, 5.0)
    assert not _images(hwplot.patching_heatmap(np.ones((12, 13))))[0].axes.texts  # large: no numbers


def test_patching_heatmap_draws_into_a_given_axes() -> None:
    fig = Figure()
    left, right = fig.subplots(1, 2)
    assert hwplot.patching_heatmap(np.ones((2, 3)), ax=right) is fig
    assert not left.images and right.images[0].get_array().shape == (2, 3)
    # An axes in a subfigure: the figure returned is the top-level one.
    outer = Figure()
    assert hwplot.logit_lens(np.ones((2, 3)), ax=outer.subfigures(1, 2)[1].add_subplot()) is outer


@pytest.mark.parametrize("values, match", [
    (np.zeros(5), r"patching_heatmap: values must be 2-D \[layers, positions\], got shape \(5,\)"),
    (np.zeros((2, 3, 4)), r"got shape \(2, 3, 4\)"),
    ([[1.0, 2.0], [3.0]], "patching_heatmap: values must"),
    ([["a", "b"]], "must hold numbers"),
])
def test_patching_heatmap_bad_values(values: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        hwplot.patching_heatmap(values)


def test_patching_heatmap_bad_labels() -> None:
    with pytest.raises(ValueError, match=r"patching_heatmap: 4 cols for 5 positions"):
        hwplot.patching_heatmap(np.zeros((2, 5)), cols=TOKENS[:4])
    with pytest.raises(ValueError, match=r"patching_heatmap: 3 rows for 2 layers"):
        hwplot.patching_heatmap(np.zeros((2, 5)), rows=["a", "b", "c"])
    with pytest.raises(ValueError, match="not a string"):
        hwplot.patching_heatmap(np.zeros((2, 5)), cols="hello")


# --- attention_pattern ---------------------------------------------------------------------


def _pattern(*shape: int) -> torch.Tensor:
    return torch.softmax(torch.randn(*shape, generator=torch.Generator().manual_seed(0)), dim=-1)


@pytest.mark.parametrize("kind", range(3), ids=["torch", "numpy", "list"])
def test_attention_pattern_one_head(kind: int) -> None:
    probs = _pattern(5, 5)
    fig = hwplot.attention_pattern(_kinds(probs)[kind], TOKENS, title="layer 0, head 3")
    (image,) = _images(fig)
    assert np.array_equal(np.asarray(image.get_array()), probs.numpy())
    ax = image.axes
    assert _ticks(ax.get_xticklabels()) == TOKENS  # keys
    assert _ticks(ax.get_yticklabels()) == TOKENS  # queries
    assert ax.get_title() == "layer 0, head 3"
    assert image.norm.vmin == 0.0 and image.norm.vmax == pytest.approx(float(probs.max()))
    assert len(fig.axes) == 2
    _renders(fig)


@pytest.mark.parametrize("heads, head, cols_expected", [(12, None, 4), (3, None, 3), (12, [0, 5, 11], 3)])
def test_attention_pattern_grid_of_heads(heads: int, head: list[int] | None, cols_expected: int) -> None:
    probs = _pattern(heads, 4, 4)
    fig = hwplot.attention_pattern(probs.numpy(), TOKENS[:4], head=head, title="layer 2")
    picked = head if head is not None else list(range(heads))
    panels = [ax for ax in fig.axes if ax.images]
    assert len(panels) == len(picked) and len(fig.axes) == len(picked) + 1  # plus one shared colorbar
    assert [ax.get_title() for ax in panels] == [f"head {h}" for h in picked]
    for ax, h in zip(panels, picked):
        assert np.array_equal(np.asarray(ax.images[0].get_array()), probs[h].numpy())
        assert _ticks(ax.get_xticklabels()) == TOKENS[:4]
    assert {ax.images[0].norm.vmax for ax in panels} == {float(probs[picked].max())}  # one scale, over the heads drawn
    assert panels[0].get_subplotspec().get_gridspec().ncols == cols_expected
    assert fig.get_suptitle() == "layer 2"
    _renders(fig)


def test_attention_pattern_one_head_of_many_and_queries() -> None:
    probs = _pattern(4, 2, 5)  # a step of 2 new queries over 5 keys
    fig = hwplot.attention_pattern(torch.from_numpy(probs.numpy()), TOKENS, head=2)
    (image,) = _images(fig)
    assert np.array_equal(np.asarray(image.get_array()), probs[2].numpy())
    assert _ticks(image.axes.get_yticklabels()) == TOKENS[-2:]  # queries are the newest tokens
    fig = hwplot.attention_pattern(probs[0], TOKENS, query_tokens=["q0", "q1"])
    assert _ticks(_images(fig)[0].axes.get_yticklabels()) == ["q0", "q1"]


def test_attention_pattern_bfloat16_tensor() -> None:
    probs = _pattern(3, 3).to(torch.bfloat16)
    (image,) = _images(hwplot.attention_pattern(probs))
    assert np.array_equal(np.asarray(image.get_array()), probs.double().numpy())


@pytest.mark.parametrize("pattern, kwargs, match", [
    (np.zeros(5), {}, r"must be \[queries, keys\] or \[heads, queries, keys\], got shape \(5,\)"),
    (np.zeros((2, 3, 4, 4)), {}, r"a batch \[batch, heads, queries, keys\]; pick one sequence"),
    (np.zeros((4, 4)), {"head": 0}, r"head= picks heads of a \[heads, queries, keys\] pattern"),
    (np.zeros((3, 4, 4)), {"head": 3}, r"head must be indices in 0\.\.2"),
    (np.zeros((3, 4, 4)), {"head": []}, r"head must be indices"),
    (np.zeros((4, 4)), {"tokens": TOKENS}, r"5 tokens for 4 keys"),
    (np.zeros((6, 5)), {"tokens": TOKENS}, r"6 queries but 5 tokens: pass query_tokens="),
    (np.zeros((3, 4, 4)), {"head_names": ["a"]}, r"1 head_names for 3 heads"),
])
def test_attention_pattern_bad_input(pattern: Any, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match) as err:
        hwplot.attention_pattern(pattern, **kwargs)
    assert str(err.value).startswith("attention_pattern: ")


def test_attention_pattern_ax_takes_one_head() -> None:
    fig = Figure()
    ax = fig.add_subplot()
    assert hwplot.attention_pattern(np.eye(3), ax=ax) is fig
    with pytest.raises(ValueError, match="ax= draws one head, and 2 are picked"):
        hwplot.attention_pattern(np.zeros((2, 3, 3)), ax=fig.add_subplot())


# --- layer_norms ---------------------------------------------------------------------------


def _cache() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {f"encoder.layer.{i}": torch.randn(2, 5, 8, generator=g) * (i + 1) for i in range(4)}


def test_layer_norms_per_layer() -> None:
    cache = _cache()
    fig = hwplot.layer_norms(cache)
    (ax,) = fig.axes
    (line,) = ax.get_lines()
    expected = [float(v.double().norm(dim=-1).mean()) for v in cache.values()]
    assert np.allclose(line.get_ydata(), expected, rtol=1e-12)
    assert _ticks(ax.get_xticklabels()) == list(cache)
    _renders(fig)


def test_layer_norms_inputs_agree() -> None:
    cache = _cache()
    stacked = torch.stack(list(cache.values()))
    want = hwplot.layer_norms(cache).axes[0].get_lines()[0].get_ydata()
    for activations in (stacked, stacked.numpy(), list(cache.values()), [v.numpy() for v in cache.values()],
                        {k: (v, None) for k, v in cache.items()}):  # a tuple output counts by its first element
        got = hwplot.layer_norms(activations).axes[0].get_lines()[0].get_ydata()
        assert np.allclose(got, want, rtol=1e-12)
    labels = _ticks(hwplot.layer_norms(stacked).axes[0].get_xticklabels())
    assert labels == ["0", "1", "2", "3"]


def test_layer_norms_per_position_with_a_mask_and_keys() -> None:
    cache = {**_cache(), "pooler": torch.randn(2, 8)}
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    fig = hwplot.layer_norms(cache, keys="encoder.layer.*", per="position", mask=mask)
    (ax,) = fig.axes
    lines = ax.get_lines()
    assert [line.get_label() for line in lines] == [f"encoder.layer.{i}" for i in range(4)]
    for line, value in zip(lines, list(cache.values())[:4]):
        norms = value.double().norm(dim=-1)  # [2, 5]
        want = [float(norms[:, p][mask[:, p].bool()].mean()) for p in range(5)]
        assert np.allclose(line.get_ydata(), want, rtol=1e-12)
    # Per layer, the mask leaves the padded positions out of the mean too.
    fig = hwplot.layer_norms(cache, keys=["encoder.layer.0"], mask=mask.numpy(), labels=["L0"])
    norms = cache["encoder.layer.0"].double().norm(dim=-1)
    assert fig.axes[0].get_lines()[0].get_ydata()[0] == pytest.approx(float(norms[mask.bool()].mean()), rel=1e-12)
    assert _ticks(fig.axes[0].get_xticklabels()) == ["L0"]
    _renders(fig)


@pytest.mark.parametrize("activations, kwargs, match", [
    ({}, {}, r"nothing to plot"),
    (_cache(), {"keys": "decoder.*"}, r"nothing to plot \(keys='decoder\.\*'\)"),
    (_cache(), {"keys": ["nope"]}, r"keys not in the mapping: \['nope'\]"),
    ({"a": "text"}, {}, r"'a' is str, not a tensor"),
    ({"a": torch.zeros(4)}, {"per": "position"}, r"'a' has shape \(4,\); per='position' needs \[\.\.\., positions, hidden\]"),
    (_cache(), {"mask": torch.ones(2, 4)}, r"mask has shape \(2, 4\), but 'encoder\.layer\.0' has \(2, 5, 8\)"),
    (_cache(), {"per": "head"}, r"per must be 'layer' or 'position'"),
    (_cache(), {"labels": ["a"]}, r"1 labels for 4 layers"),
    (torch.zeros(5), {}, r"a stacked tensor must be \[layers, \.\.\., hidden\]"),
    (torch.zeros(2, 5), {"keys": "x"}, r"keys= picks entries of a mapping"),
    (3.0, {}, r"activations must be a mapping, a sequence of tensors or a stacked tensor"),
])
def test_layer_norms_bad_input(activations: Any, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match) as err:
        hwplot.layer_norms(activations, **kwargs)
    assert str(err.value).startswith("layer_norms: ")


# --- logit_lens ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", range(3), ids=["torch", "numpy", "list"])
def test_logit_lens_ranks(kind: int) -> None:
    ranks = torch.tensor([[30000, 5000, 12], [800, 40, 3], [0, 1, 0]])
    fig = hwplot.logit_lens(_kinds(ranks)[kind], tokens=TOKENS[:3], layers=["0", "1", "2"])
    (image,) = _images(fig)
    assert np.array_equal(np.asarray(image.get_array()), ranks.numpy())
    # Ranks on a log scale, 0 (the top token) included.
    assert type(image.norm).__name__ == "SymLogNorm"
    assert (image.norm.vmin, image.norm.vmax) == (0.0, 30000.0)
    assert _ticks(image.axes.get_xticklabels()) == TOKENS[:3]
    assert _ticks(image.axes.get_yticklabels()) == ["0", "1", "2"]
    assert [t.get_text() for t in image.axes.texts][:3] == ["30000", "5000", "12"]
    _renders(fig)


def test_logit_lens_probabilities() -> None:
    probs = torch.tensor([[0.01, 0.2], [0.5, 0.99]], dtype=torch.float64)
    fig = hwplot.logit_lens(probs, kind="prob", annotate=False)
    (image,) = _images(fig)
    assert np.array_equal(np.asarray(image.get_array()), probs.numpy())
    assert (type(image.norm).__name__, image.norm.vmin, image.norm.vmax) == ("Normalize", 0.0, 1.0)
    assert not image.axes.texts
    _renders(fig)


@pytest.mark.parametrize("values, kwargs, match", [
    (np.zeros((2, 3, 4)), {}, r"must be 2-D \[layers, positions\], got shape \(2, 3, 4\)"),
    (np.array([[-1, 2]]), {}, r"ranks must be >= 0, found -1"),
    (np.array([[0.5, 1.5]]), {"kind": "prob"}, r"probabilities must be in \[0, 1\], found 0\.5\.\.1\.5"),
    (np.zeros((2, 2)), {"kind": "logit"}, r"kind must be 'rank' or 'prob'"),
    (np.zeros((2, 2)), {"tokens": ["a"]}, r"1 tokens for 2 positions"),
])
def test_logit_lens_bad_input(values: Any, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match) as err:
        hwplot.logit_lens(values, **kwargs)
    assert str(err.value).startswith("logit_lens: ")


# --- the optional extra --------------------------------------------------------------------


def _python(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "client"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_importing_hookwire_does_not_import_matplotlib_and_plot_says_how_to_get_it() -> None:
    proc = _python(
        "import sys, hookwire\n"
        "assert not any(m.split('.')[0] == 'matplotlib' for m in sys.modules), 'hookwire imported matplotlib'\n"
        "sys.modules['matplotlib'] = None  # as if it were not installed\n"
        "try:\n"
        "    import hookwire.plot\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
        "else:\n"
        "    raise SystemExit('hookwire.plot imported without matplotlib')\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert "pip install 'hookwire[plot]'" in proc.stdout
    assert "matplotlib" in proc.stdout
