"""The Node.js client (client/node), built from proto/ alone, against a real server."""

from __future__ import annotations

import os
import pathlib
import shutil
import socket
import subprocess

import pytest

NODE_DIR = pathlib.Path(__file__).resolve().parents[2] / "client" / "node"


def _node() -> str:
    node = shutil.which("node")
    if node is None or not (NODE_DIR / "node_modules").is_dir():
        if os.environ.get("CI"):
            pytest.fail("CI needs node and `npm ci --prefix client/node` (make test does it)")
        pytest.skip("node or client/node/node_modules missing: run `make test`")
    return node


def test_node_client_end_to_end(server) -> None:
    # The Node test uses only the demo models (here among the test server's), as against `make serve`.
    proc = subprocess.run(
        [_node(), "--test", "test/"], cwd=NODE_DIR, capture_output=True, text=True, timeout=120,
        env={**os.environ, "HOOKWIRE_TARGET": server.target},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "# pass 2" in proc.stdout and "# fail 0" in proc.stdout


def test_node_client_fails_without_a_server_instead_of_hanging() -> None:
    with socket.socket() as sock:  # bound, not listening: connections are refused
        sock.bind(("127.0.0.1", 0))
        target = f"127.0.0.1:{sock.getsockname()[1]}"
        proc = subprocess.run(  # the timeout is a hang guard: the run ends on its own deadlines
            [_node(), "--test", "test/"], cwd=NODE_DIR, capture_output=True, text=True, timeout=120,
            env={**os.environ, "HOOKWIRE_TARGET": target},
        )
    assert proc.returncode != 0
    assert "# pass 0" in proc.stdout and "# fail 2" in proc.stdout, proc.stdout
    assert f"no hookwire server answers at {target}" in proc.stdout
