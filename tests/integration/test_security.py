"""Authentication, roles, ownership, TLS and mTLS, against real servers."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import threading
from typing import Any, AsyncIterator, Iterator

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hookwire
from certs import make_pki
from hookwire.wire import codec
from hookwire.v1 import (
    harvest_service_pb2,
    harvest_service_pb2_grpc,
    hook_pb2,
    hook_service_pb2,
    hook_service_pb2_grpc,
    model_service_pb2,
    model_service_pb2_grpc,
    operand_service_pb2,
    operand_service_pb2_grpc,
    tensor_pb2,
)
from hookwire_server import HookwireServer, ServerSettings
from hookwire_server.auth import MINIMUM_ROLE, ROLES, hash_token
from hookwire_server.api.security import AuthInterceptor
from hookwire_server.api.servicers import HarvestServicer, HookServicer, ModelServicer, OperandServicer, add_to_server
from support import LIVENESS, ServerThread, bearer, build_test_registry, collect, serving, until

TOKENS = {name: f"hwt_test_{name}" for name in ("viewer", "alice", "bob", "observer", "operator")}
ROLE = {"viewer": "viewer", "alice": "user", "bob": "user", "observer": "observer", "operator": "operator"}
LINES = "\n".join(f"{name}:{ROLE[name]}:{hash_token(token)}" for name, token in TOKENS.items())
X = torch.randn(1, 8)


@pytest.fixture(scope="module")
def secured() -> Iterator[ServerThread]:
    with serving(tokens=LINES, allow_shared_rules=True) as srv:
        yield srv


def _connect(srv: ServerThread, who: str | None) -> hookwire.Client:
    return hookwire.connect(srv.target, options=hookwire.ConnectOptions(token=TOKENS[who] if who else ""))


async def test_missing_or_wrong_credentials_are_unauthenticated(secured) -> None:
    async with _connect(secured, None) as anonymous:
        with pytest.raises(hookwire.UnauthenticatedError, match="missing credentials"):
            await anonymous.list_models()
        with pytest.raises(hookwire.UnauthenticatedError):
            await anonymous.model("mlp")(X)
    async with hookwire.connect(secured.target, options=hookwire.ConnectOptions(token="hwt_wrong")) as wrong:
        with pytest.raises(hookwire.UnauthenticatedError, match="not valid"):
            await wrong.list_models()
        with pytest.raises(hookwire.UnauthenticatedError):
            await wrong.session()  # streams too
    cli = subprocess.run([sys.executable, "-m", "hookwire._cli", "health", secured.target],
                         capture_output=True, text=True, timeout=30)
    assert cli.returncode == 0, "health stays open for probes"


async def test_roles(secured) -> None:
    async with _connect(secured, "viewer") as viewer:
        assert any(m.name == "mlp" for m in await viewer.list_models())
        with pytest.raises(hookwire.PermissionDeniedError, match="Infer needs the user role; 'viewer' has viewer"):
            await viewer.model("mlp")(X)
    async with _connect(secured, "alice") as alice:
        await alice.model("mlp")(X)
        async with alice.model("mlp").hook("fc1", posthook=[hookwire.rules.zero("output")]):
            await alice.model("mlp")(X)
        with pytest.raises(hookwire.PermissionDeniedError, match="needs the observer role"):
            await alice.model("mlp").hook("fc1", posthook=hookwire.capture("output"), scope="all")
    async with _connect(secured, "observer") as observer:
        async with observer.model("mlp").hook("fc1", posthook=hookwire.capture("output"), scope="all"):
            pass
        with pytest.raises(hookwire.PermissionDeniedError, match="needs the operator role"):
            await observer.model("mlp").hook("fc1", posthook=[hookwire.rules.zero("output")], scope="all")
        # A monitor without a session is an observer's (capture only); rules and stop stay the operator's.
        monitor = await observer.model("mlp").hook("fc1", posthook=hookwire.capture(), scope="all", ttl_seconds=60)
        async with observer.subscribe([monitor.id]):
            pass
        assert await monitor.remove()
        with pytest.raises(hookwire.PermissionDeniedError,
                           match="rules on a hook without a session \\(an observer's may only capture\\) needs the "
                                 "operator role; 'observer' has observer"):
            await observer.model("mlp").hook("fc1", posthook=[hookwire.rules.signal("output", "n", hookwire.rules.norm())],
                                             scope="all", ttl_seconds=60)
        with pytest.raises(hookwire.PermissionDeniedError,
                           match="rules that change or fail other callers' calls needs the operator role"):
            await observer.model("mlp").hook(
                "fc1", posthook=[hookwire.rules.stop("output", hookwire.rules.norm() > 4.0)],
                scope="all", ttl_seconds=60)
    async with _connect(secured, "alice") as alice:
        with pytest.raises(hookwire.PermissionDeniedError, match="needs the observer role; 'alice' has user"):
            await alice.model("mlp").hook("fc1", posthook=hookwire.capture(), scope="all", ttl_seconds=60)
    async with _connect(secured, "operator") as operator:
        handle = await operator.model("mlp").hook("fc1", posthook=[hookwire.rules.scale("output", 1.0)], scope="all",
                                                  ttl_seconds=60)
        assert await handle.remove()


async def test_ownership(secured) -> None:
    async with _connect(secured, "alice") as alice, _connect(secured, "bob") as bob, \
            _connect(secured, "operator") as operator:
        mine = await alice.model("mlp").hook("fc1", posthook=[hookwire.rules.save("output", "s")])
        await alice.model("mlp")(X)
        # bob sees nothing of alice's, and cannot touch it.
        assert mine.id not in [h.hook_id for h in await bob.list_hooks()]
        assert await bob.deregister_hook(mine.id) is False
        with pytest.raises(hookwire.NotFoundError):
            async with bob.subscribe([mine.id]):
                pass
        stub = bob.model_stub
        from hookwire.v1 import hook_service_pb2, model_service_pb2
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Infer(model_service_pb2.InferRequest(model="mlp", session_id=alice.session_id,
                                                           args=[hookwire.wire.codec.encode_value(X)]))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await bob.hook_stub.GetSlot(hook_service_pb2.GetSlotRequest(session_id=alice.session_id, name="s"))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        # alice sees her own; the operator sees and removes anyone's.
        assert [h.hook_id for h in await alice.list_hooks()] == [mine.id]
        assert mine.id in [h.hook_id for h in await operator.list_hooks()]
        assert await operator.deregister_hook(mine.id) is True


async def test_tokens_reload_on_sighup(tmp_path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice:user:{hash_token('first')}\n")
    proc = subprocess.Popen([sys.executable, "-m", "hookwire._cli", "serve", "--port", "0", "--tokens-file", str(tokens)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        target = proc.stdout.readline().rsplit(" ", 1)[-1].strip()
        assert "tokens required" in proc.stdout.readline() + proc.stdout.readline()
        async with hookwire.connect(target, options=hookwire.ConnectOptions(token="second")) as c:
            with pytest.raises(hookwire.UnauthenticatedError):
                await c.list_models()
            tokens.write_text(f"alice:user:{hash_token('second')}\n")
            proc.send_signal(signal.SIGHUP)
            for _ in range(600):  # up to 60 s: a hang guard
                try:
                    await c.list_models()
                    break
                except hookwire.UnauthenticatedError:
                    await asyncio.sleep(0.1)
            else:
                pytest.fail("the new token was not accepted after SIGHUP")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_non_loopback_without_auth_needs_insecure() -> None:
    refused = subprocess.run([sys.executable, "-m", "hookwire._cli", "serve", "--host", "0.0.0.0", "--port", "0"],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "refusing to listen on 0.0.0.0 without authentication" in refused.stderr
    proc = subprocess.Popen([sys.executable, "-m", "hookwire._cli", "serve", "--host", "0.0.0.0", "--port", "0", "--insecure"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert "serving" in proc.stdout.readline()
        lines = proc.stdout.readline() + proc.stdout.readline()
        assert "NO authentication" in lines
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


async def test_tls_and_mtls_with_certificate_principals(tmp_path) -> None:
    pki = make_pki(tmp_path, ["svc-operator", "stranger"])
    tokens = tmp_path / "principals.toml"
    tokens.write_text(
        '[[principals]]\nname = "svc-operator"\nroles = ["operator"]\ncert_subject = "CN=svc-operator"\n'
        f'[[principals]]\nname = "alice"\nroles = ["user"]\ntoken_sha256 = "{hash_token("alice-token")}"\n'
    )
    settings = ServerSettings(port=0, tokens_file=str(tokens), tls_cert=str(pki["server_cert"]),
                              tls_key=str(pki["server_key"]), tls_client_ca=str(pki["ca"]))
    srv = ServerThread(build_test_registry(), settings).start()
    try:
        tls = dict(tls_ca=str(pki["ca"]))
        async with hookwire.connect(srv.target, options=hookwire.ConnectOptions(
                tls_cert=str(pki["svc-operator_cert"]), tls_key=str(pki["svc-operator_key"]), **tls)) as svc:
            handle = await svc.model("mlp").hook("fc1", posthook=hookwire.capture(), scope="all", ttl_seconds=30)
            assert await handle.remove()  # an operator, by its certificate alone
        async with hookwire.connect(srv.target, options=hookwire.ConnectOptions(
                token="alice-token", tls_cert=str(pki["stranger_cert"]), tls_key=str(pki["stranger_key"]), **tls)) as alice:
            await alice.model("mlp")(X)  # a token over mTLS
        async with hookwire.connect(srv.target, options=hookwire.ConnectOptions(
                tls_cert=str(pki["stranger_cert"]), tls_key=str(pki["stranger_key"]), **tls)) as stranger:
            with pytest.raises(hookwire.UnauthenticatedError):
                await stranger.list_models()  # a valid certificate of nobody configured
        async with hookwire.connect(srv.target, options=hookwire.ConnectOptions(
                token="alice-token", timeout=5, **tls)) as no_cert:
            with pytest.raises(hookwire.UnavailableError):
                await no_cert.list_models()  # the handshake needs a client certificate
        async with hookwire.connect(srv.target, options=hookwire.ConnectOptions(token="alice-token", timeout=5)) as plain:
            with pytest.raises(hookwire.UnavailableError):
                await plain.list_models()  # plaintext to a TLS port
    finally:
        srv.stop()


@pytest.fixture
def budgeted() -> Iterator[ServerThread]:
    settings = ServerSettings(port=0, tokens=LINES, max_buffered_bytes_per_principal=50 * 1024 * 1024)
    with serving(settings=settings) as srv:
        yield srv


async def test_one_principal_cannot_take_every_stream_buffer(budgeted) -> None:
    async with _connect(budgeted, "alice") as a1, _connect(budgeted, "alice") as a2, _connect(budgeted, "bob") as bob:
        await a1.session()  # 32 MiB buffer
        with pytest.raises(hookwire.ResourceExhaustedError, match="max_buffered_bytes_per_principal"):
            await a2.session()
        await bob.session()  # others are not affected


async def _unread_block_capture(stub: hook_service_pb2_grpc.HookServiceStub, metadata: Any) -> tuple[Any, str]:
    """A BLOCK session of one event that nobody reads, with a hook capturing every call of
    "scale" (scope all): the session stream and its id."""
    stream = stub.OpenSession(hook_service_pb2.OpenSessionRequest(delivery=hook_service_pb2.DeliveryOptions(
        policy=hook_service_pb2.DELIVERY_POLICY_BLOCK, max_events=1)), metadata=metadata)
    session_id = (await stream.read()).opened.session_id
    await stub.RegisterHook(hook_service_pb2.RegisterHookRequest(session_id=session_id, spec=hook_pb2.HookSpec(
        model="scale", module="", scope=hook_pb2.SCOPE_ALL,
        posthook=hook_pb2.HookAction(capture=[hook_pb2.PART_OUTPUT]))), metadata=metadata)
    return stream, session_id


async def test_an_observer_that_stops_reading_cannot_stall_other_callers(secured) -> None:
    metadata = bearer(TOKENS["observer"])
    async with grpc.aio.insecure_channel(secured.target) as channel:
        stub = hook_service_pb2_grpc.HookServiceStub(channel)
        stream, session_id = await _unread_block_capture(stub, metadata)
        observed = secured.call(lambda: secured.server.hooks._sessions[session_id].stream)
        async with _connect(secured, "alice") as alice:
            x = torch.ones(1 << 20)  # 4 MiB events: they would fill any buffer quickly
            for _ in range(30):
                out = await asyncio.wait_for(alice.model("scale")(x), LIVENESS)  # a hang guard: never held
                assert torch.equal(out, x * 2)
        # The observer's stream filled up and dropped alice's events rather than hold her passes.
        assert secured.call(lambda: observed.dropped) > 0
        assert secured.call(lambda: observed.waiting_producers) == 0
        stream.cancel()


async def test_an_operator_cannot_put_hooks_into_someone_elses_session(secured) -> None:
    async with _connect(secured, "alice") as alice, _connect(secured, "operator") as operator:
        await alice.session()
        from hookwire.v1 import hook_pb2, hook_service_pb2

        with pytest.raises(grpc.aio.AioRpcError) as info:
            await operator.hook_stub.RegisterHook(hook_service_pb2.RegisterHookRequest(
                session_id=alice.session_id, spec=hook_pb2.HookSpec(
                    model="mlp", module="fc1", posthook=hook_pb2.HookAction())))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert (await alice.model("mlp")(X)).shape == (1, 4)


async def test_revoked_principals_lose_their_sessions_and_hooks(tmp_path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice:user:{hash_token('a')}\nbob:user:{hash_token('b')}\n")
    srv = ServerThread(build_test_registry(), ServerSettings(port=0, tokens_file=str(tokens))).start()
    try:
        async with hookwire.connect(srv.target, options=hookwire.ConnectOptions(token="a")) as alice, \
                hookwire.connect(srv.target, options=hookwire.ConnectOptions(token="b")) as bob:
            await alice.model("mlp").hook("fc1", posthook=hookwire.capture())
            await bob.model("mlp").hook("fc1", posthook=hookwire.capture())
            session = await alice.session()
            tokens.write_text(f"bob:user:{hash_token('b')}\n")
            ended = srv.call(lambda: (srv.server.tokens.reload(), srv.server.hooks.reauthorize(srv.server.tokens)))
            assert ended[1] >= 1
            for _ in range(3000):  # up to 60 s: a hang guard
                if session.ended:
                    break
                await asyncio.sleep(0.02)
            assert isinstance(session.router.error, hookwire.UnavailableError) and "revoked" in str(session.router.error)
            with pytest.raises(hookwire.UnauthenticatedError):
                await alice.model("mlp")(X)
            assert len(await bob.list_hooks()) == 1
    finally:
        srv.stop()


# ---------------------------------------------------------------- early refusal (issue #9, item 3)

MIB = 1 << 20
RPC_NAMES = {m.name for service in (model_service_pb2.DESCRIPTOR.services_by_name["ModelService"],
                                    hook_service_pb2.DESCRIPTOR.services_by_name["HookService"],
                                    harvest_service_pb2.DESCRIPTOR.services_by_name["HarvestService"],
                                    operand_service_pb2.DESCRIPTOR.services_by_name["OperandService"])
             for m in service.methods}
HARVEST_RPCS = {m.name for m in harvest_service_pb2.DESCRIPTOR.services_by_name["HarvestService"].methods}
OPERAND_RPCS = {m.name for m in operand_service_pb2.DESCRIPTOR.services_by_name["OperandService"].methods}
WHO_HAS = {"viewer": "viewer", "user": "alice", "observer": "observer", "operator": "operator"}


def _memory_of(pid: int) -> dict[str, int]:
    """VmRSS (now) and VmHWM (peak) of a process, in MiB."""
    out = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) // 1024
    return out


def test_refused_and_idle_requests_cost_no_lasting_memory(tmp_path) -> None:
    """Bodies of calls refused for credentials or roles are never read, and an
    InferStream left idle is ended and freed (a server subprocess, so its memory is its own).

    The sync client: grpc's asyncio client may report a server that ends a call before
    reading all of it as INTERNAL "Internal error from Core" (grpc/grpc#36066)."""
    tokens = tmp_path / "tokens"
    tokens.write_text(LINES)
    env = {**os.environ, "HOOKWIRE_INFER_STREAM_IDLE_TIMEOUT": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "hookwire._cli", "serve", "--port", "0", "--tokens-file", str(tokens)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    release = threading.Event()
    try:
        target = proc.stdout.readline().rsplit(" ", 1)[-1].strip()
        options = [("grpc.max_send_message_length", 1 << 30), ("grpc.max_receive_message_length", 1 << 30)]
        with grpc.insecure_channel(target, options=options) as channel:
            infer = channel.unary_unary("/hookwire.v1.ModelService/Infer")  # raw bytes: the client holds one copy
            small = model_service_pb2.InferRequest(model="mlp", args=[codec.encode_value(X)]).SerializeToString()
            infer(small, metadata=bearer(TOKENS["alice"]), timeout=120)  # warm up before the baseline
            before = _memory_of(proc.pid)
            big = model_service_pb2.InferRequest(model="mlp", args=[codec.encode_value(torch.zeros(64 * MIB))])
            body = big.SerializeToString()  # 256 MiB
            empty_value = model_service_pb2.InferRequest(args=[tensor_pb2.Value()]).SerializeToString()
            wide = empty_value * (19 * 1000 * 1000)  # 19M empty Values, 38 MB
            stream = channel.stream_stream("/hookwire.v1.ModelService/InferStream")
            streamed = model_service_pb2.InferStreamRequest(request=big).SerializeToString()
            refusals = [(infer, body, (), grpc.StatusCode.UNAUTHENTICATED)] * 4 + [
                (infer, body, bearer("wrong"), grpc.StatusCode.UNAUTHENTICATED),
                (infer, body, bearer(TOKENS["viewer"]), grpc.StatusCode.PERMISSION_DENIED),
                (infer, wide, (), grpc.StatusCode.UNAUTHENTICATED),
                (stream, streamed, (), grpc.StatusCode.UNAUTHENTICATED),
                (stream, streamed, bearer(TOKENS["viewer"]), grpc.StatusCode.PERMISSION_DENIED),
            ]
            for method, payload, metadata, code in refusals:
                with pytest.raises(grpc.RpcError) as info:
                    if method is stream:
                        list(stream(iter([payload]), metadata=metadata, timeout=120))
                    else:
                        infer(payload, metadata=metadata, timeout=120)
                assert info.value.code() == code
            del body, wide, streamed
            refused = _memory_of(proc.pid)
            # Generous bounds: reading even one of those 256 MiB bodies would pass both.
            assert refused["VmHWM"] - before["VmRSS"] < 256, (before, refused)
            assert refused["VmRSS"] - before["VmRSS"] < 128, (before, refused)
            # An authorized InferStream that sends 255 MiB of a 256 MiB tensor, then nothing, never closing.
            chunked = model_service_pb2.InferRequest(model="scale")
            chunker = codec.Chunker(snapshot=False)
            codec.encode_value_into(torch.ones(64 * MIB), chunked.args.add(), chunker=chunker)

            def messages() -> Iterator[bytes]:
                yield model_service_pb2.InferStreamRequest(request=chunked).SerializeToString()
                for n, chunk in enumerate(chunker.chunks(MIB)):
                    if n < 255:
                        yield model_service_pb2.InferStreamRequest(chunk=chunk).SerializeToString()
                release.wait()

            with pytest.raises(grpc.RpcError) as info:
                list(stream(messages(), metadata=bearer(TOKENS["alice"]), timeout=120))
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "infer_stream_idle_timeout" in info.value.details()
            infer(small, metadata=bearer(TOKENS["alice"]), timeout=120)  # still serving
            after = _memory_of(proc.pid)
        assert after["VmRSS"] - before["VmRSS"] < 128, (before, after)  # the idle stream's 255 MiB are freed
    finally:
        release.set()
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def _calls(model: model_service_pb2_grpc.ModelServiceStub, hooks: hook_service_pb2_grpc.HookServiceStub,
           harvests: harvest_service_pb2_grpc.HarvestServiceStub,
           operands: operand_service_pb2_grpc.OperandServiceStub) -> dict[str, Any]:
    """Each RPC with a small request that passes every role check of a principal that
    holds the RPC's least role (it may still fail for other reasons, e.g. NOT_FOUND)."""
    infer = model_service_pb2.InferRequest(model="mlp", args=[codec.encode_value(X)])

    def first(call: Any) -> Any:
        try:
            return next(call)
        finally:
            call.cancel()

    return {
        "ListModels": lambda md: model.ListModels(model_service_pb2.ListModelsRequest(), metadata=md),
        "GetModel": lambda md: model.GetModel(model_service_pb2.GetModelRequest(name="mlp"), metadata=md),
        "Infer": lambda md: model.Infer(infer, metadata=md),
        "InferStream": lambda md: first(model.InferStream(
            iter([model_service_pb2.InferStreamRequest(request=infer)]), metadata=md)),
        "Tokenize": lambda md: model.Tokenize(model_service_pb2.TokenizeRequest(model="mlp", texts=["hi"]), metadata=md),
        "Generate": lambda md: first(model.Generate(
            model_service_pb2.GenerateRequest(model="mlp", prompts=["hi"], max_new_tokens=1), metadata=md)),
        "GetParameters": lambda md: first(model.GetParameters(
            model_service_pb2.GetParametersRequest(model="mlp", names=["fc1.bias"]), metadata=md)),
        "OpenSession": lambda md: first(hooks.OpenSession(hook_service_pb2.OpenSessionRequest(), metadata=md)),
        "RegisterHook": lambda md: hooks.RegisterHook(hook_service_pb2.RegisterHookRequest(
            session_id="ses_none", spec=hook_pb2.HookSpec(model="mlp", module="fc1", posthook=hook_pb2.HookAction())),
            metadata=md),
        "DeregisterHook": lambda md: hooks.DeregisterHook(hook_service_pb2.DeregisterHookRequest(hook_id="hk_none"),
                                                          metadata=md),
        "ListHooks": lambda md: hooks.ListHooks(hook_service_pb2.ListHooksRequest(), metadata=md),
        "GetSlot": lambda md: hooks.GetSlot(hook_service_pb2.GetSlotRequest(session_id="ses_none", name="s"),
                                            metadata=md),
        "ListSlots": lambda md: hooks.ListSlots(hook_service_pb2.ListSlotsRequest(session_id="ses_none"), metadata=md),
        "Subscribe": lambda md: first(hooks.Subscribe(hook_service_pb2.SubscribeRequest(hook_ids=["hk_none"]),
                                                      metadata=md)),
        "StartHarvest": lambda md: harvests.StartHarvest(harvest_service_pb2.StartHarvestRequest(model="mlp"), metadata=md),
        "GetHarvest": lambda md: harvests.GetHarvest(harvest_service_pb2.GetHarvestRequest(job_id="hv-0"), metadata=md),
        "WatchHarvest": lambda md: first(harvests.WatchHarvest(harvest_service_pb2.WatchHarvestRequest(job_id="hv-0"),
                                                               metadata=md)),
        "CancelHarvest": lambda md: harvests.CancelHarvest(harvest_service_pb2.CancelHarvestRequest(job_id="hv-0"),
                                                           metadata=md),
        "ListHarvests": lambda md: harvests.ListHarvests(harvest_service_pb2.ListHarvestsRequest(), metadata=md),
        # An upload whose header is refused (no lifetime), so nothing is kept between roles.
        "UploadOperand": lambda md: operands.UploadOperand(iter([operand_service_pb2.UploadOperandRequest(
            operand=operand_service_pb2.OperandUpload(name="v"))]), metadata=md),
        "DeleteOperand": lambda md: operands.DeleteOperand(operand_service_pb2.DeleteOperandRequest(name="none"),
                                                           metadata=md),
        "ListOperands": lambda md: operands.ListOperands(operand_service_pb2.ListOperandsRequest(), metadata=md),
        "PublishOperand": lambda md: operands.PublishOperand(operand_service_pb2.PublishOperandRequest(
            name="p", path="none.safetensors"), metadata=md),
    }


def _denials(target: str) -> dict[str, set[str]]:
    """For each RPC, the roles answered PERMISSION_DENIED (a sync client: see grpc/grpc#36066)."""
    denied: dict[str, set[str]] = {}
    with grpc.insecure_channel(target) as channel:
        calls = _calls(model_service_pb2_grpc.ModelServiceStub(channel), hook_service_pb2_grpc.HookServiceStub(channel),
                       harvest_service_pb2_grpc.HarvestServiceStub(channel),
                       operand_service_pb2_grpc.OperandServiceStub(channel))
        assert set(calls) == RPC_NAMES
        for rpc, call in calls.items():
            denied[rpc] = set()
            for role, who in WHO_HAS.items():
                try:
                    call(bearer(TOKENS[who]))
                except grpc.RpcError as exc:
                    assert exc.code() not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INTERNAL), (rpc, exc)
                    if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                        denied[rpc].add(role)
    return denied


async def test_the_early_role_check_agrees_with_the_handlers(secured) -> None:
    """Every RPC has a least role; the interceptor refuses exactly the roles below it,
    and so do the handlers on their own (a server whose interceptor checks no roles)."""
    assert set(MINIMUM_ROLE) == RPC_NAMES
    expected = {rpc: set(ROLES[:ROLES.index(role)]) for rpc, role in MINIMUM_ROLE.items()}
    assert expected["Infer"] == {"viewer"} and expected["ListModels"] == set()
    assert await asyncio.to_thread(_denials, secured.target) == expected  # the early refusal

    parts = HookwireServer(build_test_registry(), ServerSettings(port=0, tokens=LINES))
    handlers_only = grpc.aio.server(interceptors=[AuthInterceptor(parts.tokens, client_certs=False, roles={})])
    add_to_server(ModelServicer(parts.registry, parts.inference, parts.metrics, parts.tokens,
                                parts.tokenization, parts.generation, parts.parameters),
                  model_service_pb2.DESCRIPTOR.services_by_name["ModelService"], handlers_only)
    add_to_server(HookServicer(parts.hooks, parts.tokens),
                  hook_service_pb2.DESCRIPTOR.services_by_name["HookService"], handlers_only)
    add_to_server(HarvestServicer(parts.harvests, parts.tokens, parts.metrics),
                  harvest_service_pb2.DESCRIPTOR.services_by_name["HarvestService"], handlers_only)
    add_to_server(OperandServicer(parts.hooks, parts.inference, parts.tokens),
                  operand_service_pb2.DESCRIPTOR.services_by_name["OperandService"], handlers_only)
    port = handlers_only.add_insecure_port("127.0.0.1:0")
    await handlers_only.start()
    try:
        assert await asyncio.to_thread(_denials, f"127.0.0.1:{port}") == expected  # the handlers' own checks
    finally:
        await handlers_only.stop(0)
        await parts.hooks.close()
        parts.registry.shutdown()


@given(body=st.binary(max_size=4096), rpc=st.sampled_from(sorted(RPC_NAMES)), who=st.sampled_from([None, "wrong", "viewer"]))
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_fuzz_refused_callers_get_a_clear_status_whatever_they_send(fuzz_secured, body, rpc, who) -> None:
    """Random bodies from callers without credentials, with wrong ones, or without the
    role: UNAUTHENTICATED or PERMISSION_DENIED, never a parse error (the body is not read)."""
    service = ("ModelService" if rpc in ("ListModels", "GetModel", "Infer", "InferStream", "Tokenize", "Generate",
                                         "GetParameters")
               else "HarvestService" if rpc in HARVEST_RPCS else "OperandService" if rpc in OPERAND_RPCS
               else "HookService")
    path = f"/hookwire.v1.{service}/{rpc}"
    metadata = () if who is None else bearer(TOKENS.get(who, "hwt_wrong"))
    channel = fuzz_secured
    streaming_in = rpc in ("InferStream", "UploadOperand")
    streaming_out = rpc in ("InferStream", "OpenSession", "Subscribe", "Generate", "WatchHarvest", "GetParameters")
    if rpc == "UploadOperand":
        call = channel.stream_unary(path).future(iter([body, body]), metadata=metadata, timeout=60)
    elif streaming_in:
        call = channel.stream_stream(path)(iter([body, body]), metadata=metadata, timeout=60)
    elif streaming_out:
        call = channel.unary_stream(path)(body, metadata=metadata, timeout=60)
    else:
        call = channel.unary_unary(path).future(body, metadata=metadata, timeout=60)
    try:
        list(call) if streaming_out else call.result()
    except grpc.RpcError as exc:
        code = exc.code()
    else:
        code = grpc.StatusCode.OK
    if who == "viewer":
        expected = grpc.StatusCode.PERMISSION_DENIED if MINIMUM_ROLE[rpc] != "viewer" else None
    else:
        expected = grpc.StatusCode.UNAUTHENTICATED
    if expected is not None:
        assert code == expected, (rpc, who, code)
    else:
        assert code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAUTHENTICATED)


