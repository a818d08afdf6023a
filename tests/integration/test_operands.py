"""Named operands (issue 25): a tensor or an SAE uploaded once and named by rules and
readouts gives exactly what the same operand sent inline gives (which the rule tests check
against in-process torch and SAELens), in Infer and at every Generate step; operators
publish SAEs saved by SAELens itself; a name in use cannot be deleted; every rule using
an operand shares its one copy per device and dtype."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch

import hookwire
import lm_oracle as oracle
from hookwire import rules
from hookwire.rules import Sae
from hookwire_server.hooks.operands import OperandStore
from hookwire_server.hooks.rules import compile_rules
from hookwire_server.limits import Limits
from hookwire.v1 import hook_pb2, operand_service_pb2
from support import until

PROMPTS = ["the cat sat", "a"]
D_IN, D_SAE = 64, 96


@pytest.fixture(scope="module")
def sae_lens() -> Any:
    return pytest.importorskip("sae_lens")


def _sae(sae_lens: Any, architecture: str = "jumprelu", seed: int = 0) -> Any:
    from test_rules_sae import make_sae

    return make_sae(sae_lens, architecture, seed=seed)


async def _layer0(client: hookwire.Client, *rule_list: rules.Rule) -> torch.Tensor:
    """tiny-lm's layer 0 output after ``rule_list``, in one Infer call on PROMPTS."""
    result = await client.model("tiny-lm").infer(*oracle.batch(PROMPTS), hooks=[
        hookwire.HookSpec("model.layers.0", posthook=hookwire.edit(*rule_list, capture=("output",)))])
    return result.events[0].output


async def test_named_tensors_equal_the_same_tensors_inline(client) -> None:
    g = torch.Generator().manual_seed(3)
    vector = torch.randn(D_IN, generator=g)
    # Large enough to travel in chunks (over the SDK's 256 KiB inline limit): [64, 64] x 20 rows of directions.
    directions = torch.randn(1200, D_IN, generator=g) * 0.05
    weight = torch.eye(D_IN) + torch.randn(D_IN, D_IN, generator=g) * 0.01
    for name, value in (("steer", vector), ("dirs", directions), ("map", weight)):
        info = await client.upload_operand(name, value)
        assert (info.kind, info.shape, info.nbytes) == ("tensor", tuple(value.shape), value.numel() * 4)
        assert info.session_id == client.session_id and not info.ended
    cases = [
        ([rules.add("output", rules.operand("steer"))], [rules.add("output", vector)]),
        ([rules.norm_add("output", rules.operand("steer"), 0.5)], [rules.norm_add("output", vector, 0.5)]),
        ([rules.top_k("output", rules.operand("dirs"), 7, mode="zero")], [rules.top_k("output", directions, 7, mode="zero")]),
        ([rules.affine("output", rules.operand("map"), rules.operand("steer"))], [rules.affine("output", weight, vector)]),
        ([rules.when(rules.projection(rules.operand("steer")) > 0.0, rules.project_out("output", rules.operand("steer")))],
         [rules.when(rules.projection(vector) > 0.0, rules.project_out("output", vector))]),
    ]
    for named, inline in cases:
        assert torch.equal(await _layer0(client, *named), await _layer0(client, *inline)), named[0].op


async def test_a_named_sae_equals_the_same_sae_inline_at_every_generate_step(client, sae_lens) -> None:
    sae = _sae(sae_lens)
    inline = Sae.from_sae_lens(sae)
    info = await client.upload_operand("sae", inline, ttl=600)
    assert (info.kind, info.shape, info.nbytes) == ("sae", (D_IN, D_SAE), (2 * D_IN * D_SAE + D_IN + 2 * D_SAE) * 4)
    assert info.expires is not None and info.session_id == ""
    try:
        async def run(autoencoder: Sae) -> Any:
            return await client.model("tiny-lm").generate(PROMPTS, 5, do_sample=False, hooks=[
                hookwire.HookSpec("model.layers.0", posthook=hookwire.edit(
                    rules.sae("output", autoencoder, [3, 7], edit="clamp", value=6.0), capture=("output",))),
                hookwire.HookSpec("model.layers.0", posthook=hookwire.capture(
                    "output", readout=rules.sae_top_k(autoencoder, 4))),
                hookwire.HookSpec("model.layers.1", posthook=[
                    rules.when(rules.sae_feature(autoencoder, 11) > 0.1, rules.scale("output", 0.5))])])

        named, plain = await run(Sae.named("sae")), await run(inline)
        assert [list(t) for t in named.token_ids] == [list(t) for t in plain.token_ids]
        for step_named, step_plain in zip(named.events_by_step, plain.events_by_step, strict=True):
            for a, b in zip(step_named, step_plain, strict=True):
                if isinstance(a.output, dict):  # the readout's features and values
                    assert a.output.keys() == b.output.keys()
                    for key in a.output:
                        assert torch.equal(a.output[key], b.output[key]), key
                else:
                    assert torch.equal(a.output, b.output)
    finally:
        await client.delete_operand("sae")


