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
permuted with a generator seeded from the seed, the worker and the group's index), the
group is cut into shards, each written (to a temporary name, then renamed, where the
storage can rename), then the worker manifest is rewritten. Group boundaries depend only
on the batches, so a job killed at any point and resumed (skipping the batches its manifest
counts) rebuilds exactly the same groups: no token is duplicated or lost, and a shard file
left by the killed run (in no manifest) is simply rewritten.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import tempfile
from collections.abc import Mapping
from typing import Any

FORMAT = "hookwire-activations"
VERSION = "1"
MANIFEST = "manifest.json"
INDEX_KEYS = ("token_ids", "sequence", "position")


class DatasetExists(Exception):
    """A finished dataset is where a writer was opened without overwrite."""


class SettingsMismatch(Exception):
    """An unfinished dataset written with other settings is where a writer was opened."""


def settings_digest(settings: Mapping[str, Any]) -> str:
    """sha256 (hex) of the canonical JSON of ``settings``."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def worker_manifest_name(worker_index: int, num_workers: int) -> str:
    return f"workers/w{worker_index:04d}-of-{num_workers:04d}.json"


def shard_name(worker_index: int, index: int) -> str:
    return f"shards/w{worker_index:04d}-{index:06d}.safetensors"


def group_seed(seed: int, worker_index: int, group: int) -> int:
    """The seed of a group's permutation: a function of (seed, worker, group) only."""
    digest = hashlib.sha256(f"{seed}:{worker_index}:{group}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _fs(url: str, storage_options: Mapping[str, Any] | None) -> tuple[Any, str]:
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
    return fs, path.rstrip("/")


def _local(fs: Any) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")


def _read_json(fs: Any, path: str) -> dict[str, Any] | None:
    try:
        with fs.open(path, "rb") as f:
            loaded = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        return None
    return loaded if isinstance(loaded, dict) else None


def read_manifest(url: str, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """The merged manifest of the dataset at ``url``, or None when it has none (yet)."""
    fs, root = _fs(url, storage_options)
    return _read_json(fs, f"{root}/{MANIFEST}")


def _write_json(fs: Any, path: str, record: Mapping[str, Any]) -> None:
    """Writes ``record`` whole or not at all where the storage can rename (local files);
    object stores write a whole object per put."""
    data = json.dumps(record, indent=1, sort_keys=True).encode()
    if _local(fs):
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    else:
        fs.pipe(path, data)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat()


class DatasetWriter:
    """Writes one worker's part of a dataset (see the module docstring). Not thread-safe:
    one thread calls it at a time. Every method blocks on storage I/O."""

    def __init__(
        self, url: str, *, header: Mapping[str, Any], worker_index: int = 0, num_workers: int = 1,
        shard_tokens: int = 65536, shuffle_buffer_shards: int = 0, shuffle_seed: int = 0, overwrite: bool = False,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        """Opens the dataset folder at ``url``. Raises DatasetExists when it holds a finished
        dataset (unless ``overwrite``: its files are removed first), SettingsMismatch when
        it holds this worker's unfinished part written with other settings; otherwise an
        unfinished part is resumed (``resume_batches``)."""
        if not 0 <= worker_index < num_workers:
            raise ValueError(f"worker_index {worker_index} is not in [0, {num_workers})")
        if shard_tokens < 1:
            raise ValueError(f"shard_tokens {shard_tokens} is not positive")
        self.url = url
        self.fs, self.root = _fs(url, storage_options)
        self.worker_index, self.num_workers = worker_index, num_workers
        self.shard_tokens = shard_tokens
        self.buffer_shards = shuffle_buffer_shards
        self.seed = shuffle_seed
        self.header = dict(header)
        self.digest = settings_digest(self.header.get("settings", {}))
        self._worker_path = f"{self.root}/{worker_manifest_name(worker_index, num_workers)}"
        merged = _read_json(self.fs, f"{self.root}/{MANIFEST}")
        if merged is not None and not overwrite:
            raise DatasetExists(f"{url} holds a finished dataset ({merged.get('tokens', '?')} tokens)")
        if overwrite:
            self._remove_dataset(merged is not None)
        existing = _read_json(self.fs, self._worker_path)
        if existing is not None and existing.get("settings_digest") != self.digest:
            raise SettingsMismatch(_difference(existing.get("settings", {}), self.header.get("settings", {})))
        others = [] if overwrite else [m for m in self._worker_manifests() if m.get("settings_digest") != self.digest]
        if others:
            raise SettingsMismatch("another worker's manifest in it was written with other settings: "
                                   + _difference(others[0].get("settings", {}), self.header.get("settings", {})))
        self.manifest: dict[str, Any] = existing or {
            "format": FORMAT, "version": VERSION, **self.header, "settings_digest": self.digest,
            "dtypes": {}, "shapes": {}, "worker_index": worker_index, "num_workers": num_workers,
            "batches_done": 0, "batches_total": 0, "tokens_done": 0, "shards": [], "done": False, "updated": _now(),
        }
        #: This worker's batches already committed: the job skips that many of its own batches.
        self.resume_batches = int(self.manifest["batches_done"])
        self._buffer: list[tuple[dict[str, Any], Any, Any, Any]] = []
        self._buffered_tokens = 0
        self._buffered_batches = 0

    # ---- figures ------------------------------------------------------------------------

    @property
    def tokens_done(self) -> int:
        """Tokens committed by this worker."""
        return int(self.manifest["tokens_done"])

    @property
    def shards_written(self) -> int:
        return len(self.manifest["shards"])

    @property
    def bytes_written(self) -> int:
        return sum(int(s["bytes"]) for s in self.manifest["shards"])

    @property
    def done(self) -> bool:
        return bool(self.manifest.get("done"))

    def set_batches_total(self, n: int) -> None:
        """Records how many batches this worker runs in all (progress, for readers)."""
        self.manifest["batches_total"] = int(n)

    # ---- writing ------------------------------------------------------------------------

    def add(self, values: Mapping[str, Any], token_ids: Any, sequence: Any, position: Any) -> None:
        """Buffers one batch (``values``: module -> CPU tensor ``[n, ...]``; the index
        tensors int64 ``[n]``) and commits a group when the buffer holds enough tokens.
        ValueError when a module's dtype or per-token shape differs from the first batch's."""
        import torch

        n = int(token_ids.shape[0])
        modules = list(self.header.get("modules") or values)
        if set(values) != set(modules):
            raise ValueError(f"the batch has modules {sorted(values)}, the dataset {sorted(modules)}")
        dtypes, shapes = self.manifest["dtypes"], self.manifest["shapes"]
        for name in modules:
            t = values[name]
            if int(t.shape[0]) != n:
                raise ValueError(f"module {name!r}: {t.shape[0]} rows for {n} tokens")
            dtype, shape = str(t.dtype).removeprefix("torch."), list(t.shape[1:])
            if name not in dtypes:
                dtypes[name], shapes[name] = dtype, shape
            elif dtypes[name] != dtype or shapes[name] != shape:
                raise ValueError(
                    f"module {name!r}: {dtype} {shape} per token, the dataset holds {dtypes[name]} {shapes[name]}"
                )
        ids, seq, pos = (torch.as_tensor(x).to(torch.int64) for x in (token_ids, sequence, position))
        self._buffer.append(({name: values[name] for name in modules}, ids, seq, pos))
        self._buffered_tokens += n
        self._buffered_batches += 1
        if self._buffered_tokens >= self._group_tokens:
            self._commit()

    @property
    def _group_tokens(self) -> int:
        return self.shard_tokens * (self.buffer_shards if self.buffer_shards > 0 else 1)

    def finish(self) -> None:
        """Commits what is buffered and marks this worker done."""
        if self._buffer:
            self._commit()
        self.manifest["done"] = True
        self.manifest["updated"] = _now()
        _write_json(self.fs, self._worker_path, self.manifest)

    def _commit(self) -> None:
        import torch

        modules = list(self._buffer[0][0])
        columns = {name: torch.cat([b[0][name] for b in self._buffer]) for name in modules}
        for i, key in enumerate(INDEX_KEYS):
            columns[key] = torch.cat([b[i + 1] for b in self._buffer])  # type: ignore[misc]
        total = self._buffered_tokens
        group = len(self.manifest.setdefault("groups", []))
        if self.buffer_shards > 0:
            generator = torch.Generator().manual_seed(group_seed(self.seed, self.worker_index, group))
            order = torch.randperm(total, generator=generator)
            columns = {k: v[order] for k, v in columns.items()}
        self._buffer.clear()
        shards = []
        first = len(self.manifest["shards"])
        count = max(1, total // self.shard_tokens) if self.buffer_shards > 0 else 1
        for i in range(count):
            start = i * self.shard_tokens if count > 1 else 0
            stop = (i + 1) * self.shard_tokens if i < count - 1 else total
            part = {k: v[start:stop].contiguous() for k, v in columns.items()}
            name = shard_name(self.worker_index, first + i)
            nbytes = self._write_shard(name, part)
            shards.append({"file": name, "tokens": stop - start, "bytes": nbytes, "worker": self.worker_index})
        self.manifest["shards"].extend(shards)
        self.manifest["groups"].append({"batches": self._buffered_batches, "tokens": total})
        self.manifest["batches_done"] = int(self.manifest["batches_done"]) + self._buffered_batches
        self.manifest["tokens_done"] = int(self.manifest["tokens_done"]) + total
        self.manifest["updated"] = _now()
        self._buffered_tokens = self._buffered_batches = 0
        _write_json(self.fs, self._worker_path, self.manifest)  # the commit point of the group

    def _write_shard(self, name: str, tensors: dict[str, Any]) -> int:
        from safetensors.torch import save_file

        metadata = {"format": FORMAT, "version": VERSION}
        target = f"{self.root}/{name}"
        if _local(self.fs):
            folder = os.path.dirname(target)
            os.makedirs(folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".safetensors")
            os.close(fd)
            try:
                save_file(tensors, tmp, metadata=metadata)
                os.replace(tmp, target)
            except BaseException:
                if os.path.exists(tmp):
                    os.unlink(tmp)
                raise
            return os.path.getsize(target)
        # No rename on object stores: written whole under its final name; a shard in no
        # manifest is garbage that a resumed run overwrites.
        with tempfile.TemporaryDirectory() as tmpdir:
            local = os.path.join(tmpdir, "shard.safetensors")
            save_file(tensors, local, metadata=metadata)
            self.fs.put_file(local, target)
            return os.path.getsize(local)

    # ---- merging ------------------------------------------------------------------------

    def _worker_manifests(self) -> list[dict[str, Any]]:
        folder = f"{self.root}/workers"
        try:
            names = sorted(self.fs.ls(folder, detail=False))
        except FileNotFoundError:
            return []
        out = []
        for name in names:
            base = name.rsplit("/", 1)[-1]
            if base.startswith("w") and base.endswith(".json") and "-of-" in base:
                record = _read_json(self.fs, name if "://" in name or name.startswith("/") else f"{folder}/{base}")
                if record is not None:
                    out.append(record)
        return out

    def merge(self) -> bool:
        """Worker 0: writes manifest.json once every worker's manifest is done; whether the
        dataset is committed (now or before)."""
        if self.worker_index != 0:
            raise ValueError("only worker 0 writes the merged manifest")
        if _read_json(self.fs, f"{self.root}/{MANIFEST}") is not None:
            return True
        workers = {
            int(m["worker_index"]): m for m in self._worker_manifests()
            if m.get("num_workers") == self.num_workers and m.get("settings_digest") == self.digest
        }
        if set(workers) != set(range(self.num_workers)) or not all(m.get("done") for m in workers.values()):
            return False
        dtypes: dict[str, Any] = {}
        shapes: dict[str, Any] = {}
        for m in workers.values():
            dtypes.update(m.get("dtypes", {}))
            shapes.update(m.get("shapes", {}))
        merged = {
            "format": FORMAT, "version": VERSION, **self.header, "settings_digest": self.digest,
            "dtypes": dtypes, "shapes": shapes, "num_workers": self.num_workers,
            "tokens": sum(int(m["tokens_done"]) for m in workers.values()),
            "shards": [s for i in sorted(workers) for s in workers[i]["shards"]],
            "complete": True, "updated": _now(),
        }
        _write_json(self.fs, f"{self.root}/{MANIFEST}", merged)
        return True

    def _remove_dataset(self, finished: bool) -> None:
        """Removes the merged manifest and this worker's files (its shards and manifest;
        worker 0 also the manifests of other splits), nothing else: the other workers of
        a split remove their own, so no two writers touch the same file."""
        if finished:
            self.fs.rm(f"{self.root}/{MANIFEST}")
        own = f"w{self.worker_index:04d}-"
        for sub in ("shards", "workers"):
            folder = f"{self.root}/{sub}"
            try:
                names = self.fs.ls(folder, detail=False)
            except FileNotFoundError:
                continue
            for name in names:
                base = name.rsplit("/", 1)[-1]
                stale_split = (sub == "workers" and self.worker_index == 0
                               and not base.endswith(f"-of-{self.num_workers:04d}.json"))
                if base.startswith(own) or stale_split:
                    self.fs.rm(f"{folder}/{base}")


def _difference(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    if not keys:
        return "the settings differ"
    return "; ".join(f"{k}: {json.dumps(old.get(k))[:80]} there, {json.dumps(new.get(k))[:80]} now" for k in keys[:4])
