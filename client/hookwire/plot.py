"""Figures for what interpretability researchers look at every day: an activation-patching
sweep, attention patterns, per-layer activation norms, a logit lens.

Needs matplotlib, an optional extra (``pip install 'hookwire[plot]'``; from a checkout of
this repository, ``pip install '.[plot]'``); ``import hookwire`` never imports it.

Every helper takes torch tensors, numpy arrays or nested lists, and returns a
``matplotlib.figure.Figure`` built with matplotlib's object-oriented API: nothing goes
through ``pyplot``, so no display, backend or global figure state is involved, and nothing
is shown by itself. In a notebook, leave the figure as the cell's value (or
``display(fig)``) to see it; anywhere, ``fig.savefig("out.png")``. Each helper that draws
on one axes also takes ``ax=`` to draw into a figure of your own (it then returns that
axes' figure). Nothing here blocks on anything but the drawing, and nothing talks to a
server.

    import hookwire.plot as hwplot
    fig = hwplot.attention_pattern(probs[0, 3], pieces[0], title="layer 0, head 3")
    fig.savefig("attention.png")
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np

try:
    from matplotlib import colors as mcolors
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator
except ImportError as exc:  # the extra is optional: say how to get it
    raise ImportError(
        "hookwire.plot needs matplotlib, which is not installed: pip install 'hookwire[plot]' "
        "(from a checkout of this repository: pip install '.[plot]')"
    ) from exc

from ._cache import _glob

__all__ = ["attention_pattern", "layer_norms", "logit_lens", "patching_heatmap"]

#: Heatmaps get their cells annotated with values, when annotate=None, up to this many cells.
_ANNOTATE_CELLS = 150


def patching_heatmap(
    values: Any,
    *,
    rows: Sequence[str] | None = None,
    cols: Sequence[str] | None = None,
    title: str = "Activation patching",
    xlabel: str = "position",
    ylabel: str = "layer",
    colorbar_label: str = "patching effect",
    cmap: str = "RdBu",
    vmax: float | None = None,
    annotate: bool | None = None,
    fmt: str = "{:.2f}",
    ax: Axes | None = None,
) -> Figure:
    """A heatmap of an activation-patching sweep: ``values[layer, position]`` is the effect
    of patching that layer at that position (e.g. the logit difference recovered).

    The colormap diverges around 0 (``vmax`` sets both ends, ``-vmax`` to ``vmax``;
    default: the largest absolute value), so positive and negative effects read apart
    at a glance. ``rows`` / ``cols`` label the layers and positions (e.g. module paths
    and tokens; default: their indices). ``annotate`` writes each cell's value
    (formatted with ``fmt``); None annotates small sweeps (up to 150 cells).

    Returns the figure (``ax=`` draws into that axes instead and returns its figure).
    Raises ValueError when ``values`` is not 2-D [layers, positions] or a label list
    has the wrong length. Example::

        effect = torch.zeros(6, 8)          # filled by a patching sweep over 6 layers x 8 positions
        fig = hookwire.plot.patching_heatmap(effect, cols=pieces, title="logit diff recovered")
    """
    grid = _as_array(values, "patching_heatmap", "values")
    if grid.ndim != 2:
        raise ValueError(f"patching_heatmap: values must be 2-D [layers, positions], got shape {grid.shape}")
    row_labels = _labels(rows, grid.shape[0], "patching_heatmap", "rows", "layers (values.shape[0])")
    col_labels = _labels(cols, grid.shape[1], "patching_heatmap", "cols", "positions (values.shape[1])")
    finite = np.abs(grid[np.isfinite(grid)])
    limit = float(vmax) if vmax is not None else (float(finite.max()) if finite.size else 0.0)
    limit = limit if limit > 0 else 1.0  # an all-zero sweep still gets a valid scale
    fig, axes = _figure_and_axes(ax, _heatmap_size(grid.shape))
    image = axes.imshow(grid, cmap=cmap, norm=mcolors.Normalize(-limit, limit), aspect="auto",
                        interpolation="nearest")
    _label_heatmap(axes, row_labels, col_labels, xlabel=xlabel, ylabel=ylabel, title=title)
    fig.colorbar(image, ax=axes, label=colorbar_label)
    if _should_annotate(annotate, grid.shape):
        _annotate(axes, image, grid, fmt)
    return fig


def attention_pattern(
    pattern: Any,
    tokens: Sequence[str] | None = None,
    *,
    head: int | Sequence[int] | None = None,
    query_tokens: Sequence[str] | None = None,
    title: str | None = None,
    head_names: Sequence[str] | None = None,
    cmap: str = "Blues",
    vmax: float | None = None,
    max_cols: int = 4,
    ax: Axes | None = None,
) -> Figure:
    """Attention probabilities of one head ([queries, keys]) or of several heads
    ([heads, queries, keys], drawn as a grid, one panel per head, sharing one colour
    scale), each query row over the keys it attends to, with token labels.

    ``tokens`` label the keys (columns); query rows (top to bottom) are labelled with
    ``query_tokens``, by default the last ``queries`` of ``tokens`` (the same tokens
    for self-attention; a generation step's queries are the newest tokens).
    ``head`` picks heads from a [heads, q, k] input (an int draws that head alone).
    Colours run from 0 to ``vmax`` (default: the largest probability drawn). For a
    batch, pick the sequence first, and cut padding off: ``probs[1, :, :n, :n]`` with
    that sequence's ``n`` real tokens.

    Returns the figure (``ax=`` draws one head into that axes and returns its
    figure). Raises ValueError for another number of dimensions (a 4-D batch
    included), a head out of range, or token lists of the wrong length. Example::

        out, cache = await model.run_with_cache(ids, attention_mask=mask, modules="encoder.layer.0.attention.self")
        probs = cache["encoder.layer.0.attention.self"][1]      # [batch, heads, q, k]
        fig = hookwire.plot.attention_pattern(probs[0], pieces[0], head=[0, 1, 2, 3])
    """
    probs = _as_array(pattern, "attention_pattern", "pattern")
    if probs.ndim == 4:
        raise ValueError(
            f"attention_pattern: pattern has shape {probs.shape}, a batch [batch, heads, queries, keys]; "
            "pick one sequence first (pattern[i], padding cut off)"
        )
    if probs.ndim not in (2, 3):
        raise ValueError(
            f"attention_pattern: pattern must be [queries, keys] or [heads, queries, keys], got shape {probs.shape}"
        )
    if probs.ndim == 2:
        if head is not None:
            raise ValueError("attention_pattern: head= picks heads of a [heads, queries, keys] pattern; "
                             f"this one is [queries, keys] {probs.shape}")
        heads = [0]
        probs = probs[None]
    else:
        picked = list(range(probs.shape[0])) if head is None else ([head] if isinstance(head, (int, np.integer)) else list(head))
        bad = [h for h in picked if not isinstance(h, (int, np.integer)) or not 0 <= h < probs.shape[0]]
        if bad or not picked:
            raise ValueError(f"attention_pattern: head must be indices in 0..{probs.shape[0] - 1}, not {head!r}")
        heads = [int(h) for h in picked]
    n_queries, n_keys = probs.shape[1:]
    key_labels = _labels(tokens, n_keys, "attention_pattern", "tokens", "keys (pattern.shape[-1])")
    if query_tokens is not None:
        query_labels = _labels(query_tokens, n_queries, "attention_pattern", "query_tokens",
                               "queries (pattern.shape[-2])")
    elif key_labels is not None and n_queries <= n_keys:
        query_labels = key_labels[n_keys - n_queries:]
    elif key_labels is not None:
        raise ValueError(f"attention_pattern: {n_queries} queries but {n_keys} tokens: "
                         "pass query_tokens= to label the queries")
    else:
        query_labels = None
    if head_names is not None and len(head_names) != len(heads):
        raise ValueError(f"attention_pattern: {len(head_names)} head_names for {len(heads)} heads")
    if ax is not None and len(heads) != 1:
        raise ValueError(f"attention_pattern: ax= draws one head, and {len(heads)} are picked (pass head=)")
    drawn = probs[heads]
    finite = drawn[np.isfinite(drawn)]
    top = float(vmax) if vmax is not None else (float(finite.max()) if finite.size else 1.0)
    norm = mcolors.Normalize(0.0, top if top > 0 else 1.0)

    n_cols = max(1, min(len(heads), max_cols))
    n_rows = math.ceil(len(heads) / n_cols)
    cell = min(6.0, max(2.8, 0.28 * max(n_queries, n_keys) + 1.2))
    if ax is not None:
        fig, panels = ax.figure, [ax]
    else:
        fig = Figure(figsize=(n_cols * cell + 1.0, n_rows * cell + (0.4 if title else 0.0)), layout="constrained")
        panels = [fig.add_subplot(n_rows, n_cols, i + 1) for i in range(len(heads))]
    image = None
    for i, (panel, h) in enumerate(zip(panels, heads)):
        image = panel.imshow(drawn[i], cmap=cmap, norm=norm, aspect="equal", interpolation="nearest")
        name = head_names[i] if head_names is not None else (f"head {h}" if probs.shape[0] > 1 else None)
        _label_heatmap(panel, query_labels, key_labels, xlabel="key", ylabel="query",
                       title=name if (title is None or len(heads) > 1) else title)
    if title is not None and len(heads) > 1:
        fig.suptitle(title)
    assert image is not None
    fig.colorbar(image, ax=panels, label="attention probability", shrink=0.8 if len(heads) > 1 else 1.0)
    return _root(fig)


def layer_norms(
    activations: Any,
    *,
    keys: str | Sequence[str] | None = None,
    per: Literal["layer", "position"] = "layer",
    mask: Any = None,
    labels: Sequence[str] | None = None,
    title: str = "Activation norms",
    ylabel: str = "mean L2 norm",
    ax: Axes | None = None,
) -> Figure:
    """The mean L2 norm of each layer's activations (over the last dimension, the
    hidden size), as a line plot: ``per="layer"`` draws one point per layer (the mean
    over every position of every sequence), ``per="position"`` one line per layer
    across positions (the mean over sequences), to see the residual stream grow or a
    position (BOS, say) stand out.

    ``activations``: a mapping from name to tensor (an ``ActivationCache`` from
    ``run_with_cache``, or a dict), a sequence of tensors, or one stacked tensor
    [layers, ..., positions, hidden]. A value that is a tuple (a module that returns
    several things, as many transformers layers do) counts by its first element.
    ``keys`` picks entries of a mapping: a glob as ``ActivationCache.keys_matching``
    takes (``"encoder.layer.*"``) or a list of keys. ``mask`` (e.g. the attention
    mask, [batch, positions], 1 for real tokens) leaves padding out of the means.
    ``labels`` name the layers (default: the keys, or the indices).

    Returns the figure (``ax=`` draws into that axes and returns its figure). Raises
    ValueError when nothing is left to plot, a value is not a tensor with a hidden
    dimension (``per="position"``: and a position dimension), the mask's shape is not
    a value's without the hidden dimension, or ``labels`` has the wrong length. Example::

        out, cache = await model.run_with_cache(ids, attention_mask=mask, modules="encoder.layer.*")
        fig = hookwire.plot.layer_norms(cache, mask=mask, per="position")
    """
    names, tensors = _layer_values(activations, keys)
    if per not in ("layer", "position"):
        raise ValueError(f"layer_norms: per must be 'layer' or 'position', not {per!r}")
    weights = None if mask is None else _as_array(mask, "layer_norms", "mask")
    series = []
    for name, value in zip(names, tensors):
        if value.ndim < (2 if per == "position" else 1):
            raise ValueError(f"layer_norms: {name!r} has shape {value.shape}; per={per!r} needs "
                             + ("[..., positions, hidden]" if per == "position" else "[..., hidden]"))
        norms = np.sqrt(np.sum(np.square(value, dtype=np.float64), axis=-1))  # [..., positions]
        if weights is not None and weights.shape != norms.shape:
            raise ValueError(f"layer_norms: mask has shape {weights.shape}, but {name!r} has {value.shape}; "
                             f"the mask must be its shape without the hidden dimension, {norms.shape}")
        w = np.ones_like(norms) if weights is None else (weights != 0).astype(np.float64)
        if per == "layer":
            series.append(np.array([_weighted_mean(norms, w)]))
        else:
            flat_n = norms.reshape(-1, norms.shape[-1])
            flat_w = w.reshape(-1, norms.shape[-1])
            series.append(np.array([_weighted_mean(flat_n[:, p], flat_w[:, p]) for p in range(flat_n.shape[1])]))
    layer_labels = _labels(labels, len(names), "layer_norms", "labels", "layers") or names

    fig, axes = _figure_and_axes(ax, (max(5.0, 0.5 * len(names) + 3.0) if per == "layer" else 8.5, 4.0))
    if per == "layer":
        axes.plot(range(len(names)), [s[0] for s in series], marker="o")
        axes.set_xticks(range(len(names)), layer_labels, rotation=_rotation(layer_labels), ha="right"
                        if _rotation(layer_labels) else "center")
        axes.set_xlabel("layer")
    else:
        colours = _line_colours(len(series))
        for label, values, colour in zip(layer_labels, series, colours):
            axes.plot(range(len(values)), values, marker=".", label=label, color=colour)
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.set_xlabel("position")
        # Beside the plot, not over it: lines of many layers fill the whole area.
        axes.legend(fontsize="small", ncols=1 if len(series) <= 16 else 2, loc="center left",
                    bbox_to_anchor=(1.01, 0.5))
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.grid(alpha=0.3)
    return fig


def logit_lens(
    ranks_or_probs: Any,
    *,
    layers: Sequence[str] | None = None,
    tokens: Sequence[str] | None = None,
    kind: Literal["rank", "prob"] = "rank",
    title: str = "Logit lens",
    xlabel: str = "position",
    ylabel: str = "layer",
    cmap: str | None = None,
    annotate: bool | None = None,
    ax: Axes | None = None,
) -> Figure:
    """A logit lens as a heatmap [layers, positions]: per layer (each layer's residual
    stream decoded through the unembedding) and position, the rank of the target token
    (``kind="rank"``: 0 is the top token, as ``(logits > logits[target]).sum(-1)``
    counts) or its probability (``kind="prob"``).

    Ranks use a logarithmic colour scale (symmetric-log, linear below 1, so both 0- and
    1-based ranks work), bright for a good (low) rank; probabilities a linear 0..1
    scale, bright for a high one. ``layers`` / ``tokens`` label the rows and columns (default:
    indices). ``annotate`` writes each cell's value; None annotates up to 150 cells.

    Returns the figure (``ax=`` draws into that axes and returns its figure). Raises
    ValueError when the input is not 2-D, ranks are negative, probabilities fall
    outside [0, 1], ``kind`` is unknown, or a label list has the wrong length. Example::

        logits = stacked_residuals @ unembedding.T                   # [layers, positions, vocab]
        ranks = (logits > logits[..., target, None]).sum(-1)     # [layers, positions]
        fig = hookwire.plot.logit_lens(ranks, tokens=pieces)
    """
    grid = _as_array(ranks_or_probs, "logit_lens", "ranks_or_probs")
    if grid.ndim != 2:
        raise ValueError(f"logit_lens: ranks_or_probs must be 2-D [layers, positions], got shape {grid.shape}")
    finite = grid[np.isfinite(grid)]
    norm: mcolors.Normalize
    if kind == "rank":
        if finite.size and finite.min() < 0:
            raise ValueError(f"logit_lens: ranks must be >= 0, found {finite.min():g}")
        top = float(finite.max()) if finite.size else 1.0
        norm = mcolors.SymLogNorm(linthresh=1.0, vmin=0.0, vmax=max(top, 1.0), base=10)
        cmap = cmap or "viridis_r"
        label, fmt = "rank of the target (0 = top)", "{:.0f}"
    elif kind == "prob":
        if finite.size and (finite.min() < 0 or finite.max() > 1):
            raise ValueError(f"logit_lens: probabilities must be in [0, 1], found {finite.min():g}..{finite.max():g}")
        norm = mcolors.Normalize(0.0, 1.0)
        cmap = cmap or "viridis"
        label, fmt = "probability of the target", "{:.2f}"
    else:
        raise ValueError(f"logit_lens: kind must be 'rank' or 'prob', not {kind!r}")
    row_labels = _labels(layers, grid.shape[0], "logit_lens", "layers", "layers (shape[0])")
    col_labels = _labels(tokens, grid.shape[1], "logit_lens", "tokens", "positions (shape[1])")
    fig, axes = _figure_and_axes(ax, _heatmap_size(grid.shape))
    image = axes.imshow(grid, cmap=cmap, norm=norm, aspect="auto", interpolation="nearest")
    _label_heatmap(axes, row_labels, col_labels, xlabel=xlabel, ylabel=ylabel, title=title)
    fig.colorbar(image, ax=axes, label=label)
    if _should_annotate(annotate, grid.shape):
        _annotate(axes, image, grid, fmt)
    return fig


# --- shared pieces -----------------------------------------------------------------------


def _as_array(value: Any, fn: str, name: str) -> np.ndarray:
    """A float numpy array from a torch tensor (any device, bfloat16 included), a numpy
    array or nested lists. torch is never imported here: a tensor is known by its methods."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        value = value.detach().cpu()
        if not value.is_floating_point() or str(value.dtype) == "torch.bfloat16":
            value = value.double()  # numpy has no bfloat16; exact for every bfloat16 and integer value plotted
        value = value.numpy()
    try:
        array = np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{fn}: {name} must be a tensor, an array or nested lists of numbers: {exc}") from None
    if array.dtype == object or not (np.issubdtype(array.dtype, np.number) or array.dtype == np.bool_):
        raise ValueError(f"{fn}: {name} must hold numbers, not {array.dtype} (ragged lists?)")
    if np.iscomplexobj(array):
        raise ValueError(f"{fn}: {name} must be real, not {array.dtype}")
    return array if np.issubdtype(array.dtype, np.floating) else array.astype(np.float64)


