"""Reading activation datasets (docs/harvest.md, "Dataset format"): ``hookwire.ActivationDataset``.

Shards are memory-mapped, not read: opening a dataset reads its manifest only; a shard's
safetensors header (a few KB) is read when the shard is first used, and its values are
paged in by the OS as they are indexed. The header is parsed here (8 bytes of length,
then JSON) and the file mapped with ``numpy.memmap``: safetensors' own ``safe_open``
maps the file too, but its ``get_tensor``/``get_slice`` copy what they return and it
cannot hand numpy a bfloat16 array, while a numpy view of the map is zero-copy for both
frameworks (``torch.from_numpy`` of it, bfloat16 viewed from uint16).

Imports without torch; ``framework="numpy"`` never imports it.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import shutil
import struct
import tempfile
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from .wire.harvest_format import (
    FORMAT, INDEX_KEYS, MANIFEST, VERSION, WORKER_KEYS, is_local, open_fs, read_json, read_worker_manifests,
)

# safetensors dtype -> the numpy dtype its bytes are mapped as. bfloat16 and float8 have
# no numpy type: they are mapped as unsigned integers of their width and viewed as the
# torch dtype (torch), or converted exactly to float32 (numpy; float8 cannot be).
_NUMPY = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F8_E4M3": np.uint8,
    "F8_E5M2": np.uint8, "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U64": np.uint64,
    "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}
_TORCH_VIEW = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
MAX_HEADER = 100 << 20


class _Shard:
    """One memory-mapped shard: its header parsed, its tensors as numpy views of the map."""

    def __init__(self, path: str, tokens: int, nbytes: int | None, label: str) -> None:
        self.path, self.tokens, self.label = path, tokens, label
        size = os.path.getsize(path)
        if nbytes is not None and size != nbytes:
            raise ValueError(f"{label}: {size} bytes, the manifest says {nbytes} (the file changed)")
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > MAX_HEADER or 8 + length > size:
                raise ValueError(f"{label}: not a safetensors file (a header of {length} bytes)")
            self.header: dict[str, Any] = json.loads(f.read(length))
        self.base = 8 + length
        # Copy-on-write: writable views (torch.from_numpy wants them) whose writes stay private.
        self._map = np.memmap(path, dtype=np.uint8, mode="c") if size > self.base else np.zeros(0, np.uint8)

    def raw(self, name: str) -> tuple[np.ndarray, str]:
        """Tensor ``name`` as a numpy view of the map (bfloat16 as uint16), and its
        safetensors dtype."""
        info = self.header.get(name)
        if info is None or name == "__metadata__":
            raise KeyError(f"{self.label} holds no tensor {name!r}")
        begin, end = info["data_offsets"]
        kind = info["dtype"]
        if kind not in _NUMPY:
            raise ValueError(f"{self.label}: tensor {name!r} has dtype {kind}, which this reader does not know")
        shape = list(info["shape"])
        if not shape or shape[0] != self.tokens:
            raise ValueError(f"{self.label}: tensor {name!r} has shape {shape}, the manifest says {self.tokens} tokens")
        return self._map[self.base + begin:self.base + end].view(_NUMPY[kind]).reshape(shape), kind


class ActivationDataset:
    """An activation dataset written by a harvest (a server-side job or the client sink).

    ``len(ds)`` is its number of tokens. ``ds[i]`` is one token, ``ds[a:b]`` (any step)
    or ``ds[[i, j, ...]]`` (a list, numpy array or tensor of indices) several: a dict of
    module path -> values (``[...]`` per token, ``[n, ...]`` for several) plus
    ``token_ids``, ``sequence`` and ``position``, across shard boundaries.

    Values: with ``framework="torch"`` (the default when torch imports) torch tensors,
    which share memory with the map where a contiguous slice stays inside one shard
    (bfloat16 stays bfloat16); otherwise copies. With ``framework="numpy"`` numpy
    arrays, bfloat16 converted exactly to float32 (numpy has no bfloat16; every bfloat16
    is a float32). The map is copy-on-write: writing into a returned view never changes
    the file, but does change what this object returns for those tokens while the shard
    stays open (``.clone()`` a value before editing it in place; DataLoader's collation
    copies already).

    A map-style dataset: ``torch.utils.data.DataLoader(ds, batch_size=...)`` works (one
    ``ds[i]`` per token, collated); faster, one gather per batch:
    ``DataLoader(ds, batch_size=None, sampler=BatchSampler(RandomSampler(ds), 4096,
    drop_last=False))``. It pickles without its maps (DataLoader workers reopen shards).

    Lazy: construction reads the manifest only (blocks on that I/O); each shard is
    opened (its header read, mapped) when first used; at most ``max_open_shards`` stay
    open (each map holds a file descriptor). Raises FileNotFoundError when there is no
    manifest.json (an unfinished dataset: ``allow_incomplete=True`` reads what its
    worker manifests commit, merged as worker 0 would), ValueError for another format or
    version, KeyError for ``modules`` it does not hold; a shard whose size differs from
    its manifest entry raises ValueError when opened. An unfinished dataset's manifest
    says ``complete: false`` and lists ``workers_done`` (the workers that finished).

    Remote URLs (any fsspec URL; ``storage_options`` for its filesystem): each shard is
    downloaded whole when first used, with the filesystem's ``get_file``, into
    ``cache_dir`` (default: a temporary folder removed with the dataset), then mapped.
    The cache is hookwire's own rather than fsspec's ``simplecache`` because that one
    downloads in place (a killed download, or a second process reading meanwhile, sees a
    partial file) and keys files by path only: here a download goes to a temporary name
    renamed when whole, and the cached name includes the remote file's ``ukey`` (its
    size, etag or mtime), so a persistent ``cache_dir`` never serves a changed shard.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, modules: Sequence[str] | None = None, framework: str | None = None,
        allow_incomplete: bool = False, storage_options: Mapping[str, Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None, max_open_shards: int = 64,
    ) -> None:
        self.url = os.fspath(path)
        self._fs, self._root = open_fs(self.url, storage_options)
        self._local = is_local(self._fs)
        manifest = read_json(self._fs, f"{self._root}/{MANIFEST}")
        if manifest is None:
            if not allow_incomplete:
                raise FileNotFoundError(f"{self.url} has no {MANIFEST}: no dataset, or an unfinished one "
                                        "(allow_incomplete=True reads what it has committed)")
            manifest = _merge_workers(self.url, read_worker_manifests(self._fs, self._root))
        if manifest.get("format") != FORMAT or str(manifest.get("version")) != VERSION:
            raise ValueError(f"{self.url}: format {manifest.get('format')!r} version {manifest.get('version')!r}, "
                             f"not {FORMAT!r} version {VERSION!r}")
        #: The manifest read (manifest.json, or the workers' merged with allow_incomplete).
        self.manifest: dict[str, Any] = manifest
        if framework is None:
            try:
                import torch  # noqa: F401
            except ImportError:
                framework = "numpy"
            else:
                framework = "torch"
        if framework not in ("torch", "numpy"):
            raise ValueError(f"framework {framework!r} is not 'torch' or 'numpy'")
        self.framework: str = framework
        held = list(manifest.get("modules", []))
        chosen = list(modules) if modules is not None else held
        unknown = [m for m in chosen if m not in held]
        if unknown:
            raise KeyError(f"modules {unknown} are not in the dataset (it holds {held})")
        #: The modules read (the dataset's, or those asked for), in shard order.
        self.modules: list[str] = chosen
        #: module -> stored dtype name ("bfloat16", ...), and per-token shape.
        self.dtypes: dict[str, str] = {m: str(manifest.get("dtypes", {}).get(m, "")) for m in chosen}
        self.shapes: dict[str, list[int]] = {m: list(manifest.get("shapes", {}).get(m, [])) for m in chosen}
        #: The manifest's shard entries ({"file", "tokens", "bytes", "worker"}), in order
        #: (shards of no tokens left out).
        self.shards: list[dict[str, Any]] = [s for s in manifest.get("shards", []) if int(s["tokens"]) > 0]
        self._starts = np.zeros(len(self.shards) + 1, dtype=np.int64)
        np.cumsum([int(s["tokens"]) for s in self.shards], out=self._starts[1:])
        self._max_open = max(1, max_open_shards)
        self._open: collections.OrderedDict[int, _Shard] = collections.OrderedDict()
        self._cache_dir: str | None = None
        if not self._local:
            if cache_dir is not None:
                self._cache_dir = os.fspath(cache_dir)
                os.makedirs(self._cache_dir, exist_ok=True)
            else:
                self._cache_dir = tempfile.mkdtemp(prefix="hookwire-acts-")
                # Removed with the dataset, by the process that made it only (a forked
                # DataLoader worker inherits the object but not the folder's lifetime).
                # Maps already handed out stay valid after the files are unlinked.
                weakref.finalize(self, _remove_cache, self._cache_dir, os.getpid())

    # ---- shards -------------------------------------------------------------------------

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __repr__(self) -> str:
        return (f"ActivationDataset({self.url!r}: {len(self)} tokens, {len(self.shards)} shards, "
                f"modules {self.modules}, {self.framework})")

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_open"] = collections.OrderedDict()  # maps are reopened, never pickled (that would copy them)
        return state

    def _shard(self, i: int) -> _Shard:
        shard = self._open.get(i)
        if shard is not None:
            self._open.move_to_end(i)
            return shard
        entry = self.shards[i]
        label = f"{self.url.rstrip('/')}/{entry['file']}"
        remote = f"{self._root}/{entry['file']}"
        local = remote if self._local else self._download(remote)
        nbytes = int(entry["bytes"]) if "bytes" in entry else None
        shard = self._open[i] = _Shard(local, int(entry["tokens"]), nbytes, label)
        while len(self._open) > self._max_open:
            self._open.popitem(last=False)  # its views still hold their map; the dataset lets go
        return shard

    def _download(self, remote: str) -> str:
        assert self._cache_dir is not None
        ukey = self._fs.ukey(remote)
        key = hashlib.sha256(f"{self._fs.unstrip_protocol(remote)}\0{ukey}".encode()).hexdigest()[:40]
        local = os.path.join(self._cache_dir, f"{key}.safetensors")
        if not os.path.exists(local):
            fd, tmp = tempfile.mkstemp(dir=self._cache_dir, prefix=".part-", suffix=".safetensors")
            os.close(fd)
            try:
                self._fs.get_file(remote, tmp)
                os.replace(tmp, local)  # whole, or not there: another process never sees a part
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        return local

    def _raw(self, i: int, name: str) -> tuple[np.ndarray, str]:
        return self._shard(i).raw(name)

    def _convert(self, array: np.ndarray, kind: str) -> Any:
        """A raw array (bfloat16 as uint16) as the framework's value: zero-copy for
        torch; numpy converts bfloat16 to float32 (exact: a bfloat16 is the top half of
        a float32)."""
        if self.framework == "numpy":
            if kind == "BF16":
                return (array.astype(np.uint32) << 16).view(np.float32)
            if kind in _TORCH_VIEW:
                raise ValueError(f"{kind} values have no numpy type: read this dataset with framework='torch'")
            return array
        import torch

        t = torch.from_numpy(array)
        return t.view(getattr(torch, _TORCH_VIEW[kind])) if kind in _TORCH_VIEW else t

    def _names(self, modules: Sequence[str] | None) -> list[str]:
        if modules is None:
            return [*self.modules, *INDEX_KEYS]
        unknown = [m for m in modules if m not in self.modules]
        if unknown:
            raise KeyError(f"modules {unknown} are not read from this dataset ({self.modules})")
        return [*modules, *INDEX_KEYS]

    def shard(self, i: int, *, modules: Sequence[str] | None = None) -> dict[str, Any]:
        """Shard ``i`` whole (``i`` indexes ``ds.shards``), zero-copy views of its map
        for torch (nothing is read until used)."""
        return {name: self._convert(*self._raw(i, name)) for name in self._names(modules)}

    def iter_shards(self, *, modules: Sequence[str] | None = None) -> Iterator[dict[str, Any]]:
        """Each shard whole, in order (see ``shard``)."""
        for i in range(len(self.shards)):
            yield self.shard(i, modules=modules)

    # ---- indexing -----------------------------------------------------------------------

    def _range(self, start: int, stop: int, names: Sequence[str]) -> dict[str, Any]:
        """Tokens [start, stop): views when they lie in one shard, else joined."""
        pieces: dict[str, list[np.ndarray]] = {name: [] for name in names}
        kinds: dict[str, str] = {}
        i = int(np.searchsorted(self._starts, start, side="right")) - 1
        while start < stop:
            lo, hi = start - int(self._starts[i]), min(stop, int(self._starts[i + 1])) - int(self._starts[i])
            for name in names:
                array, kinds[name] = self._raw(i, name)
                pieces[name].append(array[lo:hi])
            start = int(self._starts[i]) + hi
            i += 1
        if not kinds:  # an empty range: empty values of the right dtype and shape
            return self._take(np.zeros(0, dtype=np.int64), names)
        return {name: self._convert(parts[0] if len(parts) == 1 else np.concatenate(parts), kinds[name])
                for name, parts in pieces.items()}

    def _take(self, index: np.ndarray, names: Sequence[str]) -> dict[str, Any]:
        """Tokens at ``index`` (in range, any order, repeats allowed), gathered shard by
        shard into new arrays."""
        shard_of = np.searchsorted(self._starts, index, side="right") - 1
        out: dict[str, np.ndarray] = {}
        kinds: dict[str, str] = {}
        used = np.unique(shard_of)
        for name in names:
            for i in used:
                array, kind = self._raw(int(i), name)
                where = np.nonzero(shard_of == i)[0]
                if name not in out:
                    out[name] = np.empty((len(index), *array.shape[1:]), dtype=array.dtype)
                    kinds[name] = kind
                out[name][where] = array[index[where] - self._starts[i]]
            if name not in out:  # no tokens asked for
                out[name], kinds[name] = self._empty(name)
        return {name: self._convert(out[name], kinds[name]) for name in names}

    def _empty(self, name: str) -> tuple[np.ndarray, str]:
        if self.shards:
            array, kind = self._raw(0, name)
            return np.empty((0, *array.shape[1:]), dtype=array.dtype), kind
        if name in INDEX_KEYS:
            return np.empty(0, dtype=np.int64), "I64"
        kind = _SAFETENSORS.get(self.dtypes.get(name, ""), "F32")
        return np.empty((0, *self.shapes.get(name, [])), dtype=_NUMPY[kind]), kind

    def _index(self, key: Any) -> np.ndarray:
        n = len(self)
        index = np.asarray(key.cpu() if hasattr(key, "cpu") else key)
        if index.dtype == np.bool_ or not np.issubdtype(index.dtype, np.integer) or index.ndim != 1:
            if index.size == 0 and index.ndim == 1:
                return np.zeros(0, dtype=np.int64)
            raise TypeError(f"an index list must be 1-D integers, not {index.dtype} {list(index.shape)}")
        index = index.astype(np.int64)
        index = np.where(index < 0, index + n, index)
        if index.size and (index.min() < 0 or index.max() >= n):
            raise IndexError(f"an index is out of range for {n} tokens")
        return index

    def _get(self, key: Any, names: Sequence[str]) -> dict[str, Any]:
        n = len(self)
        if isinstance(key, slice):
            start, stop, step = key.indices(n)
            if step == 1:
                return self._range(start, max(start, stop), names)
            return self._take(np.arange(start, stop, step, dtype=np.int64), names)
        if isinstance(key, (int, np.integer)) or (hasattr(key, "ndim") and key.ndim == 0):
            index = int(key)
            if index < 0:
                index += n
            if not 0 <= index < n:
                raise IndexError(f"token {int(key)} of {n}")
            return {k: v[0] for k, v in self._range(index, index + 1, names).items()}
        return self._take(self._index(key), names)

    def __getitem__(self, key: int | slice | Sequence[int] | Any) -> dict[str, Any]:
        """One token (an int), several (a slice, or a 1-D sequence/array/tensor of
        indices): module -> values, plus ``token_ids``, ``sequence``, ``position``."""
        return self._get(key, self._names(None))

    def module(self, name: str) -> ModuleColumn:
        """One module's values as a lazily concatenating view over the shards (see
        ModuleColumn): nothing is read until it is indexed or iterated."""
        if name not in self.modules and name not in INDEX_KEYS:
            raise KeyError(f"module {name!r} is not in {self.modules}")
        return ModuleColumn(self, name)

    def iter_batches(
        self, batch_size: int, *, modules: Sequence[str] | None = None, shuffle: bool = False, seed: int = 0,
        drop_last: bool = False,
    ) -> Iterator[dict[str, Any]]:
        """Batches of ``batch_size`` tokens in dataset order (the last one shorter
        unless ``drop_last``), as ``ds[a:b]`` gives them (views within a shard).

        With ``shuffle``, tokens are visited in an order drawn from ``seed`` (numpy's
        ``default_rng``): the shards in a random order, each shard's tokens permuted, a
        batch taking the rest of one shard and the start of the next. It reads one shard
        at a time (a shard's columns in memory at once, not the dataset), so the mixing
        is within a shard; a dataset harvested with its own shuffle buffer is mixed
        across ``shuffle_buffer_shards`` shards already."""
        if batch_size < 1:
            raise ValueError(f"batch_size {batch_size} is not positive")
        names = self._names(modules)
        n = len(self)
        if not shuffle:
            for start in range(0, n, batch_size):
                if drop_last and start + batch_size > n:
                    return
                yield self._range(start, min(n, start + batch_size), names)
            return
        rng = np.random.default_rng(seed)
        carry: dict[str, list[np.ndarray]] = {name: [] for name in names}
        kinds: dict[str, str] = {}
        held = 0
        for i in rng.permutation(len(self.shards)):
            order = rng.permutation(int(self.shards[int(i)]["tokens"]))
            for name in names:
                array, kinds[name] = self._raw(int(i), name)
                carry[name].append(array[order])
            held += len(order)
            while held >= batch_size:
                joined = {name: parts[0] if len(parts) == 1 else np.concatenate(parts) for name, parts in carry.items()}
                yield {name: self._convert(v[:batch_size], kinds[name]) for name, v in joined.items()}
                carry = {name: [v[batch_size:]] for name, v in joined.items()}
                held -= batch_size
        if held and not drop_last:
            yield {name: self._convert(np.concatenate(parts), kinds[name]) for name, parts in carry.items()}


