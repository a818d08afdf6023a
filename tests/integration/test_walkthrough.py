"""docs/protocol.md's walkthrough with `buf curl` runs as written against a real server."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess

import pytest

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def _blocks() -> list[str]:
    section = DOC.read_text().split("## 16. Walkthrough", 1)[1]
    return re.findall(r"```sh\n(.*?)```", section, flags=re.S)


def test_walkthrough_commands_run(server) -> None:
    if shutil.which("npx") is None:
        pytest.fail("npx (Node.js) is needed for buf curl")
    blocks = _blocks()
    assert len(blocks) == 3
    script = "set -euo pipefail\n" + "\n".join(blocks)
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TARGET": server.target})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "hookwire.v1.ModelService" in out and "grpc.health.v1.Health" in out
    assert '"status": "SERVING"' in out
    infer = json.loads(out[out.rindex('{\n  "requestId"'):])
    assert infer["events"][0]["module"] == "fc1"
    assert sum(int(c) for c in infer["events"][0]["output"]["summary"]["histogram"]) == 32
