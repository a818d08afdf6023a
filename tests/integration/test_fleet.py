"""Fleet mode: three server processes on loopback used as one."""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
from typing import Iterator

import pytest
import torch

import hookwire

TESTS = pathlib.Path(__file__).resolve().parent.parent
X = torch.randn(1, 8)


class Replica:
    def __init__(self, *models: str) -> None:
        self.log = tempfile.TemporaryFile(mode="w+")
        args = [arg for m in models for arg in ("--model", m)]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hookwire._cli", "serve", "--port", "0", *args, "--log-level", "warning"],
            stdout=subprocess.PIPE, stderr=self.log, text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])},
        )
        self.target = self.proc.stdout.readline().rsplit(" ", 1)[-1].strip()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


@pytest.fixture
def replicas() -> Iterator[list[Replica]]:
    started = [Replica("mlp=hookwire_server.demo_models:mlp") for _ in range(3)]
    yield started
    for r in started:
        r.stop()


async def _count_hooks(target: str) -> int:
    async with hookwire.connect(target) as c:
        return len(await c.list_hooks(model="mlp"))


async def _take(iterator, n: int, timeout: float = 60.0) -> list:
    out = []

    async def run() -> None:
        async for item in iterator:
            out.append(item)
            if len(out) == n:
                return

    await asyncio.wait_for(run(), timeout)
    return out


async def test_fleet_registers_everywhere_merges_events_survives_a_kill_and_adopts_a_new_replica(replicas) -> None:
    targets = [r.target for r in replicas]
    async with hookwire.connect_fleet(lambda: list(targets), refresh_seconds=0.3) as fleet:
        model = fleet.model("mlp")
        async with model.hook("fc1", posthook=hookwire.capture("output")) as hook:
            # Registered on every replica.
            assert sorted(hook.handles) == sorted(targets)
            assert [await _count_hooks(t) for t in targets] == [1, 1, 1]
            events = hook.events()
            # Round-robin calls, merged events: complete, each naming its replica.
            results = [await model.infer(X) for _ in range(9)]
            got = await _take(events, 9)
            assert sorted(e.request_id for e in got) == sorted(r.request_id for r in results)
            assert {e.replica for e in got} == set(targets)
            assert all(sum(e.replica == t for e in got) == 3 for t in targets)
            expected = hookwire_local_fc1()
            assert all(torch.equal(e.output, expected) for e in got)

            # One replica dies mid-stream: the others go on, the fleet reports it.
            replicas[0].kill()
            results = [await model.infer(X) for _ in range(6)]
            got = await _take(events, 6)
            assert {e.replica for e in got} == set(targets[1:])
            assert sorted(e.request_id for e in got) == sorted(r.request_id for r in results)
            assert any(n.kind == "replica_lost" and n.replica == targets[0] for n in fleet.notices)
            assert fleet.replicas[targets[0]] is False

            # A new replica appears: it gets the fleet's hook and serves calls.
            newcomer = Replica("mlp=hookwire_server.demo_models:mlp")
            replicas.append(newcomer)
            targets.append(newcomer.target)
            deadline = time.monotonic() + 60  # a hang guard
            while fleet.replicas.get(newcomer.target) is not True:
                assert time.monotonic() < deadline, fleet.notices
                await asyncio.sleep(0.05)
            assert await _count_hooks(newcomer.target) == 1
            results = [await model.infer(X) for _ in range(6)]
            got = await _take(events, 6)
            assert newcomer.target in {e.replica for e in got}
            assert any(n.kind == "replica_joined" and n.replica == newcomer.target for n in fleet.notices)
        # Removing the hook removes it everywhere that is alive.
        assert [await _count_hooks(t) for t in targets[1:]] == [0, 0, 0]


def hookwire_local_fc1() -> torch.Tensor:
    from hookwire_server.demo_models import mlp

    return mlp().fc1(X).detach()


async def test_registration_is_all_or_nothing(replicas) -> None:
    odd = Replica("scale=support:scale_factory")  # does not host "mlp"
    try:
        targets = [r.target for r in replicas] + [odd.target]
        async with hookwire.connect_fleet(targets) as fleet:
            await fleet.wait_ready(timeout=120)  # every replica's own models
            with pytest.raises(hookwire.NotFoundError, match="no model 'mlp'"):
                await fleet.wait_ready(["mlp"], timeout=120)  # the odd replica does not configure it
            with pytest.raises(hookwire.NotFoundError, match=f"replica {odd.target} refused the hook"):
                await fleet.model("mlp").hook("fc1", posthook=hookwire.capture("output"))
            assert [await _count_hooks(r.target) for r in replicas] == [0, 0, 0]
    finally:
        odd.stop()


async def test_fleet_needs_a_live_replica() -> None:
    with pytest.raises(hookwire.UnavailableError):
        async with hookwire.connect_fleet(["127.0.0.1:1"], options=hookwire.ConnectOptions(timeout=2)):
            pass


