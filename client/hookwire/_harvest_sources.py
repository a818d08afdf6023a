"""Where a harvest's inputs come from: text datasets (JSON lines, Parquet, plain text, a
Hugging Face ``save_to_disk`` folder), documents cut into fixed-length contexts, contexts
formed into batches, and the plan of a job (its batches, their stored tokens, a token
budget's end, a worker's share).

Everything here is deterministic: the same files and settings give the same contexts and
batches, byte for byte, in every process, so a job split across workers (every N-th batch)
stores exactly the tokens of a one-worker run, and a resumed job skips exactly the batches
it committed. Everything streams: a multi-GB corpus is never loaded whole.

Used by the server's harvest jobs and by the client sink (``hookwire harvest --sink
client``); needs numpy only (pyarrow and datasets are imported when such a file is read).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

#: File suffixes and the format they mean when the request leaves it unset.
_SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".txt": "text"}
FORMATS = ("jsonl", "parquet", "text", "hf")


class SourceError(ValueError):
    """A source that cannot be read as asked; the message names the field, file or line."""


class PathNotAllowed(SourceError):
    """A path that would leave its root."""


def confine(root: str | os.PathLike[str], relative: str, *, what: str) -> pathlib.Path:
    """``root/relative``, refusing anything that could leave ``root``: an empty or
    absolute path, ``..`` segments, NUL bytes, and any path whose real path (symlinks
    resolved) is not inside the root's real path. Raises PathNotAllowed naming ``what``."""
    if not relative:
        raise SourceError(f"{what}: empty")
    if "\x00" in relative:
        raise PathNotAllowed(f"{what}: {relative!r} has a NUL byte")
    candidate = pathlib.PurePosixPath(relative.replace("\\", "/"))
    if candidate.is_absolute() or relative.startswith(("/", "\\")) or pathlib.PureWindowsPath(relative).drive:
        raise PathNotAllowed(f"{what}: {relative!r} is absolute; give a path relative to the server's root")
    if ".." in candidate.parts:
        raise PathNotAllowed(f"{what}: {relative!r} has '..' in it")
    base = pathlib.Path(os.path.realpath(root))
    resolved = pathlib.Path(os.path.realpath(base / candidate))
    if resolved != base and base not in resolved.parents:
        raise PathNotAllowed(f"{what}: {relative!r} leaves the root (through a symlink)")
    if resolved == base:
        raise SourceError(f"{what}: {relative!r} is the root itself; name a file or folder in it")
    return resolved


