"""Named operands (OperandService, issue 25) end to end, on real servers over loopback:
names per principal and the operator's view (auth on), a harvest job holding what its
rules name, a fleet's all-or-nothing upload, lifetimes (session, TTL, ended but held by a
hook), quotas and uploads that are refused or cut short.

The oracle for "a rule uses this tensor" is in-process torch: the demo MLP's output plus
the tensor, bit for bit. Nothing here waits for a time to pass before asserting: what
happens later (a TTL, a session's end seen by the server) is polled for (support.until,
a hang guard), and a harvest job is kept from running by holding its model's scheduler.
"""

from __future__ import annotations

import asyncio
import pathlib
from typing import Any, AsyncIterator

import grpc
import pytest
import torch

import hookwire
from hookwire import rules
from hookwire.v1 import operand_service_pb2 as op_pb2
from hookwire.v1 import tensor_pb2
from hookwire.wire import codec
from hookwire_server import ModelHost, ModelRegistry
from hookwire_server.auth import hash_token
from hookwire_server.demo_models import mlp, tiny_lm, tiny_lm_tokenizer
from support import PROCESS_LIVENESS, ServerThread, read_dataset, until

TOKENS = {name: f"hwt_operands_{name}" for name in ("alice", "bob", "operator")}
ROLE = {"alice": "user", "bob": "user", "operator": "operator"}
LINES = "\n".join(f"{name}:{ROLE[name]}:{hash_token(token)}" for name, token in TOKENS.items())
X = torch.randn(3, 8, generator=torch.Generator().manual_seed(11))
LOCAL_MLP = mlp()


def _vector(seed: int, n: int = 4) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _steered(v: torch.Tensor) -> torch.Tensor:
    """The oracle: the demo MLP's output plus ``v``, in process."""
    with torch.no_grad():
        return LOCAL_MLP(X) + v


def _add(name: str) -> hookwire.HookSpec:
    """A request-scoped hook adding operand ``name`` to the MLP's output."""
    return hookwire.HookSpec("out", posthook=[rules.add("output", rules.operand(name))])


async def _infer_with(client: hookwire.Client, name: str) -> torch.Tensor:
    return (await client.model("mlp").infer(X, hooks=[_add(name)])).output


def _connect(srv: ServerThread, who: str | None = None) -> hookwire.Client:
    return hookwire.connect(srv.target, options=hookwire.ConnectOptions(token=TOKENS[who] if who else ""))


async def _names(client: hookwire.Client) -> dict[str, hookwire.OperandInfo]:
    return {op.name: op for op in await client.list_operands()}


async def _total_bytes(client: hookwire.Client) -> int:
    reply = await client.operand_stub.ListOperands(op_pb2.ListOperandsRequest())
    return int(reply.total_bytes)


def _chunked_header(name: str, n: int, *, ttl: int = 600) -> op_pb2.UploadOperandRequest:
    """The header of a float32 [n] tensor upload whose data comes in chunk 1."""
    return op_pb2.UploadOperandRequest(operand=op_pb2.OperandUpload(
        name=name, ttl_seconds=ttl, tensor=tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_FLOAT32, shape=[n], chunk_id=1)))


# ------------------------------------------------------------------ principals