class ModuleColumn:
    """One module's values across every shard, as one lazily concatenating view (from
    ``ActivationDataset.module(name)``): ``len(col)`` tokens, ``col.shape`` (tokens,
    *per-token shape), ``col.dtype`` (stored dtype name); ``col[i]``, ``col[a:b]``,
    ``col[[i, j]]`` read only what they index (views within a shard, as
    ``ds[...]``); iterating yields each shard's values in order (zero-copy views for
    torch); ``col.read()`` concatenates the whole column into memory."""

    def __init__(self, dataset: ActivationDataset, name: str) -> None:
        self.dataset, self.name = dataset, name
        self.dtype: str = "int64" if name in INDEX_KEYS else dataset.dtypes[name]
        per_token = [] if name in INDEX_KEYS else dataset.shapes[name]
        self.shape: tuple[int, ...] = (len(dataset), *per_token)

    def __len__(self) -> int:
        return len(self.dataset)

    def __repr__(self) -> str:
        return f"ModuleColumn({self.name!r}, {self.dtype} {list(self.shape)})"

    def __getitem__(self, key: Any) -> Any:
        return self.dataset._get(key, [self.name])[self.name]

    def __iter__(self) -> Iterator[Any]:
        for i in range(len(self.dataset.shards)):
            yield self.dataset._convert(*self.dataset._raw(i, self.name))

    def read(self) -> Any:
        """The whole column in memory (``[tokens, ...]``): reads every shard's part."""
        return self[:]