def _labels(labels: Sequence[Any] | None, n: int, fn: str, name: str, what: str) -> list[str] | None:
    if labels is None:
        return None
    if isinstance(labels, str):
        raise ValueError(f"{fn}: {name} must be a list of {n} labels, not a string")
    out = [str(x) for x in labels]
    if len(out) != n:
        raise ValueError(f"{fn}: {len(out)} {name} for {n} {what}")
    return out


def _layer_values(activations: Any, keys: str | Sequence[str] | None) -> tuple[list[str], list[np.ndarray]]:
    """(names, arrays) of layer_norms' input, in order."""
    if isinstance(activations, Mapping):
        names = list(activations)
        if isinstance(keys, str):
            pattern = _glob(keys)
            names = [k for k in names if pattern.fullmatch(str(k))]
        elif keys is not None:
            missing = [k for k in keys if k not in activations]
            if missing:
                raise ValueError(f"layer_norms: keys not in the mapping: {missing[:5]}")
            names = list(keys)
        values = [activations[k] for k in names]
        names = [str(k) for k in names]
    else:
        if keys is not None:
            raise ValueError("layer_norms: keys= picks entries of a mapping (a cache or a dict)")
        if hasattr(activations, "shape"):  # one stacked tensor: [layers, ..., hidden]
            stacked = _as_array(activations, "layer_norms", "activations")
            values = list(stacked) if stacked.ndim >= 2 else []
            if stacked.ndim < 2:
                raise ValueError(f"layer_norms: a stacked tensor must be [layers, ..., hidden], got shape {stacked.shape}")
        elif isinstance(activations, Sequence) and not isinstance(activations, str):
            values = list(activations)
        else:
            raise ValueError(f"layer_norms: activations must be a mapping, a sequence of tensors or a stacked "
                             f"tensor, not {type(activations).__name__}")
        names = [str(i) for i in range(len(values))]
    if not values:
        raise ValueError(f"layer_norms: nothing to plot (keys={keys!r})")
    arrays = []
    for name, value in zip(names, values):
        if isinstance(value, (tuple, list)) and value and hasattr(value[0], "shape"):
            value = value[0]  # (hidden_states, ...) as transformers layers return
        if not hasattr(value, "shape"):
            raise ValueError(f"layer_norms: {name!r} is {type(value).__name__}, not a tensor")
        arrays.append(_as_array(value, "layer_norms", repr(name)))
    return names, arrays