@pytest.fixture(scope="module")
def fuzz_secured(secured) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(secured.target) as channel:
        yield channel


# ---------------------------------------------------------------- token rotation and role changes (issue #9)


def _reload(srv: ServerThread) -> int:
    """What SIGHUP does in `hookwire serve` (server.serve's reload_tokens)."""
    return srv.call(lambda: (srv.server.tokens.reload(), srv.server.hooks.reauthorize(srv.server.tokens)))[1]


def _token_lines(**roles_and_tokens: tuple[str, str]) -> str:
    return "\n".join(f"{name}:{role}:{hash_token(token)}" for name, (role, token) in roles_and_tokens.items())


@pytest.fixture
def reloadable(tmp_path) -> Iterator[tuple[ServerThread, Any]]:
    tokens = tmp_path / "tokens"
    tokens.write_text(_token_lines(alice=("user", "a1"), ops=("operator", "o1"), obs=("observer", "s1")))
    with serving(tokens_file=str(tokens)) as srv:
        yield srv, tokens


async def test_a_rotated_token_ends_the_streams_it_opened(reloadable) -> None:
    srv, tokens = reloadable
    as_ = lambda token: hookwire.connect(srv.target, options=hookwire.ConnectOptions(token=token))  # noqa: E731
    async with as_("a1") as alice, as_("o1") as ops, as_("s1") as obs:
        session = await alice.session()
        await alice.model("mlp").hook("fc1", posthook=hookwire.capture())
        shared = await ops.model("mlp").hook("fc1", posthook=hookwire.capture(), scope="all", ttl_seconds=600)
        subscription = ops.subscribe([shared.id])
        await subscription.start()
        kept = await obs.session()
        # alice's and ops's tokens change; obs's stays.
        tokens.write_text(_token_lines(alice=("user", "a2"), ops=("operator", "o2"), obs=("observer", "s1")))
        assert _reload(srv) >= 2
        await until(lambda: session.ended, "alice's session ends")
        assert isinstance(session.router.error, hookwire.UnavailableError)
        assert "your credentials were rotated or revoked" in str(session.router.error)
        with pytest.raises(hookwire.UnavailableError, match="rotated or revoked"):
            async for _ in subscription:
                pass
        assert not kept.ended
        # The principals stay: a hook owned by name survives, new tokens work, old ones do not.
        async with as_("a2") as alice2, as_("o2") as ops2:
            assert (await alice2.model("mlp")(X)).shape == (1, 4)
            assert [h.hook_id for h in await ops2.list_hooks(model="mlp") if h.hook_id == shared.id] == [shared.id]
            async with ops2.subscribe([shared.id]):
                pass
        with pytest.raises(hookwire.UnauthenticatedError):
            await alice.model("mlp")(X)


