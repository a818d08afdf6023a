"""Prometheus metrics and structured logs."""

from __future__ import annotations

import asyncio
import json
import pathlib
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from typing import Iterator

import pytest
import torch

import hookwire
from support import ServerThread, serving

ROOT = pathlib.Path(__file__).resolve().parents[2]


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
        target = json.loads(proc.stdout.readline())["target"]  # JSON mode: its own lines are JSON too
        assert json.loads(proc.stdout.readline())["metrics_url"].startswith("http://127.0.0.1:")

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


def _samples(text: str) -> dict[str, float]:
    """Each sample of the scrape, by its name and labels as written, e.g. 'x_total{model="a"}'."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def _total(samples: dict[str, float], name: str, **labels: str) -> float:
    return sum(v for k, v in samples.items() if (k == name or k.startswith(name + "{"))
               and all(f'{n}="{want}"' in k for n, want in labels.items()))


async def test_generate_observes_time_to_first_token_and_inter_token_latency(metered: ServerThread) -> None:
    before = _samples(await asyncio.to_thread(_scrape, metered))
    async with hookwire.connect(metered.target) as client:
        result = await client.model("tiny-lm").generate(["Once upon a time"], 5, do_sample=False)
    after = _samples(await asyncio.to_thread(_scrape, metered))
    grew = {name: _total(after, name, model="tiny-lm") - _total(before, name, model="tiny-lm")
            for name in ("hookwire_time_to_first_token_seconds_count", "hookwire_inter_token_latency_seconds_count")}
    assert grew == {"hookwire_time_to_first_token_seconds_count": 1,
                    "hookwire_inter_token_latency_seconds_count": result.steps - 1}
    assert _total(after, "hookwire_time_to_first_token_seconds_bucket", model="tiny-lm", le="+Inf") >= 1
    assert _total(after, "hookwire_inter_token_latency_seconds_sum", model="tiny-lm") > 0
    # The process's own metrics, from the server's registry.
    assert after["process_resident_memory_bytes"] > 0 and "process_cpu_seconds_total" in after
    assert after["process_open_fds"] > 0


def test_the_metrics_port_serves_metrics_only(metered: ServerThread) -> None:
    base = f"http://127.0.0.1:{metered.server.metrics_port}"
    for path in ("/foo", "/", "/metrics/extra", "/favicon.ico"):
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(base + path, timeout=10)
        assert caught.value.code == 404, path
        assert caught.value.read() == b"not found: this port serves /metrics only\n"
    with urllib.request.urlopen(base + "/metrics?name[]=hookwire_sessions", timeout=10) as reply:
        assert reply.status == 200 and b"hookwire_sessions" in reply.read()


#: Words of PromQL (functions, aggregations, keywords) and Grafana's variables, none a metric.
PROMQL_WORDS = {"sum", "max", "min", "avg", "count", "rate", "irate", "increase", "histogram_quantile", "by",
                "without", "on", "ignoring", "and", "or", "unless", "bool", "offset"}
#: Counters with labels that show a sample only once they count something (a Generate
#: drops no events): their families must still be declared.
DECLARED_ONLY = {"hookwire_events_dropped_total"}


def _metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: what is left once label matchers,
    ranges, grouping clauses, numbers and PromQL's own words are taken out."""
    expr = re.sub(r'"[^"]*"', "", expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", " ", expr)
    words = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", expr))
    return {w for w in words if w not in PROMQL_WORDS}


def test_the_grafana_dashboard_queries_metrics_the_server_exports(metered: ServerThread) -> None:
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "hookwire.json").read_text())
    assert dashboard["uid"] == "hookwire" and dashboard["title"] == "hookwire"
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    panels += [p for row in dashboard["panels"] if row["type"] == "row" for p in row.get("panels", [])]
    titles = [p["title"] for p in panels]
    assert len(titles) == len(set(titles)) and len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])

    async def traffic() -> None:  # an Infer, a Generate, a hook with a session stream
        async with hookwire.connect(metered.target) as client:
            async with client.model("mlp").hook("fc1", posthook=hookwire.capture("output")) as hook:
                await client.model("mlp")(torch.randn(1, 8))
                async for _ in hook.events():
                    break
                await client.model("tiny-lm").generate(["Hello"], 3, do_sample=False)
                return await asyncio.to_thread(_scrape, metered)

    text = asyncio.run(traffic())
    shown = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    declared = {line.split(" ")[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    used: dict[str, set[str]] = {}
    for panel in panels:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = _metric_names(target["expr"])
            assert names, (panel["title"], target["expr"])
            for name in names:
                used.setdefault(name, set()).add(panel["title"])
    missing = {name: titles for name, titles in used.items()
               if name not in shown and not (name in DECLARED_ONLY and name.removesuffix("_total") in declared)}
    assert not missing, f"panels query metrics that /metrics does not show: {missing}"
    # What the issue asks the dashboard to show is on it.
    for metric in ("hookwire_rpcs_total", "hookwire_infer_seconds_bucket", "hookwire_generate_seconds_bucket",
                   "hookwire_time_to_first_token_seconds_bucket", "hookwire_inter_token_latency_seconds_bucket",
                   "hookwire_generated_tokens_total", "hookwire_batch_calls_bucket", "hookwire_model_state",
                   "hookwire_hooks", "hookwire_sessions", "hookwire_streams", "hookwire_events_dropped_total",
                   "process_resident_memory_bytes", "process_cpu_seconds_total"):
        assert metric in used, metric
