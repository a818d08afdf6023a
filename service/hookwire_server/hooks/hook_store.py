"""Hooks without a session kept on disk (``hookwire serve --state-dir DIR``), so that a
restarted server registers them again with their ids.

Each hook is one file, ``DIR/hooks/<hook id>.hook``: a first line ``hookwire-hook 1``,
a JSON header line (id, owner, role, expiry, when it was saved, the request's length
and SHA-256), then the ``RegisterHookRequest`` exactly as protobuf serialized it. The
file is data: the server parses the request again with the checks of a new
registration (see HookManager.restore); nothing in it is unpickled or executed.

Files are written atomically (a temporary file in the same folder, fsync, rename, fsync
of the folder) with mode 0600, in folders of mode 0700, and removed when the hook ends
(deregistered, expired, its owner revoked), not when the server stops. ``DIR/stopped``
records when the server last stopped cleanly (the start of the gap a restored hook
reports). One server at a time uses a state folder: ``DIR/lock`` is held (flock) while
it runs, and a second server on the same folder is refused at start.

Blocking file I/O: call ``save`` and ``load`` off the event loop when that matters.
Nothing here imports grpc or torch.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import pathlib
import secrets
import time

from hookwire.wire.ids import HOOK, id_pattern

log = logging.getLogger("hookwire.hooks")

MAGIC = b"hookwire-hook 1\n"
SUFFIX = ".hook"
#: The longest header line read (a header is about 300 bytes).
MAX_HEADER_BYTES = 4096
_HOOK_ID = id_pattern(HOOK)


class StateDirError(ValueError):
    """The state folder cannot be used (not creatable, not ours, or in use by another
    server). A ValueError, so that ``hookwire serve`` reports it and exits 2."""


@dataclasses.dataclass(frozen=True)
class StoredHook:
    """One persisted hook: who registered it, until when, and what it asked for."""

    hook_id: str
    #: The owner's principal name, and its role when the hook was saved (the restore
    #: checks the role the token file gives it then, not this one).
    owner: str
    role: str
    #: Whether the owner authenticated (False: the server ran without tokens).
    authenticated: bool
    #: Wall-clock expiry (ns since the epoch): absolute, so time spent stopped counts.
    expires_ns: int
    #: When it was saved (ns since the epoch).
    saved_ns: int
    #: ``RegisterHookRequest.SerializeToString()`` of its registration.
    request: bytes


class HookStore:
    """The hook files of one state folder. ``open`` before use, ``close`` at stop."""

    def __init__(self, state_dir: str) -> None:
        self.root = pathlib.Path(state_dir)
        self.folder = self.root / "hooks"
        self._lock_fd: int | None = None
        #: When the server using this folder last stopped cleanly (ns), read by ``open``;
        #: None when it never did, or when it did not stop cleanly since.
        self.stopped_ns: int | None = None

    # ---------------------------------------------------------------- life

    def open(self) -> None:
        """Creates the folders (mode 0700; an existing root keeps its mode), takes the folder's lock and reads the clean-stop
        marker (removing it: a crash from now on leaves none). StateDirError when the
        folder cannot be made or is in use by another server. Blocks briefly."""
        try:
            # The root may be an operator's existing folder: made 0700 when missing, its mode
            # otherwise left as it is; the hooks' own folder is ours and private (the files
            # in it are 0600 too).
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.folder.mkdir(mode=0o700, exist_ok=True)
            os.chmod(self.folder, 0o700)
            fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise StateDirError(f"state_dir {self.root}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise StateDirError(
                f"state_dir {self.root} is in use by another hookwire server (its lock file is held): "
                "each server needs a state folder of its own"
            ) from None
        self._lock_fd = fd
        marker = self.root / "stopped"
        try:
            self.stopped_ns = int(json.loads(marker.read_text())["stopped_ns"])
        except (OSError, ValueError, KeyError, TypeError):
            self.stopped_ns = None
        try:
            marker.unlink()
        except FileNotFoundError:
            pass

    def close(self, *, clean: bool = True) -> None:
        """Records a clean stop (``clean``) and lets the folder's lock go. Idempotent."""
        if self._lock_fd is None:
            return
        if clean:
            try:
                self._write(self.root / "stopped", json.dumps({"stopped_ns": time.time_ns()}).encode() + b"\n")
            except OSError as exc:
                log.warning("state_dir %s: the clean-stop marker was not written: %s", self.root, exc)
        os.close(self._lock_fd)  # closing the descriptor releases the flock
        self._lock_fd = None

    # ---------------------------------------------------------------- hooks

    def path_of(self, hook_id: str) -> pathlib.Path:
        """The file of hook ``hook_id`` (ValueError for a string that is no hook id)."""
        if not _HOOK_ID.fullmatch(hook_id):
            raise ValueError(f"{hook_id!r} is not a hook id")
        return self.folder / (hook_id + SUFFIX)

    def save(self, hook: StoredHook) -> None:
        """Writes ``hook``'s file atomically (mode 0600). OSError when it cannot be
        written (nothing is left behind). Blocks: fsync."""
        header = {
            "hook_id": hook.hook_id, "owner": hook.owner, "role": hook.role, "authenticated": hook.authenticated,
            "expires_ns": hook.expires_ns, "saved_ns": hook.saved_ns, "request_bytes": len(hook.request),
            "request_sha256": hashlib.sha256(hook.request).hexdigest(),
        }
        self._write(self.path_of(hook.hook_id), MAGIC + json.dumps(header).encode() + b"\n" + hook.request)

    def remove(self, hook_id: str) -> None:
        """Removes hook ``hook_id``'s file, if there is one. Never raises for a missing
        file; other failures are logged (the restore drops an expired hook anyway)."""
        try:
            self.path_of(hook_id).unlink()
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as exc:
            log.warning("hook %s: its file in %s was not removed: %s", hook_id, self.folder, exc)

    def load(self) -> list[StoredHook]:
        """Every readable hook file, oldest saved first. A file that cannot be read as one
        (truncated, altered, an unknown version) is removed with a log line saying why.
        Blocks: reads every file."""
        hooks = []
        for path in sorted(self.folder.glob("*" + SUFFIX)):
            try:
                hooks.append(self._read(path))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("hook file %s dropped: it cannot be read as a saved hook (%s)", path, exc)
                try:
                    path.unlink()
                except OSError:
                    pass
        for stale in self.folder.glob(".*.tmp"):  # a write interrupted by a crash
            try:
                stale.unlink()
            except OSError:
                pass
        return sorted(hooks, key=lambda h: h.saved_ns)

    def _read(self, path: pathlib.Path) -> StoredHook:
        with open(path, "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                raise ValueError("not a hookwire hook file of version 1")
            line = f.readline(MAX_HEADER_BYTES)
            if not line.endswith(b"\n"):
                raise ValueError("its header line is cut short")
            header = json.loads(line)
            request = f.read()
        if len(request) != header["request_bytes"] or hashlib.sha256(request).hexdigest() != header["request_sha256"]:
            raise ValueError("its request bytes do not match their length and SHA-256")
        hook = StoredHook(
            hook_id=str(header["hook_id"]), owner=str(header["owner"]), role=str(header["role"]),
            authenticated=bool(header["authenticated"]), expires_ns=int(header["expires_ns"]),
            saved_ns=int(header["saved_ns"]), request=request,
        )
        if self.path_of(hook.hook_id) != path:
            raise ValueError(f"it names hook {hook.hook_id!r}, not the one of its file name")
        return hook

    def _write(self, path: pathlib.Path, data: bytes) -> None:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            try:
                os.fchmod(fd, 0o600)  # whatever the umask
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            try:
                tmp.unlink()
            except OSError:
                pass
            raise
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)  # the rename itself survives a power loss
        finally:
            os.close(dir_fd)