async def test_a_removed_certificate_subject_ends_the_streams_it_opened(tmp_path) -> None:
    pki = make_pki(tmp_path, ["svc"])
    principals = tmp_path / "principals.toml"
    entry = '[[principals]]\nname = "svc"\nroles = ["user"]\n'
    principals.write_text(entry + 'cert_subject = "CN=svc"\n')
    srv = ServerThread(build_test_registry(), ServerSettings(
        port=0, tokens_file=str(principals), tls_cert=str(pki["server_cert"]), tls_key=str(pki["server_key"]),
        tls_client_ca=str(pki["ca"]))).start()
    try:
        async with hookwire.connect(srv.target, options=hookwire.ConnectOptions(
                tls_ca=str(pki["ca"]), tls_cert=str(pki["svc_cert"]), tls_key=str(pki["svc_key"]))) as svc:
            session = await svc.session()
            principals.write_text(entry + f'token_sha256 = "{hash_token("svc-token")}"\n')  # the certificate no longer
            assert _reload(srv) >= 1
            await until(lambda: session.ended, "the certificate's session ends")
            assert "rotated or revoked" in str(session.router.error)
            with pytest.raises(hookwire.UnauthenticatedError):
                await svc.model("mlp")(X)
    finally:
        srv.stop()


async def test_an_mtls_caller_is_refused_before_its_request_is_read(tmp_path) -> None:
    """The certificate path of the early refusal: no token, the principal comes from the
    certificate, and a caller without the role is refused by the interceptor."""
    pki = make_pki(tmp_path, ["reader", "stranger"])
    principals = tmp_path / "principals.toml"
    principals.write_text('[[principals]]\nname = "reader"\nroles = ["viewer"]\ncert_subject = "CN=reader"\n')
    srv = ServerThread(build_test_registry(), ServerSettings(
        port=0, tokens_file=str(principals), tls_cert=str(pki["server_cert"]), tls_key=str(pki["server_key"]),
        tls_client_ca=str(pki["ca"]))).start()
    try:
        for name, code in (("reader", grpc.StatusCode.PERMISSION_DENIED), ("stranger", grpc.StatusCode.UNAUTHENTICATED)):
            credentials = grpc.ssl_channel_credentials(
                pki["ca"].read_bytes(), pki[f"{name}_key"].read_bytes(), pki[f"{name}_cert"].read_bytes())
            async with grpc.aio.secure_channel(srv.target, credentials) as channel:
                # A body that does not parse: a handler reading it would answer INVALID_ARGUMENT.
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await channel.unary_unary("/hookwire.v1.ModelService/Infer")(b"\xff" * 64)
                assert info.value.code() == code
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await channel.unary_stream("/hookwire.v1.HookService/OpenSession")(b"\xff" * 64).read()
                assert info.value.code() == code
                if name == "reader":
                    models = model_service_pb2_grpc.ModelServiceStub(channel)
                    assert (await models.GetModel(model_service_pb2.GetModelRequest(name="mlp"))).name == "mlp"
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await channel.unary_unary("/hookwire.v1.ModelService/GetModel")(b"\xff" * 64)
                    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # allowed: read and parsed
    finally:
        srv.stop()


