"""Reading activation datasets (docs/harvest.md): ``hookwire.ActivationDataset``.

Shards are memory-mapped, not read: opening a dataset reads its manifest and each shard's
safetensors header (a few KB); values are paged in by the OS as they are indexed. The
header is parsed here and the data mapped with numpy (safetensors' own ``safe_open`` maps
too, but cannot hand numpy a bfloat16 array, and we want one code path for both
frameworks). Imports without torch; ``framework="numpy"`` never touches torch.
"""

from __future__ import annotations

import bisect
import json
import os
import struct
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from ._harvest_format import INDEX_KEYS, MANIFEST

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64, "I32": np.int32,
    "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


class _Shard:
    """One memory-mapped shard: its header parsed, its arrays as views of the map."""

    def __init__(self, path: str, tokens: int) -> None:
        self.path = path
        self.tokens = tokens
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100 << 20:
                raise ValueError(f"{path}: a safetensors header of {size} bytes")
            self.header: dict[str, Any] = json.loads(f.read(size))
        self.base = 8 + size
        self._map: np.memmap | None = None

    def array(self, name: str) -> tuple[np.ndarray, str]:
        """The tensor ``name`` as a numpy view of the map, and its safetensors dtype."""
        info = self.header.get(name)
        if info is None:
            raise KeyError(f"{self.path} holds no tensor {name!r}")
        if self._map is None:
            # Copy-on-write: writable views (torch.from_numpy wants them) that never write the file.
            self._map = np.memmap(self.path, dtype=np.uint8, mode="c")
        begin, end = info["data_offsets"]
        kind = info["dtype"]
        raw = self._map[self.base + begin:self.base + end]
        return raw.view(_DTYPES[kind]).reshape(info["shape"]), kind


