"""Where a harvest's inputs come from, and how they become batches.

- **Text datasets** (:class:`TextDataset`): JSON lines, Parquet, plain text, or a Hugging
  Face ``datasets`` folder written by ``save_to_disk``; their documents in file order,
  streamed, and a fingerprint of their bytes.
- **Contexts** (:func:`contexts`): documents tokenized (without special tokens) and cut to
  fixed-length contexts, one document per context (truncate) or documents packed with a
  separator (pack), with or without a BOS token per context.
- **Batches** (:func:`batches`, :func:`token_batches`): consecutive runs of contexts,
  right-padded, numbered globally.
- **Plans** (:func:`plan`, :class:`Plan`): the tokens each batch stores (:func:`keep_mask`),
  where a token budget ends, and which batches each worker of a split runs.
- **Confinement** (:func:`confine`): a client's relative path kept inside a root.

Everything here is deterministic: the same files and settings give the same contexts and
batches, byte for byte, in every process (contexts do not depend on how many documents
are tokenized at once), so a job split across workers (every N-th batch) stores exactly
the tokens of a one-worker run, and a resumed job skips exactly the batches it committed.
Everything streams: a corpus is never loaded whole (JSON lines and text line by line,
Parquet in record batches, a Hugging Face dataset memory-mapped and read in batches).

Used by the server's harvest jobs and by the client sink (``hookwire harvest --sink
client``). Needs numpy only at import; pyarrow and datasets are imported when a Parquet
file or a Hugging Face folder is read. Never imports torch or grpc.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

#: The formats a TextDataset reads.
FORMATS = ("jsonl", "parquet", "text", "hf")
#: File suffixes and the format they mean when none is given (a folder means "hf").
SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".txt": "text"}
#: The packings of ContextSpec.
PACKINGS = ("truncate", "pack")

# Documents per record batch read from Parquet or a Hugging Face dataset: small enough
# that a batch of long documents stays a few MB, large enough to amortize the reads.
_READ_ROWS = 1024
# Bytes per read when hashing.
_HASH_CHUNK = 1 << 20
# Packing keeps the unconsumed tail of its token stream; it compacts the list once this
# many consumed tokens sit before the tail, so memory stays bounded by one chunk's tokens.
_COMPACT = 1 << 16


class SourceError(ValueError):
    """A source, or a setting of one, that cannot be used as asked. The message names
    the field, file, line or row at fault."""


class PathNotAllowed(SourceError):
    """A path that is absolute or would leave its root (``..``, a symlink, a NUL byte)."""


# --------------------------------------------------------------------------- paths


def confine(root: str | os.PathLike[str], relative: str, *, what: str) -> pathlib.Path:
    """``root/relative`` with symlinks resolved, refusing anything that could leave ``root``.

    Refused: an empty path or the root itself (SourceError); an absolute path, a Windows
    drive, a ``..`` segment, a NUL byte, or a path whose real path (every symlink resolved,
    the root's included) is not strictly inside the root's real path (PathNotAllowed).
    Backslashes count as separators, so ``..\\x`` is refused too. The path need not exist
    (an output folder): the part that exists is resolved, the rest is taken as written.
    Every message starts with ``what`` (the request field, e.g. ``"source.text.path"``).

    The check is made now; a symlink planted inside the root after it is not seen, so
    roots should not be writable by whoever chooses the paths (harvest clients are not).
    """
    if not relative:
        raise SourceError(f"{what}: empty; give a path relative to the root")
    if "\x00" in relative:
        raise PathNotAllowed(f"{what}: {relative!r} has a NUL byte")
    posix = relative.replace("\\", "/")
    candidate = pathlib.PurePosixPath(posix)
    if candidate.is_absolute() or pathlib.PureWindowsPath(relative).drive:
        raise PathNotAllowed(f"{what}: {relative!r} is absolute; give a path relative to the root")
    if ".." in candidate.parts:
        raise PathNotAllowed(f"{what}: {relative!r} has a '..' segment")
    base = pathlib.Path(os.path.realpath(root))
    resolved = pathlib.Path(os.path.realpath(base.joinpath(*candidate.parts)))
    if resolved == base:
        raise SourceError(f"{what}: {relative!r} is the root itself; name a file or folder inside it")
    if base not in resolved.parents:
        raise PathNotAllowed(f"{what}: {relative!r} leaves the root (through a symlink)")
    return resolved


# --------------------------------------------------------------------------- text datasets


class TextDataset:
    """A text dataset on disk: its documents (strings) in file order.

    Formats (``format=None`` guesses from the path: ``.jsonl``/``.json``/``.ndjson`` ->
    ``"jsonl"``, ``.parquet`` -> ``"parquet"``, ``.txt`` -> ``"text"``, a folder -> ``"hf"``):

    - ``"jsonl"``: one JSON object per line, the document in ``text_field``; blank lines
      are skipped. Each line must be UTF-8.
    - ``"parquet"``: the string column ``text_field``, read in record batches.
    - ``"text"``: UTF-8 text, each line that is not blank is a document (its line ending
      removed, other whitespace kept).
    - ``"hf"``: a folder written by ``datasets``' ``save_to_disk``: a ``Dataset``, or a
      ``DatasetDict`` of which ``split`` is read (``split`` if given, else ``"train"``,
      else the only split); the string column ``text_field``.

    The constructor checks the path, the format, and (reading the first document: it
    blocks briefly) that the source holds a document and that its first one is well
    formed; for Parquet and Hugging Face it also checks the column's type. Raises
    SourceError with a message naming the file, field, line or row.
    """

    def __init__(self, path: pathlib.Path, *, format: str | None = None, text_field: str = "text",
                 split: str | None = None) -> None:
        self.path = pathlib.Path(path)
        self.name = self.path.name or str(self.path)
        if not self.path.exists():
            raise SourceError(f"{self.name}: no such file or folder")
        if format is None:
            if self.path.is_dir():
                format = "hf"
            else:
                format = SUFFIXES.get(self.path.suffix.lower())
                if format is None:
                    raise SourceError(
                        f"{self.name}: cannot tell the format from the name; say it ({', '.join(FORMATS)})"
                    )
        if format not in FORMATS:
            raise SourceError(f"format: {format!r} is not one of {', '.join(FORMATS)}")
        if format == "hf" and not self.path.is_dir():
            raise SourceError(f"{self.name}: not a folder; a Hugging Face dataset is a folder written by save_to_disk")
        if format != "hf" and not self.path.is_file():
            raise SourceError(f"{self.name}: not a file; {format} is read from a file")
        if split and format != "hf":
            raise SourceError(f"split: {split!r} given, but only a Hugging Face dataset folder has splits")
        self.format = format
        self.text_field = text_field or "text"
        self.split = split or None
        # Fail now, not hours into a job: the first document is read (and the column's
        # type checked), which also refuses an empty source.
        first = self._documents()
        try:
            next(first)
        finally:
            first.close()

    def documents(self) -> Iterator[str]:
        """The documents, in file order: a lazy generator reading the source once, as it
        is consumed (each call starts a new pass). Blocks on reading; raises SourceError
        on bad data (naming the line or row) and on a source that holds no document."""
        return self._documents()

    def _documents(self) -> Generator[str, None, None]:
        readers = {"jsonl": self._jsonl, "text": self._text, "parquet": self._parquet, "hf": self._hf}
        count = 0
        for count, text in enumerate(readers[self.format](), 1):
            yield text
        if count == 0:
            raise SourceError(f"{self.name}: empty (no documents)")

    def _jsonl(self) -> Iterator[str]:
        field = self.text_field
        with open(self.path, "rb") as f:
            for number, raw in enumerate(f, 1):
                if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                    raw = raw[3:]  # a UTF-8 byte order mark, as some editors write
                if not raw.strip():
                    continue
                where = f"{self.name}, line {number}"
                try:
                    record = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError as exc:
                    raise SourceError(f"{where}: not UTF-8 (byte {exc.start})") from None
                except json.JSONDecodeError as exc:
                    raise SourceError(f"{where}: not JSON ({exc.msg}, column {exc.colno})") from None
                if not isinstance(record, dict):
                    raise SourceError(f"{where}: a JSON {type(record).__name__}, not an object")
                if field not in record:
                    raise SourceError(f"{where}: no field {field!r} (fields: {sorted(record)[:20]})")
                text = record[field]
                if not isinstance(text, str):
                    kind = "null" if text is None else type(text).__name__
                    raise SourceError(f"{where}: field {field!r} is {kind}, not text")
                if b"\\u" in raw or b"\\U" in raw:
                    # "\ud800" escapes decode to lone surrogates, which no tokenizer takes.
                    try:
                        text.encode("utf-8")
                    except UnicodeEncodeError:
                        raise SourceError(f"{where}: field {field!r} has a lone surrogate escape") from None
                yield text

    def _text(self) -> Iterator[str]:
        with open(self.path, "rb") as f:
            for number, raw in enumerate(f, 1):
                if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                    raw = raw[3:]
                try:
                    line = raw.decode("utf-8").rstrip("\r\n")
                except UnicodeDecodeError as exc:
                    raise SourceError(f"{self.name}, line {number}: not UTF-8 (byte {exc.start})") from None
                if line.strip():
                    yield line

    def _parquet(self) -> Iterator[str]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            file = pq.ParquetFile(self.path)
        except Exception as exc:
            raise SourceError(f"{self.name}: not a Parquet file ({exc})") from None
        try:
            schema = file.schema_arrow
            if self.text_field not in schema.names:
                raise SourceError(f"{self.name}: no column {self.text_field!r} (columns: {schema.names})")
            _check_text_type(schema.field(self.text_field).type, f"{self.name}: column {self.text_field!r}")
            row = 0
            for batch in file.iter_batches(batch_size=_READ_ROWS, columns=[self.text_field]):
                yield from self._strings(batch.column(0).to_pylist(), row)
                row += batch.num_rows
        except (pa.ArrowException, OSError) as exc:
            raise SourceError(f"{self.name}: cannot read the Parquet file ({exc})") from None
        finally:
            file.close()

    def _hf(self) -> Iterator[str]:
        import datasets

        try:
            loaded = datasets.load_from_disk(str(self.path))
        except Exception as exc:
            raise SourceError(f"{self.name}: not a dataset written by save_to_disk ({exc})") from None
        if isinstance(loaded, datasets.DatasetDict):
            splits = list(loaded)
            name = self.split or ("train" if "train" in loaded or len(splits) != 1 else splits[0])
            if name not in loaded:
                hint = "" if self.split else "; say which with split"
                raise SourceError(f"{self.name}: no split {name!r} (splits: {splits}){hint}")
            loaded = loaded[name]
        elif self.split:
            raise SourceError(f"{self.name}: a single Dataset, not a DatasetDict: it has no split {self.split!r}")
        if not isinstance(loaded, datasets.Dataset):
            raise SourceError(f"{self.name}: a {type(loaded).__name__}, not a Dataset written by save_to_disk")
        if self.text_field not in loaded.column_names:
            raise SourceError(f"{self.name}: no column {self.text_field!r} (columns: {loaded.column_names})")
        if loaded.num_rows == 0:
            return
        _check_text_type(loaded.data.schema.field(self.text_field).type, f"{self.name}: column {self.text_field!r}")
        row = 0
        for batch in loaded.select_columns([self.text_field]).iter(batch_size=_READ_ROWS):
            values = batch[self.text_field]
            yield from self._strings(values, row)
            row += len(values)

    def _strings(self, values: list[Any], first_row: int) -> Iterator[str]:
        """Yields ``values`` (rows ``first_row``...), refusing anything but strings."""
        for row, text in enumerate(values, first_row):
            if not isinstance(text, str):
                kind = "null" if text is None else type(text).__name__
                raise SourceError(f"{self.name}: column {self.text_field!r}, row {row} (from 0): {kind}, not text")
            yield text

    def files(self) -> list[pathlib.Path]:
        """The files the source reads: the file, or a folder's files (symlinked ones
        included, symlinked folders not entered) sorted by their relative POSIX path."""
        if not self.path.is_dir():
            return [self.path]
        found: list[pathlib.Path] = []
        for folder, _, names in os.walk(self.path):
            found.extend(p for p in (pathlib.Path(folder, n) for n in names) if p.is_file())
        return sorted(found, key=lambda p: p.relative_to(self.path).as_posix())

    def fingerprint(self) -> str:
        """sha256 (hex) identifying the source's bytes. A file: the sha256 of its bytes
        (what ``sha256sum`` prints). A folder: of each file in :meth:`files` order, its
        relative POSIX path's length and bytes, its size, then its bytes (so the folder's
        location does not matter, and renaming or moving bytes between files changes it).
        Streams the files in 1 MiB reads: blocks for as long as reading them takes."""
        digest = hashlib.sha256()
        folder = self.path.is_dir()
        for file in self.files():
            with open(file, "rb") as f:
                if folder:
                    name = file.relative_to(self.path).as_posix().encode("utf-8", "surrogateescape")
                    size = os.fstat(f.fileno()).st_size
                    digest.update(len(name).to_bytes(8, "little") + name + size.to_bytes(8, "little"))
                while chunk := f.read(_HASH_CHUNK):
                    digest.update(chunk)
        return digest.hexdigest()

    def describe(self) -> dict[str, Any]:
        """What identifies the source in a manifest, JSON-able: ``{"kind": "text", "path",
        "format", "text_field", "split", "fingerprint"}`` (``path`` as this object holds
        it; the server replaces it with the path the client gave). Computes the
        fingerprint: blocks (see :meth:`fingerprint`)."""
        return {"kind": "text", "path": str(self.path), "format": self.format, "text_field": self.text_field,
                "split": self.split, "fingerprint": self.fingerprint()}

    def __repr__(self) -> str:
        return f"TextDataset({str(self.path)!r}, format={self.format!r}, text_field={self.text_field!r})"


def _check_text_type(arrow_type: Any, where: str) -> None:
    import pyarrow as pa

    is_view = getattr(pa.types, "is_string_view", None)
    if not (pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)
            or (is_view is not None and is_view(arrow_type)) or pa.types.is_null(arrow_type)):
        raise SourceError(f"{where} holds {arrow_type}, not strings")


# --------------------------------------------------------------------------- contexts


@dataclasses.dataclass(frozen=True)
class ContextSpec:
    """How documents become contexts (see :func:`contexts`)."""

    #: Tokens per context, BOS included (at least 1; at least 2 with a BOS).
    length: int
    #: ``"truncate"``: one context per document, cut to ``length``; ``"pack"``: documents
    #: joined, each followed by ``sep_id``, and cut into contexts of exactly ``length``.
    packing: str
    #: The id that starts every context; None for no BOS.
    bos_id: int | None
    #: The id appended after every packed document; None for no separator.
    sep_id: int | None
    #: The id batches pad with (padding is never stored; it only has to be a valid id).
    pad_id: int

    def check(self) -> None:
        """Raises SourceError for an unknown packing, or a length with no room for a
        token (:func:`contexts` calls it when it starts)."""
        if self.packing not in PACKINGS:
            raise SourceError(f"contexts.packing: {self.packing!r} is not one of {', '.join(PACKINGS)}")
        least = 2 if self.bos_id is not None else 1
        if self.length < least:
            room = "a BOS and one token" if least == 2 else "one token"
            raise SourceError(f"contexts.length: {self.length} leaves no room for {room}")


def special_ids(tokenizer: Any, *, bos: bool | None) -> tuple[int | None, int | None, int]:
    """``(bos_id, sep_id, pad_id)`` of a transformers tokenizer.

    - BOS: its ``bos_token_id``, else its ``cls_token_id`` (BERT-like tokenizers).
      ``bos=False``: None; ``bos=None``: BOS when the tokenizer has one; ``bos=True``: the
      same, and None still when it has none (the caller decides whether that is an error).
    - Separator (after every packed document): its ``eos_token_id``, else ``sep_token_id``.
    - Pad: its ``pad_token_id``, else its ``eos_token_id``, else 0 (padding is never stored).

    GPT-2-like tokenizers give ``(eos, eos, eos)`` (``<|endoftext|>`` everywhere);
    BERT-like ``(cls, sep, pad)``; Llama-like ``(bos, eos, pad or eos)``.
    """
    def first(*names: str) -> int | None:
        for name in names:
            value = getattr(tokenizer, name, None)
            if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
                return int(value)
        return None

    bos_id = None if bos is False else first("bos_token_id", "cls_token_id")
    sep_id = first("eos_token_id", "sep_token_id")
    pad_id = first("pad_token_id", "eos_token_id")
    return bos_id, sep_id, 0 if pad_id is None else pad_id


def contexts(
    documents: Iterable[str], tokenize: Callable[[list[str]], list[list[int]]], spec: ContextSpec, *,
    chunk: int = 256,
) -> Iterator[list[int]]:
    """The contexts of ``documents``: lists of token ids, lazily, in document order.

    ``tokenize`` is called on chunks of ``chunk`` documents and must return one id list
    per document, without special tokens (the job passes ``lambda texts:
    tokenizer(texts, add_special_tokens=False)["input_ids"]``; BOS and separators are
    added here). The contexts do not depend on ``chunk``.

    - ``truncate``: one context per document with at least one token,
      ``[bos] + ids[:length-1]`` (``ids[:length]`` without BOS); shorter ones stay short.
    - ``pack``: the stream ``ids(d1) + [sep] + ids(d2) + [sep] + ...`` (documents without
      tokens skipped, no separator without ``sep_id``) cut into contexts of exactly
      ``length`` tokens (``[bos]`` + ``length-1`` stream tokens with BOS); the last
      partial context is dropped.

    Memory: one chunk's token ids (and the unconsumed tail of the stream when packing).
    Raises SourceError (when iteration starts) for a bad spec (:meth:`ContextSpec.check`)
    or chunk, if ``tokenize`` returns the wrong number of lists, and when the documents
    give no context at all (no tokens; pack: fewer tokens than one context).
    """
    spec.check()
    if chunk < 1:
        raise SourceError(f"chunk: {chunk} is not positive")
    head = [spec.bos_id] if spec.bos_id is not None else []
    room = spec.length - len(head)
    tail = [spec.sep_id] if spec.sep_id is not None else []
    pack = spec.packing == "pack"
    stream: list[int] = []
    start = 0  # stream[start:] is not in a context yet
    made = streamed = 0
    for texts in _chunks(documents, chunk):
        encoded = tokenize(texts)
        if len(encoded) != len(texts):
            raise SourceError(f"tokenize returned {len(encoded)} id lists for {len(texts)} documents")
        for ids in encoded:
            if len(ids) == 0:
                continue
            if not pack:
                made += 1
                yield head + [int(i) for i in ids[:room]]
                continue
            stream.extend(int(i) for i in ids)
            stream.extend(tail)
            streamed += len(ids) + len(tail)
            while len(stream) - start >= room:
                made += 1
                yield head + stream[start:start + room]
                start += room
            if start >= _COMPACT:
                del stream[:start]
                start = 0
    if made == 0:
        if pack and streamed:
            raise SourceError(
                f"no context: the documents give {streamed} tokens (separators included), "
                f"fewer than one context of {spec.length}"
            )
        raise SourceError("no context: the documents have no tokens")


def _chunks(items: Iterable[str], size: int) -> Iterator[list[str]]:
    chunk: list[str] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


# --------------------------------------------------------------------------- batches


@dataclasses.dataclass
class TokenBatch:
    """One batch of contexts, right-padded to the batch's longest context."""

    #: Global batch index (0, 1, 2, ...).
    index: int
    #: Global index of its first context (contexts are numbered 0, 1, 2, ... in source
    #: order; batch b holds contexts b*batch_size ...).
    first_sequence: int
    #: int64 [rows, width]: the contexts, right-padded with the pad id.
    input_ids: np.ndarray
    #: int64 [rows, width]: 1 for a real token, 0 for padding.
    attention_mask: np.ndarray