async def test_dns_targets_resolve(replicas) -> None:
    port = replicas[0].target.rsplit(":", 1)[1]
    async with hookwire.connect_fleet(f"dns:///localhost:{port}") as fleet:
        assert any(t.endswith(f":{port}") for t, up in fleet.replicas.items() if up)
        out = await fleet.model("mlp")(X)
        assert out.shape == (1, 4)


async def test_round_robin_skips_a_dead_replica_without_failing_calls(replicas) -> None:
    targets = ["127.0.0.1:1"] + [r.target for r in replicas[:2]]
    async with hookwire.connect_fleet(targets, options=hookwire.ConnectOptions(timeout=5)) as fleet:
        for _ in range(6):
            assert (await fleet.model("mlp")(X)).shape == (1, 4)
        assert fleet.replicas["127.0.0.1:1"] is False
        async with fleet.model("mlp").hook("fc1", posthook=hookwire.capture()) as hook:
            assert sorted(hook.handles) == sorted(targets[1:])  # the dead one gets it when it is back


async def test_a_replica_whose_model_is_loading_is_not_lost() -> None:
    """UNAVAILABLE also means "this model is still loading": the call moves to another
    replica, and the loading one stays in the fleet (it answers, it is not gone)."""
    from hookwire_server import ModelHost, ModelRegistry
    from hookwire_server.demo_models import mlp

    from support import ServerThread

    ready_registry = ModelRegistry()
    ready_registry.add(ModelHost("mlp", mlp()))
    loading_registry = ModelRegistry()
    loading_registry.expect("mlp")
    ready, loading = ServerThread(ready_registry).start(), ServerThread(loading_registry).start()
    try:
        async with hookwire.connect_fleet([loading.target, ready.target]) as fleet:
            for _ in range(4):  # round-robin reaches the loading replica first or second
                assert (await fleet.model("mlp")(X)).shape == (1, 4)
            assert fleet.replicas == {loading.target: True, ready.target: True}, fleet.notices
            with pytest.raises(TimeoutError):
                await fleet.wait_ready(["mlp"], timeout=0.5)  # a bound on waiting, not on speed
    finally:
        ready.stop()
        loading.stop()


async def _all(iterator, timeout: float = 60.0) -> list:
    """Every item of an iteration that must end by itself (the timeout is a hang guard)."""

    async def run() -> list:
        return [item async for item in iterator]

    return await asyncio.wait_for(run(), timeout)


async def test_fleet_events_until_a_call_and_with_an_idle_timeout(replicas) -> None:
    """FleetHookHandle.events takes HookHandle.events' until= and timeout= (issue 22)."""
    targets = [r.target for r in replicas]
    async with hookwire.connect_fleet(targets) as fleet:
        model = fleet.model("mlp")
        async with model.hook("fc1", posthook=hookwire.capture("output")) as hook, \
                model.hook("fc2", posthook=hookwire.capture("output"), eval_update=False) as quiet:
            # until: the call's events, from whichever replica ran it, then the end; no timeout.
            seen = set()
            for _ in targets:  # round-robin: one call per replica
                result = await model.infer(X)
                got = await _all(hook.events(until=result))
                assert [e.request_id for e in got] == [result.request_id]
                seen.add(got[0].replica)
            assert seen == set(targets)
            # Unread events of earlier calls come first; a call whose marker was passed ends at once.
            first, second = await model.infer(X), await model.infer(X)
            got = await _all(hook.events(until=second.request_id))
            assert sorted(e.request_id for e in got) == sorted([first.request_id, second.request_id])
            assert len({e.replica for e in got}) == 2
            assert await _all(hook.events(until=first)) == []
            # A call the hook captured nothing from still ends the iteration (its marker comes).
            result = await model.infer(X)
            assert await _all(quiet.events(until=result)) == []
            assert [e.request_id for e in await _all(hook.events(until=result))] == [result.request_id]

            # timeout: an idle limit, ending quietly; what arrives later waits for the next iteration.
            assert await _all(quiet.events(timeout=0.2)) == []
            assert await _all(hook.events(timeout=0.2)) == []
            later = await model.infer(X)
            assert [e.request_id for e in await _take(hook.events(timeout=30), 1)] == [later.request_id]
            last = await model.infer(X)
            assert [e.request_id for e in await _all(hook.events(until=last, timeout=30))] == [last.request_id]

            with pytest.raises(ValueError, match="timeout must be a number of seconds > 0"):
                hook.events(timeout=0)
            with pytest.raises(TypeError, match="until: expected a call result or a request id"):
                hook.events(until=object())  # type: ignore[arg-type]
        # After remove(), an iteration ends at once.
        assert await _all(hook.events(timeout=30)) == []