async def test_a_demoted_observer_loses_its_shared_hooks(reloadable) -> None:
    srv, tokens = reloadable
    as_ = lambda token: hookwire.connect(srv.target, options=hookwire.ConnectOptions(token=token))  # noqa: E731
    async with as_("a1") as alice, as_("s1") as obs, as_("o1") as ops:
        session = await obs.session()
        watching = await obs.model("mlp").hook("fc1", posthook=hookwire.capture("output"), scope="all")
        own = await obs.model("mlp").hook("fc2", posthook=hookwire.capture("output"))
        outliving = await ops.model("mlp").hook(
            "fc1", posthook=[hookwire.rules.signal("output", "n", hookwire.rules.norm())], scope="all", ttl_seconds=600)
        monitor = await ops.model("mlp").hook("fc1", posthook=hookwire.capture(), scope="all", ttl_seconds=600)
        await alice.model("mlp")(X)
        assert (await collect(watching, 1))[0].module == "fc1"  # another caller's traffic
        tokens.write_text(_token_lines(alice=("user", "a1"), ops=("observer", "o1"), obs=("user", "s1")))
        assert _reload(srv) >= 2
        await until(lambda: any(n.hook_id == watching.id for n in session.router.notices), "the removal notice")
        notice = next(n for n in session.router.notices if n.hook_id == watching.id)
        assert notice.kind == "hook_removed"
        assert "role changed" in notice.message and "needs the observer role; 'obs' has user" in notice.message
        async for _ in watching.events():  # its events end
            pytest.fail("a removed hook delivered an event")
        assert [h.hook_id for h in await obs.list_hooks()] == [own.id]  # what a user may keep stays
        assert not session.ended
        await alice.model("mlp")(X)
        await obs.model("mlp")(X)
        assert (await collect(own, 1))[0].module == "fc2"  # its own calls are still seen
        # The operator, now an observer, loses its session-less hook with a rule (that needs
        # operator) and keeps its capture-only one (an observer's monitor).
        assert [h.hook_id for h in await ops.list_hooks()] == [monitor.id]
        with pytest.raises(hookwire.PermissionDeniedError, match="needs the operator role; 'ops' has observer"):
            await ops.model("mlp").hook("fc1", posthook=[hookwire.rules.signal("output", "n", hookwire.rules.norm())],
                                        scope="all", ttl_seconds=60)