def batches(contexts: Iterable[list[int]], batch_size: int, pad_id: int) -> Iterator[TokenBatch]:
    """Consecutive runs of ``batch_size`` contexts, lazily; a last short batch is kept.
    Each batch is as wide as its longest context (packed contexts: all ``length``).
    Raises SourceError for a non-positive ``batch_size`` or an empty context."""
    if batch_size < 1:
        raise SourceError(f"contexts.batch_size: {batch_size} is not positive")
    rows: list[list[int]] = []
    index = sequence = 0
    for ctx in contexts:
        if len(ctx) == 0:
            raise SourceError(f"context {sequence + len(rows)} is empty")
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
    """Batches of given token ids (a token source): ``input_ids`` is an integer array
    ``[contexts, length]``, its rows taken ``batch_size`` at a time (a last short batch
    kept), lazily. Without ``pad_id`` every token is real; with it, each row's *trailing*
    run of ``pad_id`` is padding (the same id inside a row, or at its start, is a real
    token: with ``pad_id == eos`` a real trailing EOS counts as padding, so send rows
    without one, or no ``pad_id``). Raises SourceError for a bad shape, dtype or id."""
    ids = np.asarray(input_ids)
    if ids.ndim != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
        raise SourceError(f"input_ids: shape {list(ids.shape)} is not [contexts, length] with both above 0")
    if not np.issubdtype(ids.dtype, np.integer):
        raise SourceError(f"input_ids: dtype {ids.dtype} is not an integer type")
    if batch_size < 1:
        raise SourceError(f"contexts.batch_size: {batch_size} is not positive")
    if int(ids.min()) < 0:
        raise SourceError(f"input_ids: holds a negative id ({int(ids.min())})")
    ids = ids.astype(np.int64, copy=False)
    columns = np.arange(ids.shape[1])
    for index, start in enumerate(range(0, ids.shape[0], batch_size)):
        rows = np.ascontiguousarray(ids[start:start + batch_size])
        if pad_id is None:
            mask = np.ones_like(rows)
        else:
            real = rows != pad_id
            # A row's length: one past its last non-pad token (0 for a row of pads).
            lengths = np.where(real.any(axis=1), rows.shape[1] - np.argmax(real[:, ::-1], axis=1), 0)
            mask = (columns[None, :] < lengths[:, None]).astype(np.int64)
        yield TokenBatch(index, start, rows, mask)


