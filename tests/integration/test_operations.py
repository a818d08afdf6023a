"""Operating the server: health, reflection, graceful shutdown, settings precedence."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import select
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
    finally:
        proc.kill()


def test_settings_precedence_flags_over_env_over_config(tmp_path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('[server]\nmax_slot_bytes = 1000\nmax_ttl_seconds = 50\ngrace = 2.5\nlog_format = "json"\n')
    port = _free_port()
    proc, log = _spawn("--port", str(port), HOOKWIRE_CONFIG=str(config), HOOKWIRE_MAX_TTL_SECONDS="60",
                       HOOKWIRE_GRACE="3", HOOKWIRE_PORT="1")
    try:
        # log_format = "json": the lines hookwire serve says itself are JSON records too.
        records = [json.loads(proc.stdout.readline()) for _ in range(4)]
        lines = [r["message"] for r in records]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert records[3]["settings"]["max_slot_bytes"] == {"value": "1000", "source": "config"}
    assert lines[0].startswith("hookwire serving mlp, tiny-transformer, tiny-lm on 127.0.0.1:" + str(port))
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


def _banner(proc: subprocess.Popen, log) -> str:
    line = proc.stdout.readline()
    if "serving" not in line:
        log.seek(0)
        raise AssertionError(f"server did not start: {line!r} {log.read()}")
    return line


@pytest.mark.parametrize("hooked", [False, True], ids=["no-hook", "hooked"])
async def test_sigterm_exits_within_the_grace_period_while_a_long_pass_runs(hooked: bool) -> None:
    """The model thread cannot be stopped: the process must exit without waiting for it,
    also when hooks on that model still wait to be detached behind the pass."""
    port = _free_port()
    proc, log = _spawn("--port", str(port), "--model", "sleeper=support:sleeper_factory", HOOKWIRE_GRACE="1")
    try:
        _banner(proc, log)
        async with hookwire.connect(f"127.0.0.1:{port}") as client:
            if hooked:
                await client.model("sleeper").hook("inner", posthook=hookwire.capture("output"))
            in_flight = asyncio.ensure_future(client.model("sleeper")(torch.tensor(120.0)))  # a 120 s pass
            await asyncio.sleep(1.0)
            assert not in_flight.done()
            proc.send_signal(signal.SIGTERM)
            # Generous: 60 s is far above grace (1 s) and far below the pass's own 120 s.
            assert await asyncio.to_thread(proc.wait, 60) == 0
            with pytest.raises((hookwire.UnavailableError, hookwire.CancelledError)):
                await asyncio.wait_for(in_flight, 30)
    finally:
        proc.kill()
        proc.wait(30)


async def test_a_second_server_on_a_busy_port_refuses_to_start() -> None:
    port = _free_port()
    proc, log = _spawn("--port", str(port))
    try:
        _banner(proc, log)
        second = subprocess.run([*HOOKWIRE, "serve", "--port", str(port)], capture_output=True, text=True,
                                timeout=120, env=_env())
        assert second.returncode == 2, second.stderr
        assert f"cannot listen on 127.0.0.1:{port}: the port is in use" in second.stderr
        assert "hookwire serving" not in second.stdout
        # The same with two servers in one process.
        from hookwire_server import HookwireServer, ModelRegistry, ServerSettings

        with pytest.raises(OSError, match="the port is in use"):
            await HookwireServer(ModelRegistry(), ServerSettings(port=port)).start()
        assert await _health(f"127.0.0.1:{port}") == "SERVING"  # the first one is untouched
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


async def _listed(client: hookwire.Client) -> dict[str, hookwire.ModelInfo]:
    deadline = time.monotonic() + 300  # a loaded machine takes long to import torch
    while time.monotonic() < deadline:
        try:
            return {m.name: m for m in await client.list_models()}
        except hookwire.UnavailableError:  # not listening yet
            await asyncio.sleep(0.1)
    raise AssertionError("the server never answered")


async def test_models_are_listed_with_their_state_while_they_load(tmp_path) -> None:
    port = _free_port()
    target = f"127.0.0.1:{port}"
    gate = tmp_path / "gate"
    proc, log = _spawn("--port", str(port), "--model", "gated=support:gated_factory",
                       "--model", "broken=support:failing_factory", "--model", "scale=support:scale_factory",
                       HOOKWIRE_TEST_GATE=str(gate))
    try:
        async with hookwire.connect(target) as client:
            listed = await _listed(client)
            # Models load one after the other: "gated" holds the others back until the gate opens.
            assert [(m.name, m.state) for m in listed.values()] == [
                ("gated", "loading"), ("broken", "loading"), ("scale", "loading")]
            assert await _health(target) == "NOT_SERVING"
            with pytest.raises(hookwire.UnavailableError, match="model 'gated' is loading"):
                await client.model("gated")(torch.ones(2))
            with pytest.raises(hookwire.UnavailableError, match="model 'scale' is loading"):
                await client.model("scale").hook("", posthook=hookwire.capture("output"))
            info = await client.model("gated").info()
            assert info.state == "loading" and info.modules == ()
            # Long enough for ListModels to answer on a busy machine (the model never gets ready here).
            with pytest.raises(TimeoutError, match="gated"):
                await client.wait_ready(["gated"], timeout=5)
            readable, _, _ = select.select([proc.stdout], [], [], 0)
            assert not readable, "nothing is printed before the server serves"

            gate.touch()
            ready = await client.wait_ready(["gated", "scale"], timeout=120)
            assert [(m.name, m.state) for m in ready] == [("gated", "ready"), ("scale", "ready")]
            with pytest.raises(hookwire.FailedPreconditionError, match="model 'broken' failed to load: RuntimeError: weights are corrupt"):
                await client.wait_ready(timeout=120)
            with pytest.raises(hookwire.FailedPreconditionError, match="model 'broken' failed to load: RuntimeError: weights are corrupt"):
                await client.model("broken")(torch.ones(2))
            with pytest.raises(hookwire.NotFoundError, match="'nope'"):
                await client.wait_ready(["nope"], timeout=120)
            assert torch.equal(await client.model("gated")(torch.ones(2)), torch.full((2,), 2.0))
            states = {m.name: (m.state, m.state_message) for m in await client.list_models()}
            assert states == {"gated": ("ready", ""), "broken": ("failed", "RuntimeError: weights are corrupt"),
                              "scale": ("ready", "")}
            assert len((await client.model("gated").info()).modules) == 1

            banner = _banner(proc, log)
            assert banner.startswith(f"hookwire serving gated, scale on {target}")
            lines = [proc.stdout.readline() for _ in range(3)]
            assert lines[2].startswith(f"settings: port={port} (flag); every other setting has its default")
            assert await _health(target) == "SERVING"
    finally:
        gate.touch()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        finally:
            proc.kill()
    log.seek(0)
    assert "model 'broken' failed to load: RuntimeError: weights are corrupt" in log.read()