async def test_names_are_per_principal_and_operators_see_and_delete_everyones(make_server) -> None:
    srv = make_server(tokens=LINES)
    alice_v, bob_v = _vector(1), _vector(2)
    async with _connect(srv, "alice") as alice, _connect(srv, "bob") as bob, _connect(srv, "operator") as operator:
        info = await alice.upload_operand("v", alice_v)
        assert (info.name, info.kind, info.owner, info.dtype, info.shape) == ("v", "tensor", "alice", "float32", (4,))
        assert info.session_id == alice.session_id and not info.ended

        # bob cannot see or use alice's "v".
        with pytest.raises(hookwire.NotFoundError, match="'v'"):
            await _infer_with(bob, "v")
        assert "v" not in await _names(bob)
        with pytest.raises(hookwire.NotFoundError):
            await bob.delete_operand("v")

        # bob's own "v": a name per principal; each rule uses its own principal's tensor.
        mine = await bob.upload_operand("v", bob_v, ttl=600)
        assert mine.owner == "bob" and mine.expires is not None
        assert torch.equal(await _infer_with(bob, "v"), _steered(bob_v))
        assert torch.equal(await _infer_with(alice, "v"), _steered(alice_v))
        assert [(op.owner, op.name) for op in await bob.list_operands()] == [("bob", "v")]
        assert [(op.owner, op.name) for op in await alice.list_operands()] == [("alice", "v")]

        # The operator sees both, with their owners, and has no "v" of its own to use.
        assert [(op.owner, op.name) for op in await operator.list_operands()] == [("alice", "v"), ("bob", "v")]
        with pytest.raises(hookwire.NotFoundError):
            await _infer_with(operator, "v")

        # A user may not delete another principal's operand; the operator may.
        with pytest.raises(hookwire.PermissionDeniedError, match="operator"):
            await bob.delete_operand("v", owner="alice")
        with pytest.raises(hookwire.PermissionDeniedError, match="operator"):
            await alice.delete_operand("v", owner="bob")
        assert "v" in await _names(alice)
        assert await operator.delete_operand("v", owner="alice") == alice_v.numel() * 4
        assert "v" not in await _names(alice)
        with pytest.raises(hookwire.NotFoundError):
            await _infer_with(alice, "v")
        # bob's is untouched.
        assert [(op.owner, op.name) for op in await operator.list_operands()] == [("bob", "v")]
        assert torch.equal(await _infer_with(bob, "v"), _steered(bob_v))
        with pytest.raises(hookwire.NotFoundError):
            await operator.delete_operand("v", owner="alice")


# ------------------------------------------------------------------ harvest jobs hold their operands


@pytest.fixture
def harvest_server(make_server, tmp_path: pathlib.Path) -> ServerThread:
    out = tmp_path / "out"
    data = tmp_path / "data"
    out.mkdir()
    data.mkdir()
    registry = ModelRegistry([ModelHost("tiny-lm", tiny_lm(), tokenizer=tiny_lm_tokenizer())])
    return make_server(registry, harvest_data_root=str(data), harvest_output_root=str(out))


HARVEST = dict(tokens=torch.randint(3, 300, (4, 8), generator=torch.Generator().manual_seed(3)), length=8,
               batch_size=2)


async def test_a_harvest_job_holds_the_operands_its_rules_name_until_it_ends(harvest_server: ServerThread) -> None:
    srv = harvest_server
    out = pathlib.Path(srv.server.settings.harvest_output_root)
    v = torch.randn(64, generator=torch.Generator().manual_seed(4))

    def steer(value: Any) -> list[hookwire.HookSpec]:
        return [hookwire.HookSpec("model.layers.0.mlp", posthook=[rules.add("output", value)])]

    scheduler = srv.call(lambda: srv.server.engines.scheduler(srv.server.registry.get("tiny-lm")))
    async with _connect(srv) as client:
        await client.upload_operand("v", v, ttl=600)
        with pytest.raises(hookwire.NotFoundError, match="'nope'"):
            await client.harvest("tiny-lm", "model.norm", out="missing", rules=steer(rules.operand("nope")), **HARVEST)

        srv.call(scheduler.hold)  # the job cannot run a batch: it stays active, whatever the machine's speed
        try:
            job = await client.harvest("tiny-lm", "model.norm", out="named", rules=steer(rules.operand("v")), **HARVEST)
            assert (await job.refresh()).state in ("pending", "running")
            assert (await _names(client))["v"].used_by == (f"harvest job {job.id}",)
            with pytest.raises(hookwire.FailedPreconditionError, match=f"harvest job {job.id}"):
                await client.delete_operand("v")
        finally:
            srv.call(scheduler.release)
        done = await asyncio.wait_for(job.wait(), PROCESS_LIVENESS)
        assert done.state == "succeeded"
        # The job let it go as it ended.
        assert (await _names(client))["v"].used_by == ()

        # The named operand steered the job exactly as the same tensor inline does, and it did steer.
        inline = await client.harvest("tiny-lm", "model.norm", out="inline", rules=steer(v), **HARVEST)
        plain = await client.harvest("tiny-lm", "model.norm", out="plain", **HARVEST)
        assert (await asyncio.wait_for(inline.wait(), PROCESS_LIVENESS)).state == "succeeded"
        assert (await asyncio.wait_for(plain.wait(), PROCESS_LIVENESS)).state == "succeeded"
        named_ds, inline_ds, plain_ds = (read_dataset(out / name) for name in ("named", "inline", "plain"))
        assert torch.equal(named_ds["model.norm"], inline_ds["model.norm"])
        assert not torch.equal(named_ds["model.norm"], plain_ds["model.norm"])

        # A start refused after its rules were compiled (the finished dataset is ALREADY_EXISTS)
        # holds nothing.
        with pytest.raises(hookwire.AlreadyExistsError):
            await client.harvest("tiny-lm", "model.norm", out="named", rules=steer(rules.operand("v")), **HARVEST)
        assert (await _names(client))["v"].used_by == ()
        assert await client.delete_operand("v") == v.numel() * 4
        assert "v" not in await _names(client)


