"""Harvest jobs on a real server (HarvestService over grpc.aio on loopback): datasets
bit-identical to in-process torch hooks on the same contexts, token ids exactly the
tokenizer's, resuming, cancelling, live calls before harvest batches, bad requests.

In-process PyTorch / transformers is the oracle: the test forms the contexts itself from
the tokenizer's ids (not with hookwire's own context code) and runs the model with real
torch forward hooks.
"""

from __future__ import annotations

import asyncio
import copy
import json
import pathlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest
import torch
import transformers

from hookwire.wire import codec
from hookwire.v1 import harvest_service_pb2 as hv
from hookwire.v1 import harvest_service_pb2_grpc as hv_grpc
from hookwire.v1 import hook_pb2, rule_pb2, tensor_pb2
from hookwire_server.demo_models import tiny_lm, tiny_lm_tokenizer
from hookwire_server.models.model_loading import ModelConfig, build_host
from hookwire_server.models.model_registry import ModelHost, ModelRegistry
from hookwire_server.api.server import ServerSettings
from support import PROCESS_LIVENESS, ServerThread, minilm_folder, read_dataset, serving

pytestmark = pytest.mark.asyncio

#: A liveness bound for waiting on jobs (never a speed claim): a busy machine only makes it slower.

DOCS = [
    "The cat sat on the mat.",
    "Hooks see every layer of the model, and the data is written to shards.",
    "Hello world",
    "",
    "Interpretability researchers harvest activations by the billions of tokens for sparse autoencoders.",
    "A short one.",
    "The model is a text model; it reads tokens and writes hidden states for each of them, layer by layer.",
    "the of and to in is it that was for on are with as at be this have from or one by not",
    "Sparse autoencoders want shuffled activations.",
]


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, pathlib.Path]:
    data = tmp_path_factory.mktemp("data")
    out = tmp_path_factory.mktemp("out")
    with open(data / "docs.jsonl", "w") as f:
        for doc in DOCS:
            f.write(json.dumps({"text": doc, "id": len(doc)}) + "\n")
    (data / "more.txt").write_text("\n".join([d for d in DOCS if d] * 12))
    return data, out


@pytest.fixture(scope="module")
def local() -> dict[str, Any]:
    folder = minilm_folder()
    return {
        "bert": transformers.BertModel.from_pretrained(str(folder), local_files_only=True).eval(),
        "bert_tok": transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True),
        "lm": tiny_lm().eval(),
        "lm_tok": tiny_lm_tokenizer(),
    }


@pytest.fixture(scope="module")
def server(roots: tuple[pathlib.Path, pathlib.Path], local: dict[str, Any]) -> Iterator[ServerThread]:
    data, out = roots
    registry = ModelRegistry([ModelHost("tiny-lm", copy.deepcopy(local["lm"]), tokenizer=tiny_lm_tokenizer())])
    registry.add(build_host(ModelConfig(name="minilm", transformers=str(minilm_folder()))))
    settings = ServerSettings(port=0, harvest_data_root=str(data), harvest_output_root=str(out))
    with serving(registry, settings) as srv:
        yield srv


@pytest.fixture
async def stub(server: ServerThread) -> AsyncIterator[hv_grpc.HarvestServiceStub]:
    async with grpc.aio.insecure_channel(server.target) as channel:
        yield hv_grpc.HarvestServiceStub(channel)


async def _finish(stub: hv_grpc.HarvestServiceStub, job: hv.HarvestJob) -> hv.HarvestJob:
    """Follows the job with WatchHarvest until it ends; its last state."""
    last = job
    async for last in stub.WatchHarvest(hv.WatchHarvestRequest(job_id=job.job_id, interval_ms=50)):
        pass
    assert last.state != hv.HARVEST_STATE_RUNNING
    return last


_read = read_dataset


def _by_token(tensors: dict[str, torch.Tensor]) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    out = {}
    for i, (s, p) in enumerate(zip(tensors["sequence"].tolist(), tensors["position"].tolist())):
        assert (s, p) not in out, f"token {(s, p)} stored twice"
        out[(s, p)] = {k: v[i] for k, v in tensors.items()}
    return out