class TextDataset:
    """A text dataset on disk. Construction checks the format and that the file exists;
    ``documents`` reads it (lazily, streaming) each time it is called."""

    def __init__(self, path: pathlib.Path, *, format: str | None = None, text_field: str = "text",
                 split: str | None = None) -> None:
        self.path = pathlib.Path(path)
        if not self.path.exists():
            raise SourceError(f"{self.path.name}: no such file or folder")
        if format is None:
            if self.path.is_dir():
                format = "hf"
            else:
                format = _SUFFIXES.get(self.path.suffix.lower())
                if format is None:
                    raise SourceError(
                        f"{self.path.name}: cannot tell the format from the name; say it (jsonl, parquet, text, hf)"
                    )
        if format not in FORMATS:
            raise SourceError(f"format {format!r} is not one of {', '.join(FORMATS)}")
        if format == "hf" and not self.path.is_dir():
            raise SourceError(f"{self.path.name}: a Hugging Face dataset is a folder written by save_to_disk")
        if format != "hf" and self.path.is_dir():
            raise SourceError(f"{self.path.name}: is a folder, not a {format} file")
        self.format = format
        self.text_field = text_field or "text"
        self.split = split

    def documents(self) -> Iterator[str]:
        """The documents in file order (blocks on reading; raises SourceError on bad data)."""
        if self.format == "jsonl":
            return self._jsonl()
        if self.format == "text":
            return self._text()
        if self.format == "parquet":
            return self._parquet()
        return self._hf()

    def _jsonl(self) -> Iterator[str]:
        with open(self.path, "rb") as f:
            for number, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    record = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError:
                    raise SourceError(f"{self.path.name}, line {number}: not UTF-8") from None
                except json.JSONDecodeError as exc:
                    raise SourceError(f"{self.path.name}, line {number}: not JSON ({exc.msg})") from None
                if not isinstance(record, dict) or self.text_field not in record:
                    raise SourceError(f"{self.path.name}, line {number}: no field {self.text_field!r}")
                text = record[self.text_field]
                if not isinstance(text, str):
                    raise SourceError(
                        f"{self.path.name}, line {number}: field {self.text_field!r} is {type(text).__name__}, not text"
                    )
                yield text

    def _text(self) -> Iterator[str]:
        with open(self.path, "rb") as f:
            for number, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8").rstrip("\r\n")
                except UnicodeDecodeError:
                    raise SourceError(f"{self.path.name}, line {number}: not UTF-8") from None
                if line.strip():
                    yield line

    def _parquet(self) -> Iterator[str]:
        import pyarrow.parquet as pq

        try:
            file = pq.ParquetFile(self.path)
        except Exception as exc:
            raise SourceError(f"{self.path.name}: not a Parquet file ({exc})") from None
        if self.text_field not in file.schema_arrow.names:
            raise SourceError(f"{self.path.name}: no column {self.text_field!r} (columns: {file.schema_arrow.names})")
        for batch in file.iter_batches(columns=[self.text_field], batch_size=1024):
            for text in batch.column(0).to_pylist():
                if not isinstance(text, str):
                    raise SourceError(f"{self.path.name}: column {self.text_field!r} holds {type(text).__name__}, not text")
                yield text

    def _open_hf(self) -> Any:
        import datasets

        try:
            loaded = datasets.load_from_disk(str(self.path))
        except Exception as exc:
            raise SourceError(f"{self.path.name}: not a dataset written by save_to_disk ({exc})") from None
        if isinstance(loaded, datasets.DatasetDict):
            splits = list(loaded)
            name = self.split or ("train" if "train" in loaded or len(splits) != 1 else splits[0])
            if name not in loaded:
                raise SourceError(f"{self.path.name}: no split {name!r} (splits: {splits})")
            loaded = loaded[name]
        elif self.split:
            raise SourceError(f"{self.path.name}: a single dataset has no splits (split {self.split!r} given)")
        if self.text_field not in loaded.column_names:
            raise SourceError(f"{self.path.name}: no column {self.text_field!r} (columns: {loaded.column_names})")
        return loaded

    def _hf(self) -> Iterator[str]:
        loaded = self._open_hf()
        for batch in loaded.select_columns([self.text_field]).iter(batch_size=1024):
            for text in batch[self.text_field]:
                if not isinstance(text, str):
                    raise SourceError(f"{self.path.name}: column {self.text_field!r} holds {type(text).__name__}, not text")
                yield text

    def _files(self) -> list[pathlib.Path]:
        if self.path.is_dir():
            return sorted((p for p in self.path.rglob("*") if p.is_file()), key=lambda p: p.relative_to(self.path).as_posix())
        return [self.path]

    def fingerprint(self) -> str:
        """sha256 (hex) of the bytes of the dataset's file(s) (a folder: each file's
        relative path, then its bytes, sorted by path). Reads everything: blocks."""
        digest = hashlib.sha256()
        for file in self._files():
            if self.path.is_dir():
                digest.update(file.relative_to(self.path).as_posix().encode() + b"\0")
            with open(file, "rb") as f:
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
        return digest.hexdigest()

    def describe(self) -> dict[str, Any]:
        """What identifies the source in a manifest (its fingerprint included: blocks)."""
        return {"kind": "text", "path": str(self.path), "format": self.format, "text_field": self.text_field,
                "split": self.split, "fingerprint": self.fingerprint()}


@dataclasses.dataclass(frozen=True)
class ContextSpec:
    """How documents become contexts."""

    length: int
    #: "truncate": one context per document, cut to ``length``; "pack": documents joined
    #: with ``sep_id`` and cut into full contexts.
    packing: str
    bos_id: int | None
    sep_id: int | None
    pad_id: int


def special_ids(tokenizer: Any, *, bos: bool | None) -> tuple[int | None, int | None, int]:
    """(BOS, separator, pad) ids of a transformers tokenizer. BOS is its bos token, else its
    CLS token (BERT-like); ``bos=False`` means none, ``None`` means "when it has one". The
    separator (after each packed document) is its EOS token, else its SEP token. Pad is its
    pad token, else EOS, else 0 (padding is never stored, so its id only has to be valid)."""
    def first(*names: str) -> int | None:
        for name in names:
            value = getattr(tokenizer, name, None)
            if isinstance(value, int):
                return value
        return None

    bos_id = None if bos is False else first("bos_token_id", "cls_token_id")
    sep_id = first("eos_token_id", "sep_token_id")
    pad_id = first("pad_token_id", "eos_token_id")
    return bos_id, sep_id, pad_id if pad_id is not None else 0


def contexts(
    documents: Iterable[str], tokenize: Callable[[list[str]], list[list[int]]], spec: ContextSpec, *, chunk: int = 256,
) -> Iterator[list[int]]:
    """The contexts of ``documents`` (see ContextSpec): token ids, ``tokenize`` called on
    chunks of documents (without special tokens: the job adds BOS and separators).

    truncate: ``[bos] + ids[:length-1]`` per non-empty document (or ``ids[:length]``
    without BOS); shorter ones stay short (the batch pads them). pack: the stream
    ``ids(d1) + [sep] + ids(d2) + [sep] + ...`` cut into contexts of exactly ``length``
    tokens (``[bos]`` plus ``length-1`` stream tokens with BOS); a last partial context
    is dropped."""
    if spec.length < 1 or (spec.bos_id is not None and spec.length < 2):
        raise SourceError(f"contexts.length: {spec.length} leaves no room for a token")
    if spec.packing not in ("truncate", "pack"):
        raise SourceError(f"packing {spec.packing!r} is not truncate or pack")
    head = [spec.bos_id] if spec.bos_id is not None else []
    room = spec.length - len(head)
    stream: list[int] = []
    start = 0
    for texts in _chunks(documents, chunk):
        for ids in tokenize(texts):
            ids = list(ids)
            if spec.packing == "truncate":
                if ids:
                    yield head + ids[:room]
                continue
            if not ids:
                continue
            stream.extend(ids)
            if spec.sep_id is not None:
                stream.append(spec.sep_id)
            while len(stream) - start >= room:
                yield head + stream[start:start + room]
                start += room
            if start > 1 << 16:  # keep the unconsumed tail only
                del stream[:start]
                start = 0


