"""The Node.js client (client/node), built from proto/ alone, against a real server."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

NODE_DIR = pathlib.Path(__file__).resolve().parents[2] / "client" / "node"


def test_node_client_end_to_end(server) -> None:
    node = shutil.which("node")
    if node is None or not (NODE_DIR / "node_modules").is_dir():
        if os.environ.get("CI"):
            pytest.fail("CI needs node and `npm ci --prefix client/node` (make test does it)")
        pytest.skip("node or client/node/node_modules missing: run `make test`")
    proc = subprocess.run(
        [node, "--test", "test/"], cwd=NODE_DIR, capture_output=True, text=True, timeout=120,
        env={**os.environ, "HOOKWIRE_TARGET": server.target},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "# pass 2" in proc.stdout and "# fail 0" in proc.stdout