def _truncated_contexts(tokenizer: Any, docs: list[str], length: int, bos: int | None) -> list[list[int]]:
    """The oracle's contexts: one per non-empty document, [BOS] + its ids, cut to length."""
    out = []
    for doc in docs:
        ids = tokenizer(doc, add_special_tokens=False)["input_ids"]
        if not ids:
            continue
        ctx = ([bos] if bos is not None else []) + ids
        out.append(ctx[:length])
    return out


def _oracle(model: torch.nn.Module, modules: list[str], contexts: list[list[int]], batch_size: int, pad: int,
            dtype: torch.dtype | None, skip_first: int = 0, edit: Any = None) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    """In-process: right-padded batches of the contexts, torch forward hooks on the modules."""
    out: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    named = dict(model.named_modules())
    for b in range(0, len(contexts), batch_size):
        rows = contexts[b:b + batch_size]
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        seen: dict[str, torch.Tensor] = {}
        handles = []
        if edit is not None:
            handles.append(named[edit[0]].register_forward_hook(edit[1]))
        for m in modules:
            def hook(mod: Any, args: Any, output: Any, m: str = m) -> None:
                value = output[0] if isinstance(output, tuple) else output
                seen[m] = value.detach().clone()
            handles.append(named[m].register_forward_hook(hook))
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
        for h in handles:
            h.remove()
        for r, row in enumerate(rows):
            for pos in range(skip_first, len(row)):
                values = {m: (seen[m][r, pos].to(dtype) if dtype is not None else seen[m][r, pos]) for m in modules}
                values["token_ids"] = torch.tensor(row[pos])
                out[(b + r, pos)] = values
    return out


def _assert_equal(stored: dict[tuple[int, int], dict[str, torch.Tensor]],
                  expected: dict[tuple[int, int], dict[str, torch.Tensor]]) -> None:
    assert sorted(stored) == sorted(expected)
    for key, values in expected.items():
        for name, value in values.items():
            got = stored[key][name]
            assert got.dtype == value.dtype and torch.equal(got, value), f"{key} {name}"


async def test_minilm_layers_in_bfloat16_equal_in_process_hooks_bit_for_bit(
    stub: hv_grpc.HarvestServiceStub, roots: tuple[pathlib.Path, pathlib.Path], local: dict[str, Any],
) -> None:
    data, out = roots
    request = hv.StartHarvestRequest(
        model="minilm", modules=["encoder.layer.*"], dtype=tensor_pb2.DTYPE_BFLOAT16,
        source=hv.HarvestSource(text=hv.TextSource(path="docs.jsonl")),
        contexts=hv.HarvestContexts(length=16, batch_size=3),
        output=hv.HarvestOutput(path="minilm-bf16", shard_tokens=20),
    )
    job = await stub.StartHarvest(request)
    assert job.state == hv.HARVEST_STATE_PENDING and job.job_id.startswith("hv-")
    done = await _finish(stub, job)
    assert done.state == hv.HARVEST_STATE_SUCCEEDED, done.error
    assert done.committed and done.tokens_done == done.tokens_total > 0
    assert list(done.modules) == [f"encoder.layer.{i}" for i in range(6)]
    tensors = _read(out / "minilm-bf16")
    assert tensors["encoder.layer.0"].dtype == torch.bfloat16 and tensors["encoder.layer.0"].shape[1:] == (384,)
    tok = local["bert_tok"]
    contexts = _truncated_contexts(tok, DOCS, 16, tok.cls_token_id)
    expected = _oracle(local["bert"], list(done.modules), contexts, 3, tok.pad_token_id, torch.bfloat16)
    _assert_equal(_by_token(tensors), expected)
    manifest = json.loads((out / "minilm-bf16" / "manifest.json").read_text())
    assert manifest["model"] == "minilm" and manifest["tokens"] == done.tokens_done
    assert manifest["dtypes"]["encoder.layer.0"] == "bfloat16"