async def test_a_registered_hook_holds_its_operand(client) -> None:
    await client.upload_operand("held", torch.ones(D_IN))
    model = client.model("tiny-lm")
    plain = await _layer0(client)
    async with model.hook("model.layers.0", posthook=[rules.add("output", rules.operand("held"))]) as hook:
        (listed,) = [op for op in await client.list_operands() if op.name == "held"]
        assert listed.used_by == (f"hook {hook.id}",)
        with pytest.raises(hookwire.FailedPreconditionError, match=f"in use by hook {hook.id}"):
            await client.delete_operand("held")
        # The session hook (attached first) edits with it; the call's capture hook sees that.
        assert torch.equal(await _layer0(client), plain + 1.0)
    assert await client.delete_operand("held") == D_IN * 4
    with pytest.raises(hookwire.NotFoundError, match="no operand 'held'"):
        await _layer0(client, rules.add("output", rules.operand("held")))


async def test_references_that_cannot_be_used_are_refused_naming_the_field(client, sae_lens) -> None:
    await client.upload_operand("vec", torch.ones(D_IN))
    await client.upload_operand("ae", Sae.from_sae_lens(_sae(sae_lens, "standard")))
    with pytest.raises(hookwire.FailedPreconditionError, match=r"rules\[0\]\.sae\.sae\.operand: 'vec' is a tensor operand"):
        await _layer0(client, rules.sae("output", Sae.named("vec"), [1]))
    with pytest.raises(hookwire.FailedPreconditionError, match=r"add\.value\.tensor\.operand: 'ae' is an SAE operand"):
        await _layer0(client, rules.add("output", rules.operand("ae")))
    with pytest.raises(hookwire.NotFoundError, match=r"affine\.weight\.operand: no operand 'nope'"):
        await _layer0(client, rules.affine("output", rules.operand("nope")))
    # A reference that also carries data is ambiguous: refused, not guessed.
    op = rules.add("output", rules.operand("vec")).to_proto().add
    op.value.tensor.shape.append(3)
    with pytest.raises(hookwire.InvalidArgumentError, match="carries no dtype, shape or data of its own"):
        await _layer0(client, rules.Rule("output", "add", message=op))
    # Shapes are still checked against the model at each use.
    await client.upload_operand("short", torch.ones(3))
    with pytest.raises(hookwire.InvalidArgumentError):
        await _layer0(client, rules.add("output", rules.operand("short")))


def _save_sae(sae_lens: Any, folder: pathlib.Path, seed: int) -> Any:
    sae = _sae(sae_lens, "jumprelu", seed=seed)
    sae.save_model(str(folder))  # SAELens' own layout: cfg.json and sae_weights.safetensors
    return sae