# ------------------------------------------------------------------ fleet


async def test_a_fleet_upload_is_all_or_nothing_and_a_fleet_delete_is_everywhere(make_server) -> None:
    v = _vector(5, 1024)  # 4 KiB
    small = make_server(max_operand_bytes_per_principal=1000)
    roomy = make_server()
    async with hookwire.connect_fleet([roomy.target, small.target]) as fleet:
        with pytest.raises(hookwire.ResourceExhaustedError, match="max_operand_bytes_per_principal") as refused:
            await fleet.upload_operand("v", v, ttl=600)
        assert small.target in str(refused.value)
    for srv in (roomy, small):
        async with _connect(srv) as plain:
            assert await plain.list_operands() == [], srv.target  # rolled back on the replica that took it
            assert await _total_bytes(plain) == 0

    w = _vector(6)
    first, second = make_server(allow_shared_rules=True), make_server(allow_shared_rules=True)
    async with hookwire.connect_fleet([first.target, second.target]) as fleet:
        info = await fleet.upload_operand("w", w, ttl=600)
        assert (info.name, info.shape) == ("w", (4,))
        hook = await fleet.model("mlp").hook("out", posthook=[rules.add("output", rules.operand("w"))], scope="all")
        for srv in (first, second):
            async with _connect(srv) as plain:
                listed = await _names(plain)
                assert list(listed) == ["w"] and listed["w"].expires is not None
                assert listed["w"].used_by == (f"hook {hook.handles[srv.target].id}",)
                assert torch.equal(await plain.model("mlp")(X), _steered(w)), srv.target
        with pytest.raises(hookwire.FailedPreconditionError, match="in use by hook"):
            await fleet.delete_operand("w")
        await hook.remove()
        for srv in (first, second):  # a refused delete kept it on every replica
            async with _connect(srv) as plain:
                assert "w" in await _names(plain)
        await fleet.upload_operand("w", w, ttl=600)  # the fleet takes it again (a replica's copy is replaced)
        await fleet.delete_operand("w")
        for srv in (first, second):
            async with _connect(srv) as plain:
                assert await plain.list_operands() == []
                assert torch.equal(await plain.model("mlp")(X), _steered(torch.zeros(4)))


