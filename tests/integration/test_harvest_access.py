"""Harvest jobs and principals: a job is visible to its owner and operators only,
quotas on concurrent jobs and on bytes written hold, fsspec URL outputs need an allowed
prefix, and a server without harvest storage says how to harvest anyway."""

from __future__ import annotations

import asyncio
import copy
import json
import pathlib
from collections.abc import Iterator

import grpc
import pytest

import hookwire
from hookwire_server.auth import hash_token
from hookwire_server.demo_models import tiny_lm, tiny_lm_tokenizer
from hookwire_server.models.model_registry import ModelHost, ModelRegistry
from hookwire_server.api.server import ServerSettings
from support import ServerThread, bearer

TOKENS = {name: f"hwt_harvest_{name}" for name in ("viewer", "alice", "bob", "carol", "operator")}
ROLE = {"viewer": "viewer", "alice": "user", "bob": "user", "carol": "user", "operator": "operator"}
LINES = "\n".join(f"{name}:{ROLE[name]}:{hash_token(token)}" for name, token in TOKENS.items())
LM = tiny_lm().eval()


def _registry() -> ModelRegistry:
    return ModelRegistry([ModelHost("tiny-lm", copy.deepcopy(LM), tokenizer=tiny_lm_tokenizer())])


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, pathlib.Path]:
    data, out = tmp_path_factory.mktemp("data"), tmp_path_factory.mktemp("out")
    (data / "docs.jsonl").write_text("".join(json.dumps({"text": f"the cat {i} sat on the mat"}) + "\n" for i in range(60)))
    return data, out


@pytest.fixture(scope="module")
def secured(roots: tuple[pathlib.Path, pathlib.Path]) -> Iterator[ServerThread]:
    data, out = roots
    srv = ServerThread(_registry(), ServerSettings(
        port=0, tokens=LINES, harvest_data_root=str(data), harvest_output_root=str(out),
        harvest_url_prefixes="memory://hookwire-harvest-test/", harvest_max_jobs_per_principal=1,
    )).start()
    yield srv
    srv.stop()


def _connect(srv: ServerThread, who: str) -> hookwire.Client:
    return hookwire.connect(srv.target, options=hookwire.ConnectOptions(token=TOKENS[who]))


OPTIONS = dict(data="docs.jsonl", length=8, batch_size=2, packing="pack")


@pytest.mark.asyncio
async def test_jobs_are_visible_to_their_owner_and_operators_only(secured: ServerThread) -> None:
    async with _connect(secured, "alice") as alice, _connect(secured, "bob") as bob, \
            _connect(secured, "operator") as operator, _connect(secured, "viewer") as viewer:
        job = await alice.harvest("tiny-lm", "model.norm", out="alice-run", **OPTIONS)
        done = await job.wait()
        assert done.state == "succeeded" and done.owner == "alice"
        for other in (bob, viewer):
            with pytest.raises(hookwire.NotFoundError):
                await other.harvest_job(job.id).refresh()
            with pytest.raises((hookwire.NotFoundError, hookwire.PermissionDeniedError)):
                await other.harvest_job(job.id).cancel()
            assert job.id not in [j.job_id for j in await other.harvests()]
        assert (await operator.harvest_job(job.id).refresh()).owner == "alice"
        assert job.id in [j.job_id for j in await operator.harvests()]
        with pytest.raises(hookwire.PermissionDeniedError, match="user"):
            await viewer.harvest("tiny-lm", "model.norm", out="viewer-run", **OPTIONS)


@pytest.mark.asyncio
async def test_a_principal_runs_at_most_its_quota_of_jobs_at_once(secured: ServerThread) -> None:
    scheduler = secured.server.engines.scheduler(secured.server.registry.get("tiny-lm"))
    async with _connect(secured, "bob") as bob, _connect(secured, "alice") as alice:
        secured.call(scheduler.hold)  # bob's first job waits for the model: it stays active
        try:
            first = await bob.harvest("tiny-lm", "model.norm", out="bob-1", **OPTIONS)
            with pytest.raises(hookwire.ResourceExhaustedError, match="harvest_max_jobs_per_principal"):
                await bob.harvest("tiny-lm", "model.norm", out="bob-2", **OPTIONS)
            with pytest.raises(hookwire.AlreadyExistsError, match="is writing"):
                await alice.harvest("tiny-lm", "model.norm", out="bob-1", **OPTIONS)  # the same output, meanwhile
        finally:
            secured.call(scheduler.release)
        assert (await first.wait()).state == "succeeded"
        second = await bob.harvest("tiny-lm", "model.norm", out="bob-2", **OPTIONS)  # room again
        assert (await second.wait()).state == "succeeded"


