"""WatchHarvest's stream of job states (HarvestManager.watch, no server): the stream's
last message is always the one showing the job ended, however the job's changes fall
between the messages being taken and being sent."""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import time
import types

import pytest

from hookwire.v1 import harvest_service_pb2 as hv
from hookwire_server.auth import Principal
from hookwire_server.calls.harvest import HarvestConfig, HarvestManager, Job

OWNER = Principal("alice", "user")


def _manager_with_job() -> tuple[HarvestManager, Job]:
    manager = HarvestManager(None, types.SimpleNamespace(metrics=None), HarvestConfig(), limits=None)
    settings = types.SimpleNamespace(model="m", output="out", worker_index=0, num_workers=1, modules=["a"])
    job = Job("hv-1", OWNER.name, settings)  # type: ignore[arg-type]
    job.state = hv.HARVEST_STATE_RUNNING
    manager._jobs[job.id] = job
    return manager, job


@pytest.mark.asyncio
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


@pytest.mark.asyncio
async def test_a_job_that_ended_before_the_watch_sends_one_message() -> None:
    manager, job = _manager_with_job()
    job.state = hv.HARVEST_STATE_CANCELLED
    assert [msg.state async for msg in manager.watch(job.id, OWNER, 0)] == [hv.HARVEST_STATE_CANCELLED]


@pytest.mark.asyncio
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


# ---- the state folder: index, leases, retention (no server) ---------------------------

def _stored(folder: pathlib.Path, job_id: str, state: str, *, ended: float | None = None,
            heartbeat: float | None = None, lease: float = 30.0, owner: str = OWNER.name) -> pathlib.Path:
    """A state file as another replica writes it."""
    record: dict[str, object] = {"job_id": job_id, "state": state, "owner": owner, "model": "m", "output": "o",
                                 "created": "2026-01-01T00:00:00Z", "lease_seconds": lease,
                                 "heartbeat": time.time() if heartbeat is None else heartbeat}
    if ended is not None:
        record["ended"] = datetime.datetime.fromtimestamp(ended, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    path = folder / f"{job_id}.json"
    path.write_text(json.dumps(record))
    return path


def _listing(manager: HarvestManager, **kw: bool) -> dict[str, int]:
    return {j.job_id: j.state for j in manager.list_jobs(hv.ListHarvestsRequest(**kw), OWNER)}


def test_listing_reads_only_the_state_files_that_changed(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manager = HarvestManager(None, types.SimpleNamespace(metrics=None), HarvestConfig(state_dir=str(tmp_path)), limits=None)
    for i in range(5):
        _stored(tmp_path, f"hv-{i}", "HARVEST_STATE_SUCCEEDED", ended=time.time())
    reads: list[str] = []
    real = pathlib.Path.read_text

    def counting(self: pathlib.Path, *args: object, **kwargs: object) -> str:
        reads.append(self.name)
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(pathlib.Path, "read_text", counting)
    assert len(_listing(manager)) == 5 and len(reads) == 5
    reads.clear()
    assert len(_listing(manager)) == 5 and reads == []  # nothing changed: nothing read
    # Another replica writes a new job and updates one: only those two are read.
    _stored(tmp_path, "hv-new", "HARVEST_STATE_RUNNING")
    path = _stored(tmp_path, "hv-2", "HARVEST_STATE_FAILED", ended=time.time())
    os.utime(path, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))  # a coarse-mtime filesystem still sees it
    listed = _listing(manager)
    assert sorted(reads) == ["hv-2.json", "hv-new.json"]
    assert listed["hv-2"] == hv.HARVEST_STATE_FAILED and listed["hv-new"] == hv.HARVEST_STATE_RUNNING
    (tmp_path / "hv-0.json").unlink()  # removed elsewhere: gone here too
    assert "hv-0" not in _listing(manager)


def test_an_expired_lease_is_interrupted_and_a_live_one_running(tmp_path: pathlib.Path) -> None:
    manager = HarvestManager(None, types.SimpleNamespace(metrics=None), HarvestConfig(state_dir=str(tmp_path)), limits=None)
    _stored(tmp_path, "hv-alive", "HARVEST_STATE_RUNNING", heartbeat=time.time(), lease=30)
    _stored(tmp_path, "hv-dead", "HARVEST_STATE_RUNNING", heartbeat=time.time() - 60, lease=30)
    listed = _listing(manager)
    assert listed == {"hv-alive": hv.HARVEST_STATE_RUNNING, "hv-dead": hv.HARVEST_STATE_INTERRUPTED}
    assert _listing(manager, active_only=True) == {"hv-alive": hv.HARVEST_STATE_RUNNING}
    dead = manager.get("hv-dead", OWNER)
    assert "interrupted" in dead.error and "StartHarvestRequest" in dead.error  # no CLI command for it: the request


def test_finished_jobs_are_pruned_after_the_retention(tmp_path: pathlib.Path) -> None:
    day = 86400.0
    config = HarvestConfig(state_dir=str(tmp_path), retention_seconds=7 * day)
    manager = HarvestManager(None, types.SimpleNamespace(metrics=None), config, limits=None)
    now = time.time()
    _stored(tmp_path, "hv-old", "HARVEST_STATE_SUCCEEDED", ended=now - 8 * day)
    (tmp_path / "hv-old.cancel").write_text("x")
    _stored(tmp_path, "hv-recent", "HARVEST_STATE_CANCELLED", ended=now - day)
    _stored(tmp_path, "hv-longdead", "HARVEST_STATE_RUNNING", heartbeat=now - 9 * day)  # interrupted long ago
    _stored(tmp_path, "hv-running", "HARVEST_STATE_RUNNING", heartbeat=now)
    assert sorted(manager.prune()) == ["hv-longdead", "hv-old"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hv-recent.json", "hv-running.json"]
    assert set(_listing(manager)) == {"hv-recent", "hv-running"}
    keep = HarvestManager(None, types.SimpleNamespace(metrics=None),
                          HarvestConfig(state_dir=str(tmp_path), retention_seconds=0), limits=None)
    assert keep.prune(now=now + 1000 * day) == []  # 0 keeps finished jobs forever


@pytest.mark.parametrize("setting,value", [("lease_seconds", 0.5), ("lease_seconds", float("nan")),
                                           ("retention_seconds", -1.0), ("max_jobs_per_principal", -1),
                                           ("max_workers", 0), ("min_watch_ms", -1)])
def test_harvest_settings_are_validated(setting: str, value: float) -> None:
    from hookwire_server.models.model_loading import ConfigError
    from hookwire_server.api.server import ServerSettings

    with pytest.raises(ValueError, match=setting):
        HarvestConfig(**{setting: value}).validate()  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=f"harvest_{setting}"):
        ServerSettings(**{f"harvest_{setting}": value})  # type: ignore[arg-type]
