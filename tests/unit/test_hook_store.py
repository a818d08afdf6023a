"""The state folder's hook files (hooks/hook_store.py): atomic private writes, data only,
damaged files dropped, one server per folder."""

from __future__ import annotations

import stat
import time

import pytest

from hookwire.wire.ids import HOOK, new_id
from hookwire_server.hooks.hook_store import HookStore, StateDirError, StoredHook


def _hook(**fields: object) -> StoredHook:
    values: dict[str, object] = dict(hook_id=new_id(HOOK), owner="obs", role="observer", authenticated=True,
                                     expires_ns=time.time_ns() + 10**12, saved_ns=time.time_ns(), request=b"\x12\x00")
    values.update(fields)
    return StoredHook(**values)  # type: ignore[arg-type]


def test_saved_hooks_load_back_and_files_are_private(tmp_path) -> None:
    store = HookStore(str(tmp_path / "state"))
    store.open()
    try:
        hook = _hook(request=bytes(range(256)) * 100)
        store.save(hook)
        assert store.load() == [hook]
        path = store.path_of(hook.hook_id)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(store.folder.stat().st_mode) == 0o700
        assert not [p for p in store.folder.iterdir() if p.name.endswith(".tmp")]
        store.remove(hook.hook_id)
        store.remove(hook.hook_id)  # idempotent
        assert store.load() == []
    finally:
        store.close()


def test_damaged_files_are_dropped_not_trusted(tmp_path) -> None:
    store = HookStore(str(tmp_path))
    store.open()
    try:
        good, cut, renamed = _hook(), _hook(), _hook()
        for hook in (good, cut, renamed):
            store.save(hook)
        path = store.path_of(cut.hook_id)
        path.write_bytes(path.read_bytes()[:-1])  # its request no longer matches its SHA-256
        other = store.path_of(new_id(HOOK))
        store.path_of(renamed.hook_id).rename(other)  # a file that names another hook
        (store.folder / "junk.hook").write_bytes(b"\x80\x04pickle")
        assert store.load() == [good]
        assert sorted(p.name for p in store.folder.iterdir()) == [good.hook_id + ".hook"]
    finally:
        store.close()
    with pytest.raises(ValueError, match="not a hook id"):
        store.path_of("../../etc/passwd")


def test_one_server_per_folder_and_the_clean_stop_marker(tmp_path) -> None:
    first = HookStore(str(tmp_path))
    first.open()
    assert first.stopped_ns is None  # never stopped cleanly
    with pytest.raises(StateDirError, match="in use by another hookwire server"):
        HookStore(str(tmp_path)).open()
    before = time.time_ns()
    first.close()
    second = HookStore(str(tmp_path))
    second.open()
    assert second.stopped_ns is not None and second.stopped_ns >= before
    second.close(clean=False)  # a crash leaves no marker
    third = HookStore(str(tmp_path))
    third.open()
    assert third.stopped_ns is None
    third.close()