async def test_steered_tiny_lm_packed_contexts_skip_bos_equal_in_process_edit(
    stub: hv_grpc.HarvestServiceStub, roots: tuple[pathlib.Path, pathlib.Path], local: dict[str, Any],
) -> None:
    data, out = roots
    rule = hook_pb2.HookSpec(module="model.layers.0", posthook=hook_pb2.HookAction(
        rules=[rule_pb2.Rule(target="output", scale=rule_pb2.ScaleOp(factor=2.0))]))
    request = hv.StartHarvestRequest(
        model="tiny-lm", modules=["model.layers.1", "model.norm"], rules=[rule],
        source=hv.HarvestSource(text=hv.TextSource(path="docs.jsonl")),
        contexts=hv.HarvestContexts(length=12, batch_size=2, packing=hv.PACKING_PACK),
        positions=hv.HarvestPositions(skip_first=1),
        output=hv.HarvestOutput(path="lm-steered", shard_tokens=16),
    )
    done = await _finish(stub, await stub.StartHarvest(request))
    assert done.state == hv.HARVEST_STATE_SUCCEEDED, done.error
    tok = local["lm_tok"]
    stream: list[int] = []
    for doc in DOCS:
        ids = tok(doc, add_special_tokens=False)["input_ids"]
        if ids:
            stream += ids + [tok.eos_token_id]
    contexts = [[tok.bos_token_id] + stream[i:i + 11] for i in range(0, len(stream) - 10, 11)]
    contexts = [c for c in contexts if len(c) == 12]

    def double(mod: Any, args: Any, output: Any) -> Any:
        return (output[0] * 2.0, *output[1:]) if isinstance(output, tuple) else output * 2.0

    expected = _oracle(local["lm"], ["model.layers.1", "model.norm"], contexts, 2, tok.pad_token_id, None,
                       skip_first=1, edit=("model.layers.0", double))
    _assert_equal(_by_token(_read(out / "lm-steered")), expected)


async def test_a_cancelled_job_resumes_to_the_same_dataset_as_an_uninterrupted_one(
    stub: hv_grpc.HarvestServiceStub, server: ServerThread, roots: tuple[pathlib.Path, pathlib.Path],
) -> None:
    data, out = roots

    def request(path: str) -> hv.StartHarvestRequest:
        return hv.StartHarvestRequest(
            model="tiny-lm", modules=["model.layers.*"],
            source=hv.HarvestSource(text=hv.TextSource(path="more.txt")),
            contexts=hv.HarvestContexts(length=8, batch_size=1, packing=hv.PACKING_PACK),
            output=hv.HarvestOutput(path=path, shard_tokens=16,
                                    shuffle=hv.HarvestShuffle(enabled=True, buffer_shards=2, seed=7)),
        )

    whole = await _finish(stub, await stub.StartHarvest(request("whole")))
    assert whole.state == hv.HARVEST_STATE_SUCCEEDED, whole.error
    assert whole.batches_total > 60
    job = await stub.StartHarvest(request("parts"))
    async for state in stub.WatchHarvest(hv.WatchHarvestRequest(job_id=job.job_id, interval_ms=50)):
        if state.shards_written >= 2:  # two groups of four batches committed, fifty batches to go
            cancelled = await stub.CancelHarvest(hv.CancelHarvestRequest(job_id=job.job_id))
            assert cancelled.job_id == job.job_id
            break
    first = await _finish(stub, job)
    assert first.state == hv.HARVEST_STATE_CANCELLED and "cancelled" in first.error
    assert 0 < first.shards_written < whole.shards_written
    again = await _finish(stub, await stub.StartHarvest(request("parts")))
    assert again.state == hv.HARVEST_STATE_SUCCEEDED, again.error
    assert again.resumed_tokens > 0 and again.resumed_tokens % 32 == 0  # whole groups of 4 batches of 8 tokens
    a, b = _read(out / "whole"), _read(out / "parts")
    assert set(a) == set(b)
    for key in a:  # the same tokens, in the same (shuffled) order: resuming rebuilt the same groups
        assert torch.equal(a[key], b[key]), key
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.StartHarvest(request("whole"))
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS


