"""Authentication, roles, ownership, TLS and mTLS, against real servers."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from typing import Iterator

import grpc
import pytest
import torch

import hookwire
from certs import make_pki
from hookwire_server import ServerSettings
from hookwire_server.auth import hash_token
from support import ServerThread, build_test_registry

TOKENS = {name: f"hwt_test_{name}" for name in ("viewer", "alice", "bob", "observer", "operator")}
ROLE = {"viewer": "viewer", "alice": "user", "bob": "user", "observer": "observer", "operator": "operator"}
LINES = "\n".join(f"{name}:{ROLE[name]}:{hash_token(token)}" for name, token in TOKENS.items())
X = torch.randn(1, 8)


@pytest.fixture(scope="module")
def secured() -> Iterator[ServerThread]:
    srv = ServerThread(build_test_registry(), ServerSettings(port=0, tokens=LINES, allow_shared_rules=True)).start()
    yield srv
    srv.stop()


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
        with pytest.raises(hookwire.PermissionDeniedError, match="outlives its client\\) needs the operator role"):
            await observer.model("mlp").hook("fc1", posthook=hookwire.capture(), scope="all", ttl_seconds=60)
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
                                                           args=[hookwire._codec.encode_value(X)]))
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
    settings = ServerSettings(port=0, tokens=LINES, max_buffered_bytes_per_principal=100 * 1024 * 1024)
    srv = ServerThread(build_test_registry(), settings).start()
    yield srv
    srv.stop()


async def test_one_principal_cannot_take_every_stream_buffer(budgeted) -> None:
    async with _connect(budgeted, "alice") as a1, _connect(budgeted, "alice") as a2, _connect(budgeted, "bob") as bob:
        await a1.session()  # 64 MiB buffer
        with pytest.raises(hookwire.ResourceExhaustedError, match="max_buffered_bytes_per_principal"):
            await a2.session()
        await bob.session()  # others are not affected


async def test_an_observer_that_stops_reading_cannot_stall_other_callers(secured) -> None:
    from hookwire.v1 import hook_pb2, hook_service_pb2, hook_service_pb2_grpc

    metadata = (("authorization", f"Bearer {TOKENS['observer']}"),)
    async with grpc.aio.insecure_channel(secured.target) as channel:
        stub = hook_service_pb2_grpc.HookServiceStub(channel)
        stream = stub.OpenSession(hook_service_pb2.OpenSessionRequest(delivery=hook_service_pb2.DeliveryOptions(
            policy=hook_service_pb2.DELIVERY_POLICY_BLOCK, max_events=1)), metadata=metadata)
        session_id = (await stream.read()).opened.session_id
        await stub.RegisterHook(hook_service_pb2.RegisterHookRequest(session_id=session_id, spec=hook_pb2.HookSpec(
            model="scale", module="", scope=hook_pb2.SCOPE_ALL,
            posthook=hook_pb2.HookAction(capture=[hook_pb2.PART_OUTPUT]))), metadata=metadata)
        async with _connect(secured, "alice") as alice:
            x = torch.ones(1 << 20)  # 4 MiB events: they would fill any buffer quickly
            for _ in range(30):
                await asyncio.wait_for(alice.model("scale")(x), 10)  # never held by the stalled observer
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
            ended = srv.call(lambda: (srv.server.tokens.reload(), srv.server.hooks.revoke(set(srv.server.tokens.principals))))
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
