"""Operating the server: health, reflection, graceful shutdown, settings precedence."""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

import hookwire

HOOKWIRE = [sys.executable, "-m", "hookwire._cli"]
TESTS = pathlib.Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKWIRE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def _spawn(*args: str, **env: str) -> tuple[subprocess.Popen, tempfile._TemporaryFileWrapper]:
    log = tempfile.NamedTemporaryFile(mode="w+", suffix=".log")
    proc = subprocess.Popen([*HOOKWIRE, "serve", *args], stdout=subprocess.PIPE, stderr=log, text=True, env=_env(**env))
    return proc, log


async def _health(target: str, service: str = "") -> str:
    async with grpc.aio.insecure_channel(target) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def test_health_is_not_serving_while_models_load_then_serving(tmp_path) -> None:
    port = _free_port()
    target = f"127.0.0.1:{port}"
    proc, log = _spawn("--port", str(port), "--model", "slow=support:slow_factory")
    try:
        seen = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                status = await _health(target)
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.05)
                continue
            if not seen or seen[-1] != status:
                seen.append(status)
            if status == "SERVING":
                break
            await asyncio.sleep(0.05)
        assert seen == ["NOT_SERVING", "SERVING"]
        assert await _health(target, "hookwire.v1.ModelService") == "SERVING"
        assert await _health(target, "hookwire.v1.HookService") == "SERVING"
        cli = subprocess.run([*HOOKWIRE, "health", target], capture_output=True, text=True, timeout=30)
        assert cli.returncode == 0 and "SERVING" in cli.stdout
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    down = subprocess.run([*HOOKWIRE, "health", target, "--timeout", "1"], capture_output=True, text=True, timeout=30)
    assert down.returncode == 2 and "UNAVAILABLE" in down.stderr


async def test_reflection_lists_the_services() -> None:
    port = _free_port()
    proc, log = _spawn("--port", str(port))
    try:
        proc.stdout.readline()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

            stub = reflection_pb2_grpc.ServerReflectionStub(channel)

            async def ask():
                yield reflection_pb2.ServerReflectionRequest(list_services="")

            async for reply in stub.ServerReflectionInfo(ask()):
                names = {s.name for s in reply.list_services_response.service}
                break
        assert {"hookwire.v1.ModelService", "hookwire.v1.HookService", "grpc.health.v1.Health"} <= names
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


async def test_sigterm_finishes_in_flight_infer_ends_streams_and_exits_zero() -> None:
    port = _free_port()
    target = f"127.0.0.1:{port}"
    proc, log = _spawn("--port", str(port), "--model", "sleeper=support:sleeper_factory", "--demo")
    try:
        proc.stdout.readline()
        async with hookwire.connect(target) as client:
            await client.model("mlp").hook("fc1", posthook=hookwire.capture("output"))
            await client.model("sleeper").hook("inner", posthook=[hookwire.rules.scale("output", 10.0)])
            session = await client.session()
            in_flight = asyncio.ensure_future(client.model("sleeper")(torch.tensor(1.5)))
            await asyncio.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            stopped_at = time.monotonic()
            out = await asyncio.wait_for(in_flight, 10)
            assert float(out) == 15.0  # the in-flight call finished, its session's rule intact
            for _ in range(100):
                if session.ended:
                    break
                await asyncio.sleep(0.02)
            assert isinstance(session.router.error, hookwire.UnavailableError)
            assert "shutting down" in session.router.error.details
            with pytest.raises((hookwire.UnavailableError, hookwire.CancelledError)):
                await client.model("mlp")(torch.zeros(1, 8))
        assert proc.wait(30) == 0
        assert time.monotonic() - stopped_at < 10
    finally:
        proc.kill()


def test_settings_precedence_flags_over_env_over_config(tmp_path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('[server]\nmax_slot_bytes = 1000\nmax_ttl_seconds = 50\ngrace = 2.5\nlog_format = "json"\n')
    port = _free_port()
    proc, log = _spawn("--port", str(port), HOOKWIRE_CONFIG=str(config), HOOKWIRE_MAX_TTL_SECONDS="60",
                       HOOKWIRE_GRACE="3", HOOKWIRE_PORT="1")
    try:
        lines = [proc.stdout.readline() for _ in range(4)]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert lines[0].startswith("hookwire serving mlp, tiny-transformer on 127.0.0.1:" + str(port))
    assert "logs: json" in lines[1]
    assert lines[2].startswith("security: plaintext") and "NO authentication" in lines[2]
    settings = lines[3]
    assert f"port={port} (flag)" in settings
    assert "max_ttl_seconds=60 (env)" in settings and "grace=3.0 (env)" in settings
    assert "max_slot_bytes=1000 (config)" in settings


def test_bad_settings_are_reported(tmp_path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('[server]\nportt = 1\n')
    proc = subprocess.run([*HOOKWIRE, "serve", "--config", str(config)], capture_output=True, text=True, timeout=60, env=_env())
    assert proc.returncode == 2 and "unknown keys ['portt']" in proc.stderr
    proc = subprocess.run([*HOOKWIRE, "serve"], capture_output=True, text=True, timeout=60, env=_env(HOOKWIRE_PORT="x"))
    assert proc.returncode == 2 and "HOOKWIRE_PORT: 'x' is not a valid int" in proc.stderr