def _chunks(items: Iterable[str], size: int) -> Iterator[list[str]]:
    chunk: list[str] = []
    for item in items:
        chunk.append(item)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


@dataclasses.dataclass
class TokenBatch:
    """One batch of contexts: rows right-padded to the batch's longest context."""

    #: Global batch index (0, 1, 2, ...).
    index: int
    #: Global index of its first context (contexts are numbered in source order).
    first_sequence: int
    #: int64 [batch, length].
    input_ids: np.ndarray
    #: int64 [batch, length]: 1 for a real token, 0 for padding.
    attention_mask: np.ndarray


def batches(contexts: Iterable[list[int]], batch_size: int, pad_id: int) -> Iterator[TokenBatch]:
    """Consecutive runs of ``batch_size`` contexts (a last short batch is kept)."""
    if batch_size < 1:
        raise SourceError(f"batch_size {batch_size} is not positive")
    rows: list[list[int]] = []
    index = sequence = 0
    for ctx in contexts:
        rows.append(ctx)
        if len(rows) == batch_size:
            yield _batch(rows, index, sequence, pad_id)
            index, sequence, rows = index + 1, sequence + len(rows), []
    if rows:
        yield _batch(rows, index, sequence, pad_id)


def _batch(rows: list[list[int]], index: int, first: int, pad_id: int) -> TokenBatch:
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = row
        mask[i, :len(row)] = 1
    return TokenBatch(index, first, ids, mask)


def token_batches(input_ids: np.ndarray, batch_size: int, pad_id: int | None) -> Iterator[TokenBatch]:
    """Batches of given token ids ([contexts, length]); with ``pad_id``, a row's trailing
    run of ``pad_id`` is padding (a pad id inside a row is a real token)."""
    if input_ids.ndim != 2:
        raise SourceError(f"input_ids: shape {list(input_ids.shape)} is not [contexts, length]")
    if batch_size < 1:
        raise SourceError(f"batch_size {batch_size} is not positive")
    ids = input_ids.astype(np.int64, copy=False)
    for index, start in enumerate(range(0, ids.shape[0], batch_size)):
        rows = ids[start:start + batch_size]
        mask = np.ones_like(rows)
        if pad_id is not None:
            real = rows != pad_id
            # length = position after the last non-pad token of each row
            last = np.where(real.any(axis=1), rows.shape[1] - np.argmax(real[:, ::-1], axis=1), 0)
            mask = (np.arange(rows.shape[1])[None, :] < last[:, None]).astype(np.int64)
        yield TokenBatch(index, start, np.ascontiguousarray(rows), mask)


def keep_mask(attention_mask: np.ndarray, *, skip_first: int = 0, only: Sequence[int] = ()) -> np.ndarray:
    """bool [batch, length]: the real tokens at kept positions (``only`` if given, then
    positions from ``skip_first`` on)."""
    keep = attention_mask.astype(bool)
    length = keep.shape[1]
    positions = np.arange(length)
    allowed = positions >= skip_first
    if only:
        chosen = np.zeros(length, dtype=bool)
        picked = [p for p in only if 0 <= p < length]
        chosen[picked] = True
        allowed &= chosen
    return keep & allowed[None, :]


@dataclasses.dataclass
class Plan:
    """What a job runs: its batches (after the token budget) and their stored tokens."""

    batch_size: int
    num_batches: int
    #: Stored tokens of each batch, in order.
    kept_tokens: list[int]
    total_tokens: int

    def worker_batches(self, worker_index: int, num_workers: int) -> list[int]:
        """The global batch indices worker ``worker_index`` of ``num_workers`` runs."""
        return list(range(worker_index, self.num_batches, max(1, num_workers)))

    def worker_tokens(self, worker_index: int, num_workers: int) -> int:
        """The tokens that worker stores."""
        return sum(self.kept_tokens[i] for i in self.worker_batches(worker_index, num_workers))


def plan(batches: Iterable[TokenBatch], *, skip_first: int = 0, only: Sequence[int] = (), max_tokens: int = 0) -> Plan:
    """Counts ``batches`` (reading them all: blocks). With ``max_tokens``, the batches end
    at the first one at which the running total of stored tokens reaches it."""
    kept: list[int] = []
    total = 0
    size = 0
    for batch in batches:
        size = max(size, batch.input_ids.shape[0])
        n = int(keep_mask(batch.attention_mask, skip_first=skip_first, only=only).sum())
        kept.append(n)
        total += n
        if max_tokens and total >= max_tokens:
            break
    return Plan(batch_size=size, num_batches=len(kept), kept_tokens=kept, total_tokens=total)
