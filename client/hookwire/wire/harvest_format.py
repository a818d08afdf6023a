"""The activation dataset format (docs/harvest.md, "Dataset format"), and its writer.

A dataset is a folder (a local path or an fsspec URL):

- ``shards/w{worker:04d}-{index:06d}.safetensors``: one tensor per module ``[tokens,
  ...]`` plus ``token_ids``, ``sequence`` and ``position`` (int64 ``[tokens]``);
- ``workers/w{worker:04d}-of-{num_workers:04d}.json``: a worker's manifest, rewritten
  after each committed group of shards (the resume point);
- ``manifest.json``: the merged manifest, written last by worker 0 once every worker is
  done (the dataset's commit point).

Shards are committed in *groups*: when the buffered batches hold ``shard_tokens`` tokens
(or ``shard_tokens * shuffle_buffer_shards`` with shuffling, the group's tokens then
permuted with a generator seeded by ``group_seed(seed, worker, group)``), the group is
cut into shards, each written whole (locally to ``<name>.tmp``, fsynced, renamed; on an
object store under its final name), then the worker manifest is rewritten (locally a
fsynced temporary file renamed over it; on an object store one whole-object put). Group
boundaries depend only on the batches, so a process killed at any instruction and
resumed (skipping the ``resume_batches`` its manifest counts) rebuilds exactly the same
groups, under the same shard names: no token is duplicated or lost, and a shard file
left by the killed run (in no manifest) is removed when the writer opens, or rewritten.

Importable without torch: torch, safetensors and fsspec are imported where used.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Mapping
from typing import Any

FORMAT = "hookwire-activations"
VERSION = "1"
MANIFEST = "manifest.json"
INDEX_KEYS = ("token_ids", "sequence", "position")
#: Keys of a worker manifest that the merged manifest does not carry.
WORKER_KEYS = ("worker_index", "batches_done", "batches_total", "tokens_done", "shards", "groups", "done", "layout")

_WORKER_MANIFEST = re.compile(r"^w(\d{4,})-of-(\d{4,})\.json$")
_SHARD = re.compile(r"^w(\d{4,})-(\d{6,})\.safetensors(\.tmp)?$")


class DatasetExists(Exception):
    """A finished dataset (its manifest.json exists) is where a writer was opened
    without ``overwrite``."""


class UnsafePath(ValueError):
    """A local file of a confined dataset would be reached through a symlink (or lie
    outside the dataset's folder): a writer opened with ``confine=True`` opens nothing
    there. The message names the path."""


def check_confined(root: str, path: str) -> None:
    """Raises UnsafePath unless ``path`` is ``root`` or below it, with none of its
    components, from ``root`` itself down to ``path``, a symlink (components that do not
    exist yet are fine: they are created as plain folders and files). Each component is
    looked at with ``lstat``, so a symlink planted anywhere inside the folder, to a
    folder or as a file's name, is refused before anything is opened through it."""
    rel = os.path.relpath(path, root)
    if rel == os.pardir or rel.startswith(os.pardir + os.sep) or os.path.isabs(rel):
        raise UnsafePath(f"{path} is not inside the dataset folder {root}")
    parts = [] if rel == os.curdir else rel.split(os.sep)
    current = root
    for i, part in enumerate([None, *parts]):
        if part is not None:
            current = os.path.join(current, part)
        try:
            is_link = os.path.islink(current)
            exists = is_link or os.path.lexists(current)
        except OSError:
            return
        if is_link:
            shown = os.path.join(*parts[:i]) if i else "the dataset folder itself"
            raise UnsafePath(
                f"{shown} (in {root}) is a symlink: a confined harvest writes only inside its output folder, "
                "never through a link"
            )
        if not exists:
            return


class SettingsMismatch(Exception):
    """An unfinished dataset written with other settings (or another split, shard size
    or shuffle) is where a writer was opened; the message names what differs."""


def settings_digest(settings: Mapping[str, Any]) -> str:
    """sha256 (hex) of the canonical JSON of ``settings``: ``json.dumps(settings,
    sort_keys=True, separators=(",", ":"))`` (ASCII-escaped), UTF-8 encoded."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def worker_manifest_name(worker_index: int, num_workers: int) -> str:
    """``workers/w{worker:04d}-of-{num_workers:04d}.json``, relative to the dataset."""
    return f"workers/w{worker_index:04d}-of-{num_workers:04d}.json"


def shard_name(worker_index: int, index: int) -> str:
    """``shards/w{worker:04d}-{index:06d}.safetensors``, relative to the dataset."""
    return f"shards/w{worker_index:04d}-{index:06d}.safetensors"


def group_seed(seed: int, worker_index: int, group: int) -> int:
    """The seed of a shuffled group's permutation, a function of (seed, worker, group)
    only: the first 8 bytes (little-endian) of ``sha256(f"{seed}:{worker_index}:{group}")``
    with the top bit cleared. The permutation is ``torch.randperm(tokens,
    generator=torch.Generator().manual_seed(group_seed(...)))``, applied to every tensor
    of the group."""
    digest = hashlib.sha256(f"{seed}:{worker_index}:{group}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


# ---- storage helpers (shared with hookwire.dataset) ---------------------------------------


def open_fs(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[Any, str]:
    """The fsspec filesystem and root path of ``url`` (a local path or any fsspec URL)."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(os.fspath(url), **dict(storage_options or {}))
    return fs, path.rstrip("/") or path


def is_local(fs: Any) -> bool:
    """Whether ``fs`` is the local filesystem (which can rename and fsync)."""
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return bool({"file", "local"} & set(protocols))


def read_json(fs: Any, path: str) -> dict[str, Any] | None:
    """The JSON object at ``path``, or None when there is no such file."""
    try:
        fs.invalidate_cache(path)  # listings cached by object-store filesystems go stale
        data = fs.cat_file(path)
    except FileNotFoundError:
        return None
    loaded = json.loads(data.decode("utf-8"))
    if not isinstance(loaded, dict):
        raise ValueError(f"{path}: not a JSON object")
    return loaded


def read_manifest(url: str, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """The merged manifest (manifest.json) of the dataset at ``url``, or None when it has
    none (no dataset, or an unfinished one). Blocks on I/O."""
    fs, root = open_fs(url, storage_options)
    return read_json(fs, f"{root}/{MANIFEST}")


def read_worker_manifests(fs: Any, root: str) -> dict[str, dict[str, Any]]:
    """Every worker manifest under ``root/workers`` (file name -> manifest), by name."""
    folder = f"{root}/workers"
    try:
        fs.invalidate_cache(folder)
        names = fs.ls(folder, detail=False)
    except FileNotFoundError:
        return {}
    out = {}
    for name in sorted(names):
        base = name.rstrip("/").rsplit("/", 1)[-1]
        if _WORKER_MANIFEST.match(base):
            record = read_json(fs, f"{folder}/{base}")
            if record is not None:
                out[base] = record
    return out


def _write_json(fs: Any, path: str, record: Mapping[str, Any], confine: str | None = None) -> None:
    """Writes ``record`` whole or not at all: locally a temporary file, fsynced and
    renamed over ``path``; on an object store one put of the whole object. ``confine``:
    a local folder whose files are never reached through a symlink (check_confined)."""
    data = json.dumps(record, indent=1, sort_keys=True).encode()
    if not is_local(fs):
        fs.pipe_file(path, data)
        return
    folder = os.path.dirname(path)
    tmp = f"{path}.tmp"  # one name per manifest: a kill leaves at most this file, reused next time
    if confine is not None:
        check_confined(confine, tmp)
        check_confined(confine, path)
    os.makedirs(folder, exist_ok=True)
    with _open_new(tmp, confine is not None) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(folder)


def _open_new(path: str, nofollow: bool) -> Any:
    """``open(path, "wb")``; with ``nofollow`` a symlink at ``path`` (planted after the
    check) is refused by the kernel (O_NOFOLLOW) instead of followed."""
    if not nofollow:
        return open(path, "wb")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if os.path.islink(path):
            raise UnsafePath(f"{path} is a symlink: a confined harvest never writes through a link") from None
        raise exc
    return os.fdopen(fd, "wb")


def _fsync_dir(folder: str) -> None:
    """Makes the renames in ``folder`` durable (a power loss, not only a kill)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # platforms that cannot open a directory
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _rm(fs: Any, path: str) -> None:
    try:
        fs.rm_file(path)
    except FileNotFoundError:
        pass


def _ls_names(fs: Any, folder: str) -> list[str]:
    try:
        fs.invalidate_cache(folder)
        return sorted(name.rstrip("/").rsplit("/", 1)[-1] for name in fs.ls(folder, detail=False))
    except FileNotFoundError:
        return []


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat()


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


class DatasetWriter:
    """Writes one worker's part of a dataset (see the module docstring and
    docs/harvest.md). One writer per worker and output at a time; not thread-safe (one
    thread calls it at a time). Every method that writes blocks on storage I/O.

    Memory: the batches of one group (``shard_tokens`` tokens, times
    ``shuffle_buffer_shards`` with shuffling) are kept by reference until the group is
    committed (do not modify them in place after ``add``); committing concatenates them
    one tensor name at a time (dropping the batches' tensors as it goes), so the peak is
    about one group plus one module's column.
    """

    def __init__(
        self, url: str, *, header: Mapping[str, Any], worker_index: int = 0, num_workers: int = 1,
        shard_tokens: int = 65536, shuffle_buffer_shards: int = 0, shuffle_seed: int = 0, overwrite: bool = False,
        storage_options: Mapping[str, Any] | None = None, confine: bool = False,
    ) -> None:
        """Opens the dataset folder at ``url`` (created when missing). ``header`` gives
        ``model``, ``modules`` (may be empty: then the first batch's modules, in its
        order), ``settings`` (a JSON object; its digest decides what may be resumed),
        ``source`` and ``hookwire_version``.

        Raises DatasetExists when the folder holds a finished dataset, unless
        ``overwrite``: then the format's files (manifest.json, this worker's manifest
        and shards; for worker 0 also files of other splits) are removed first, nothing
        else. Raises SettingsMismatch when an unfinished dataset there was written with
        other settings, another ``num_workers``, or another shard size or shuffle (the
        message names what differs). Otherwise this worker's committed part, if any,
        is resumed: ``resume_batches`` says how many of its batches to skip. Shard files
        of this worker that its manifest does not list (left by a killed run) are
        removed. Blocks on I/O.

        ``confine=True`` (a server's jobs; local folders only): every file the writer
        reads, creates, renames or removes is checked as it is opened, and refused with
        UnsafePath when a component of its path inside the folder (the folder itself,
        ``shards``, ``workers``, the file's own name) is a symlink; new files are opened
        with O_NOFOLLOW. The format's folders and files are checked when the writer
        opens, so a planted link refuses the start."""
        if not 0 <= worker_index < num_workers:
            raise ValueError(f"worker_index {worker_index} is not in [0, {num_workers})")
        if shard_tokens < 1:
            raise ValueError(f"shard_tokens {shard_tokens} is not positive")
        if shuffle_buffer_shards < 0:
            raise ValueError(f"shuffle_buffer_shards {shuffle_buffer_shards} is negative")
        self.url = os.fspath(url)
        self.fs, self.root = open_fs(self.url, storage_options)
        self._local = is_local(self.fs)
        #: The folder no file of this writer may leave through a symlink (None: no check).
        self._confine: str | None = self.root if confine and self._local else None
        if self._confine is not None:
            self._check_folder()
        self.worker_index, self.num_workers = worker_index, num_workers
        self.shard_tokens = shard_tokens
        self.buffer_shards = shuffle_buffer_shards
        self.seed = shuffle_seed
        self.header: dict[str, Any] = {
            "model": "", "modules": [], "settings": {}, "source": {}, "hookwire_version": "", **dict(header),
        }
        self.digest = settings_digest(self.header["settings"])
        layout = {"shard_tokens": shard_tokens, "shuffle_buffer_shards": shuffle_buffer_shards,
                  "shuffle_seed": shuffle_seed if shuffle_buffer_shards > 0 else None}
        self._worker_path = f"{self.root}/{worker_manifest_name(worker_index, num_workers)}"

        merged = read_json(self.fs, f"{self.root}/{MANIFEST}")
        if merged is not None and not overwrite:
            raise DatasetExists(f"{self.url} holds a finished dataset ({merged.get('tokens', '?')} tokens)")
        if overwrite:
            self._remove_old()
        existing = read_json(self.fs, self._worker_path)
        if existing is not None:
            if existing.get("settings_digest") != self.digest:
                raise SettingsMismatch(_difference(existing.get("settings", {}), self.header["settings"]))
            if existing.get("layout", layout) != layout:
                raise SettingsMismatch(_difference(existing.get("layout", {}), layout))
        if not overwrite:
            own = worker_manifest_name(worker_index, num_workers).rsplit("/", 1)[-1]
            for name, other in read_worker_manifests(self.fs, self.root).items():
                if name == own:
                    continue
                if other.get("settings_digest") != self.digest:
                    raise SettingsMismatch(f"workers/{name} was written with other settings: "
                                           + _difference(other.get("settings", {}), self.header["settings"]))
                if other.get("num_workers") != num_workers:
                    raise SettingsMismatch(f"workers/{name} belongs to a split of {other.get('num_workers')} "
                                           f"workers, this one of {num_workers}")

        self.manifest: dict[str, Any]
        if existing is not None:
            self.manifest = existing
            self.manifest["hookwire_version"] = self.header["hookwire_version"]
        else:
            self.manifest = {
                "format": FORMAT, "version": VERSION, **self.header, "modules": list(self.header["modules"]),
                "settings_digest": self.digest, "dtypes": {}, "shapes": {}, "worker_index": worker_index,
                "num_workers": num_workers, "batches_done": 0, "batches_total": 0, "tokens_done": 0, "shards": [],
                "groups": [], "done": False, "layout": layout, "updated": _now(),
            }
        self.manifest.setdefault("groups", [])
        self._remove_uncommitted()
        if existing is None:
            # Visible at once: other workers' mismatch checks and allow_incomplete readers
            # see this worker, and an overwritten worker's old manifest is replaced now.
            self._write_manifest()

        #: This worker's batches already committed: the job skips that many of its own batches.
        self.resume_batches: int = int(self.manifest["batches_done"])
        #: Tokens, shards and shard bytes committed by this worker (resumed ones included).
        self.tokens_done: int = int(self.manifest["tokens_done"])
        self.shards_written: int = len(self.manifest["shards"])
        self.bytes_written: int = sum(int(s["bytes"]) for s in self.manifest["shards"])
        self._pending: dict[str, list[Any]] = {}
        self._buffered_tokens = 0
        self._buffered_batches = 0

    @property
    def done(self) -> bool:
        """Whether this worker's part is finished (``finish`` ran, now or before)."""
        return bool(self.manifest.get("done"))

    @property
    def buffered_tokens(self) -> int:
        """Tokens added but not committed yet (lost if the process dies now; the
        resumed job recomputes their batches)."""
        return self._buffered_tokens

    def set_batches_total(self, n: int) -> None:
        """Records how many batches this worker runs in all (for progress readers);
        rewrites the worker manifest when it changes (blocks on I/O)."""
        if int(self.manifest.get("batches_total", 0)) != int(n):
            self.manifest["batches_total"] = int(n)
            self._write_manifest()

    # ---- writing ------------------------------------------------------------------------

    def add(self, values: Mapping[str, Any], token_ids: Any, sequence: Any, position: Any) -> None:
        """Buffers one batch and commits a group when the buffer holds enough tokens
        (blocks on I/O then). ``values``: module -> CPU tensor ``[n, ...]``, stored bit
        for bit as given; ``token_ids``, ``sequence``, ``position``: integer ``[n]``
        (stored as int64). A batch of no tokens still counts as a batch (resume skips
        batches). ValueError, naming the module, when the batch's modules differ from
        the dataset's, or a module's dtype or per-token shape from the first batch's (or
        the resumed manifest's); the writer is then unchanged."""
        import torch

        if self.done:
            raise ValueError(f"worker {self.worker_index} of {self.url} is finished: no more batches")
        ids, seq, pos = (_index_tensor(x, key) for x, key in zip((token_ids, sequence, position), INDEX_KEYS))
        n = int(ids.shape[0])
        for key, t in (("sequence", seq), ("position", pos)):
            if int(t.shape[0]) != n:
                raise ValueError(f"{key} has {t.shape[0]} entries for {n} token ids")
        modules = list(self.manifest["modules"]) or list(values)
        if set(values) != set(modules):
            missing, extra = sorted(set(modules) - set(values)), sorted(set(values) - set(modules))
            raise ValueError(f"the batch's modules differ from the dataset's: missing {missing}, not in it {extra}")
        dtypes, shapes = self.manifest["dtypes"], self.manifest["shapes"]
        new: dict[str, tuple[str, list[int]]] = {}
        for name in modules:
            t = values[name]
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"module {name!r}: a {type(t).__name__}, not a torch tensor")
            if t.device.type != "cpu":
                raise ValueError(f"module {name!r}: on {t.device}, not the CPU")
            if t.dim() == 0 or int(t.shape[0]) != n:
                raise ValueError(f"module {name!r}: shape {list(t.shape)} for {n} tokens")
            dtype, shape = _dtype_name(t.dtype), list(t.shape[1:])
            if name not in dtypes:
                new[name] = (dtype, shape)
            elif dtypes[name] != dtype or list(shapes[name]) != shape:
                raise ValueError(
                    f"module {name!r}: {dtype} {shape} per token, the dataset holds {dtypes[name]} {shapes[name]}"
                )
        # Valid: only now does the batch change the writer.
        if not self.manifest["modules"]:
            self.manifest["modules"] = modules
        for name, (dtype, shape) in new.items():
            dtypes[name], shapes[name] = dtype, shape
        if not self._pending:
            self._pending = {name: [] for name in [*modules, *INDEX_KEYS]}
        for name in modules:
            self._pending[name].append(values[name])
        for key, t in zip(INDEX_KEYS, (ids, seq, pos)):
            self._pending[key].append(t)
        self._buffered_tokens += n
        self._buffered_batches += 1
        if self._buffered_tokens >= self._group_tokens:
            self._commit()

    @property
    def _group_tokens(self) -> int:
        return self.shard_tokens * (self.buffer_shards if self.buffer_shards > 0 else 1)

    def finish(self) -> None:
        """Commits what is buffered and marks this worker done (its manifest rewritten).
        Idempotent. Blocks on I/O."""
        if self._buffered_batches:
            self._commit()
        self.manifest["done"] = True
        self._write_manifest()

    def _commit(self) -> None:
        """Writes the buffered batches as one group: shards first, then the worker
        manifest (the group's commit point)."""
        import torch

        total, batches = self._buffered_tokens, self._buffered_batches
        group = len(self.manifest["groups"])
        order = None
        if self.buffer_shards > 0 and total > 1:
            generator = torch.Generator().manual_seed(group_seed(self.seed, self.worker_index, group))
            order = torch.randperm(total, generator=generator)
        columns: dict[str, Any] = {}
        # One name at a time, dropping the batches' tensors as they are joined: the peak
        # is one group plus one column, not two groups.
        for name in list(self._pending):
            parts = self._pending.pop(name)
            column = torch.cat(parts)
            del parts
            columns[name] = column.index_select(0, order) if order is not None else column
            del column
        self._pending = {}
        if total == 0:
            bounds: list[tuple[int, int]] = []
        elif order is None:
            bounds = [(0, total)]
        else:
            count = max(1, total // self.shard_tokens)
            bounds = [(i * self.shard_tokens, (i + 1) * self.shard_tokens if i < count - 1 else total)
                      for i in range(count)]
        first = len(self.manifest["shards"])
        entries: list[dict[str, Any]] = []
        for i, (start, stop) in enumerate(bounds):
            name = shard_name(self.worker_index, first + i)
            nbytes = self._write_shard(name, {k: v[start:stop] for k, v in columns.items()})
            entries.append({"file": name, "tokens": stop - start, "bytes": nbytes, "worker": self.worker_index})
        del columns
        if entries and self._local:
            _fsync_dir(f"{self.root}/shards")  # the shards' renames are durable before the manifest names them
        self.manifest["shards"].extend(entries)
        self.manifest["groups"].append({"batches": batches, "tokens": total})
        self.manifest["batches_done"] = int(self.manifest["batches_done"]) + batches
        self.manifest["tokens_done"] = int(self.manifest["tokens_done"]) + total
        self._buffered_tokens = self._buffered_batches = 0
        self._write_manifest()  # the commit point of the group
        self.tokens_done = int(self.manifest["tokens_done"])
        self.shards_written = len(self.manifest["shards"])
        self.bytes_written += sum(int(e["bytes"]) for e in entries)

    def _write_shard(self, name: str, tensors: dict[str, Any]) -> int:
        """Writes one shard whole under ``name``; its size in bytes."""
        from safetensors.torch import save_file

        metadata = {"format": FORMAT, "version": VERSION}
        target = f"{self.root}/{name}"
        if self._local:
            tmp = f"{target}.tmp"  # a fixed name: a kill leaves at most this, rewritten or removed on resume
            if self._confine is not None:
                # Checked as it is opened: a link planted since the writer opened is refused.
                check_confined(self._confine, tmp)
                check_confined(self._confine, target)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if self._confine is not None:
                _open_new(tmp, True).close()  # created here, not through a link planted at its name
            save_file(tensors, tmp, metadata=metadata)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, target)
            return os.path.getsize(target)
        # An object store cannot rename: the shard is serialized to a local temporary
        # file and put whole under its final name (an object appears whole or not at all);
        # a shard in no manifest is garbage that a resumed run rewrites or removes.
        with tempfile.TemporaryDirectory(prefix="hookwire-shard-") as folder:
            local = os.path.join(folder, "shard.safetensors")
            save_file(tensors, local, metadata=metadata)
            self.fs.put_file(local, target)
            return os.path.getsize(local)

    def _write_manifest(self) -> None:
        self.manifest["updated"] = _now()
        _write_json(self.fs, self._worker_path, self.manifest, self._confine)

    def _check_folder(self) -> None:
        """confine: refuses a dataset folder with a symlink among the format's folders
        and files (it would lead reads, writes or removals out of the folder)."""
        root = self._confine
        assert root is not None
        check_confined(root, root)
        for sub in ("shards", "workers", MANIFEST):
            check_confined(root, os.path.join(root, sub))
        for sub in ("shards", "workers"):
            folder = os.path.join(root, sub)
            if os.path.isdir(folder):
                for name in sorted(os.listdir(folder)):
                    check_confined(root, os.path.join(folder, name))

    # ---- opening: overwrite and leftovers -----------------------------------------------

    def _remove_old(self) -> None:
        """overwrite=True: removes manifest.json, then this worker's manifest, then its
        shards (worker 0 also other splits' manifests and shards of workers that this
        split does not have), in that order, so that a removal cut short never leaves a
        manifest naming a missing shard. Files of this split's other workers are theirs
        to remove (no two writers touch one file), and files not of the format stay."""
        _rm(self.fs, f"{self.root}/{MANIFEST}")
        own = worker_manifest_name(self.worker_index, self.num_workers).rsplit("/", 1)[-1]
        for base in _ls_names(self.fs, f"{self.root}/workers"):
            match = _WORKER_MANIFEST.match(base.removesuffix(".tmp"))
            if match and (base.removesuffix(".tmp") == own
                          or (self.worker_index == 0 and int(match.group(2)) != self.num_workers)):
                _rm(self.fs, f"{self.root}/workers/{base}")
        for base in _ls_names(self.fs, f"{self.root}/shards"):
            match = _SHARD.match(base)
            if match and (int(match.group(1)) == self.worker_index
                          or (self.worker_index == 0 and int(match.group(1)) >= self.num_workers)):
                _rm(self.fs, f"{self.root}/shards/{base}")

    def _remove_uncommitted(self) -> None:
        """Removes this worker's shard files that its manifest does not list (a group
        a killed run wrote but never committed, its temporary files): they would be
        rewritten under the same names anyway, but a job that is not resumed to the same
        point would leave them behind."""
        committed = len(self.manifest["shards"])
        for base in _ls_names(self.fs, f"{self.root}/shards"):
            match = _SHARD.match(base)
            if match and int(match.group(1)) == self.worker_index and (match.group(3) or int(match.group(2)) >= committed):
                _rm(self.fs, f"{self.root}/shards/{base}")

    # ---- merging ------------------------------------------------------------------------

    def merge(self) -> bool:
        """Worker 0 only (ValueError otherwise): writes manifest.json once every worker
        manifest of this split says done; returns whether the dataset is committed (now,
        or before). False means some worker is not done yet: call again later. Raises
        SettingsMismatch when a worker of this split wrote other settings, ValueError
        when workers disagree on a module's dtype or shape. Blocks on I/O."""
        if self.worker_index != 0:
            raise ValueError("only worker 0 writes the merged manifest")
        if self._confine is not None:  # other workers' files are read below: not through a link
            check_confined(self._confine, f"{self.root}/{MANIFEST}")
            check_confined(self._confine, f"{self.root}/workers")
        if read_json(self.fs, f"{self.root}/{MANIFEST}") is not None:
            return True
        workers: list[dict[str, Any]] = []
        for i in range(self.num_workers):
            if i == 0:
                record: dict[str, Any] | None = self.manifest
            else:
                path = f"{self.root}/{worker_manifest_name(i, self.num_workers)}"
                if self._confine is not None:
                    check_confined(self._confine, path)
                record = read_json(self.fs, path)
            if record is None or not record.get("done"):
                return False
            if record.get("settings_digest") != self.digest:
                raise SettingsMismatch(f"worker {i} wrote other settings: "
                                       + _difference(record.get("settings", {}), self.header["settings"]))
            workers.append(record)
        modules = next((list(m["modules"]) for m in workers if m.get("modules")), list(self.header["modules"]))
        dtypes: dict[str, str] = {}
        shapes: dict[str, list[int]] = {}
        for i, m in enumerate(workers):
            for name, dtype in m.get("dtypes", {}).items():
                shape = list(m.get("shapes", {}).get(name, []))
                if name in dtypes and (dtypes[name], shapes[name]) != (dtype, shape):
                    raise ValueError(f"module {name!r}: worker {i} stored {dtype} {shape}, "
                                     f"an earlier worker {dtypes[name]} {shapes[name]}")
                dtypes[name], shapes[name] = dtype, shape
        merged = {
            **{k: v for k, v in workers[0].items() if k not in WORKER_KEYS},
            "format": FORMAT, "version": VERSION, "modules": modules, "dtypes": dtypes, "shapes": shapes,
            "num_workers": self.num_workers, "tokens": sum(int(m["tokens_done"]) for m in workers),
            "shards": [s for m in workers for s in m["shards"]], "complete": True, "updated": _now(),
        }
        _write_json(self.fs, f"{self.root}/{MANIFEST}", merged, self._confine)
        return True


def _index_tensor(x: Any, key: str) -> Any:
    import torch

    t = torch.as_tensor(x)
    if t.dim() != 1 or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"{key}: an integer tensor [n] is needed, not {_dtype_name(t.dtype)} {list(t.shape)}")
    return t.to(torch.int64)


def _difference(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    """What differs between two settings objects, key by key (``key: X there, Y now``)."""
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    if not keys:
        return "the settings differ"
    shown = "; ".join(f"{k}: {json.dumps(old.get(k))[:80]} there, {json.dumps(new.get(k))[:80]} now" for k in keys[:6])
    return shown + (f" (and {len(keys) - 6} more)" if len(keys) > 6 else "")


__all__ = [
    "DatasetExists", "DatasetWriter", "FORMAT", "INDEX_KEYS", "MANIFEST", "SettingsMismatch", "VERSION",
    "group_seed", "read_manifest", "read_worker_manifests", "settings_digest", "shard_name", "worker_manifest_name",
]