@pytest.mark.asyncio
async def test_concurrent_starts_cannot_get_past_the_job_quota(secured: ServerThread) -> None:
    # Six StartHarvest calls at once, quota 1: the count is taken from the check on (a
    # slot reserved before the awaits of validation and opening the output), so exactly
    # one is accepted, whatever order their awaits interleave in.
    scheduler = secured.server.engines.scheduler(secured.server.registry.get("tiny-lm"))
    async with _connect(secured, "carol") as carol:
        secured.call(scheduler.hold)  # the accepted job waits for the model: it stays active
        try:
            results = await asyncio.gather(
                *(carol.harvest("tiny-lm", "model.norm", out=f"carol-{i}", **OPTIONS) for i in range(6)),
                return_exceptions=True,
            )
            accepted = [r for r in results if isinstance(r, hookwire.HarvestJob)]
            refused = [r for r in results if not isinstance(r, hookwire.HarvestJob)]
            assert len(accepted) == 1, results
            for exc in refused:
                assert isinstance(exc, hookwire.ResourceExhaustedError), exc
                assert "harvest_max_jobs_per_principal" in str(exc)
            running = [j for j in await carol.harvests(active_only=True)]
            assert [j.job_id for j in running] == [accepted[0].id]
        finally:
            secured.call(scheduler.release)
        assert (await accepted[0].wait()).state == "succeeded"
        # The refused calls released their slots: room for one again.
        again = await carol.harvest("tiny-lm", "model.norm", out="carol-again", **OPTIONS)
        assert (await again.wait()).state == "succeeded"


@pytest.mark.asyncio
async def test_url_outputs_need_an_allowed_prefix_and_are_read_back(secured: ServerThread) -> None:
    async with _connect(secured, "alice") as alice:
        with pytest.raises(hookwire.PermissionDeniedError, match="harvest_url_prefixes"):
            await alice.harvest("tiny-lm", "model.norm", out="memory://elsewhere/x", **OPTIONS)
        job = await alice.harvest("tiny-lm", "model.layers.*", out="memory://hookwire-harvest-test/run", **OPTIONS)
        done = await job.wait()
        assert done.state == "succeeded" and done.committed
    ds = hookwire.ActivationDataset("memory://hookwire-harvest-test/run")  # the server runs in this process
    assert len(ds) == done.tokens_done and ds.modules == ["model.layers.0", "model.layers.1"]


@pytest.mark.asyncio
async def test_the_byte_quota_stops_a_job_and_keeps_what_it_committed(roots: tuple[pathlib.Path, pathlib.Path]) -> None:
    data, out = roots
    srv = ServerThread(_registry(), ServerSettings(
        port=0, harvest_data_root=str(data), harvest_output_root=str(out / "quota"), harvest_max_bytes_per_principal=4096,
    )).start()
    try:
        async with hookwire.connect(srv.target) as client:
            job = await client.harvest("tiny-lm", "model.layers.*", out="big", shard_tokens=16, **OPTIONS)
            with pytest.raises(hookwire.HarvestFailed, match="harvest_max_bytes_per_principal"):
                await job.wait()
            assert job.last is not None and job.last.shards_written >= 1
            with pytest.raises(hookwire.ResourceExhaustedError, match="harvest_max_bytes_per_principal"):
                await client.harvest("tiny-lm", "model.norm", out="more", **OPTIONS)
    finally:
        srv.stop()


@pytest.mark.asyncio
async def test_a_server_without_harvest_storage_says_what_to_do() -> None:
    srv = ServerThread(_registry(), ServerSettings(port=0)).start()
    try:
        async with hookwire.connect(srv.target) as client:
            with pytest.raises(hookwire.FailedPreconditionError, match="harvest_output_root.*--sink client"):
                await client.harvest("tiny-lm", "model.norm", out="x", **OPTIONS)
    finally:
        srv.stop()


def test_status_codes_over_raw_grpc(secured: ServerThread) -> None:
    from hookwire.v1 import harvest_service_pb2 as hv
    from hookwire.v1 import harvest_service_pb2_grpc as hv_grpc

    with grpc.insecure_channel(secured.target) as channel:
        stub = hv_grpc.HarvestServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.ListHarvests(hv.ListHarvestsRequest())
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        md = bearer(TOKENS["viewer"])
        with pytest.raises(grpc.RpcError) as info:
            stub.StartHarvest(hv.StartHarvestRequest(model="tiny-lm"), metadata=md)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as info:
            list(stub.WatchHarvest(hv.WatchHarvestRequest(job_id="hv-00", interval_ms=10), metadata=md))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "interval_ms" in (info.value.details() or "")