async def test_a_demoted_operator_no_longer_blocks_other_callers(reloadable) -> None:
    """A stream keeps its principal's new role: BLOCK on other sessions' calls is for
    operators, so once demoted, a stalled stream no longer holds others' passes."""
    srv, tokens = reloadable
    async with grpc.aio.insecure_channel(srv.target) as channel:
        stub = hook_service_pb2_grpc.HookServiceStub(channel)
        metadata = bearer("o1")
        stream, session_id = await _unread_block_capture(stub, metadata)
        tokens.write_text(_token_lines(alice=("user", "a1"), ops=("observer", "o1"), obs=("observer", "s1")))
        _reload(srv)
        assert srv.call(lambda: [h.hook_id for h in srv.server.hooks.list_hooks()]), "an observer may keep the capture"
        async with hookwire.connect(srv.target, options=hookwire.ConnectOptions(token="a1")) as alice:
            x = torch.ones(1 << 20)  # 4 MiB events fill the stalled stream at once
            for _ in range(30):
                await asyncio.wait_for(alice.model("scale")(x), 60)  # never held by the stalled stream
        stream.cancel()



async def test_a_demotion_releases_a_pass_the_stream_already_holds(reloadable) -> None:
    """Another caller's call waiting on an operator's full BLOCK stream when a reload
    demotes the operator must go on at once (its event drops), not wait for room."""
    srv, tokens = reloadable
    async with grpc.aio.insecure_channel(srv.target) as channel:
        stub = hook_service_pb2_grpc.HookServiceStub(channel)
        metadata = bearer("o1")
        stream, session_id = await _unread_block_capture(stub, metadata)
        session_stream = srv.call(lambda: srv.server.hooks._sessions[session_id].stream)
        async with hookwire.connect(srv.target, options=hookwire.ConnectOptions(token="a1")) as alice:
            x = torch.ones(1 << 20)  # 4 MiB events: the buffer and gRPC's windows fill after a few calls
            stop = asyncio.Event()

            async def calls() -> int:
                done = 0
                while not stop.is_set():
                    await alice.model("scale")(x)
                    done += 1
                return done

            caller = asyncio.ensure_future(calls())
            scheduler = srv.call(lambda: srv.server.engines.scheduler(srv.server.registry.get("scale")))
            # Held after its pass (its event waits for room) or before it (the stream is full).
            await until(lambda: session_stream.waiting_producers == 1
                         or any(w.stalled_since is not None for w in scheduler._queue), "alice's call is held")
            tokens.write_text(_token_lines(alice=("user", "a1"), ops=("observer", "o1"), obs=("observer", "s1")))
            _reload(srv)
            stop.set()
            assert await asyncio.wait_for(caller, 60) >= 1  # released by the reload: nobody ever read the stream
        stream.cancel()