async def test_live_infer_calls_run_while_a_harvest_job_runs(
    stub: hv_grpc.HarvestServiceStub, server: ServerThread, roots: tuple[pathlib.Path, pathlib.Path],
) -> None:
    import hookwire

    request = hv.StartHarvestRequest(
        model="tiny-lm", modules=["model.norm"],
        source=hv.HarvestSource(text=hv.TextSource(path="docs.jsonl")),
        contexts=hv.HarvestContexts(length=8, batch_size=1, packing=hv.PACKING_PACK),
        output=hv.HarvestOutput(path="alongside", shard_tokens=8),
    )
    job = await stub.StartHarvest(request)
    async with hookwire.connect(server.target) as client:
        model = client.model("tiny-lm")
        for _ in range(5):
            out = await model(torch.tensor([[1, 5, 6, 7]]))
            assert out["logits"].shape[:2] == (1, 4)
    state = await stub.GetHarvest(hv.GetHarvestRequest(job_id=job.job_id))
    assert state.job_id == job.job_id
    done = await _finish(stub, job)
    assert done.state == hv.HARVEST_STATE_SUCCEEDED, done.error
    listed = await stub.ListHarvests(hv.ListHarvestsRequest(model="tiny-lm"))
    assert job.job_id in [j.job_id for j in listed.jobs]


def _bad(**changes: Any) -> hv.StartHarvestRequest:
    request = hv.StartHarvestRequest(
        model="tiny-lm", modules=["model.norm"], source=hv.HarvestSource(text=hv.TextSource(path="docs.jsonl")),
        contexts=hv.HarvestContexts(length=8, batch_size=2), output=hv.HarvestOutput(path="bad"),
    )
    for path, value in changes.items():
        target = request
        *parents, leaf = path.split("__")
        for p in parents:
            target = getattr(target, p)
        field = target.DESCRIPTOR.fields_by_name[leaf]
        if field.is_repeated:
            del getattr(target, leaf)[:]
            getattr(target, leaf).extend(value)
        elif field.message_type is not None:
            getattr(target, leaf).CopyFrom(value)
        else:
            setattr(target, leaf, value)
    return request