async def test_a_fleet_operand_whose_delete_was_refused_still_reaches_a_joining_replica(make_server) -> None:
    # FleetClient.delete_operand: "FailedPreconditionError from the first that still uses
    # it in a hook: it is then kept everywhere it is left". A replica that joins later gets
    # the fleet's hooks, and the hook names the operand: it must get the operand too.
    w = _vector(18)
    first, second = make_server(allow_shared_rules=True), make_server(allow_shared_rules=True)
    targets = [first.target]
    async with hookwire.connect_fleet(lambda: list(targets), refresh_seconds=3600) as fleet:
        await fleet.upload_operand("w", w, ttl=600)
        hook = await fleet.model("mlp").hook("out", posthook=[rules.add("output", rules.operand("w"))], scope="all")
        with pytest.raises(hookwire.FailedPreconditionError, match="in use by hook"):
            await fleet.delete_operand("w")
        targets.append(second.target)
        await fleet.refresh()
        assert fleet.replicas == {first.target: True, second.target: True}, fleet.notices
        async with _connect(second) as plain:
            assert (await _names(plain))["w"].used_by == (f"hook {hook.handles[second.target].id}",)
            assert torch.equal(await plain.model("mlp")(X), _steered(w))


# ------------------------------------------------------------------ lifetimes


async def test_a_session_operand_ends_with_its_session_and_a_ttl_one_outlives_it(make_server) -> None:
    srv = make_server()
    s, t = _vector(7), _vector(8)
    async with _connect(srv) as other:
        async with _connect(srv) as owner:
            info = await owner.upload_operand("s", s)
            assert info.session_id == owner.session_id != "" and info.expires is None
            await owner.upload_operand("t", t, ttl=600)
            # A hook of the session names its operand: both end with the session.
            hook = await owner.model("mlp").hook("fc1", posthook=[rules.add("output", rules.operand("s"), index="[..., :4]")])
            assert (await _names(other))["s"].used_by == (f"hook {hook.id}",)
            # Names are the principal's (auth is off: everyone is "anonymous"), not the session's.
            assert torch.equal(await _infer_with(other, "s"), _steered(s))
        # The owner's session is over once the server has seen its stream end.
        await until(lambda: srv.call(lambda: srv.server.hooks.session_count) == 0, "the owner's session closed")
        await until(lambda: _absent(other, "s"), "the session operand freed")
        with pytest.raises(hookwire.NotFoundError, match="'s'"):
            await _infer_with(other, "s")
        listed = await _names(other)
        assert not listed["t"].ended and listed["t"].session_id == ""
        assert torch.equal(await _infer_with(other, "t"), _steered(t))


async def _absent(client: hookwire.Client, name: str) -> bool:
    return name not in await _names(client)


async def test_a_ttl_operand_is_freed_once_its_ttl_passed(make_server) -> None:
    srv = make_server()
    v = _vector(9)
    async with _connect(srv) as client:
        info = await client.upload_operand("brief", v, ttl=1)
        assert info.expires is not None and info.session_id == ""
        await until(lambda: _absent(client, "brief"), "the TTL operand freed")
        with pytest.raises(hookwire.NotFoundError, match="'brief'"):
            await _infer_with(client, "brief")
        assert await _total_bytes(client) == 0
        await client.upload_operand("brief", v, ttl=600)  # the name is free again


