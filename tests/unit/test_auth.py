"""Principals, roles and token files."""

from __future__ import annotations

import pytest

from hookwire_server.auth import (
    ANONYMOUS, AuthConfigError, Principal, TokenStore, Unauthenticated, hash_token, new_token, parse_lines,
)
from hookwire_server.errors import PermissionDenied


def test_roles_are_cumulative() -> None:
    observer = Principal("o", "observer")
    assert observer.has("viewer") and observer.has("user") and observer.has("observer") and not observer.has("operator")
    with pytest.raises(PermissionDenied, match="x needs the operator role; 'o' has observer"):
        observer.require("operator", "x")
    assert ANONYMOUS.is_operator


def test_token_lines_with_comments_and_several_roles() -> None:
    text = f"""
    # principal:role:sha256
    alice:user:{hash_token('a')}   # trailing comment
    ops:viewer,operator:{hash_token('o')}
    """
    entries = parse_lines(text, "t")
    assert [(e.principal.name, e.principal.role) for e in entries] == [("alice", "user"), ("ops", "operator")]


@pytest.mark.parametrize("text,message", [
    ("alice:user", "expected principal:role"),
    ("alice:admin:" + "0" * 64, "roles"),
    ("alice:user:xyz", "64 lowercase hex"),
])
def test_bad_token_lines(text: str, message: str) -> None:
    with pytest.raises(AuthConfigError, match=message):
        parse_lines(text, "t")


def test_store_authenticates_tokens_and_certificates(tmp_path) -> None:
    path = tmp_path / "p.toml"
    path.write_text(
        f'[[principals]]\nname = "svc"\nroles = ["observer"]\ncert_subject = "CN=svc"\n'
        f'[[principals]]\nname = "bob"\nroles = ["user"]\ntoken_sha256 = "{hash_token("b")}"\n'
    )
    store = TokenStore(str(path), f"eve:viewer:{hash_token('e')}")
    assert store.enabled
    assert store.authenticate("b") == Principal("bob", "user")
    assert store.authenticate("e") == Principal("eve", "viewer")
    assert store.authenticate(None, ["CN=svc"]) == Principal("svc", "observer")
    with pytest.raises(Unauthenticated, match="not valid"):
        store.authenticate("wrong", ["CN=svc"])  # a wrong token is never rescued by a certificate
    with pytest.raises(Unauthenticated, match="missing credentials"):
        store.authenticate(None, ["CN=someone"])


def test_reload_and_duplicates(tmp_path) -> None:
    path = tmp_path / "t"
    path.write_text(f"a:user:{hash_token('1')}")
    store = TokenStore(str(path))
    path.write_text(f"a:user:{hash_token('2')}")
    assert store.reload() == 1
    assert store.authenticate("2").name == "a"
    path.write_text(f"a:user:{hash_token('1')} a:user:{hash_token('2')}")
    with pytest.raises(AuthConfigError, match="twice"):
        store.reload()
    assert store.authenticate("2").name == "a"  # a failed reload keeps the tokens in force


def test_no_principals_means_authentication_is_off() -> None:
    assert not TokenStore().enabled
    assert new_token().startswith("hwt_") and len(new_token()) > 40


def test_a_reload_never_turns_authentication_off(tmp_path) -> None:
    path = tmp_path / "t"
    path.write_text(f"a:user:{hash_token('1')}")
    store = TokenStore(str(path))
    path.write_text("# everyone removed\n")
    with pytest.raises(AuthConfigError, match="no principal"):
        store.reload()
    assert store.enabled and store.authenticate("1").name == "a"


def test_ownership_survives_a_role_change() -> None:
    assert Principal("a", "observer").owns(Principal("a", "user"))
    assert not Principal("b", "operator").owns(Principal("a", "user"))


def test_current_follows_rotation_revocation_and_role_changes(tmp_path) -> None:
    path = tmp_path / "p.toml"
    entry = '[[principals]]\nname = "{name}"\nroles = ["{role}"]\n{credential}\n'
    token = lambda t: f'token_sha256 = "{hash_token(t)}"'  # noqa: E731
    path.write_text(entry.format(name="a", role="observer", credential=token("1"))
                    + entry.format(name="svc", role="user", credential='cert_subject = "CN=svc"'))
    store = TokenStore(str(path))
    alice, svc = store.authenticate("1"), store.authenticate(None, ["CN=svc"])
    assert alice.credential and svc.credential and alice.credential != svc.credential
    assert "1" not in repr(alice) and hash_token("1") not in repr(alice)  # never logged
    assert store.current(alice) == Principal("a", "observer") and store.current(svc) == svc
    # a is demoted; svc's certificate is replaced by a token.
    path.write_text(entry.format(name="a", role="user", credential=token("1"))
                    + entry.format(name="svc", role="user", credential=token("s")))
    store.reload()
    demoted = store.current(alice)
    assert demoted == Principal("a", "user") and demoted.credential == alice.credential
    assert store.current(svc) is None
    # a's token is rotated: what it opened with the old one is no longer its.
    path.write_text(entry.format(name="a", role="user", credential=token("2")))
    store.reload()
    assert store.current(alice) is None and store.current(store.authenticate("2")) == Principal("a", "user")
    # Another principal given a's old token does not inherit a's streams.
    path.write_text(entry.format(name="b", role="operator", credential=token("1")))
    store.reload()
    assert store.current(alice) is None
    assert store.current(ANONYMOUS) is ANONYMOUS