def _weighted_mean(values: np.ndarray, weights: np.ndarray) -> float:
    total = float(weights.sum())
    return float((values * weights).sum() / total) if total else math.nan


def _figure_and_axes(ax: Axes | None, size: tuple[float, float]) -> tuple[Figure, Axes]:
    if ax is not None:
        return _root(ax.figure), ax
    fig = Figure(figsize=size, layout="constrained")
    return fig, fig.add_subplot()


def _root(fig: Any) -> Figure:
    """The top-level Figure of a (sub)figure: a SubFigure's ``.figure`` leads there
    (``get_figure(root=True)`` would too, but only from matplotlib 3.10 on)."""
    for _ in range(64):
        if isinstance(fig, Figure):
            return fig
        fig = fig.figure
    raise ValueError("hookwire.plot: ax= is not in a matplotlib Figure")


def _heatmap_size(shape: tuple[int, ...]) -> tuple[float, float]:
    rows, cols = shape
    return (min(16.0, max(5.0, 0.45 * cols + 2.5)), min(12.0, max(3.5, 0.35 * rows + 1.5)))


def _label_heatmap(axes: Axes, rows: list[str] | None, cols: list[str] | None, *, xlabel: str, ylabel: str,
                   title: str | None) -> None:
    """Every label when given (tokens must all be readable), else integer ticks."""
    if cols is not None:
        axes.set_xticks(range(len(cols)), cols, rotation=_rotation(cols), ha="right" if _rotation(cols) else "center",
                        fontsize=_tick_size(cols))
    else:
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    if rows is not None:
        axes.set_yticks(range(len(rows)), rows, fontsize=_tick_size(rows))
    else:
        axes.yaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    if title:
        axes.set_title(title)