async def test_operators_publish_saes_saved_by_saelens_for_everyone(make_server, sae_lens, tmp_path) -> None:
    from safetensors.torch import save_file

    root = tmp_path / "operands"
    (root / "gpt").mkdir(parents=True)
    sae = _save_sae(sae_lens, root / "gpt" / "layer0", seed=4)
    vector = torch.randn(D_IN, generator=torch.Generator().manual_seed(8))
    save_file({"direction": vector}, str(root / "refusal.safetensors"))
    save_file({"a": vector, "b": vector.clone()}, str(root / "two.safetensors"))
    (root / "pickled.pt").write_bytes(b"\x80\x04K\x01.")
    srv = make_server(operand_root=str(root))
    async with hookwire.connect(srv.target) as client:
        info = await client.publish_operand("gpt/layer0", "gpt/layer0")
        assert (info.kind, info.published, info.owner, info.shape) == ("sae", True, "", (D_IN, D_SAE))
        assert (await client.publish_operand("refusal", "refusal.safetensors")).shape == (D_IN,)
        # The published SAE is SAELens' own: the same edit as the same SAE sent inline.
        named = await _layer0(client, rules.sae("output", Sae.named("gpt/layer0"), [2], value=4.0))
        inline = await _layer0(client, rules.sae("output", Sae.from_sae_lens(sae), [2], value=4.0))
        assert torch.equal(named, inline)
        assert torch.equal(await _layer0(client, rules.add("output", rules.operand("refusal"))),
                           await _layer0(client, rules.add("output", vector)))
        # Names of published operands are everyone's: an upload cannot take one.
        with pytest.raises(hookwire.AlreadyExistsError, match="published operand"):
            await client.upload_operand("refusal", vector)
        bad = [("two.safetensors", hookwire.InvalidArgumentError, "holds 2 tensors"),
               ("pickled.pt", hookwire.InvalidArgumentError, "only safetensors are read"),
               ("../outside", hookwire.PermissionDeniedError, "'..' segment"),
               ("/etc/passwd", hookwire.PermissionDeniedError, "is absolute"),
               ("gpt", hookwire.InvalidArgumentError, "without SAELens' cfg.json")]
        for path, error, message in bad:
            with pytest.raises(error, match=message):
                await client.publish_operand("x", path)
        async with client.model("tiny-lm").hook("model.layers.0", posthook=[
                rules.add("output", rules.operand("refusal"))]):
            with pytest.raises(hookwire.FailedPreconditionError, match="in use by hook"):
                await client.delete_operand("refusal")
        assert await client.delete_operand("refusal") == D_IN * 4  # an operator unpublishes
    srv_without = make_server()
    async with hookwire.connect(srv_without.target) as client:
        with pytest.raises(hookwire.FailedPreconditionError, match="no operand folder"):
            await client.publish_operand("x", "refusal.safetensors")


async def test_hostile_operator_files_are_invalid_argument_naming_the_file(make_server, tmp_path) -> None:
    """Files torch cannot check for finiteness (float8), that hold no float (int, bool), or
    whose cfg.json nests deep enough to exhaust the parser's recursion: each refused with
    INVALID_ARGUMENT naming the file (no incident), and the server publishes on after them."""
    import json

    from safetensors.torch import save_file

    root = tmp_path / "operands"
    root.mkdir()

    def folder(name: str, cfg: str, dtype: torch.dtype = torch.float32) -> str:
        (root / name).mkdir()
        (root / name / "cfg.json").write_text(cfg)
        weights = {"W_enc": torch.randn(4, 8), "b_enc": torch.zeros(8), "W_dec": torch.randn(8, 4), "b_dec": torch.zeros(4)}
        save_file({k: v.to(dtype) for k, v in weights.items()}, str(root / name / "sae_weights.safetensors"))
        return name

    bad: dict[str, str] = {}
    dtypes = [torch.float8_e4m3fn, torch.float8_e5m2, torch.int64, torch.uint8, torch.bool, torch.complex64]
    for dtype in dtypes:
        save_file({"v": torch.ones(4).to(dtype)}, str(root / f"{dtype}.safetensors"))
        bad[f"{dtype}.safetensors"] = f"a tensor of {str(dtype).removeprefix('torch.')}"
    standard = json.dumps({"architecture": "standard"})
    bad[folder("f8_sae", standard, torch.float8_e4m3fn)] = "W_enc: a tensor of float8_e4m3fn"
    bad[folder("deep_arrays", "[" * 200_000 + "]" * 200_000)] = "cfg.json nests arrays or objects too deeply"
    bad[folder("deep_objects", '{"a":' * 100_000 + "0" + "}" * 100_000)] = "cfg.json nests arrays or objects too deeply"
    # Just within the parser's reach: then quoting it back (repr) would recurse as deep.
    bad[folder("deep_name", '{"architecture": ' + "[" * 900 + "]" * 900 + "}")] = "architecture must be a name"
    bad[folder("long_name", json.dumps({"architecture": "x" * 100_000}))] = "architecture must be a name"
    good = folder("good", standard)
    srv = make_server(operand_root=str(root))
    async with hookwire.connect(srv.target) as client:
        for path, message in bad.items():
            with pytest.raises(hookwire.InvalidArgumentError) as info:
                await client.publish_operand("x", path)
            assert f"path: {path!r}" in str(info.value) and message in str(info.value), str(info.value)
            assert len(str(info.value)) < 400
        assert (await client.publish_operand("good", good)).shape == (4, 8)


