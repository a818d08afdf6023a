"""The activation dataset format (sources and contexts: test_harvest_sources.py): the writer (bit-exact round trips,
shards at batch boundaries, shuffle, resume after a kill at every step of the commit protocol,
workers, overwrite, settings) and ActivationDataset (indexing, numpy without torch, DataLoader, fsspec)."""

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
from hookwire.wire import harvest_format as fmt

ROOT = pathlib.Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------- writer and reader

HEADER = {"model": "m", "modules": ["enc.0", "enc.attn"], "settings": {"k": 1, "shuffle": None},
          "source": {"kind": "test"}, "hookwire_version": "x"}
Batch = tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]


class Killed(BaseException):
    """The process dies here (a BaseException, as nothing in the writer may swallow it)."""


def _random_bits(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Values of ``dtype`` from random bit patterns: NaNs with payloads, infinities, -0 and
    subnormals included, so that any conversion on the way would show."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[torch.empty(0, dtype=dtype).element_size()]
    info = torch.iinfo(ints)
    return torch.randint(info.min, info.max, shape, dtype=ints, generator=g).view(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def _batches(n: int, *, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> list[Batch]:
    """Batch b: contexts 2b and 2b+1, tokens at (sequence, position) pairs unique across
    batches; batch 4 keeps no token (a batch of padding only still counts)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for b in range(n):
        tokens = 0 if b == 4 else 1 + (b * 5) % 7
        values = {"enc.0": _random_bits((tokens, 4), dtype, g), "enc.attn": _random_bits((tokens, 2, 3), dtype, g)}
        ids = torch.randint(0, 30000, (tokens,), generator=g)
        k = torch.arange(tokens)
        out.append((values, ids, 2 * b + k % 2, k // 2))
    return out


def _run(url: str, batches: list[Batch], *, worker: int = 0, workers: int = 1, header: dict[str, Any] = HEADER,
         merge: bool = True, **kw: Any) -> fmt.DatasetWriter:
    """One worker's job: open, skip the committed batches, add the rest, finish, merge."""
    w = fmt.DatasetWriter(url, header=header, worker_index=worker, num_workers=workers, **kw)
    mine = batches[worker::workers]
    w.set_batches_total(len(mine))
    for b in mine[w.resume_batches:]:
        w.add(*b)
    w.finish()
    if merge and worker == 0:
        assert w.merge()
    return w


def _concat(batches: list[Batch]) -> dict[str, torch.Tensor]:
    out = {m: torch.cat([b[0][m] for b in batches]) for m in HEADER["modules"]}
    for i, key in enumerate(fmt.INDEX_KEYS):
        out[key] = torch.cat([b[i + 1] for b in batches])
    return out


def _by_token(rows: dict[str, Any]) -> dict[tuple[int, int], tuple[Any, ...]]:
    """(sequence, position) -> the token's bits, asserting no token appears twice."""
    out: dict[tuple[int, int], tuple[Any, ...]] = {}
    for i in range(len(rows["sequence"])):
        key = (int(rows["sequence"][i]), int(rows["position"][i]))
        assert key not in out, f"token {key} twice"
        out[key] = (int(rows["token_ids"][i]),
                    *(_bits(torch.as_tensor(rows[m][i])).tolist() for m in HEADER["modules"]))
    return out


def _files(folder: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _shard_contents(path: pathlib.Path) -> tuple[Any, ...]:
    """What a shard holds: its metadata, and each tensor's dtype, shape and bytes (the
    file's bytes are not compared: safetensors orders its metadata map at random)."""
    import safetensors

    with safetensors.safe_open(str(path), "pt") as f:
        return (f.metadata(), path.stat().st_size,
                {k: (str(f.get_tensor(k).dtype), _bits(f.get_tensor(k)).tolist()) for k in sorted(f.keys())})


def _assert_same_dataset(a: pathlib.Path, b: pathlib.Path) -> None:
    """The same manifest and shards, and no other file of the format left over."""
    ma, mb = fmt.read_manifest(str(a)), fmt.read_manifest(str(b))
    assert ma is not None and mb is not None
    assert {k: v for k, v in ma.items() if k != "updated"} == {k: v for k, v in mb.items() if k != "updated"}
    assert sorted(_files(a)) == sorted(_files(b))
    for shard in ma["shards"]:
        assert _shard_contents(a / shard["file"]) == _shard_contents(b / shard["file"]), shard["file"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_bit_exact(tmp_path: pathlib.Path, dtype: torch.dtype) -> None:
    import safetensors

    batches = _batches(9, dtype=dtype)
    _run(str(tmp_path / "d"), batches, shard_tokens=10)
    want = _concat(batches)
    ds = ActivationDataset(tmp_path / "d")
    name = str(dtype).removeprefix("torch.")
    assert ds.framework == "torch" and len(ds) == len(want["token_ids"]) == ds.manifest["tokens"]
    assert ds.modules == ["enc.0", "enc.attn"]
    assert ds.dtypes == {"enc.0": name, "enc.attn": name} and ds.shapes == {"enc.0": [4], "enc.attn": [2, 3]}
    got = ds[:]
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(_bits(got[key]), _bits(value)), key
    # With safetensors alone, following the manifest.
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in want}
    for shard in manifest["shards"]:
        with safetensors.safe_open(str(tmp_path / "d" / shard["file"]), "pt") as f:
            assert f.metadata() == {"format": "hookwire-activations", "version": "1"}
            assert sorted(f.keys()) == sorted(want)
            for key in want:
                parts[key].append(f.get_tensor(key))
        assert shard["bytes"] == (tmp_path / "d" / shard["file"]).stat().st_size
    for key, value in want.items():
        assert torch.equal(_bits(torch.cat(parts[key])), _bits(value)), key


def test_shards_end_at_batch_boundaries(tmp_path: pathlib.Path) -> None:
    batches = _batches(13)
    w = _run(str(tmp_path / "d"), batches, shard_tokens=9)
    ds = ActivationDataset(tmp_path / "d")
    sizes = [s["tokens"] for s in ds.shards]
    ends = set(np.cumsum([len(b[1]) for b in batches]).tolist())
    assert set(np.cumsum(sizes).tolist()) <= ends
    assert all(n >= 9 for n in sizes[:-1]) and len(sizes) >= 3
    # A group closes at the first batch boundary at or past shard_tokens, no later.
    start = 0
    for n in sizes[:-1]:
        before = max(e for e in ends | {0} if e < start + n)
        assert before - start < 9
        start += n
    assert w.manifest["batches_done"] == 13 and w.manifest["batches_total"] == 13 and w.done
    assert [s["file"] for s in ds.shards] == [f"shards/w0000-{i:06d}.safetensors" for i in range(len(sizes))]
    assert w.shards_written == len(sizes) and w.tokens_done == len(ds)
    assert w.bytes_written == sum(s["bytes"] for s in ds.shards)


def test_indexing_slices_and_views(tmp_path: pathlib.Path) -> None:
    batches = _batches(12)
    _run(str(tmp_path / "d"), batches, shard_tokens=6)
    ds = ActivationDataset(tmp_path / "d")
    want = _concat(batches)
    n = len(ds)
    assert len(ds.shards) > 3
    first = ds.shards[0]["tokens"]
    for key in (0, 5, first - 1, first, n - 1, -1, -n):
        row = ds[key]
        assert torch.equal(_bits(row["enc.attn"]), _bits(want["enc.attn"][key])) and row["enc.attn"].shape == (2, 3)
        assert int(row["sequence"]) == int(want["sequence"][key])
    for key in (slice(3, 30), slice(first - 2, first + 2), slice(None), slice(5, 5), slice(None, None, 3),
                slice(n - 1, 2, -4), [7, 0, 7, n - 1, -2], np.array([3, 1]), torch.tensor([2, first]), []):
        got = ds[key]
        index = torch.as_tensor(np.arange(n)[key].copy() if isinstance(key, slice) else np.asarray(key, dtype=np.int64))
        for k, v in want.items():
            assert torch.equal(_bits(got[k]), _bits(v[index])), (key, k)
    with pytest.raises(IndexError):
        ds[n]
    with pytest.raises(IndexError):
        ds[[0, n]]
    # Inside one shard a slice is a view of the map (no copy), and the map is copy-on-write:
    # writing into a value changes what this object reads there, never the file.
    inside = ds[1:3]["enc.0"]
    assert inside.data_ptr() == ds[1:3]["enc.0"].data_ptr() == ds.shard(0)["enc.0"][1:].data_ptr()
    assert ds[first - 1:first + 1]["enc.0"].data_ptr() != ds.shard(0)["enc.0"][first - 1:].data_ptr()  # joined
    inside.zero_()
    assert not ds[1:3]["enc.0"].any()
    assert torch.equal(_bits(ActivationDataset(tmp_path / "d")[1:3]["enc.0"]), _bits(want["enc.0"][1:3]))
    col = ds.module("enc.attn")
    assert len(col) == n and col.shape == (n, 2, 3) and col.dtype == "bfloat16"
    assert torch.equal(_bits(col[4:20]), _bits(want["enc.attn"][4:20]))
    per_shard = list(col)
    assert [len(p) for p in per_shard] == [s["tokens"] for s in ds.shards]
    assert torch.equal(_bits(ActivationDataset(tmp_path / "d").module("enc.attn").read()), _bits(want["enc.attn"]))
    assert torch.equal(ds.module("position").read(), want["position"])
    only = ActivationDataset(tmp_path / "d", modules=["enc.0"])
    assert sorted(only[0]) == ["enc.0", "position", "sequence", "token_ids"]
    with pytest.raises(KeyError):
        ActivationDataset(tmp_path / "d", modules=["nope"])
    with pytest.raises(KeyError):
        ds.module("nope")


def test_iter_batches_in_order_and_shuffled(tmp_path: pathlib.Path) -> None:
    batches = _batches(12)
    _run(str(tmp_path / "d"), batches, shard_tokens=6)
    ds = ActivationDataset(tmp_path / "d")
    want = _concat(batches)
    plain = list(ds.iter_batches(5))
    assert [len(b["token_ids"]) for b in plain[:-1]] == [5] * (len(plain) - 1)
    assert torch.equal(torch.cat([b["sequence"] for b in plain]), want["sequence"])
    assert len(list(ds.iter_batches(5, drop_last=True))) == len(ds) // 5
    one = list(ds.iter_batches(5, shuffle=True, seed=1, modules=["enc.0"]))
    again = list(ds.iter_batches(5, shuffle=True, seed=1, modules=["enc.0"]))
    other = list(ds.iter_batches(5, shuffle=True, seed=2, modules=["enc.0"]))
    assert sorted(one[0]) == ["enc.0", "position", "sequence", "token_ids"]
    joined = {k: torch.cat([b[k] for b in one]) for k in one[0]}
    assert all(torch.equal(joined[k], torch.cat([b[k] for b in again])) for k in joined)
    assert not torch.equal(joined["sequence"], torch.cat([b["sequence"] for b in other]))
    assert not torch.equal(joined["sequence"], want["sequence"])
    keyed = {(int(s), int(p)): _bits(v).tolist() for s, p, v in zip(joined["sequence"], joined["position"], joined["enc.0"])}
    assert len(keyed) == len(ds)
    assert keyed == {(int(s), int(p)): _bits(v).tolist()
                     for s, p, v in zip(want["sequence"], want["position"], want["enc.0"])}


def test_shuffle_is_the_documented_seeded_permutation(tmp_path: pathlib.Path) -> None:
    batches = _batches(14)
    st, buf, seed = 5, 3, 11
    _run(str(tmp_path / "plain"), batches, shard_tokens=st)
    _run(str(tmp_path / "s"), batches, shard_tokens=st, shuffle_buffer_shards=buf, shuffle_seed=seed)
    _run(str(tmp_path / "again"), batches, shard_tokens=st, shuffle_buffer_shards=buf, shuffle_seed=seed)
    _run(str(tmp_path / "other"), batches, shard_tokens=st, shuffle_buffer_shards=buf, shuffle_seed=seed + 1)
    plain, s, other = (ActivationDataset(tmp_path / n) for n in ("plain", "s", "other"))
    # The same tokens, in another order; the same seed gives the same files, byte for byte.
    assert _by_token(plain[:]) == _by_token(s[:]) == _by_token(other[:])
    assert not torch.equal(s[:]["sequence"], plain[:]["sequence"])
    assert not torch.equal(s[:]["sequence"], other[:]["sequence"])
    _assert_same_dataset(tmp_path / "s", tmp_path / "again")
    # Rebuilt by hand: groups of batches reaching st*buf tokens, each permuted by
    # randperm(group_seed(seed, worker, group)), cut into shards of st (the last takes the rest).
    groups: list[list[Batch]] = [[]]
    for b in batches:
        groups[-1].append(b)
        if sum(len(x[1]) for x in groups[-1]) >= st * buf:
            groups.append([])
    groups = [g for g in groups if g]
    shards = iter(s.shards)
    for index, group in enumerate(groups):
        cols = _concat(group)
        total = len(cols["token_ids"])
        order = torch.randperm(total, generator=torch.Generator().manual_seed(fmt.group_seed(seed, 0, index)))
        count = max(1, total // st)
        sizes = [st] * (count - 1) + [total - st * (count - 1)]
        got = [next(shards) for _ in sizes]
        assert [g["tokens"] for g in got] == sizes
        lo = sum(int(x["tokens"]) for x in s.shards[:s.shards.index(got[0])])
        rows = s[lo:lo + total]
        for key, value in cols.items():
            assert torch.equal(_bits(rows[key]), _bits(value[order])), (index, key)
    assert next(shards, None) is None


@pytest.mark.parametrize("shuffle", [0, 2])
def test_a_kill_at_any_point_resumes_to_the_uninterrupted_dataset(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, shuffle: int,
) -> None:
    """Every step of the commit protocol (each shard write, each manifest write, the
    merged manifest) is a place to die: before it, in the middle (a partial file), after
    it. Whatever the point, a resumed job gives the uninterrupted dataset, byte for byte,
    with no file left over."""
    batches = _batches(12)
    kw = {"shard_tokens": 6, "shuffle_buffer_shards": shuffle, "shuffle_seed": 3}
    _run(str(tmp_path / "whole"), batches, **kw)
    real_shard, real_json = fmt.DatasetWriter._write_shard, fmt._write_json
    plan: dict[str, Any] = {"count": 0, "at": None, "how": None}

    def _partial(path: pathlib.Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def step(write_partial: Any) -> None:
        plan["count"] += 1
        if plan["count"] == plan["at"]:
            if plan["how"] == "during":
                write_partial()
            if plan["how"] in ("before", "during"):
                raise Killed

    def after() -> None:
        if plan["count"] == plan["at"] and plan["how"] == "after":
            raise Killed

    def shard(self: fmt.DatasetWriter, name: str, tensors: dict[str, torch.Tensor]) -> int:
        step(lambda: _partial(pathlib.Path(f"{self.root}/{name}.tmp"), b"\x08\x00\x00partial"))
        nbytes = real_shard(self, name, tensors)
        after()
        return nbytes

    def manifest(fs: Any, path: str, record: Any, *rest: Any) -> None:
        step(lambda: _partial(pathlib.Path(f"{path}.tmp"), b'{"partial'))
        real_json(fs, path, record, *rest)
        after()

    monkeypatch.setattr(fmt.DatasetWriter, "_write_shard", shard)
    monkeypatch.setattr(fmt, "_write_json", manifest)
    _run(str(tmp_path / "count"), batches, **kw)
    steps = plan["count"]
    assert steps > 10
    for at in range(1, steps + 1):
        for how in ("before", "during", "after"):
            out = tmp_path / f"k{at}-{how}"
            plan.update(count=0, at=at, how=how)
            with pytest.raises(Killed):
                _run(str(out), batches, **kw)
            plan.update(at=None)
            if at == steps and how == "after":  # killed after its commit point: finished
                with pytest.raises(fmt.DatasetExists):
                    _run(str(out), batches, **kw)
            else:
                _run(str(out), batches, **kw)
            _assert_same_dataset(tmp_path / "whole", out)


def test_a_resumed_writer_skips_its_committed_batches_and_removes_orphans(tmp_path: pathlib.Path) -> None:
    batches = _batches(10)
    url = str(tmp_path / "d")
    w = fmt.DatasetWriter(url, header=HEADER, shard_tokens=8)
    for b in batches[:6]:
        w.add(*b)
    committed = w.manifest["batches_done"]
    assert 0 < committed < 6 and w.buffered_tokens > 0
    del w  # killed: its buffered batches are lost, and recomputed by the resumed job
    orphan = tmp_path / "d" / "shards" / "w0000-000042.safetensors"
    orphan.write_bytes(b"garbage")
    (tmp_path / "d" / "shards" / "w0000-000001.safetensors.tmp").write_bytes(b"garbage")
    (tmp_path / "d" / "shards" / "notes.txt").write_text("not the format's")
    resumed = fmt.DatasetWriter(url, header=HEADER, shard_tokens=8)
    assert resumed.resume_batches == committed
    assert not orphan.exists() and not (tmp_path / "d" / "shards" / "w0000-000001.safetensors.tmp").exists()
    assert (tmp_path / "d" / "shards" / "notes.txt").exists()
    for b in batches[committed:]:
        resumed.add(*b)
    resumed.finish()
    assert resumed.merge() and resumed.merge()
    _run(str(tmp_path / "whole"), batches, shard_tokens=8)
    assert _by_token(ActivationDataset(url)[:]) == _by_token(ActivationDataset(tmp_path / "whole")[:])
    with pytest.raises(ValueError, match="finished"):
        resumed.add(*batches[0])


def test_batches_must_agree_with_the_dataset(tmp_path: pathlib.Path) -> None:
    batches = _batches(3)
    w = fmt.DatasetWriter(str(tmp_path / "d"), header=HEADER, shard_tokens=1000)
    w.add(*batches[0])
    values, ids, seq, pos = batches[1]
    with pytest.raises(ValueError, match="'enc.0'.*float32"):
        w.add({**values, "enc.0": values["enc.0"].float()}, ids, seq, pos)
    with pytest.raises(ValueError, match="'enc.attn'.*\\[6\\]"):
        w.add({**values, "enc.attn": values["enc.attn"].reshape(len(ids), 6)}, ids, seq, pos)
    with pytest.raises(ValueError, match="missing \\['enc.attn'\\]"):
        w.add({"enc.0": values["enc.0"]}, ids, seq, pos)
    with pytest.raises(ValueError, match="sequence"):
        w.add(values, ids, seq[:-1], pos)
    with pytest.raises(ValueError, match="token_ids"):
        w.add(values, ids.float(), seq, pos)
    for b in batches[1:]:  # the rejected batches left the writer as it was
        w.add(*b)
    w.finish()
    assert w.merge()
    assert _by_token(ActivationDataset(tmp_path / "d")[:]) == _by_token(_concat(batches))
    # A resumed dataset's dtypes bind the next batches too.
    _run(str(tmp_path / "r"), batches[:2], shard_tokens=1, merge=False)
    (tmp_path / "r" / "workers" / "w0000-of-0001.json").write_text(
        (tmp_path / "r" / "workers" / "w0000-of-0001.json").read_text().replace('"done": true', '"done": false'))
    again = fmt.DatasetWriter(str(tmp_path / "r"), header=HEADER, shard_tokens=1)
    with pytest.raises(ValueError, match="'enc.0'"):
        again.add({m: v.float() for m, v in batches[2][0].items()}, *batches[2][1:])


def test_modules_come_from_the_first_batch_when_the_header_has_none(tmp_path: pathlib.Path) -> None:
    batches = [({"b": v["enc.0"], "a": v["enc.attn"]}, *rest) for v, *rest in _batches(3)]
    _run(str(tmp_path / "d"), batches, header={**HEADER, "modules": []}, shard_tokens=4)  # type: ignore[arg-type]
    ds = ActivationDataset(tmp_path / "d")
    assert ds.modules == ["b", "a"] and ds.dtypes == {"b": "bfloat16", "a": "bfloat16"}


def test_finished_datasets_are_kept_unless_overwritten(tmp_path: pathlib.Path) -> None:
    batches = _batches(8)
    url = str(tmp_path / "d")
    _run(url, batches, shard_tokens=4)
    old = _files(tmp_path / "d")
    with pytest.raises(fmt.DatasetExists):
        fmt.DatasetWriter(url, header=HEADER)
    assert _files(tmp_path / "d") == old
    (tmp_path / "d" / "notes.txt").write_text("mine")
    (tmp_path / "d" / "shards" / "README").write_text("mine too")
    _run(url, batches[:2], shard_tokens=4, overwrite=True)
    ds = ActivationDataset(url)
    assert _by_token(ds[:]) == _by_token(_concat(batches[:2]))
    assert (tmp_path / "d" / "notes.txt").read_text() == "mine"  # only the format's files go
    assert (tmp_path / "d" / "shards" / "README").read_text() == "mine too"
    assert sorted(p.name for p in (tmp_path / "d" / "shards").glob("*.safetensors")) == \
        sorted(pathlib.Path(s["file"]).name for s in ds.shards)
    # Overwriting a 2-way split with a 1-way run: worker 0 removes the split's leftovers.
    _run(str(tmp_path / "s"), batches, worker=1, workers=2, shard_tokens=4)
    _run(str(tmp_path / "s"), batches, worker=0, workers=2, shard_tokens=4)
    _run(str(tmp_path / "s"), batches, shard_tokens=4, overwrite=True)
    assert sorted(p.name for p in (tmp_path / "s" / "workers").iterdir()) == ["w0000-of-0001.json"]
    assert all(p.name.startswith("w0000-") for p in (tmp_path / "s" / "shards").iterdir())
    assert _by_token(ActivationDataset(tmp_path / "s")[:]) == _by_token(_concat(batches))


def test_unfinished_datasets_of_other_settings_are_refused(tmp_path: pathlib.Path) -> None:
    batches = _batches(6)
    url = str(tmp_path / "d")
    w = fmt.DatasetWriter(url, header=HEADER, shard_tokens=4)
    for b in batches[:4]:
        w.add(*b)
    other = {**HEADER, "settings": {"k": 2, "shuffle": None}}
    with pytest.raises(fmt.SettingsMismatch, match="k: 1 there, 2 now"):
        fmt.DatasetWriter(url, header=other, shard_tokens=4)
    with pytest.raises(fmt.SettingsMismatch, match="shard_tokens: 4 there, 5 now"):
        fmt.DatasetWriter(url, header=HEADER, shard_tokens=5)
    with pytest.raises(fmt.SettingsMismatch, match="shuffle_buffer_shards"):
        fmt.DatasetWriter(url, header=HEADER, shard_tokens=4, shuffle_buffer_shards=2)
    with pytest.raises(fmt.SettingsMismatch, match="other settings.*k: 1 there, 2 now"):
        fmt.DatasetWriter(url, header=other, worker_index=1, num_workers=2, shard_tokens=4)
    with pytest.raises(fmt.SettingsMismatch, match="split of 1 workers, this one of 2"):
        fmt.DatasetWriter(url, header=HEADER, worker_index=1, num_workers=2, shard_tokens=4)
    assert fmt.DatasetWriter(url, header=HEADER, shard_tokens=4).resume_batches == w.manifest["batches_done"]
    _run(url, batches, header=other, shard_tokens=4, overwrite=True)  # overwrite starts over
    assert fmt.read_manifest(url)["settings"] == other["settings"]  # type: ignore[index]
    assert fmt.settings_digest({"b": 1, "a": [1, 2]}) == fmt.settings_digest({"a": [1, 2], "b": 1})
    assert fmt.read_manifest(url)["settings_digest"] == fmt.settings_digest(other["settings"])  # type: ignore[index]


def test_two_workers_merge_into_the_one_worker_dataset(tmp_path: pathlib.Path) -> None:
    batches = _batches(11)
    _run(str(tmp_path / "one"), batches, shard_tokens=5)
    split = str(tmp_path / "split")
    w0 = _run(split, batches, worker=0, workers=2, shard_tokens=5, merge=False)
    assert not w0.merge()  # worker 1 has not started
    assert fmt.read_manifest(split) is None
    partial = ActivationDataset(split, allow_incomplete=True)
    assert len(partial) == w0.tokens_done and partial.manifest["complete"] is False
    w1 = fmt.DatasetWriter(split, header=HEADER, worker_index=1, num_workers=2, shard_tokens=5)
    for b in batches[1::2][:3]:
        w1.add(*b)
    assert not w0.merge()  # worker 1 is not done
    assert len(ActivationDataset(split, allow_incomplete=True)) == w0.tokens_done + w1.tokens_done
    for b in batches[1::2][3:]:
        w1.add(*b)
    w1.finish()
    with pytest.raises(ValueError, match="worker 0"):
        w1.merge()
    assert w0.merge()
    merged = ActivationDataset(split)
    assert merged.manifest["num_workers"] == 2 and merged.manifest["complete"] is True
    assert merged.manifest["tokens"] == len(merged) == len(ActivationDataset(tmp_path / "one"))
    assert [s["worker"] for s in merged.shards] == sorted(s["worker"] for s in merged.shards)
    assert len({s["file"] for s in merged.shards}) == len(merged.shards)
    assert _by_token(merged[:]) == _by_token(ActivationDataset(tmp_path / "one")[:])
    assert set(merged.manifest) == {"format", "version", "hookwire_version", "model", "modules", "dtypes", "shapes",
                                    "settings", "settings_digest", "source", "num_workers", "tokens", "shards",
                                    "complete", "updated"}
    with pytest.raises(fmt.DatasetExists):
        fmt.DatasetWriter(split, header=HEADER, worker_index=1, num_workers=2, shard_tokens=5)


def test_a_memory_url_works_end_to_end(tmp_path: pathlib.Path) -> None:
    import uuid

    import fsspec
    import safetensors.torch

    batches = _batches(9)
    url = f"memory://hookwire-test-{uuid.uuid4().hex}/ds"
    fs = fsspec.filesystem("memory")
    try:
        for worker in (1, 0):
            _run(url, batches, worker=worker, workers=2, shard_tokens=5, shuffle_buffer_shards=2, shuffle_seed=1)
        for worker in (1, 0):
            _run(str(tmp_path / "local"), batches, worker=worker, workers=2, shard_tokens=5, shuffle_buffer_shards=2,
                 shuffle_seed=1)
        local = ActivationDataset(tmp_path / "local")
        cache = tmp_path / "cache"
        remote = ActivationDataset(url, cache_dir=cache)
        assert len(remote) == len(local)
        assert all(torch.equal(_bits(remote[:][k]), _bits(local[:][k])) for k in local[:])
        assert len(list(cache.iterdir())) == len(remote.shards)  # each shard downloaded once, whole
        for shard in local.shards:
            there, here = fs.cat_file(f"{url}/{shard['file']}"), (tmp_path / "local" / shard["file"]).read_bytes()
            assert len(there) == len(here) == shard["bytes"]
            a, b = safetensors.torch.load(there), safetensors.torch.load(here)
            assert a.keys() == b.keys() and all(torch.equal(_bits(a[k]), _bits(b[k])) for k in a)
        # A persistent cache never serves a shard that changed under the same name.
        _run(url, batches[:3], workers=1, shard_tokens=100, overwrite=True)
        assert _by_token(ActivationDataset(url, cache_dir=cache)[:]) == _by_token(_concat(batches[:3]))
        # A default cache folder goes with the dataset.
        ds = ActivationDataset(url)
        ds[0]
        folder = ds._cache_dir
        assert folder is not None and os.listdir(folder)
        del ds
        import gc

        gc.collect()
        assert not os.path.exists(folder)
        # Kill and resume on an object store: an orphan under its final name is rewritten.
        resumed = f"{url}-resumed"
        w = fmt.DatasetWriter(resumed, header=HEADER, shard_tokens=4)
        for b in batches[:5]:
            w.add(*b)
        fs.pipe_file(f"{resumed}/shards/w0000-{w.shards_written:06d}.safetensors", b"partial")
        _run(resumed, batches, shard_tokens=4)
        _run(str(tmp_path / "plain"), batches, shard_tokens=4)
        assert _by_token(ActivationDataset(resumed)[:]) == _by_token(ActivationDataset(tmp_path / "plain")[:])
    finally:
        fs.rm(url.split("/ds")[0], recursive=True)


def test_reading_with_numpy_never_imports_torch(tmp_path: pathlib.Path) -> None:
    batches = _batches(6)
    _run(str(tmp_path / "d"), batches, shard_tokens=4)
    for b in batches:  # bfloat16 NaNs become float32 NaNs with the same payload bits
        b[0]["enc.0"][:1] = torch.tensor([0x7FC1], dtype=torch.int16).view(torch.bfloat16)
    _run(str(tmp_path / "n"), batches, shard_tokens=4)
    want = _concat(batches)
    np.save(tmp_path / "want.npy", want["enc.0"].float().numpy().view(np.uint32))
    np.save(tmp_path / "seq.npy", want["sequence"].numpy())
    script = (
        "import sys; sys.modules['torch'] = None\n"
        "import numpy as np, hookwire\n"
        f"ds = hookwire.ActivationDataset({str(tmp_path / 'n')!r})\n"
        "rows = ds[:]\n"
        "assert ds.framework == 'numpy' and rows['enc.0'].dtype == np.float32, rows['enc.0'].dtype\n"
        f"assert np.array_equal(rows['enc.0'].view(np.uint32), np.load({str(tmp_path / 'want.npy')!r}))\n"
        f"assert np.array_equal(rows['sequence'], np.load({str(tmp_path / 'seq.npy')!r}))\n"
        "assert ds[3]['enc.attn'].shape == (2, 3) and ds[[1, 2]]['enc.0'].shape == (2, 4)\n"
        "assert sum(len(b['token_ids']) for b in ds.iter_batches(4, shuffle=True)) == len(ds)\n"
        "assert not any(m == 'torch' or m.startswith('torch.') for m in sys.modules if sys.modules[m] is not None)\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'client'}"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["ok"]
    assert ActivationDataset(tmp_path / "n", framework="numpy")[:]["enc.attn"].dtype == np.float32


def test_a_dataloader_reads_it(tmp_path: pathlib.Path) -> None:
    import pickle

    batches = _batches(10)
    _run(str(tmp_path / "d"), batches, shard_tokens=6)
    ds = ActivationDataset(tmp_path / "d")
    want = _concat(batches)
    loader = torch.utils.data.DataLoader(ds, batch_size=7)
    got = list(loader)
    assert [len(b["token_ids"]) for b in got[:-1]] == [7] * (len(got) - 1)
    for key, value in want.items():
        assert torch.equal(_bits(torch.cat([b[key] for b in got])), _bits(value)), key
    sampler = torch.utils.data.BatchSampler(
        torch.utils.data.RandomSampler(ds, generator=torch.Generator().manual_seed(0)), 8, drop_last=False)
    fast = list(torch.utils.data.DataLoader(ds, batch_size=None, sampler=sampler))
    assert _by_token({k: torch.cat([b[k] for b in fast]) for k in want}) == _by_token(want)
    # Pickled for worker processes without its maps (not a copy of the data).
    blob = pickle.dumps(ds)
    assert len(blob) < 20_000
    assert torch.equal(_bits(pickle.loads(blob)[:]["enc.0"]), _bits(want["enc.0"]))


def test_bad_files_are_named(tmp_path: pathlib.Path) -> None:
    _run(str(tmp_path / "d"), _batches(6), shard_tokens=4)
    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        ActivationDataset(tmp_path / "nothing")
    with pytest.raises(FileNotFoundError, match="no worker manifests"):
        ActivationDataset(tmp_path / "nothing", allow_incomplete=True)
    with pytest.raises(ValueError, match="framework"):
        ActivationDataset(tmp_path / "d", framework="jax")
    ds = ActivationDataset(tmp_path / "d", max_open_shards=1)
    first = ds.shards[0]["file"]
    path = tmp_path / "d" / first
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(ValueError, match=f"{first}: .* bytes, the manifest says"):
        ds[0]
    assert ds[len(ds) - 1]["token_ids"].shape == ()
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    (tmp_path / "d" / "manifest.json").write_text(json.dumps({**manifest, "version": "2"}))
    with pytest.raises(ValueError, match="version '2'"):
        ActivationDataset(tmp_path / "d")


@pytest.mark.parametrize("planted", ["shards", "shards/w0000-000000.safetensors.tmp", "workers/w0000-of-0001.json.tmp"])
def test_a_confined_writer_checks_each_file_as_it_opens_it(tmp_path: pathlib.Path, planted: str) -> None:
    # A link planted after the writer opened (the start-time checks passed) is refused
    # when the file under it is opened: nothing is written outside the folder.
    folder, outside = tmp_path / "ds", tmp_path / "outside"
    outside.mkdir()
    w = fmt.DatasetWriter(str(folder), header=HEADER, shard_tokens=4, confine=True)
    link = folder / planted
    link.parent.mkdir(parents=True, exist_ok=True)
    if planted == "shards":
        link.symlink_to(outside, target_is_directory=True)
    else:
        link.symlink_to(outside / "victim")
    with pytest.raises(fmt.UnsafePath, match="symlink"):
        for b in _batches(6):
            w.add(*b)
        w.finish()
    assert list(outside.iterdir()) == []
    # A writer opened on a folder holding such a link refuses at once.
    with pytest.raises(fmt.UnsafePath, match="symlink"):
        fmt.DatasetWriter(str(folder), header=HEADER, shard_tokens=4, confine=True)
    # Without confine (the client sink, the user's own folder) links are the user's business.
    assert fmt.UnsafePath.__mro__[1] is ValueError