def _rotation(labels: Sequence[str]) -> int:
    """Long or many labels are turned so that they do not overlap."""
    return 45 if len(labels) > 6 or max((len(s) for s in labels), default=0) > 4 else 0


def _tick_size(labels: Sequence[str]) -> str:
    """Smaller type for long token lists, which still label every position."""
    return "medium" if len(labels) <= 24 else ("small" if len(labels) <= 48 else "xx-small")


def _should_annotate(annotate: bool | None, shape: tuple[int, ...]) -> bool:
    return annotate if annotate is not None else shape[0] * shape[1] <= _ANNOTATE_CELLS


def _annotate(axes: Axes, image: Any, grid: np.ndarray, fmt: str) -> None:
    """Writes each finite cell's value, in black or white, whichever reads on its colour."""
    rgba = image.cmap(image.norm(grid))
    luminance = 0.299 * rgba[..., 0] + 0.587 * rgba[..., 1] + 0.114 * rgba[..., 2]
    for (i, j), v in np.ndenumerate(grid):
        if np.isfinite(v):
            axes.text(j, i, fmt.format(v), ha="center", va="center", fontsize="x-small",
                      color="white" if luminance[i, j] < 0.5 else "black")


def _line_colours(n: int) -> list[Any]:
    """One colour per layer, early to late along viridis, so depth reads as colour."""
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    return [cmap(i / max(1, n - 1) * 0.9) for i in range(n)]
