"""Every Python block of docs/recipes.md runs against a real server (with shared rules allowed)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
from typing import Iterator

import pytest

from hookwire_server import ServerSettings
from support import ServerThread, build_test_registry

RECIPES = pathlib.Path(__file__).resolve().parents[2] / "docs" / "recipes.md"
BLOCKS = re.findall(r"```python\n(.*?)```", RECIPES.read_text(), flags=re.S)


@pytest.fixture(scope="module")
def recipe_server() -> Iterator[ServerThread]:
    srv = ServerThread(build_test_registry(), ServerSettings(port=0, allow_shared_rules=True)).start()
    yield srv
    srv.stop()


def test_recipes_found() -> None:
    assert len(BLOCKS) == 5


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_recipe_runs(recipe_server: ServerThread, index: int) -> None:
    env = {**os.environ, "HOOKWIRE_TARGET": recipe_server.target}
    proc = subprocess.run([sys.executable, "-c", BLOCKS[index]], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip()