# ---------------------------------------------------------------- InferStream (issue #9)


@pytest.fixture
def streams_limited() -> Iterator[ServerThread]:
    settings = ServerSettings(port=0, tokens=LINES, max_infer_streams_per_principal=1, infer_stream_idle_timeout=1.0)
    with serving(settings=settings) as srv:
        yield srv


def _stalled_infer_stream(stub: model_service_pb2_grpc.ModelServiceStub, who: str, release: asyncio.Event,
                          *, send_request: bool = True) -> Any:
    """An InferStream that sends its request and the first MiB of a 64 MiB tensor, then waits for ``release``."""
    request = model_service_pb2.InferRequest(model="scale")
    chunker = codec.Chunker(snapshot=False)
    codec.encode_value_into(torch.ones(16 * MIB), request.args.add(), chunker=chunker)

    async def messages() -> AsyncIterator[model_service_pb2.InferStreamRequest]:
        if send_request:
            yield model_service_pb2.InferStreamRequest(request=request)
            yield model_service_pb2.InferStreamRequest(chunk=next(iter(chunker.chunks(MIB))))
        await release.wait()

    return stub.InferStream(messages(), metadata=bearer(TOKENS[who]))


async def test_an_idle_infer_stream_is_ended_and_freed(streams_limited) -> None:
    srv = streams_limited
    async with grpc.aio.insecure_channel(srv.target) as channel:
        stub = model_service_pb2_grpc.ModelServiceStub(channel)
        never = asyncio.Event()
        for send_request in (True, False):  # idle after some chunks, or before the first message
            call = _stalled_infer_stream(stub, "alice", never, send_request=send_request)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await asyncio.wait_for(call.read(), 60)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "no message from the client for 1 s (infer_stream_idle_timeout)" in info.value.details()
            await until(lambda: srv.call(lambda: srv.server.inference.open_streams) == {}, "the stream is released")
    async with _connect(srv, "alice") as alice:
        assert (await alice.model("mlp")(X)).shape == (1, 4)