def test_rules_using_one_operand_share_its_casts() -> None:
    """Every rule naming an operand uses the one stored tensor on its own device and
    dtype (no copy), and one cast per other dtype, made once for all of them."""
    from hookwire.wire.framing import RawChunk  # noqa: F401 - the store's chunk type (import check)
    from hookwire_server.auth import ANONYMOUS

    store = OperandStore(Limits())
    header = operand_service_pb2.OperandUpload(name="w", ttl_seconds=60)
    header.tensor.CopyFrom(hookwire.wire.codec.encode_tensor(torch.randn(8, 8)))

    async def upload() -> Any:
        async def nothing() -> Any:
            return
            yield
        return await store.upload(ANONYMOUS, header, nothing(), require_session=lambda _: None)

    import asyncio

    stored = asyncio.run(upload())
    compiled = []
    for _ in range(2):
        source = store.source(ANONYMOUS, torch.device("cpu"))
        compiled.append(compile_rules([rules.affine("output", rules.operand("w")).to_proto()], phase=hook_pb2.PHASE_FORWARD,
                                      phase_field="posthook", with_kwargs=False, device=torch.device("cpu"),
                                      source=source)[0])
        assert source.used == {"w": stored}
    x32, x64 = torch.randn(2, 8), torch.randn(2, 8, dtype=torch.float64)
    assert compiled[0]._tensor("weight", x32) is stored.tensors[""]  # its own dtype: the stored tensor itself
    assert compiled[0]._tensor("weight", x64) is compiled[1]._tensor("weight", x64)  # one float64 cast for both
    assert compiled[0].operands == {}  # nothing of its own: listed by name, counted once


async def _nothing() -> Any:
    return
    yield


def _tensor_header(name: str, **lifetime: Any) -> operand_service_pb2.OperandUpload:
    header = operand_service_pb2.OperandUpload(name=name, **lifetime)
    header.tensor.CopyFrom(hookwire.wire.codec.encode_tensor(torch.ones(4)))
    return header


async def test_an_upload_whose_session_ends_while_it_arrives_is_refused() -> None:
    """The session is checked again when the data is in: an operand committed after its
    session ended would never end."""
    from hookwire.v1 import tensor_pb2
    from hookwire_server.auth import ANONYMOUS
    from hookwire_server.errors import NotFound

    store = OperandStore(Limits())
    open_sessions = {"ses_1"}

    def require_session(session_id: str) -> None:
        if session_id not in open_sessions:
            raise NotFound(f"no open session {session_id!r}")

    header = operand_service_pb2.OperandUpload(name="v", session_id="ses_1")
    header.tensor.CopyFrom(tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_FLOAT32, shape=[4], chunk_id=1))

    async def chunks() -> Any:
        open_sessions.discard("ses_1")  # what HookManager.close_session does, mid-upload
        store.session_ended("ses_1")
        yield tensor_pb2.TensorChunk(chunk_id=1, offset=0, data=torch.ones(4).numpy().tobytes())

    with pytest.raises(NotFound, match="ses_1"):
        await store.upload(ANONYMOUS, header, chunks(), require_session=require_session)
    assert store.listing(ANONYMOUS) == []
    # Its bytes count until they are freed: the thread's future that carried them is let go
    # by a callback the loop runs next.
    await until(lambda: store.bytes_of(ANONYMOUS.name) == 0, "the refused upload's buffer freed")


async def test_a_failed_upload_counts_against_the_quota_until_its_buffers_are_freed(monkeypatch) -> None:
    """Its name is free at once; its bytes only once nothing holds its buffers (here the
    test itself, as a kept traceback or an uncollected cycle would): a principal cannot
    hold more memory than its quota by failing uploads."""
    from hookwire.v1 import tensor_pb2
    from hookwire.wire import codec
    from hookwire_server.auth import ANONYMOUS
    from hookwire_server.errors import InvalidArgument, ResourceExhausted

    assemblers: list[Any] = []

    class Kept(codec.ChunkAssembler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            assemblers.append(self)

    monkeypatch.setattr(codec, "ChunkAssembler", Kept)
    store = OperandStore(Limits(max_operand_bytes_per_principal=6000))
    header = operand_service_pb2.OperandUpload(name="v", ttl_seconds=60)
    header.tensor.CopyFrom(tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_FLOAT32, shape=[1000], chunk_id=1))

    async def half() -> Any:
        yield tensor_pb2.TensorChunk(chunk_id=1, offset=0, data=bytes(2000))

    with pytest.raises(InvalidArgument, match="before every chunked tensor was complete"):
        await store.upload(ANONYMOUS, header, half(), require_session=lambda _: None)
    assert store.listing(ANONYMOUS) == [] and store.bytes_of(ANONYMOUS.name) == 4000
    with pytest.raises(ResourceExhausted, match="max_operand_bytes_per_principal"):  # the name is free, the bytes not
        await store.upload(ANONYMOUS, header, half(), require_session=lambda _: None)
    assemblers.clear()  # the buffers are let go
    await until(lambda: store.bytes_of(ANONYMOUS.name) == 0, "the failed upload's buffer freed")