async def test_an_ended_operand_lives_on_for_the_hook_that_holds_it(make_server) -> None:
    srv = make_server(allow_shared_rules=True)
    w = _vector(10)
    async with _connect(srv) as other:
        async with _connect(srv) as owner:
            await owner.upload_operand("w", w)  # lives with owner's session
            hook = await owner.register_hook(hookwire.HookSpec(
                "out", posthook=[rules.add("output", rules.operand("w"))], scope="all", ttl_seconds=600, model="mlp"))
            assert hook.info.session_id == ""
        await until(lambda: _ended(other, "w"), "the operand ended with its session")
        held = (await _names(other))["w"]
        assert held.used_by == (f"hook {hook.id}",) and held.ended
        # The hook still uses it: a call of anyone's is steered by it ...
        assert torch.equal(await other.model("mlp")(X), _steered(w))
        # ... but a new reference, and a delete, are refused.
        with pytest.raises(hookwire.FailedPreconditionError, match="has ended"):
            await _infer_with(other, "w")
        with pytest.raises(hookwire.FailedPreconditionError, match="has ended"):
            await other.register_hook(hookwire.HookSpec(
                "fc1", posthook=[rules.add("output", rules.operand("w"))], scope="all", ttl_seconds=600, model="mlp"))
        with pytest.raises(hookwire.FailedPreconditionError, match=f"hook {hook.id}"):
            await other.delete_operand("w")
        with pytest.raises(hookwire.AlreadyExistsError):
            await other.upload_operand("w", w, ttl=600)  # the name is still taken
        # The refused registration above did not hold it: deregistering the one hook frees it.
        assert (await _names(other))["w"].used_by == (f"hook {hook.id}",)
        assert await other.deregister_hook(hook.id)
        await until(lambda: _absent(other, "w"), "the ended operand freed by its last hook's end")
        assert await _total_bytes(other) == 0
        with pytest.raises(hookwire.NotFoundError):
            await _infer_with(other, "w")
        assert torch.equal(await other.model("mlp")(X), _steered(torch.zeros(4)))


async def _ended(client: hookwire.Client, name: str) -> bool:
    listed = await _names(client)
    return name in listed and listed[name].ended


# ------------------------------------------------------------------ quotas and bad uploads


async def test_quotas_are_checked_before_any_data(make_server) -> None:
    big = _vector(11, 1024)  # 4 KiB
    async with _connect(make_server(max_operand_bytes_per_principal=1000)) as client:
        with pytest.raises(hookwire.ResourceExhaustedError, match="max_operand_bytes_per_principal"):
            await client.upload_operand("big", big, ttl=600)
        assert await client.list_operands() == [] and await _total_bytes(client) == 0
        await client.upload_operand("fits", _vector(12, 200), ttl=600)  # 800 bytes
        with pytest.raises(hookwire.ResourceExhaustedError, match="max_operand_bytes_per_principal"):
            await client.upload_operand("more", _vector(13, 100), ttl=600)  # 1200 with this one
        assert list(await _names(client)) == ["fits"]
    async with _connect(make_server(max_operands_per_principal=1)) as client:
        await client.upload_operand("one", _vector(14), ttl=600)
        with pytest.raises(hookwire.ResourceExhaustedError, match="max_operands_per_principal"):
            await client.upload_operand("two", _vector(15), ttl=600)
        await client.delete_operand("one")
        await client.upload_operand("two", _vector(15), ttl=600)
    async with _connect(make_server(max_operand_bytes=1000)) as client:
        with pytest.raises(hookwire.ResourceExhaustedError, match="max_operand_bytes\\b"):
            await client.upload_operand("big", big, ttl=600)


async def test_bad_uploads_are_invalid_argument_or_already_exists(make_server) -> None:
    v = _vector(16)
    async with _connect(make_server()) as client:
        await client.upload_operand("v", v, ttl=600)
        with pytest.raises(hookwire.AlreadyExistsError, match="'v'"):
            await client.upload_operand("v", v, ttl=600)
        with pytest.raises(hookwire.AlreadyExistsError, match="'v'"):
            await client.upload_operand("v", v)  # session or TTL: the name is the principal's
        for name in ("../x", "", "/x", ".hidden", "a//b", "sp ace", "x" * 300):
            with pytest.raises(hookwire.InvalidArgumentError, match="name"):
                await client.upload_operand(name, v, ttl=600)
        nan = v.clone()
        nan[2] = float("nan")
        for bad in (nan, torch.tensor([1.0, float("inf")]), torch.arange(4), torch.ones(3, dtype=torch.bool)):
            with pytest.raises(hookwire.InvalidArgumentError, match="finite floating-point"):
                await client.upload_operand("bad", bad, ttl=600)
        # Neither session nor TTL, or both: refused (the raw stub: the SDK always sets one).
        for header in (op_pb2.OperandUpload(name="raw", tensor=codec.encode_tensor(v)),
                       op_pb2.OperandUpload(name="raw", ttl_seconds=5, session_id="s_none",
                                            tensor=codec.encode_tensor(v))):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.operand_stub.UploadOperand(_messages(op_pb2.UploadOperandRequest(operand=header)))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        # Another principal's session (here: one that does not exist) is not the caller's.
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.operand_stub.UploadOperand(_messages(op_pb2.UploadOperandRequest(operand=op_pb2.OperandUpload(
                name="raw", session_id="s_none", tensor=codec.encode_tensor(v)))))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND, info.value.details()
        assert list(await _names(client)) == ["v"]
        assert await _total_bytes(client) == v.numel() * 4


