"""Health follows the models: each model's own service, readiness, liveness, and the
Kubernetes probes that read them."""

from __future__ import annotations

import asyncio
import pathlib
import subprocess
import sys
import urllib.request

import grpc
import pytest
import torch
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

import hookwire
from hookwire_server import ModelRegistry
from hookwire_server.demo_models import mlp
from hookwire_server.models.model_registry import ModelHost
from support import LIVENESS, Scale, ServerThread, until

DEPLOYMENT = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "deployment.yaml"
MODEL_SERVICES = ("hookwire.v1.ModelService", "hookwire.v1.HookService", "hookwire.v1.HarvestService")


async def _health(target: str, service: str = "") -> str:
    async with grpc.aio.insecure_channel(target) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def _turns(target: str, service: str, status: str) -> None:
    """Returns once health Watch reports ``status`` for ``service`` (the change is pushed
    to watchers: nothing polls)."""
    async with grpc.aio.insecure_channel(target) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=service))
        async for reply in watch:
            if health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status) == status:
                watch.cancel()
                return
    raise AssertionError(f"the Watch of {service!r} ended before it turned {status}")


async def _statuses(target: str, *services: str) -> dict[str, str]:
    return {service: await _health(target, service) for service in services}


def _cli_health(target: str, service: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hookwire._cli", "health", target, "--service", service],
                          capture_output=True, text=True, timeout=120)


def _scrape(srv: ServerThread) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.server.metrics_port}/metrics", timeout=10) as reply:
        return reply.read().decode()


def _registry() -> ModelRegistry:
    """Two ready models and one that failed to load."""
    registry = ModelRegistry([ModelHost("first", mlp()), ModelHost("second", Scale())])
    registry.expect("broken")
    registry.fail("broken", "RuntimeError: weights are corrupt")
    return registry


def _fail_while_serving(registry: ModelRegistry, name: str) -> None:
    """What the vLLM engine does when its engine dies in a step: ModelHost.failed, from
    the model's worker thread (not the event loop)."""
    host = registry.get(name)
    host.submit(lambda: host.failed("its engine failed in a step (restart the server): EngineDeadError"))


async def test_health_follows_models_that_fail_while_serving(make_server) -> None:
    registry = _registry()
    srv = make_server(registry, metrics_port=0)
    target = srv.target
    everything = ("", *MODEL_SERVICES, "hookwire.v1.OperandService", "hookwire.live",
                  "hookwire.model.first", "hookwire.model.second", "hookwire.model.broken")
    # A model that failed at load is NOT_SERVING itself, and nothing else: it never served.
    assert await _statuses(target, *everything) == {
        **{s: "SERVING" for s in everything}, "hookwire.model.broken": "NOT_SERVING"}
    cli = await asyncio.to_thread(_cli_health, target, "hookwire.model.first")
    assert (cli.returncode, cli.stdout) == (0, f"{target} hookwire.model.first: SERVING\n")

    _fail_while_serving(registry, "first")
    await asyncio.wait_for(_turns(target, "hookwire.model.first", "NOT_SERVING"), LIVENESS)
    async with hookwire.connect(target) as client:
        with pytest.raises(hookwire.FailedPreconditionError, match="model 'first' failed while serving"):
            await client.model("first")(torch.zeros(1, 8))
        assert torch.equal(await client.model("second")(torch.ones(2)), torch.full((2,), 2.0))
    # "second" still serves: the replica stays ready, but it must be restarted.
    assert await _statuses(target, *everything) == {
        **{s: "SERVING" for s in everything}, "hookwire.model.broken": "NOT_SERVING",
        "hookwire.model.first": "NOT_SERVING", "hookwire.live": "NOT_SERVING"}
    for service, code in (("hookwire.model.first", 1), ("hookwire.live", 1), ("hookwire.v1.ModelService", 0)):
        cli = await asyncio.to_thread(_cli_health, target, service)
        assert cli.returncode == code, (service, cli.stdout, cli.stderr)
        assert cli.stdout == f"{target} {service}: {'SERVING' if code == 0 else 'NOT_SERVING'}\n"

    text = await asyncio.to_thread(_scrape, srv)
    for model, state in (("first", "failed"), ("second", "ready"), ("broken", "failed")):
        for each in ("loading", "ready", "failed"):
            assert f'hookwire_model_state{{model="{model}",state="{each}"}} {1.0 if each == state else 0.0}' in text

    _fail_while_serving(registry, "second")
    await asyncio.wait_for(_turns(target, "hookwire.model.second", "NOT_SERVING"), LIVENESS)
    # No model is READY: readiness and the services that act on models turn NOT_SERVING;
    # named operands still work.
    assert await _statuses(target, *everything) == {
        **{s: "NOT_SERVING" for s in everything}, "hookwire.v1.OperandService": "SERVING"}
    cli = await asyncio.to_thread(_cli_health, target, "")
    assert cli.returncode == 1 and cli.stdout == f"{target}: NOT_SERVING\n"


async def test_every_health_service_turns_not_serving_while_the_server_drains() -> None:
    registry = ModelRegistry([ModelHost("first", mlp()), ModelHost("second", Scale())])
    srv = ServerThread(registry).start()
    scheduler = srv.call(lambda: srv.server.engines.scheduler(registry.get("first")))
    stopping: asyncio.Future[None] | None = None
    try:
        services = ("", "hookwire.v1.ModelService", "hookwire.v1.OperandService", "hookwire.live",
                    "hookwire.model.first", "hookwire.model.second")
        assert set((await _statuses(srv.target, *services)).values()) == {"SERVING"}
        async with hookwire.connect(srv.target) as client:
            srv.call(scheduler.hold)  # the call waits in the queue: in flight until released
            in_flight = asyncio.ensure_future(client.model("first")(torch.zeros(1, 8)))
            await until(lambda: srv.call(lambda: scheduler.queued) == 1, "the call is queued")
            stopping = asyncio.ensure_future(asyncio.to_thread(srv.stop, 60.0))
            # The in-flight call holds the drain open: health answers meanwhile.
            await asyncio.wait_for(_turns(srv.target, "hookwire.model.second", "NOT_SERVING"), LIVENESS)
            assert set((await _statuses(srv.target, *services)).values()) == {"NOT_SERVING"}
            srv.call(scheduler.release)
            assert torch.equal(await in_flight, mlp()(torch.zeros(1, 8)))  # it finished, as a drain promises
    finally:
        if stopping is None:
            srv.stop()
        else:
            await stopping


async def test_the_deployment_probes_services_the_server_answers(make_server) -> None:
    container = yaml.safe_load(DEPLOYMENT.read_text())["spec"]["template"]["spec"]["containers"][0]
    probes = {kind: container[kind]["grpc"] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert all(probe["port"] == 50051 for probe in probes.values())
    assert probes["readinessProbe"].get("service", "") in ("", "hookwire.v1.ModelService")
    assert probes["livenessProbe"]["service"] == "hookwire.live"
    srv = make_server(ModelRegistry([ModelHost("first", mlp())]))
    for kind, probe in probes.items():
        assert await _health(srv.target, probe.get("service", "")) == "SERVING", kind