def keep_mask(attention_mask: np.ndarray, *, skip_first: int = 0, only: Sequence[int] = ()) -> np.ndarray:
    """bool ``[rows, width]``: the tokens a harvest stores, the real tokens
    (``attention_mask`` != 0) at kept positions: positions ``skip_first`` and on, and,
    when ``only`` is given, only those of ``only`` (positions past the width are
    ignored). Raises SourceError for a negative position."""
    if skip_first < 0:
        raise SourceError(f"positions.skip_first: {skip_first} is negative")
    keep = np.asarray(attention_mask) != 0
    width = keep.shape[1]
    allowed = np.arange(width) >= skip_first
    if len(only):
        picked = np.asarray(only, dtype=np.int64)
        if picked.min() < 0:
            raise SourceError(f"positions.only: {int(picked.min())} is negative")
        chosen = np.zeros(width, dtype=bool)
        chosen[picked[picked < width]] = True
        allowed &= chosen
    return keep & allowed[None, :]


# --------------------------------------------------------------------------- plans


@dataclasses.dataclass
class Plan:
    """What a job runs: its batches (after the token budget) and their stored tokens."""

    #: Contexts per batch (the widest batch seen; 0 when there are none).
    batch_size: int
    #: Batches the job runs in all, 0 ... num_batches-1 (the budget's end applied).
    num_batches: int
    #: Stored tokens of each batch (keep_mask's count), in batch order.
    kept_tokens: list[int]
    #: sum(kept_tokens).
    total_tokens: int

    def worker_batches(self, worker_index: int, num_workers: int) -> list[int]:
        """The global indices of the batches worker ``worker_index`` of ``num_workers``
        runs: every ``num_workers``-th from ``worker_index`` (``i % num_workers ==
        worker_index``). The workers' lists partition ``range(num_batches)``. Raises
        ValueError for a worker outside ``0 <= worker_index < num_workers``."""
        _check_worker(worker_index, num_workers)
        return list(range(worker_index, self.num_batches, num_workers))

    def worker_tokens(self, worker_index: int, num_workers: int) -> int:
        """The tokens that worker stores (the sum over its batches)."""
        return sum(self.kept_tokens[i] for i in self.worker_batches(worker_index, num_workers))


