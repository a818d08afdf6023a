"""Targets as users type them, and failures to reach a server that say where and why."""

from __future__ import annotations

import pathlib
import socket
from typing import Iterator

import pytest

import hookwire
from certs import make_pki
from hookwire_server import ServerSettings
from support import ServerThread, build_test_registry


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A loopback port that is bound but not listening: connecting to it is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@pytest.mark.parametrize(("typed", "expected"), [
    ("127.0.0.1:50051", ("127.0.0.1:50051", False)),
    ("dns:///hookwire:50051", ("dns:///hookwire:50051", False)),
    ("unix:/run/hookwire.sock", ("unix:/run/hookwire.sock", False)),
    ("http://127.0.0.1:6000", ("127.0.0.1:6000", False)),
    ("HTTP://Example.COM:6000/", ("example.com:6000", False)),
    ("http://hookwire", ("hookwire:80", False)),
    ("https://hookwire.example.com", ("hookwire.example.com:443", True)),
    ("https://hookwire.example.com:8443", ("hookwire.example.com:8443", True)),
    ("http://[::1]:6000", ("[::1]:6000", False)),
])
def test_targets_as_users_type_them(typed: str, expected: tuple[str, bool]) -> None:
    from hookwire._client import resolve_target

    assert resolve_target(typed) == expected


@pytest.mark.parametrize(("typed", "message"), [
    ("http://host:6000/v1", "nothing after the port"),
    ("https://host:6000?x=1", "nothing after the port"),
    ("http://user@host:6000", "nothing after the port"),
    ("http://host:99999", "port"),
    ("grpc://host:6000", "use host:port"),
    ("grpcs://host:6000", "https://host:port"),
])
def test_unusable_targets_are_explained(typed: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        hookwire.connect(typed)


def test_http_target_with_tls_options_is_refused() -> None:
    with pytest.raises(ValueError, match="use https://"):
        hookwire.connect("http://127.0.0.1:6000", options=hookwire.ConnectOptions(tls=True))


async def test_http_target_reaches_the_server(server: ServerThread) -> None:
    async with hookwire.connect(f"http://{server.target}") as client:
        assert client.target == server.target
        assert "mlp" in [m.name for m in await client.list_models()]


async def test_https_target_means_tls(tmp_path: pathlib.Path) -> None:
    pki = make_pki(tmp_path, [])
    srv = ServerThread(build_test_registry(), ServerSettings(
        port=0, tls_cert=str(pki["server_cert"]), tls_key=str(pki["server_key"]))).start()
    try:
        async with hookwire.connect(f"https://{srv.target}",
                                    options=hookwire.ConnectOptions(tls_ca=str(pki["ca"]))) as client:
            assert "mlp" in [m.name for m in await client.list_models()]
        async with hookwire.connect(srv.target) as plain:  # plaintext to a TLS server: a hint, not a riddle
            with pytest.raises(hookwire.UnavailableError, match=f"{srv.target} closed the connection at once.*--tls"):
                await plain.list_models()
    finally:
        srv.stop()


async def test_https_target_to_a_plaintext_server_says_tls_failed(server: ServerThread, tmp_path: pathlib.Path) -> None:
    pki = make_pki(tmp_path, [])
    async with hookwire.connect(f"https://{server.target}", options=hookwire.ConnectOptions(tls_ca=str(pki["ca"]))) as c:
        with pytest.raises(hookwire.UnavailableError, match=f"the TLS handshake with {server.target} failed"):
            await c.list_models()


async def test_no_server_names_the_target(closed_port: int) -> None:
    target = f"127.0.0.1:{closed_port}"
    async with hookwire.connect(target) as client:
        with pytest.raises(hookwire.UnavailableError) as info:
            await client.list_models()
        message = str(info.value)
        assert f"no server answers at {target}: nothing listens on that port" in message
        assert "failed to connect to all addresses" in message  # gRPC's own words are kept
        with pytest.raises(hookwire.UnavailableError, match=f"no server answers at {target}"):
            await client.session()  # streams say it too
        with pytest.raises(hookwire.UnavailableError, match=f"no server answers at {target}"):
            await client.model("mlp").hook("fc1", posthook=hookwire.capture())


async def test_unresolvable_host_is_named() -> None:
    async with hookwire.connect("no-such-host.invalid:50051") as client:
        with pytest.raises(hookwire.UnavailableError,
                           match="no server answers at no-such-host.invalid:50051: the host name does not resolve"):
            await client.list_models()
