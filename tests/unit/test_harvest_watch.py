"""WatchHarvest's stream of job states (HarvestManager.watch, no server): the stream's
last message is always the one showing the job ended, however the job's changes fall
between the messages being taken and being sent."""

from __future__ import annotations

import types

import pytest

from hookwire.v1 import harvest_service_pb2 as hv
from hookwire_server.auth import Principal
from hookwire_server.harvest import HarvestConfig, HarvestManager, Job

pytestmark = pytest.mark.asyncio

OWNER = Principal("alice", "user")


def _manager_with_job() -> tuple[HarvestManager, Job]:
    manager = HarvestManager(None, types.SimpleNamespace(metrics=None), HarvestConfig(), limits=None)
    settings = types.SimpleNamespace(model="m", output="out", worker_index=0, num_workers=1, modules=["a"])
    job = Job("hv-1", OWNER.name, settings)  # type: ignore[arg-type]
    job.state = hv.HARVEST_STATE_RUNNING
    manager._jobs[job.id] = job
    return manager, job


async def test_a_job_that_ends_while_its_last_running_state_is_sent_still_sends_the_end() -> None:
    manager, job = _manager_with_job()
    stream = manager.watch(job.id, OWNER, 50)
    first = await stream.__anext__()
    assert first.state == hv.HARVEST_STATE_RUNNING
    # The job ends while the stream is suspended at its yield (gRPC sending ``first``).
    job.state = hv.HARVEST_STATE_SUCCEEDED
    job.changed()
    rest = [msg.state async for msg in stream]
    assert rest == [hv.HARVEST_STATE_SUCCEEDED]


async def test_a_job_that_ended_before_the_watch_sends_one_message() -> None:
    manager, job = _manager_with_job()
    job.state = hv.HARVEST_STATE_CANCELLED
    assert [msg.state async for msg in manager.watch(job.id, OWNER, 0)] == [hv.HARVEST_STATE_CANCELLED]


async def test_changes_while_running_are_sent_then_the_end() -> None:
    manager, job = _manager_with_job()
    stream = manager.watch(job.id, OWNER, 50)
    assert (await stream.__anext__()).tokens_done == 0
    job.tokens_done = 7
    job.changed()
    second = await stream.__anext__()
    assert (second.state, second.tokens_done) == (hv.HARVEST_STATE_RUNNING, 7)
    job.state = hv.HARVEST_STATE_FAILED
    job.error = "boom"
    job.changed()
    assert [(m.state, m.error) async for m in stream] == [(hv.HARVEST_STATE_FAILED, "boom")]
