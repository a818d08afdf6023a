"""Prometheus metrics and structured logs."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import urllib.request
from typing import Iterator

import pytest
import torch

import hookwire
from support import ServerThread, serving


@pytest.fixture(scope="module")
def metered() -> Iterator[ServerThread]:
    with serving(metrics_port=0) as srv:
        yield srv


def _scrape(srv: ServerThread) -> str:
    url = f"http://127.0.0.1:{srv.server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        return reply.read().decode()


def _value(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {name} {labels}")


async def test_metrics_endpoint_counts_what_happened(metered: ServerThread) -> None:
    x = torch.randn(1, 8)
    async with hookwire.connect(metered.target) as client:
        model = client.model("mlp")
        async with model.hook("fc*", posthook=hookwire.capture("output")) as hook:
            for _ in range(3):
                await model(x)
            got = 0
            async for _ in hook.events():
                got += 1
                if got == 6:
                    break
            with pytest.raises(hookwire.NotFoundError):
                await client.model("nope")(x)
            text = await asyncio.to_thread(_scrape, metered)
            assert _value(text, "hookwire_sessions") >= 1
            assert _value(text, "hookwire_hooks") >= 1
            assert _value(text, "hookwire_streams") >= 1
            assert "hookwire_buffered_events" in text and "hookwire_buffered_bytes" in text
    assert _value(text, "hookwire_rpcs_total", method="Infer", code="OK") >= 3
    assert _value(text, "hookwire_rpcs_total", method="Infer", code="NOT_FOUND") >= 1
    assert _value(text, "hookwire_rpcs_total", method="RegisterHook", code="OK") >= 1
    assert _value(text, "hookwire_infer_seconds_count", model="mlp") >= 3
    assert _value(text, "hookwire_infer_seconds_bucket", model="mlp", le="+Inf") >= 3
    assert _value(text, "hookwire_hook_fires_total", model="mlp") >= 6
    assert _value(text, "hookwire_events_sent_total") >= 6
    assert _value(text, "hookwire_stream_bytes_total") >= 6 * 32 * 4
    assert "hookwire_events_dropped_total" in text


def test_json_logs_carry_request_ids(tmp_path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "hookwire._cli", "serve", "--port", "0", "--log-format", "json", "--metrics-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        banner = proc.stdout.readline()
        target = banner.rsplit(" ", 1)[-1].strip()
        assert proc.stdout.readline().startswith("metrics on http://127.0.0.1:")

        async def call() -> str:
            async with hookwire.connect(target) as client:
                return (await client.model("mlp").infer(torch.randn(1, 8))).request_id

        request_id = asyncio.run(call())
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    records = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    assert records, err
    infer = [r for r in records if r.get("request_id") == request_id]
    assert infer and infer[0]["model"] == "mlp" and infer[0]["message"] == "infer ok"
    assert {"time", "level", "logger", "message", "duration_ms"} <= set(infer[0])
    assert proc.returncode == 0
