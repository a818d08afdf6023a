"""docs/notebooks/quickstart.ipynb, executed end to end (nbclient, a real IPython kernel
from this environment) against a real server on the demo models: every cell runs, and
what it shows is checked against in-process torch where the notebook computes it."""

from __future__ import annotations

import base64
import os
import pathlib
import re
from collections.abc import Iterator
from typing import Any

import nbclient
import nbformat
import pytest

from hookwire_server.models.model_loading import build_registry, demo_configs
from support import ServerThread, serving

NOTEBOOK = pathlib.Path(__file__).resolve().parents[2] / "docs" / "notebooks" / "quickstart.ipynb"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with serving(build_registry(demo_configs())) as srv:
        yield srv


def _text(cell: Any) -> str:
    out = []
    for output in cell.get("outputs", []):
        if output["output_type"] == "stream":
            out.append(output["text"])
        elif "data" in output and "text/plain" in output["data"]:
            out.append(output["data"]["text/plain"])
    return "\n".join(out)


def _images(cell: Any) -> list[bytes]:
    return [base64.b64decode(o["data"]["image/png"]) for o in cell.get("outputs", [])
            if "data" in o and "image/png" in o["data"]]


def test_the_quickstart_notebook_runs_end_to_end(server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOOKWIRE_TARGET", server.target)
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    # A hang guard per cell (never a speed claim): a busy machine only makes it slower.
    nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3", allow_errors=False).execute()
    if os.environ.get("HOOKWIRE_KEEP_NOTEBOOK"):  # to look at what it showed
        nbformat.write(notebook, os.environ["HOOKWIRE_KEEP_NOTEBOOK"])
    cells = {cell["id"]: cell for cell in notebook.cells if cell["cell_type"] == "code"}
    texts = {key: _text(cell) for key, cell in cells.items()}
    joined = "\n".join(texts.values())
    assert "'tiny-lm'" in joined
    assert "ActivationCache(2 entries" in joined
    # The last layer's lens is the model's logits (the same ops up to float rounding).
    lens = re.search(r"last layer's lens vs the model's logits: (\S+)", joined)
    assert lens is not None and float(lens.group(1)) < 1e-4
    assert "rows sum to 1.0" in joined or "rows sum to 0.99" in joined
    assert texts[list(cells)[-2]].strip() == "True"  # the async client saw the same logits
    images = [img for cell in cells.values() for img in _images(cell)]
    assert len(images) == 4 and all(img.startswith(b"\x89PNG") for img in images)  # norms, patching, lens, attention
