"""GetParameters: a model's weights over the wire, against a real server on loopback with
authentication on; MiniLM with its real weights, the in-process model as the oracle, bit
for bit."""

from __future__ import annotations

import asyncio
import pathlib
import threading
import time
from typing import Any, Iterator

import grpc
import pytest
import torch
import transformers
from torch import nn

import hookwire
from hookwire.wire import codec
from hookwire.v1 import model_service_pb2, model_service_pb2_grpc
from hookwire_server import ModelConfig, ServerSettings, demo_configs
from hookwire_server.auth import hash_token
from hookwire_server.models.model_loading import ConfigError, build_host, load_config_file
from hookwire_server.models.model_registry import ModelHost, ModelRegistry
from support import LIVENESS, ServerThread, bearer, minilm_folder, serving

TOKENS = {"alice": "hwt_params_alice", "viewer": "hwt_params_viewer"}
LINES = f"alice:user:{hash_token(TOKENS['alice'])}\nviewer:viewer:{hash_token(TOKENS['viewer'])}"
MIB = 1 << 20
EMBEDDINGS = "embeddings.word_embeddings.weight"  # 30522 x 384 float32: 47 MB
#: Generous: only a hang guard for waits on server state, never a speed assertion.


class Tied(nn.Module):
    """An embedding and an unembedding that share one weight (as GPT-2's lm_head), of
    125 KiB: between the SDK's 64 KiB cut and the 256 KiB inline limit."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, 32)
        self.head = nn.Linear(32, 1000, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


@pytest.fixture(scope="module")
def local() -> nn.Module:
    """The oracle: MiniLM loaded in-process as the server loads it (AutoModel)."""
    return transformers.AutoModel.from_pretrained(str(minilm_folder()), local_files_only=True).eval()


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    torch.manual_seed(0)
    registry = ModelRegistry([ModelHost("tied", Tied(), parameters_readable=True)])
    registry.add(build_host(ModelConfig(name="minilm", transformers=str(minilm_folder()), parameters_readable=True)))
    # As an operator configures a model that says nothing: not readable.
    registry.add(build_host(ModelConfig(name="private", factory="hookwire_server.demo_models:mlp")))
    registry.expect("loading")  # never loads
    # MiniLM's 91 MB of float32 weights pass the byte limit; in bfloat16 they fit.
    settings = ServerSettings(port=0, tokens=LINES, max_parameter_bytes=64 * MIB, max_parameter_calls_per_principal=1)
    with serving(registry, settings) as srv:
        yield srv


def _connect(srv: ServerThread, who: str = "alice") -> hookwire.Client:
    return hookwire.connect(srv.target, options=hookwire.ConnectOptions(token=TOKENS[who]))


def _same_bits(got: Any, want: torch.Tensor) -> bool:
    want = want.detach().contiguous()
    return (isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape
            and torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)))


async def test_parameters_equal_the_in_process_weights_bit_for_bit(server, local) -> None:
    named = dict(local.named_parameters(remove_duplicate=False))
    pattern = "encoder.layer.*.attention.output.dense.weight"
    async with _connect(server) as client:
        model = client.model("minilm")
        info = await model.info()
        assert info.parameters_readable
        embeddings = await model.parameter(EMBEDDINGS)  # 47 MB: sent in chunks
        assert _same_bits(embeddings, named[EMBEDDINGS])
        got = await model.parameters(pattern)
        assert list(got) == [f"encoder.layer.{i}.attention.output.dense.weight" for i in range(6)]
        assert all(_same_bits(t, named[name]) for name, t in got.items())
        # Several names and globs: each parameter once, in named_parameters order.
        got = await model.parameters("pooler.**", "embeddings.LayerNorm.*", "pooler.dense.bias", "**.0.output.dense.*")
        want = [n for n in named if n.startswith(("embeddings.LayerNorm.", "pooler.", "encoder.layer.0.output.dense."))]
        assert list(got) == want
        assert all(_same_bits(t, named[name]) for name, t in got.items())


async def test_dtype_casts_as_in_process_to(server, local) -> None:
    named = dict(local.named_parameters())
    async with _connect(server) as client:
        model = client.model("minilm")
        everything = await model.parameters("**", dtype="bfloat16")  # 45 MB: within the limit as bfloat16
        assert list(everything) == list(named)
        assert all(_same_bits(t, named[n].to(torch.bfloat16)) for n, t in everything.items())
        half = await model.parameter("encoder.layer.3.intermediate.dense.weight", dtype="float16")
        assert _same_bits(half, named["encoder.layer.3.intermediate.dense.weight"].to(torch.float16))
        with pytest.raises(ValueError, match="dtype must be one of"):
            await model.parameters("**", dtype="int8")  # type: ignore[arg-type]


async def test_tied_weights_answer_to_each_name(server) -> None:
    local = server.server.registry.get("tied").module
    async with _connect(server) as client:
        got = await client.model("tied").parameters("**")
    assert list(got) == ["embed.weight", "head.weight"]  # named_parameters(remove_duplicate=False)
    assert _same_bits(got["head.weight"], local.head.weight) and _same_bits(got["embed.weight"], local.embed.weight)


def test_large_parameters_come_in_chunks_within_the_clients_message_limit(server, local) -> None:
    """A client whose channel accepts 1 MiB messages at most (a sync grpc client, reading
    the protobuf messages as any client would): the 47 MB parameter comes as its message
    with a chunk_id, then chunks of at most 1 MiB - 64 KiB, in order."""
    options = [("grpc.max_receive_message_length", MIB)]
    with grpc.insecure_channel(server.target, options=options) as channel:
        stub = model_service_pb2_grpc.ModelServiceStub(channel)
        request = model_service_pb2.GetParametersRequest(model="minilm", names=[EMBEDDINGS, "pooler.dense.bias"],
                                                         max_response_message_bytes=MIB)
        messages = list(stub.GetParameters(request, metadata=bearer(TOKENS["alice"]), timeout=LIVENESS))
        with pytest.raises(grpc.RpcError) as info:  # below the minimum
            list(stub.GetParameters(model_service_pb2.GetParametersRequest(
                model="minilm", names=["pooler.dense.bias"], max_response_message_bytes=MIB - 1),
                metadata=bearer(TOKENS["alice"]), timeout=LIVENESS))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_response_message_bytes" in info.value.details()
    kinds = [m.WhichOneof("kind") for m in messages]
    want = dict(local.named_parameters())[EMBEDDINGS]
    chunks = [m.chunk for m in messages[1:-1]]
    assert kinds[0] == "parameter" and kinds[-1] == "parameter" and set(kinds[1:-1]) == {"chunk"}
    head = messages[0].parameter
    assert head.name == EMBEDDINGS and head.tensor.chunk_id and not head.tensor.data
    assert list(head.tensor.shape) == [30522, 384] and head.tensor.dtype == codec.wire_dtype_of(torch.float32)
    assert len(chunks) == -(-want.numel() * 4 // (MIB - 64 * 1024)) > 40
    assert all(c.chunk_id == head.tensor.chunk_id and len(c.data) <= MIB - 64 * 1024 for c in chunks)
    assert [c.offset for c in chunks] == [i * (MIB - 64 * 1024) for i in range(len(chunks))]
    data = b"".join(c.data for c in chunks)
    assert data == want.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    assert messages[-1].parameter.name == "pooler.dense.bias"  # small: inline
    assert _same_bits(codec.decode_tensor(messages[-1].parameter.tensor), local.pooler.dense.bias)


async def test_refusals(server, local) -> None:
    total = sum(p.numel() * 4 for p in local.parameters())
    async with _connect(server) as client:
        private = client.model("private")
        assert not (await private.info()).parameters_readable
        with pytest.raises(hookwire.FailedPreconditionError, match=r"'private' does not allow reading its parameters.*"
                                                                   r"`parameters_readable = true`"):
            await private.parameters("**")
        model = client.model("minilm")
        with pytest.raises(hookwire.NotFoundError, match=r"names\[1\]: model 'minilm' has no parameter 'lm_head.weight'"):
            await model.parameters("pooler.**", "lm_head.weight")
        with pytest.raises(hookwire.NotFoundError, match=r"pattern 'decoder.\*\*' matches no parameter"):
            await model.parameters("decoder.**")
        with pytest.raises(hookwire.NotFoundError, match="no model 'nope'"):
            await client.model("nope").parameters("**")
        with pytest.raises(hookwire.UnavailableError, match="'loading' is loading"):
            await client.model("loading").parameters("**")
        with pytest.raises(ValueError, match="at least one parameter"):
            await model.parameters()
        with pytest.raises(ValueError, match="exact name"):
            await model.parameter("encoder.*")
        # Limits, named; checked before anything is sent.
        with pytest.raises(hookwire.ResourceExhaustedError, match=rf"take {total} bytes, over the limit of 67108864 "
                                                                   r"\(max_parameter_bytes\)"):
            await model.parameters("**")
        # A long glob's refusal says how many parameters it matched (cut to its first characters).
        count = len(dict(local.named_parameters()))
        with pytest.raises(hookwire.ResourceExhaustedError) as refused:
            await model.parameters("*" * 1024, "pooler.dense.bias")
        assert (f"the names match {count} parameters ({'*' * 48!r}... (1024 characters): {count}; "
                f"'pooler.dense.bias': 1): they take {total} bytes, over the limit") in str(refused.value)
        with pytest.raises(hookwire.ResourceExhaustedError, match=r"names: 257 or more names.*\(max_parameter_names\)"):
            await model.parameters(*["pooler.dense.bias"] * 257)
        with pytest.raises(hookwire.InvalidArgumentError, match=r"names: 1025 bytes.*\(max_path_length\)"):
            await model.parameters("x" * 1025)
        assert list(await model.parameters("pooler.dense.bias")) == ["pooler.dense.bias"]  # still serving
    async with _connect(server, "viewer") as viewer:
        with pytest.raises(hookwire.PermissionDeniedError, match="GetParameters needs the user role"):
            await viewer.model("minilm").parameters("**")


async def test_copies_wait_for_the_models_thread_and_calls_per_principal_are_limited(server, local) -> None:
    """A copy runs on the model's worker thread, after the pass (here: a job) running
    there; meanwhile the principal's call counts against
    max_parameter_calls_per_principal (1 on this server), and the metric counts what was sent."""
    host = server.server.registry.get("minilm")
    metrics = server.server.metrics.registry
    sent = metrics.get_sample_value("hookwire_parameter_bytes_total", {"model": "minilm"}) or 0.0
    gate = threading.Event()
    host.submit(gate.wait)  # the model's thread is busy until the gate opens
    try:
        async with _connect(server) as client:
            model = client.model("minilm")
            first = asyncio.ensure_future(model.parameter("embeddings.position_embeddings.weight"))
            deadline = time.monotonic() + LIVENESS
            while server.call(lambda: server.server.parameters.running("alice")) < 1:
                assert time.monotonic() < deadline, "the first call never started"
                await asyncio.sleep(0.01)
            with pytest.raises(hookwire.ResourceExhaustedError, match=r"'alice' has 1 GetParameters calls running.*"
                                                                      r"\(max_parameter_calls_per_principal\)"):
                await model.parameters("pooler.**")
            assert not first.done()  # it cannot copy before the model's thread is free
            gate.set()
            got = await asyncio.wait_for(first, LIVENESS)
    finally:
        gate.set()
    assert _same_bits(got, dict(local.named_parameters())["embeddings.position_embeddings.weight"])
    after = metrics.get_sample_value("hookwire_parameter_bytes_total", {"model": "minilm"})
    assert after - sent == 512 * 384 * 4


def test_the_config_key_is_off_by_default_and_checked(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "hookwire.toml"
    entry = '[[models]]\nname = "{name}"\nfactory = "hookwire_server.demo_models:mlp"\n'
    path.write_text(entry.format(name="quiet") + entry.format(name="open") + "parameters_readable = true\n")
    _, configs = load_config_file(path)
    assert [c.parameters_readable for c in configs] == [False, True]
    assert build_host(configs[1]).parameters_readable and not build_host(configs[0]).parameters_readable
    assert all(c.parameters_readable for c in demo_configs())  # the demo models allow it
    path.write_text(entry.format(name="mine") + 'parameters_readable = "yes"\n')
    with pytest.raises(ConfigError, match=r"model 'mine': parameters_readable must be true or false, not 'yes'"):
        load_config_file(path)