async def test_a_registration_cancelled_while_its_spec_compiles_holds_nothing_after(monkeypatch) -> None:
    """A spec naming an operand compiles on a thread; the caller cancelling meanwhile must
    not leave the thread's hold behind (the operand could never be deleted or freed)."""
    import asyncio
    import threading

    from hookwire_server import ModelHost, ModelRegistry
    from hookwire_server.auth import ANONYMOUS
    from hookwire_server.demo_models import mlp
    from hookwire_server.hooks import hook_manager as manager_mod
    from hookwire_server.hooks.hook_manager import HookManager

    store = OperandStore(Limits())
    registry = ModelRegistry([ModelHost("mlp", mlp())])
    hooks = HookManager(registry, operands=store)
    await store.upload(ANONYMOUS, _tensor_header("v", ttl_seconds=600), _nothing(), require_session=lambda _: None)
    entered, go, finished = threading.Event(), threading.Event(), threading.Event()
    real = manager_mod.compile_spec

    def slow(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        go.wait(60)
        try:
            return real(*args, **kwargs)  # resolves "v" for the hook being registered: holds it
        finally:
            finished.set()

    monkeypatch.setattr(manager_mod, "compile_spec", slow)
    spec = hookwire.HookSpec("fc1", posthook=[rules.add("output", rules.operand("v"))]).to_proto("mlp")
    session = hooks.open_session(_limits())
    task = asyncio.ensure_future(hooks.register(session.session_id, spec, ANONYMOUS))
    await asyncio.to_thread(entered.wait, 60)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    go.set()
    await asyncio.to_thread(finished.wait, 60)
    for _ in range(600):  # the thread finished; its hold is let go on the loop
        if not store.listing(ANONYMOUS)[0].used_by:
            break
        await asyncio.sleep(0.05)
    assert store.listing(ANONYMOUS)[0].used_by == {}
    assert store.delete(ANONYMOUS, "v") == 16
    hooks.close_session(session.session_id)
    registry.shutdown()


def _limits() -> Any:
    from hookwire.v1 import hook_service_pb2
    from hookwire_server.hooks.event_bus import DeliveryLimits

    return DeliveryLimits.from_proto(hook_service_pb2.DeliveryOptions())


async def test_copies_on_vllms_ranks_count_against_the_quotas_and_never_pass_them() -> None:
    """An operand a vLLM model's ranks hold (engine/vllm_runtime.py) counts once more per
    rank against its owner's quota and the server's; copies that would pass either are
    refused (nothing counted: the hooks then run in the front), and giving them back frees
    the quota for uploads."""
    from hookwire_server.auth import ANONYMOUS
    from hookwire_server.errors import ResourceExhausted

    store = OperandStore(Limits(max_operand_bytes_per_principal=4096))
    header = operand_service_pb2.OperandUpload(name="v", ttl_seconds=60)
    header.tensor.CopyFrom(hookwire.wire.codec.encode_tensor(torch.ones(256)))  # 1 KiB

    async def nothing() -> Any:
        return
        yield

    stored = await store.upload(ANONYMOUS, header, nothing(), require_session=lambda _: None)
    assert store.bytes_of(ANONYMOUS.name) == 1024
    assert stored.add_rank_copies(2)  # two ranks: 3 KiB in all
    assert store.bytes_of(ANONYMOUS.name) == 3 * 1024 and stored.rank_copies == 2
    assert not stored.add_rank_copies(2)  # 5 KiB would pass 4 KiB: refused, nothing counted
    assert stored.rank_copies == 2
    big = operand_service_pb2.OperandUpload(name="w", ttl_seconds=60)
    big.tensor.CopyFrom(hookwire.wire.codec.encode_tensor(torch.ones(512)))  # 2 KiB more: 5 KiB
    with pytest.raises(ResourceExhausted, match="max_operand_bytes_per_principal"):
        await store.upload(ANONYMOUS, big, nothing(), require_session=lambda _: None)
    assert stored.add_rank_copies(-2)
    assert store.bytes_of(ANONYMOUS.name) == 1024
    await store.upload(ANONYMOUS, big, nothing(), require_session=lambda _: None)