BAD = [
    ("unknown model", dict(model="nope"), grpc.StatusCode.NOT_FOUND, "nope"),
    ("no modules", dict(modules=[]), grpc.StatusCode.INVALID_ARGUMENT, "modules"),
    ("no such module", dict(modules=["model.nope"]), grpc.StatusCode.NOT_FOUND, "model.nope"),
    ("bad part", dict(part=hook_pb2.PART_GRAD_INPUT), grpc.StatusCode.INVALID_ARGUMENT, "part"),
    ("bad select", dict(select="[:, :, ::0"), grpc.StatusCode.INVALID_ARGUMENT, "select"),
    ("bad dtype", dict(dtype=tensor_pb2.DTYPE_INT8), grpc.StatusCode.INVALID_ARGUMENT, "dtype"),
    ("escaping source", dict(source__text__path="../etc/passwd"), grpc.StatusCode.PERMISSION_DENIED, "source.text.path"),
    ("absolute source", dict(source__text__path="/etc/passwd"), grpc.StatusCode.PERMISSION_DENIED, "source.text.path"),
    ("missing source", dict(source__text__path="nope.jsonl"), grpc.StatusCode.NOT_FOUND, "nope.jsonl"),
    ("no source", dict(source=hv.HarvestSource()), grpc.StatusCode.INVALID_ARGUMENT, "source"),
    ("escaping output", dict(output__path="../x"), grpc.StatusCode.PERMISSION_DENIED, "output.path"),
    ("absolute output", dict(output__path="/tmp/x"), grpc.StatusCode.PERMISSION_DENIED, "output.path"),
    ("empty output", dict(output__path=""), grpc.StatusCode.INVALID_ARGUMENT, "output.path"),
    ("url not allowed", dict(output__path="s3://bucket/x"), grpc.StatusCode.PERMISSION_DENIED, "harvest_url_prefixes"),
    ("context too long", dict(contexts__length=100000), grpc.StatusCode.INVALID_ARGUMENT, "contexts.length"),
    ("batch too large", dict(contexts__batch_size=100000), grpc.StatusCode.INVALID_ARGUMENT, "contexts.batch_size"),
    ("position too far", dict(positions__only=[3, 99]), grpc.StatusCode.INVALID_ARGUMENT, "positions.only"),
    ("skip everything", dict(positions__skip_first=8), grpc.StatusCode.INVALID_ARGUMENT, "positions.skip_first"),
    ("worker index", dict(worker_index=2, num_workers=2), grpc.StatusCode.INVALID_ARGUMENT, "worker_index"),
    ("too many workers", dict(num_workers=5000), grpc.StatusCode.INVALID_ARGUMENT, "num_workers"),
    ("shard too large", dict(output__shard_tokens=1 << 30), grpc.StatusCode.INVALID_ARGUMENT, "shard_tokens"),
    ("buffer too large", dict(output__shuffle=hv.HarvestShuffle(enabled=True, buffer_shards=1000)),
     grpc.StatusCode.INVALID_ARGUMENT, "buffer_shards"),
    ("capturing rule", dict(rules=[hook_pb2.HookSpec(module="model.norm", posthook=hook_pb2.HookAction(
        capture=[hook_pb2.PART_OUTPUT]))]), grpc.StatusCode.INVALID_ARGUMENT, "rules[0]"),
    ("float tokens", dict(source=hv.HarvestSource(tokens=hv.TokenSource(
        input_ids=codec.encode_tensor(torch.zeros(2, 4))))), grpc.StatusCode.INVALID_ARGUMENT, "integer"),
    ("too many modules", dict(modules=["model.norm"] * 65), grpc.StatusCode.RESOURCE_EXHAUSTED, "modules"),
    ("long path", dict(output__path="x" * 5000), grpc.StatusCode.INVALID_ARGUMENT, "output"),
    ("output in the state folder", dict(output__path=".hookwire-jobs/acts"), grpc.StatusCode.INVALID_ARGUMENT,
     "harvest_state_dir"),
    ("output is the state folder", dict(output__path=".hookwire-jobs"), grpc.StatusCode.INVALID_ARGUMENT,
     "output.path"),
]


@pytest.mark.parametrize("name,changes,code,words", BAD, ids=[b[0] for b in BAD])
async def test_bad_requests_get_a_clear_status_and_start_nothing(
    stub: hv_grpc.HarvestServiceStub, server: ServerThread, name: str, changes: dict[str, Any],
    code: grpc.StatusCode, words: str,
) -> None:
    before = len(server.call(lambda: list(server.server.harvests._jobs)))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.StartHarvest(_bad(**changes))
    assert info.value.code() == code, info.value.details()
    assert words in (info.value.details() or ""), info.value.details()
    assert len(server.call(lambda: list(server.server.harvests._jobs))) == before
    # the server stays healthy
    assert (await stub.ListHarvests(hv.ListHarvestsRequest())) is not None


@pytest.mark.parametrize("planted", ["shards", "shards/w0000-000000.safetensors.tmp",
                                     "shards/w0000-000000.safetensors", "workers"])
async def test_a_symlink_planted_inside_an_existing_output_folder_writes_nothing_outside(
    stub: hv_grpc.HarvestServiceStub, roots: tuple[pathlib.Path, pathlib.Path], tmp_path: pathlib.Path, planted: str,
) -> None:
    # The output folder itself is inside the root (the start-time check passes), but a
    # component inside it is a link out of the root: a folder, or a shard's own name.
    data, out = roots
    outside = tmp_path / "outside"
    outside.mkdir()
    name = "planted-" + planted.replace("/", "-").replace(".", "-")
    link = out / name / planted
    link.parent.mkdir(parents=True)
    if planted in ("shards", "workers"):
        link.symlink_to(outside, target_is_directory=True)
    else:
        (outside / "victim").write_bytes(b"precious")
        link.symlink_to(outside / "victim")
    request = _bad(output__path=name)
    try:
        job = await stub.StartHarvest(request)
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.PERMISSION_DENIED, exc.details()
        assert "symlink" in (exc.details() or "") and "output.path" in (exc.details() or ""), exc.details()
    else:
        done = await asyncio.wait_for(_finish(stub, job), PROCESS_LIVENESS)
        assert done.state == hv.HARVEST_STATE_FAILED and "symlink" in done.error, (done.state, done.error)
    left = sorted(p.name for p in outside.iterdir())
    assert left in ([], ["victim"]), left
    if left:
        assert (outside / "victim").read_bytes() == b"precious"