_SAFETENSORS = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
                "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def _merge_workers(url: str, workers: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The manifest worker 0 would write from the worker manifests present, done or not
    (allow_incomplete). Only the split and settings of the most recently updated
    manifest count: manifests of another split or settings are a different dataset."""
    if not workers:
        raise FileNotFoundError(f"{url} has no {MANIFEST} and no worker manifests")
    latest = max(workers.values(), key=lambda m: str(m.get("updated", "")))
    split = (latest.get("num_workers"), latest.get("settings_digest"))
    chosen = sorted((m for m in workers.values() if (m.get("num_workers"), m.get("settings_digest")) == split),
                    key=lambda m: int(m.get("worker_index", 0)))
    merged: dict[str, Any] = {k: v for k, v in chosen[0].items() if k not in WORKER_KEYS}
    merged["modules"] = next((list(m["modules"]) for m in chosen if m.get("modules")), [])
    merged["dtypes"], merged["shapes"] = {}, {}
    for m in chosen:
        merged["dtypes"].update(m.get("dtypes", {}))
        merged["shapes"].update(m.get("shapes", {}))
    merged["shards"] = [s for m in chosen for s in m.get("shards", [])]
    merged["tokens"] = sum(int(s["tokens"]) for s in merged["shards"])
    merged["complete"] = False
    merged["workers_present"] = [int(m.get("worker_index", 0)) for m in chosen]
    merged["workers_done"] = [int(m.get("worker_index", 0)) for m in chosen if m.get("done")]
    return merged


def _remove_cache(folder: str, owner: int) -> None:
    if os.getpid() == owner:
        shutil.rmtree(folder, ignore_errors=True)


__all__ = ["ActivationDataset", "ModuleColumn"]