def _refused_infer_stream(target: str, who: str) -> grpc.RpcError:
    """The error of an InferStream call that sends one request (a sync client: the
    asyncio one may report a call refused before it was read as INTERNAL, grpc/grpc#36066)."""
    request = model_service_pb2.InferStreamRequest(request=model_service_pb2.InferRequest(
        model="mlp", args=[codec.encode_value(X)]))
    with grpc.insecure_channel(target) as channel:
        with pytest.raises(grpc.RpcError) as info:
            list(model_service_pb2_grpc.ModelServiceStub(channel).InferStream(iter([request]), metadata=bearer(TOKENS[who])))
    return info.value


async def test_open_infer_streams_are_limited_per_principal(tmp_path) -> None:
    settings = ServerSettings(port=0, tokens=LINES, max_infer_streams_per_principal=1)  # default idle timeout
    srv = ServerThread(build_test_registry(), settings).start()
    try:
        async with grpc.aio.insecure_channel(srv.target) as channel:
            stub = model_service_pb2_grpc.ModelServiceStub(channel)
            release = asyncio.Event()
            held = _stalled_infer_stream(stub, "alice", release)
            await until(lambda: srv.call(lambda: srv.server.inference.open_streams) == {"alice": 1}, "admitted")
            refused = await asyncio.to_thread(_refused_infer_stream, srv.target, "alice")
            assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "'alice' has 1 InferStream uploads open" in refused.details()
            assert "max_infer_streams_per_principal" in refused.details()
            small = hookwire.ConnectOptions(token=TOKENS["bob"], max_message_bytes=4 * MIB)  # the SDK streams
            async with hookwire.connect(srv.target, options=small) as bob:
                assert (await bob.model("mlp")(X)).shape == (1, 4)  # others are not affected
            held.cancel()
            await until(lambda: srv.call(lambda: srv.server.inference.open_streams) == {}, "the stream is released")
            async with hookwire.connect(srv.target, options=dataclasses.replace(small, token=TOKENS["alice"])) as alice:
                assert (await alice.model("mlp")(X)).shape == (1, 4)
    finally:
        srv.stop()