async def test_unknown_jobs_are_not_found(stub: hv_grpc.HarvestServiceStub) -> None:
    for call in (stub.GetHarvest(hv.GetHarvestRequest(job_id="hv-0000")),
                 stub.CancelHarvest(hv.CancelHarvestRequest(job_id="../../etc"))):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_the_client_sink_writes_the_same_dataset_as_a_server_job(
    stub: hv_grpc.HarvestServiceStub, server: ServerThread, roots: tuple[pathlib.Path, pathlib.Path],
    local: dict[str, Any], tmp_path: pathlib.Path,
) -> None:
    import hookwire

    data, out = roots
    options = dict(dtype="bfloat16", length=12, batch_size=4, packing="pack", skip_first=1, shard_tokens=32,
                   shuffle=True, shuffle_buffer=2, seed=5)
    async with hookwire.connect(server.target) as client:
        job = await client.harvest("minilm", "encoder.layer.*", data="docs.jsonl", out="sink-server", **options)
        done = await job.wait()
        assert done.state == "succeeded" and done.committed
        local_done = await client.harvest_local(
            "minilm", "encoder.layer.*", data=data / "docs.jsonl", tokenizer=local["bert_tok"],
            out=str(tmp_path / "sink-client"), **options,
        )
    assert local_done.tokens_done == done.tokens_done > 0
    a = hookwire.ActivationDataset(out / "sink-server")
    b = hookwire.ActivationDataset(tmp_path / "sink-client")
    assert a.modules == b.modules == list(done.modules)
    assert [s["tokens"] for s in a.shards] == [s["tokens"] for s in b.shards]
    for key in [*a.modules, "token_ids", "sequence", "position"]:
        x, y = a[:][key], b[:][key]
        assert x.dtype == y.dtype and torch.equal(x, y), key


async def test_the_servers_tokenize_gives_the_local_tokenizers_ids_in_batches_within_its_limits(
    server: ServerThread, local: dict[str, Any],
) -> None:
    # The client sink's default tokenizer: Tokenize on the server. Its ids must be exactly
    # transformers' own for every document (tiny-lm's tokenizer, in process, is the oracle),
    # sent in batches the server accepts (256 texts by default: more are split; a batch
    # asked over the limit is refused by the server, halved and sent again).
    import hookwire
    from hookwire._harvest import RemoteTokenize

    texts = [d for d in DOCS] * 40 + ["naïve café ☕ — 東京", "  leading and trailing  ", "a\u2028b", ""]
    expected = [list(ids) for ids in local["lm_tok"](texts, add_special_tokens=False)["input_ids"]]
    async with hookwire.connect(server.target) as client:
        remote = client.model("tiny-lm")
        tokenize = RemoteTokenize(remote, asyncio.get_running_loop(), max_texts=1000)
        got = await asyncio.to_thread(tokenize, texts)
        assert got == expected
        assert tokenize.max_texts <= 256 and tokenize.calls >= 3  # refused once, then within the limit
        small = RemoteTokenize(remote, asyncio.get_running_loop(), max_texts=7, max_chars=300)
        assert await asyncio.to_thread(small, texts) == expected
        assert small.calls >= len(texts) // 7
        info = await remote.info()
        ids = info.raw.tokenizer_ids
        tok = local["lm_tok"]
        assert (ids.bos_token_id, ids.eos_token_id, ids.pad_token_id) == (tok.bos_token_id, tok.eos_token_id,
                                                                         tok.pad_token_id)
        assert not ids.HasField("cls_token_id") and not ids.HasField("sep_token_id")