async def test_uploading_a_reference_is_a_value_error_in_the_caller(make_server) -> None:
    # upload_messages raises ValueError for a reference (rules.operand, Sae.named) or a
    # value that is no tensor; Client.upload_operand should raise it to its caller (as
    # the SDK's other argument checks do), before any call is made, and leave nothing behind.
    async with _connect(make_server()) as client:
        for value in (rules.operand("v"), rules.Sae.named("v")):
            with pytest.raises(ValueError, match="reference"):
                await client.upload_operand("ref", value, ttl=600)
        assert await client.list_operands() == [] and await _total_bytes(client) == 0


async def _messages(*messages: Any, gate: asyncio.Event | None = None) -> AsyncIterator[Any]:
    for message in messages:
        yield message
    if gate is not None:
        await gate.wait()


async def test_an_upload_cut_short_frees_its_claim_and_its_name(make_server) -> None:
    n = 1 << 20  # 4 MiB of float32
    async with _connect(make_server(max_operand_bytes_per_principal=6 << 20)) as client:
        # Header only, then the stream ends: INVALID_ARGUMENT, and nothing is left behind.
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.operand_stub.UploadOperand(_messages(_chunked_header("big", n)))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "before every chunked tensor was complete" in info.value.details()
        assert await _total_bytes(client) == 0 and await client.list_operands() == []

        # Half the data, then the end: the same.
        half = tensor_pb2.TensorChunk(chunk_id=1, offset=0, data=bytes(2 << 20))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.operand_stub.UploadOperand(_messages(_chunked_header("big", n),
                                                              op_pb2.UploadOperandRequest(chunk=half)))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert await _total_bytes(client) == 0

        # An upload in progress counts against the quota (and holds its name) from its header on.
        gate = asyncio.Event()
        pending = asyncio.ensure_future(client.operand_stub.UploadOperand(_messages(_chunked_header("big", n), gate=gate)))
        try:
            await until(lambda: _total_bytes_is(client, n * 4), "the pending upload's claim counted")
            with pytest.raises(hookwire.ResourceExhaustedError, match="max_operand_bytes_per_principal"):
                await client.upload_operand("other", torch.zeros(n), ttl=600)
            with pytest.raises(hookwire.AlreadyExistsError, match="'big'"):
                await client.upload_operand("big", torch.zeros(4), ttl=600)
            assert not pending.done()
        finally:
            gate.set()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await pending
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert await _total_bytes(client) == 0

        # The name and the bytes are free: the whole upload (1 MiB chunks, by the SDK) succeeds.
        full = torch.randn(n, generator=torch.Generator().manual_seed(17))
        info_ = await client.upload_operand("big", full, ttl=600)
        assert info_.nbytes == n * 4 and info_.shape == (n,)
        assert await _total_bytes(client) == n * 4
        # Its data is what was sent: a rule adding it to a [*, n] input gives input + full.
        srv_out = await client.model("scale").infer(torch.zeros(1, n), hooks=[hookwire.HookSpec(
            "", posthook=[rules.add("output", rules.operand("big"))])])
        assert torch.equal(srv_out.output, (torch.zeros(1, n) * 2) + full)


async def _total_bytes_is(client: hookwire.Client, n: int) -> bool:
    return await _total_bytes(client) == n
