"""Hooks without a session kept in the server's state folder (``state_dir``): restored
with their ids by the next server on the folder, against real servers and real clients."""

from __future__ import annotations

import json
import logging
import pathlib
import signal
import stat

import pytest
import torch

import hookwire
from hookwire_server import HookwireServer, ModelHost, ModelRegistry, ServerSettings
from hookwire_server.auth import hash_token
from hookwire_server.demo_models import mlp
from hookwire_server.hooks.hook_store import StateDirError
from support import ServerThread, serve_process, serving, until

TOKENS = {name: f"hwt_durable_{name}" for name in ("alice", "obs", "ops", "gone")}
ROLE = {"alice": "user", "obs": "observer", "ops": "operator", "gone": "observer"}
X = torch.randn(1, 8)


def _lines(*names: str) -> str:
    return "\n".join(f"{name}:{ROLE[name]}:{hash_token(TOKENS[name])}" for name in names)


def _registry() -> ModelRegistry:
    # One small model: each test starts several servers.
    return ModelRegistry([ModelHost("mlp", mlp())])


def _connect(srv: ServerThread, who: str) -> hookwire.Client:
    return hookwire.connect(srv.target, options=hookwire.ConnectOptions(token=TOKENS[who]))


def _mode(path: pathlib.Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def _first_event(sub: hookwire.Subscription, client: hookwire.Client) -> hookwire.InterceptEvent:
    await client.model("mlp")(X)
    async for event in sub.events(timeout=60):
        return event
    pytest.fail("no event arrived within 60 s")


async def test_ttl_hooks_come_back_after_a_restart_with_their_ids(tmp_path) -> None:
    state = tmp_path / "state"
    settings = dict(tokens=_lines("alice", "obs", "ops"), state_dir=str(state), allow_shared_rules=True)
    with serving(_registry(), **settings) as first:
        async with _connect(first, "obs") as obs, _connect(first, "ops") as ops, _connect(first, "alice") as alice:
            # An observer's monitor: capture only, no session, a TTL.
            watch = await obs.model("mlp").hook("fc1", posthook=hookwire.capture("output"), scope="all",
                                                ttl_seconds=600)
            # An operator's, with a rule on everyone's calls.
            zeroing = await ops.model("mlp").hook("out", posthook=[hookwire.rules.zero("output")], scope="all",
                                                  ttl_seconds=600)
            async with obs.subscribe([watch.id]) as sub:
                assert (await _first_event(sub, alice)).module == "fc1"
            assert torch.count_nonzero(await alice.model("mlp")(X)) == 0
            before = {h.hook_id: h for h in await ops.list_hooks()}
        assert set(before) == {watch.id, zeroing.id}
        # Private files: the folders 0700, each hook's file 0600.
        assert _mode(state) == 0o700 and _mode(state / "hooks") == 0o700
        files = sorted((state / "hooks").glob("*.hook"))
        assert [f.stem for f in files] == sorted(before) and all(_mode(f) == 0o600 for f in files)

    with serving(_registry(), **settings) as second:
        async with _connect(second, "obs") as obs, _connect(second, "alice") as alice, _connect(second, "ops") as ops:
            after = {h.hook_id: h for h in await ops.list_hooks()}
            assert set(after) == set(before)
            for hook_id, hook in after.items():
                assert hook.expires == before[hook_id].expires  # absolute: not renewed by the restart
            assert [h.hook_id for h in await obs.list_hooks()] == [watch.id]  # still the observer's own
            assert torch.count_nonzero(await alice.model("mlp")(X)) == 0  # the operator's rule acts again
            async with obs.subscribe([watch.id]) as sub:  # the same id, re-subscribed: events resume
                assert (await _first_event(sub, alice)).module == "fc1"
                restored = [n for n in sub.notices if n.kind == "hook_restored"]
                assert len(restored) == 1 and restored[0].hook_id == watch.id
                assert "restored after a restart" in restored[0].message
                assert "were not captured" in restored[0].message and "the server was stopped" in restored[0].message
            async with obs.subscribe([watch.id]) as again:  # the gap is told once
                assert (await _first_event(again, alice)).module == "fc1"
                assert not [n for n in again.notices if n.kind == "hook_restored"]
            # Removing it removes its file: a later server does not bring it back.
            assert await obs.deregister_hook(watch.id)
            assert [f.stem for f in (state / "hooks").glob("*.hook")] == [zeroing.id]


async def test_expired_revoked_and_operand_hooks_are_dropped_with_a_log_line(tmp_path, caplog) -> None:
    state = tmp_path / "state"
    with serving(_registry(), tokens=_lines("obs", "ops", "gone"), state_dir=str(state), allow_shared_rules=True) as first:
        async with _connect(first, "obs") as obs, _connect(first, "gone") as gone, _connect(first, "ops") as ops:
            expiring = await obs.model("mlp").hook("fc1", posthook=hookwire.capture(), scope="all", ttl_seconds=600)
            kept = await obs.model("mlp").hook("fc2", posthook=hookwire.capture(), scope="all", ttl_seconds=600)
            orphan = await gone.model("mlp").hook("fc1", posthook=hookwire.capture(), scope="all", ttl_seconds=600)
            await ops.upload_operand("v", torch.ones(32), ttl=600)
            named = await ops.model("mlp").hook(
                "fc1", posthook=[hookwire.rules.add("output", hookwire.rules.operand("v"))], scope="all",
                ttl_seconds=600,
            )
    # Its TTL runs out while no server runs (set in its file, rather than waited for).
    path = state / "hooks" / f"{expiring.id}.hook"
    magic, header, request = path.read_bytes().split(b"\n", 2)
    fields = json.loads(header)
    fields["expires_ns"] = fields["saved_ns"] - 1
    path.write_bytes(magic + b"\n" + json.dumps(fields).encode() + b"\n" + request)

    caplog.set_level(logging.INFO, logger="hookwire.hooks")
    # "gone" is no longer in the token file.
    with serving(_registry(), tokens=_lines("obs", "ops"), state_dir=str(state), allow_shared_rules=True) as second:
        async with _connect(second, "ops") as ops:
            assert [h.hook_id for h in await ops.list_hooks()] == [kept.id]
        assert [f.stem for f in (state / "hooks").glob("*.hook")] == [kept.id]
    dropped = {r.args[0]: r.getMessage() for r in caplog.records if "not restored" in r.getMessage()}
    assert "its TTL ran out" in dropped[expiring.id]
    assert "its owner 'gone' is no longer in the token file" in dropped[orphan.id]
    assert "registering it again failed" in dropped[named.id] and "operand" in dropped[named.id]


async def test_a_hook_that_expires_while_the_server_runs_leaves_no_file(tmp_path) -> None:
    state = tmp_path / "state"
    with serving(_registry(), state_dir=str(state)) as srv:
        async with hookwire.connect(srv.target) as client:
            hook = await client.model("mlp").hook("fc1", posthook=hookwire.capture("output"), scope="all",
                                                  ttl_seconds=1)
            # (Saved before RegisterHook answered; not checked here: a 1 s TTL may end first.)
            path = state / "hooks" / f"{hook.id}.hook"
            await until(lambda: not path.exists(), "the expired hook's file is removed")
            assert await client.list_hooks() == []


async def test_a_state_folder_serves_one_server_at_a_time(tmp_path) -> None:
    state = tmp_path / "state"
    with serving(_registry(), state_dir=str(state)):
        other = HookwireServer(_registry(), ServerSettings(port=0, state_dir=str(state)))
        with pytest.raises(StateDirError, match="in use by another hookwire server"):
            await other.start()


async def test_without_authentication_hooks_come_back_too(tmp_path) -> None:
    state = tmp_path / "state"
    with serving(_registry(), state_dir=str(state)) as first:
        async with hookwire.connect(first.target) as client:
            hook = await client.model("mlp").hook("fc1", posthook=hookwire.capture("output"), scope="all",
                                                  ttl_seconds=600)
    with serving(_registry(), state_dir=str(state)) as second:
        async with hookwire.connect(second.target) as client:
            assert [h.hook_id for h in await client.list_hooks()] == [hook.id]
            async with client.subscribe([hook.id]) as sub:
                assert (await _first_event(sub, client)).module == "fc1"
                assert [n.kind for n in sub.notices] == ["hook_restored"]
    # A server that requires tokens does not take over what nobody authenticated for.
    with serving(_registry(), tokens=_lines("ops"), state_dir=str(state)) as third:
        async with _connect(third, "ops") as ops:
            assert await ops.list_hooks() == []


async def test_hookwire_serve_state_dir_flag_and_variable(tmp_path) -> None:
    """The CLI path: models load after the server starts, so their hooks are restored once
    they have loaded, before the server reports SERVING."""
    state = tmp_path / "state"
    model_flag = ("--model", "mlp=hookwire_server.demo_models:mlp")
    with serve_process(*model_flag, "--state-dir", str(state)) as (proc, target):
        async with hookwire.connect(target) as client:
            hook = await client.model("mlp").hook("fc1", posthook=hookwire.capture("output"), scope="all",
                                                  ttl_seconds=600)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    with serve_process(*model_flag, env={"HOOKWIRE_STATE_DIR": str(state)}) as (proc, target):
        async with hookwire.connect(target) as client:
            assert [h.hook_id for h in await client.list_hooks()] == [hook.id]
            async with client.subscribe([hook.id]) as sub:
                assert (await _first_event(sub, client)).module == "fc1"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