async def test_an_infer_stream_counts_against_the_limit_only_while_it_uploads() -> None:
    """A call whose request has arrived (waiting for or running on the model) holds no
    upload memory: it must not keep its principal's other InferStream calls out."""
    settings = ServerSettings(port=0, tokens=LINES, max_infer_streams_per_principal=1)
    srv = ServerThread(build_test_registry(), settings).start()
    try:
        request = model_service_pb2.InferStreamRequest(request=model_service_pb2.InferRequest(
            model="sleeper", args=[codec.encode_value(torch.tensor(3.0))]))

        def slow_call() -> list:
            with grpc.insecure_channel(srv.target) as channel:
                stub = model_service_pb2_grpc.ModelServiceStub(channel)
                return list(stub.InferStream(iter([request]), metadata=bearer(TOKENS["alice"])))

        running = asyncio.ensure_future(asyncio.to_thread(slow_call))
        await until(lambda: srv.call(lambda: srv.server.inference._queued.get("sleeper", 0)) == 1, "running")
        assert srv.call(lambda: srv.server.inference.open_streams) == {}
        quick = model_service_pb2.InferStreamRequest(request=model_service_pb2.InferRequest(
            model="mlp", args=[codec.encode_value(X)]))

        def quick_call() -> list:
            with grpc.insecure_channel(srv.target) as channel:
                stub = model_service_pb2_grpc.ModelServiceStub(channel)
                return list(stub.InferStream(iter([quick]), metadata=bearer(TOKENS["alice"])))

        answer = await asyncio.to_thread(quick_call)  # on main: RESOURCE_EXHAUSTED (the sleeping call counted)
        assert answer[0].WhichOneof("kind") == "response"
        assert len(await asyncio.wait_for(running, 120)) == 1
    finally:
        srv.stop()


async def test_an_infer_stream_that_drips_its_upload_is_ended_at_infer_timeout() -> None:
    """One chunk at a time, each well inside the idle timeout: the upload as a whole
    is still bounded (by infer_timeout), and what it sent is freed."""
    settings = ServerSettings(port=0, tokens=LINES, infer_stream_idle_timeout=30.0, infer_timeout=1.0)
    srv = ServerThread(build_test_registry(), settings).start()
    try:
        request = model_service_pb2.InferRequest(model="scale")
        chunker = codec.Chunker(snapshot=False)
        codec.encode_value_into(torch.ones(16 * MIB), request.args.add(), chunker=chunker)
        chunks = iter(chunker.chunks(MIB))

        ended, drained = threading.Event(), threading.Event()

        def messages() -> Iterator[model_service_pb2.InferStreamRequest]:
            try:
                yield model_service_pb2.InferStreamRequest(request=request)
                for chunk in chunks:  # 64 chunks, one every 0.3 s: ~19 s in all, never idle for 30 s
                    yield model_service_pb2.InferStreamRequest(chunk=chunk)
                    if ended.wait(0.3):
                        return
            finally:
                drained.set()

        def drip() -> grpc.RpcError:
            # A sync client: the asyncio one may report a refused stream as INTERNAL (grpc/grpc#36066).
            with grpc.insecure_channel(srv.target) as channel:
                with pytest.raises(grpc.RpcError) as info:
                    list(model_service_pb2_grpc.ModelServiceStub(channel).InferStream(
                        messages(), metadata=bearer(TOKENS["alice"])))
                ended.set()
                drained.wait(60)  # gRPC's sending thread is done with the generator before the channel closes
            return info.value

        error = await asyncio.wait_for(asyncio.to_thread(drip), 120)
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, error
        assert "still sending after 1 s (infer_timeout)" in error.details()
        await until(lambda: srv.call(lambda: srv.server.inference.open_streams) == {}, "the stream is released")
    finally:
        srv.stop()