class ActivationDataset:
    """An activation dataset written by a harvest (server-side job or client sink).

    ``len(ds)`` is its number of tokens; ``ds[i]`` / ``ds[a:b]`` is a dict of module path
    -> values (``[...]`` or ``[n, ...]``) plus ``token_ids``, ``sequence`` and
    ``position``, across shard boundaries. With torch (``framework="torch"``, the default
    when torch imports) values are torch tensors that share memory with the map where a
    slice stays inside one shard (bfloat16 stays bfloat16); with ``framework="numpy"``
    they are numpy arrays, bfloat16 converted exactly to float32 (numpy has no bfloat16).
    A map-style dataset: ``torch.utils.data.DataLoader(ds, batch_size=...)`` works.

    Construction reads the manifest and the shard headers (blocks on I/O); raises
    FileNotFoundError when there is no manifest.json (an unfinished dataset: pass
    ``allow_incomplete=True`` to read the shards its worker manifests commit).
    Remote URLs (any fsspec URL) are read through fsspec's ``simplecache``: each shard is
    downloaded once, when first used, into ``cache_dir`` (a temporary folder by default).
    """

    def __init__(
        self, path: str | os.PathLike[str], *, modules: Sequence[str] | None = None, framework: str | None = None,
        allow_incomplete: bool = False, storage_options: Mapping[str, Any] | None = None,
        cache_dir: str | None = None,
    ) -> None:
        import fsspec

        self.url = os.fspath(path)
        self._remote = "://" in self.url and not self.url.startswith("file://")
        self._storage = dict(storage_options or {})
        self._cache_dir = cache_dir or (tempfile.mkdtemp(prefix="hookwire-acts-") if self._remote else None)
        fs, root = fsspec.core.url_to_fs(self.url, **self._storage)
        self._fs, self._root = fs, root.rstrip("/")
        manifest = _load(fs, f"{self._root}/{MANIFEST}")
        if manifest is None:
            if not allow_incomplete:
                raise FileNotFoundError(
                    f"{self.url} has no {MANIFEST}: the dataset is not finished (allow_incomplete=True reads what is committed)"
                )
            manifest = self._merge_workers()
        self.manifest: dict[str, Any] = manifest
        if framework is None:
            try:
                import torch  # noqa: F401

                framework = "torch"
            except ImportError:
                framework = "numpy"
        if framework not in ("torch", "numpy"):
            raise ValueError(f"framework {framework!r} is not torch or numpy")
        self.framework = framework
        all_modules = list(manifest.get("modules", []))
        chosen = list(modules) if modules is not None else all_modules
        unknown = [m for m in chosen if m not in all_modules]
        if unknown:
            raise KeyError(f"modules {unknown} are not in the dataset (it holds {all_modules})")
        #: The modules read (the dataset's, or the ones asked for), in shard order.
        self.modules: list[str] = chosen
        #: module -> stored dtype name ("bfloat16", ...) and per-token shape.
        self.dtypes: dict[str, str] = {m: manifest.get("dtypes", {}).get(m, "") for m in chosen}
        self.shapes: dict[str, list[int]] = {m: list(manifest.get("shapes", {}).get(m, [])) for m in chosen}
        #: The manifest's shard entries ({"file", "tokens", "bytes", "worker"}), in order.
        self.shards: list[dict[str, Any]] = [s for s in manifest.get("shards", []) if int(s["tokens"]) > 0]
        self._starts = [0]
        for s in self.shards:
            self._starts.append(self._starts[-1] + int(s["tokens"]))
        self._open: dict[int, _Shard] = {}

    def _merge_workers(self) -> dict[str, Any]:
        try:
            names = sorted(self._fs.ls(f"{self._root}/workers", detail=False))
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.url} has no {MANIFEST} and no worker manifests") from None
        merged: dict[str, Any] | None = None
        for name in names:
            if not name.endswith(".json"):
                continue
            record = _load(self._fs, name)
            if record is None:
                continue
            if merged is None:
                merged = {k: v for k, v in record.items() if k != "shards"}
                merged["shards"] = []
            merged["shards"].extend(record.get("shards", []))
            merged.setdefault("dtypes", {}).update(record.get("dtypes", {}))
            merged.setdefault("shapes", {}).update(record.get("shapes", {}))
        if merged is None:
            raise FileNotFoundError(f"{self.url} has no {MANIFEST} and no worker manifests")
        merged["tokens"] = sum(int(s["tokens"]) for s in merged["shards"])
        return merged

    def __len__(self) -> int:
        return self._starts[-1]

    def __repr__(self) -> str:
        return (f"ActivationDataset({self.url!r}: {len(self)} tokens, {len(self.shards)} shards, "
                f"modules {self.modules})")

    def _shard(self, i: int) -> _Shard:
        shard = self._open.get(i)
        if shard is None:
            entry = self.shards[i]
            location = f"{self._root}/{entry['file']}"
            if self._remote:
                import fsspec

                local = fsspec.open_local(
                    f"simplecache::{self.url.rstrip('/')}/{entry['file']}",
                    simplecache={"cache_storage": self._cache_dir}, **{self._fs.protocol[0] if isinstance(
                        self._fs.protocol, tuple) else self._fs.protocol: self._storage},
                )
                location = local if isinstance(local, str) else local[0]
            shard = self._open[i] = _Shard(location, int(entry["tokens"]))
        return shard

    def _convert(self, array: np.ndarray, kind: str) -> Any:
        if self.framework == "numpy":
            if kind == "BF16":
                return (array.astype(np.uint32) << 16).view(np.float32)
            return array
        import torch

        t = torch.from_numpy(array)
        return t.view(torch.bfloat16) if kind == "BF16" else t

    def _columns(self) -> list[str]:
        return [*self.modules, *INDEX_KEYS]

    def shard(self, i: int, *, modules: Sequence[str] | None = None) -> dict[str, Any]:
        """Shard ``i`` whole: views of its map (nothing is read until used)."""
        shard = self._shard(i)
        names = [*(modules if modules is not None else self.modules), *INDEX_KEYS]
        return {name: self._convert(*shard.array(name)) for name in names}

    def iter_shards(self, *, modules: Sequence[str] | None = None) -> Iterator[dict[str, Any]]:
        """Each shard whole, in order (see ``shard``)."""
        for i in range(len(self.shards)):
            yield self.shard(i, modules=modules)

    def _rows(self, start: int, stop: int, names: Sequence[str]) -> dict[str, Any]:
        pieces: dict[str, list[Any]] = {name: [] for name in names}
        i = bisect.bisect_right(self._starts, start) - 1
        while start < stop and i < len(self.shards):
            shard = self._shard(i)
            lo = start - self._starts[i]
            hi = min(stop, self._starts[i + 1]) - self._starts[i]
            for name in names:
                array, kind = shard.array(name)
                pieces[name].append(self._convert(array[lo:hi], kind))
            start = self._starts[i] + hi
            i += 1
        out: dict[str, Any] = {}
        for name, parts in pieces.items():
            if len(parts) == 1:
                out[name] = parts[0]
            elif self.framework == "torch":
                import torch

                out[name] = torch.cat(parts)
            else:
                out[name] = np.concatenate(parts)
        return out

    def __getitem__(self, key: int | slice) -> dict[str, Any]:
        n = len(self)
        if isinstance(key, slice):
            start, stop, step = key.indices(n)
            if step != 1:
                raise ValueError("ActivationDataset slices take step 1")
            return self._rows(start, max(start, stop), self._columns())
        index = int(key)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"token {key} of {n}")
        return {k: v[0] for k, v in self._rows(index, index + 1, self._columns()).items()}

    def module(self, name: str) -> Any:
        """Every value of one module, concatenated into memory ([tokens, ...]): reads the
        whole column (use ``iter_batches`` or ``shard`` for large datasets)."""
        if name not in self.modules:
            raise KeyError(f"module {name!r} is not in {self.modules}")
        return self._rows(0, len(self), [name])[name]

    def iter_batches(
        self, batch_size: int, *, modules: Sequence[str] | None = None, shuffle: bool = False, seed: int = 0,
    ) -> Iterator[dict[str, Any]]:
        """Batches of ``batch_size`` tokens (the last one shorter). With ``shuffle``, the
        tokens are visited in an order drawn from ``seed`` (the shards in a random order,
        each shard's tokens permuted), which reads one shard at a time."""
        if batch_size < 1:
            raise ValueError(f"batch_size {batch_size} is not positive")
        names = [*(modules if modules is not None else self.modules), *INDEX_KEYS]
        if not shuffle:
            for start in range(0, len(self), batch_size):
                yield self._rows(start, min(len(self), start + batch_size), names)
            return
        rng = np.random.default_rng(seed)
        carry: dict[str, list[Any]] = {name: [] for name in names}
        held = 0
        for i in rng.permutation(len(self.shards)):
            shard = self._shard(int(i))
            order = rng.permutation(shard.tokens)
            columns = {}
            for name in names:
                array, kind = shard.array(name)
                columns[name] = self._convert(np.ascontiguousarray(array[order]), kind)
            for name in names:
                carry[name].append(columns[name])
            held += shard.tokens
            while held >= batch_size:
                joined = {name: self._join(parts) for name, parts in carry.items()}
                yield {name: v[:batch_size] for name, v in joined.items()}
                carry = {name: [v[batch_size:]] for name, v in joined.items()}
                held -= batch_size
        if held:
            yield {name: self._join(parts) for name, parts in carry.items()}

    def _join(self, parts: list[Any]) -> Any:
        if len(parts) == 1:
            return parts[0]
        if self.framework == "torch":
            import torch

            return torch.cat(parts)
        return np.concatenate(parts)


def _load(fs: Any, path: str) -> dict[str, Any] | None:
    try:
        with fs.open(path, "rb") as f:
            loaded = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        return None
    return loaded if isinstance(loaded, dict) else None


__all__ = ["ActivationDataset"]