def _check_worker(worker_index: int, num_workers: int) -> None:
    if num_workers < 1 or not 0 <= worker_index < num_workers:
        raise ValueError(f"worker {worker_index} of {num_workers}: need 0 <= worker_index < num_workers")


def plan(batches: Iterable[TokenBatch], *, skip_first: int = 0, only: Sequence[int] = (), max_tokens: int = 0) -> Plan:
    """Counts ``batches``: the tokens each stores (:func:`keep_mask` with ``skip_first``
    and ``only``). With ``max_tokens`` > 0, the batches end at the first batch at which
    the running total reaches ``max_tokens`` (that batch included, stored whole), and
    the rest are not read. Consumes the iterable (tokenizing a text source once):
    blocks. Raises SourceError for a negative budget (and what the batches raise)."""
    if max_tokens < 0:
        raise SourceError(f"max_tokens: {max_tokens} is negative")
    kept: list[int] = []
    total = size = 0
    for batch in batches:
        size = max(size, int(batch.input_ids.shape[0]))
        n = int(keep_mask(batch.attention_mask, skip_first=skip_first, only=only).sum())
        kept.append(n)
        total += n
        if max_tokens and total >= max_tokens:
            break
    return Plan(batch_size=size, num_batches=len(kept), kept_tokens=kept, total_tokens=total)
