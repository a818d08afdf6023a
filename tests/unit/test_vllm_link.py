"""The link to vLLM's worker processes, the pieces that need no vLLM (engine/vllm_link.py,
engine/vllm_worker.py): the stand-in module tree a worker's description builds, which
module phases a step taps, the server's hooks run on what a worker saw with torch's own
order and return conventions, and the values that travel both ways. A real two-rank vLLM
runs the whole of it in tests/vllm_engine/test_vllm_processes.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from hookwire.v1 import hook_pb2
from hookwire.wire import codec
from hookwire_server.engine.vllm_link import merge_stages, proxy_model, run_post, run_pre, taps_of, unedited_modules
from hookwire_server.engine.vllm_worker import merge, plain, tensors_of, with_tensors

DESCRIPTION = {
    "modules": [["", "LlamaForCausalLM"], ["model", "LlamaModel"], ["model.layers", "ModuleList"],
                ["model.layers.0", "LlamaDecoderLayer"], ["model.layers.0.self_attn", "LlamaAttention"],
                ["model.layers.0.self_attn.qkv_proj", "QKVParallelLinear"],
                ["model.layers.0.self_attn.o_proj", "RowParallelLinear"],
                ["model.layers.0.self_attn.attn", "Attention"], ["model.norm", "RMSNorm"],
                ["lm_head", "ParallelLMHead"], ["logits_processor", "LogitsProcessor"]],
    "parameters": [["model.layers.0.self_attn.qkv_proj.weight", [12, 4], "float32"],
                   ["model.norm.weight", [4], "bfloat16"], ["lm_head.weight", [64, 4], "float32"]],
    "packed": {"qkv_proj": ["q_proj", "k_proj", "v_proj"]},
}


def test_the_stand_in_tree_has_vllms_paths_classes_and_parameter_shapes_on_meta() -> None:
    model = proxy_model(DESCRIPTION)
    modules = dict(model.named_modules())
    assert list(modules) == [path for path, _ in DESCRIPTION["modules"]]
    assert type(modules["model.layers.0.self_attn.qkv_proj"]).__name__ == "QKVParallelLinear"
    params = dict(model.named_parameters())
    assert params["model.norm.weight"].dtype == torch.bfloat16 and params["model.norm.weight"].device.type == "meta"
    assert list(params["lm_head.weight"].shape) == [64, 4]
    assert model.packed_modules_mapping == {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    with pytest.raises(RuntimeError, match="runs there, not in the server"):
        modules["model.norm"](torch.zeros(1))


def test_pipeline_stages_descriptions_merge_into_the_whole_tree_and_say_who_holds_what() -> None:
    """Under pipeline parallel each stage describes the layers of the others as vLLM's
    PPMissingLayer (without children) and lacks the head: the merged tree is the whole
    model in the first stage's order, each stage's modules as that stage holds them. Each
    module's hooks run on one stage: the embeddings a tied last stage also holds (for its
    head) are the first stage's, and the modules whose modules run on both stages, or that
    both stages hold and may run (a model-wide rotary embedding), take no hooks."""
    from hookwire_server.engine.vllm_engine import pipeline_stages
    from hookwire_server.models.model_registry import ModelHost

    first = {"stage": 0, "packed": {}, "modules": [
        ["", "LlamaForCausalLM"], ["model", "LlamaModel"], ["model.embed_tokens", "VocabParallelEmbedding"],
        ["model.layers", "ModuleList"], ["model.layers.0", "LlamaDecoderLayer"], ["model.layers.0.mlp", "LlamaMLP"],
        ["model.layers.1", "PPMissingLayer"], ["model.norm", "PPMissingLayer"], ["model.rotary_emb", "RotaryEmbedding"],
        ["lm_head", "PPMissingLayer"]],
        "parameters": [["model.embed_tokens.weight", [64, 4], "float32"]], "tied": []}
    second = {"stage": 1, "packed": {}, "modules": [
        ["", "LlamaForCausalLM"], ["model", "LlamaModel"], ["model.embed_tokens", "VocabParallelEmbedding"],
        ["model.layers", "ModuleList"], ["model.layers.0", "PPMissingLayer"], ["model.layers.1", "LlamaDecoderLayer"],
        ["model.layers.1.mlp", "LlamaMLP"], ["model.norm", "RMSNorm"], ["model.rotary_emb", "RotaryEmbedding"],
        ["lm_head", "ParallelLMHead"], ["logits_processor", "LogitsProcessor"]],
        "parameters": [["model.embed_tokens.weight", [64, 4], "float32"], ["model.norm.weight", [4], "float32"],
                       ["lm_head.weight", [64, 4], "float32"]], "tied": ["lm_head", "model.embed_tokens"]}
    merged, held = merge_stages([first, second])
    assert merged["modules"] == [
        ["", "LlamaForCausalLM"], ["model", "LlamaModel"], ["model.embed_tokens", "VocabParallelEmbedding"],
        ["model.layers", "ModuleList"], ["model.layers.0", "LlamaDecoderLayer"], ["model.layers.0.mlp", "LlamaMLP"],
        ["model.layers.1", "LlamaDecoderLayer"], ["model.layers.1.mlp", "LlamaMLP"], ["model.norm", "RMSNorm"],
        ["model.rotary_emb", "RotaryEmbedding"], ["lm_head", "ParallelLMHead"], ["logits_processor", "LogitsProcessor"]]
    assert [p[0] for p in merged["parameters"]] == ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    assert held[0] == {"", "model", "model.embed_tokens", "model.layers", "model.layers.0", "model.layers.0.mlp",
                       "model.rotary_emb"}
    assert held[1] == {"", "model", "model.layers", "model.layers.1", "model.layers.1.mlp", "model.norm", "lm_head",
                       "logits_processor", "model.rotary_emb"}
    assert list(dict(proxy_model(merged).named_modules())) == [path for path, _ in merged["modules"]]
    host = ModelHost("m", proxy_model(merged))
    runs = pipeline_stages(host, held)
    assert runs == [{"model.embed_tokens", "model.layers.0", "model.layers.0.mlp"},
                    {"model.layers.1", "model.layers.1.mlp", "model.norm", "lm_head", "logits_processor"}]
    assert set(host.unhooked) == {"", "model", "model.layers", "model.rotary_emb"}
    assert "stages 0, 1 each hold it" in host.unhooked["model.rotary_emb"]
    assert host.stage_of["model.embed_tokens"] == 0 and host.stage_of["lm_head"] == 1


def _hook(fn: Any, roots: tuple[str, ...], edits: bool) -> Any:
    fn.hookwire_roots, fn.hookwire_edits = roots, edits
    return fn


def test_a_step_taps_the_module_phases_with_hooks_and_says_what_they_read_and_whether_they_edit() -> None:
    model = proxy_model(DESCRIPTION)
    modules = dict(model.named_modules())
    assert taps_of(modules) == []
    modules["model.norm"].register_forward_hook(_hook(lambda m, a, o: None, ("output",), False))
    modules["model.layers.0"].register_forward_pre_hook(_hook(lambda m, a: None, ("args",), True))
    modules["model.layers.0"].register_forward_hook(_hook(lambda m, a, o: None, ("args", "output"), False))
    modules["model.layers.0"].register_forward_hook(_hook(lambda m, a, o: None, ("output",), True))
    assert taps_of(modules) == [
        ["model.layers.0", "pre", ["args"], True],
        ["model.layers.0", "post", ["args", "output"], True],
        ["model.norm", "post", ["output"], False],
    ]
    # A hook that does not say (an engine's own) gets everything, and may edit.
    modules["lm_head"].register_forward_hook(lambda m, a, o: None)
    assert ["lm_head", "post", ["args", "kwargs", "output"], True] in taps_of(modules)


def test_hooks_run_on_what_a_worker_saw_as_torch_would_run_them_on_the_module() -> None:
    """The same hooks on a real module and on a stand-in given what the module saw: the
    same firing order, the same chained edits, kwargs hooks included."""
    real = nn.Linear(3, 3)
    stand_in = proxy_model({"modules": [["", "Linear"]], "parameters": []})
    seen: dict[str, list[str]] = {"real": [], "stand_in": []}
    for name, module in (("real", real), ("stand_in", stand_in)):
        log = seen[name]
        module.register_forward_pre_hook(lambda m, a, log=log: log.append("pre1") or (a[0] * 2,))
        module.register_forward_pre_hook(lambda m, a, k, log=log: log.append("pre2") or ((a[0] + 1,), k), with_kwargs=True)
        module.register_forward_hook(lambda m, a, o, log=log: log.append("post1") or o * 3)
        module.register_forward_hook(lambda m, a, k, o, log=log: log.append("post2") and None, with_kwargs=True)
        module.register_forward_hook(lambda m, a, o, log=log: log.append("post3") or o - a[0].sum())
    x = torch.arange(3.0)
    want = real(x)
    pre = run_pre(stand_in, {"args": (x,), "kwargs": {}})
    assert pre is not None and torch.equal(pre["args"][0], x * 2 + 1)
    post = run_post(stand_in, {"args": pre["args"], "kwargs": {}, "output": real.forward(*pre["args"])})
    assert post is not None and torch.equal(post["output"], want)
    assert seen["real"] == seen["stand_in"] == ["pre1", "pre2", "post1", "post2", "post3"]
    # Hooks that change nothing: None, so the worker waits for no edit.
    quiet = proxy_model({"modules": [["", "Linear"]], "parameters": []})
    quiet.register_forward_hook(lambda m, a, o: None)
    assert run_post(quiet, {"output": x}) is None and run_pre(quiet, {"args": (x,)}) is None


def test_under_tensor_parallel_rules_edit_only_values_every_rank_holds_whole() -> None:
    """An allowlist: decoder layers (both phases), norms of a layer or of the model, the
    embedding's output, a row-parallel projection's output it reduces itself; everything
    else refused (the fused projections, attention, per-head norms inside attention, a
    row-parallel layer's input, one that leaves its partial sum to the model)."""
    description = dict(DESCRIPTION)
    description["modules"] = DESCRIPTION["modules"] + [
        ["model.layers.0.input_layernorm", "RMSNorm"], ["model.layers.0.self_attn.q_norm", "RMSNorm"],
        ["model.embed_tokens", "VocabParallelEmbedding"], ["model.layers.0.mlp", "LlamaMLP"],
        ["model.layers.0.mlp.down_proj", "RowParallelLinear"]]
    description["modules"][1] = ["model", "LlamaModel"]
    modules = dict(proxy_model(description).named_modules())
    refused = unedited_modules(modules, 2, {"model.layers.0.mlp.down_proj"})
    pre, post = hook_pb2.PHASE_FORWARD_PRE, hook_pb2.PHASE_FORWARD
    allowed = {("model.layers.0", pre), ("model.layers.0", post), ("model.norm", pre), ("model.norm", post),
               ("model.layers.0.input_layernorm", pre), ("model.layers.0.input_layernorm", post),
               ("model.embed_tokens", post), ("model.layers.0.self_attn.o_proj", post)}
    for path in modules:
        for phase in (pre, post):
            assert ((path, phase) in refused) == ((path, phase) not in allowed), (path, phase)
    assert "tensor_parallel_size 2 its value is one rank's shard" in refused[("model.layers.0.self_attn.q_norm", post)]


class _Meta:
    """Stands for what the wire cannot carry (vLLM's attention metadata)."""


def test_values_cross_the_link_as_data_and_come_back_with_what_could_not_travel() -> None:
    meta = _Meta()
    hidden = torch.randn(5, 4)
    parts = {"args": (torch.arange(5), hidden, meta), "kwargs": {"residual": None, "layer": meta}}
    sent = plain(parts)
    assert sent["args"][2] is None and sent["kwargs"]["layer"] is None
    wire = codec.decode_value(codec.encode_value(sent))  # the bytes that travel
    edited = {"args": (wire["args"][0], wire["args"][1] * 2, None), "kwargs": wire["kwargs"]}
    back = merge(parts, edited)
    assert back["args"][2] is meta and back["kwargs"]["layer"] is meta
    assert torch.equal(back["args"][1], hidden * 2) and back["args"][1].dtype == hidden.dtype
    # The other ranks of a tensor-parallel group take the edit's tensors in order.
    tensors = tensors_of(back)
    assert len(tensors) == 2
    rebuilt = with_tensors(parts, [t.clone() for t in tensors])
    assert torch.equal(rebuilt["args"][1], hidden * 2) and rebuilt["args"][2] is meta


class _Ends:
    """An engine that only counts the ends of steps (the link's protocol, nothing else)."""

    def __init__(self) -> None:
        self.ended = 0
        self.closed = 0

    def link_end(self, fired: Any = None, values: Any = None, bad: Any = None, saved: Any = None, stage: int = 0) -> None:
        self.ended += 1

    def link_closed(self) -> None:
        self.closed += 1

    def lost(self, why: str) -> None:
        pass


def test_a_tcp_link_refuses_a_connection_without_the_key_and_serves_the_worker_that_has_it() -> None:
    """vllm.link_address: the link listens on TCP (ranks on other machines); a connection
    that fails multiprocessing's HMAC challenge is refused before anything of it is read,
    and the rank's slot stays open for the real worker, whose messages are served."""
    import json
    from multiprocessing import AuthenticationError
    from multiprocessing.connection import Client

    from hookwire_server.engine.vllm_link import WorkerLink, tcp_address

    link = WorkerLink("m", "127.0.0.1:0")
    try:
        assert link.address.startswith("tcp://127.0.0.1:")
        host, port = tcp_address(link.address[len("tcp://"):])
        engine = _Ends()
        link.engine = engine  # type: ignore[assignment]
        link.start(1)
        with pytest.raises(AuthenticationError):
            Client((host, port), authkey=b"not the key").close()
        with Client((host, port), authkey=link.authkey) as conn:
            conn.send_bytes(json.dumps({"t": "end"}).encode())
            assert conn.recv_bytes() == b"{}"  # answered first: the step's hooks finish after
        _until(lambda: engine.ended == 1)
    finally:
        link.close()


@pytest.mark.parametrize("text", ["", "host", "host:", ":80", "host:http", "host:70000"])
def test_a_link_address_that_is_not_host_port_says_so(text: str) -> None:
    from hookwire_server.engine.vllm_link import tcp_address

    with pytest.raises(ValueError, match="is not HOST:PORT"):
        tcp_address(text)
    assert tcp_address("[::1]:0") == ("::1", 0) and tcp_address("10.0.0.2:7000") == ("10.0.0.2", 7000)


@pytest.mark.parametrize("text", ["0.0.0.0:7000", "[::]:0"])
def test_a_link_address_no_rank_can_dial_is_refused(text: str) -> None:
    from hookwire_server.engine.vllm_link import tcp_address

    with pytest.raises(ValueError, match="is no address a rank can dial"):
        tcp_address(text)


def _served(address: str, link: Any, engine: _Ends) -> None:
    """A worker's connection (the worker's own dial) is served: a step's end is answered."""
    import json

    from hookwire_server.engine.vllm_worker import dial

    conn = dial(address, link.authkey)
    try:
        conn.send_bytes(json.dumps({"t": "end"}).encode())
        assert conn.recv_bytes() == b"{}"
    finally:
        conn.close()
    _until(lambda: engine.ended == 1)


def _until(ok: Any, seconds: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + seconds
    while not ok():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_peer_that_connects_and_says_nothing_or_hangs_up_does_not_hold_the_ranks_accept(monkeypatch) -> None:
    """The challenge has a deadline for the whole of it (HANDSHAKE_SECONDS, shortened
    here): a silent peer and one that trickles its answer a byte at a time are dropped
    when it passes, one that hangs up mid-challenge at once, and the worker that connects
    after them is served."""
    import contextlib
    import socket
    import threading

    from hookwire_server.engine import vllm_link
    from hookwire_server.engine.vllm_link import WorkerLink, tcp_address

    monkeypatch.setattr(vllm_link, "HANDSHAKE_SECONDS", 1.0)
    link = WorkerLink("m", "127.0.0.1:0")
    try:
        engine = _Ends()
        link.engine = engine  # type: ignore[assignment]
        link.start(1)
        host, port = tcp_address(link.address[len("tcp://"):])
        silent = socket.create_connection((host, port))
        trickles = socket.create_connection((host, port))
        socket.create_connection((host, port)).close()  # hangs up before the challenge ends
        stop = threading.Event()

        def trickle() -> None:  # a length prefix of 256, then a byte now and then
            with contextlib.suppress(OSError):
                trickles.sendall(b"\x00\x00\x01\x00")
                while not stop.wait(0.2):
                    trickles.sendall(b"x")

        feeder = threading.Thread(target=trickle, daemon=True)
        feeder.start()
        try:
            _served(link.address, link, engine)
        finally:
            stop.set()
            silent.close()
            trickles.close()
    finally:
        link.close()


def _serves_a_worker(tcp: str | None, prefix: str) -> None:
    from hookwire_server.engine.vllm_link import WorkerLink

    link = WorkerLink("m", tcp)
    try:
        assert link.address.startswith(prefix)
        engine = _Ends()
        link.engine = engine  # type: ignore[assignment]
        link.start(1)
        _served(link.address, link, engine)
    finally:
        link.close()


def test_a_unix_socket_link_and_an_ipv6_link_serve_the_worker() -> None:
    import socket
    import tempfile

    _serves_a_worker(None, tempfile.gettempdir())
    try:
        probe = socket.socket(socket.AF_INET6)
        probe.bind(("::1", 0))
        probe.close()
    except OSError:
        pytest.skip("this machine has no IPv6 loopback")
    _serves_a_worker("[::1]:0", "tcp://[::1]:")


def test_a_link_address_in_use_is_refused_when_the_link_listens() -> None:
    from hookwire_server.engine.vllm_link import WorkerLink, tcp_address

    first = WorkerLink("m", "127.0.0.1:0")
    try:
        _, port = tcp_address(first.address[len("tcp://"):])
        with pytest.raises(OSError):
            WorkerLink("m", f"127.0.0.1:{port}")
    finally:
        first.close()



def _frames(*values: Any) -> list[bytes]:
    return [b"" if v is None else codec.encode_value(v).SerializeToString() for v in values]


@pytest.mark.parametrize("joined", [True, False])
def test_a_steps_values_arrive_joined_or_one_by_one_as_the_workers_header_says(
        joined: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's step end (runtime.plan) sends its captured values as one message cut by
    the header's ``sizes``, or past JOINED_BYTES one message each; a value the worker
    could not encode (size 0) arrives as None, in its place; a step without values sends
    nothing after its header."""
    import json
    from multiprocessing import Pipe

    from hookwire_server.engine import vllm_worker
    from hookwire_server.engine.vllm_link import _receive_values

    values = [torch.randn(3, 4), None, {"x": torch.arange(6).reshape(2, 3)}, torch.zeros(0)]
    frames = _frames(*values)
    if not joined:
        monkeypatch.setattr(vllm_worker, "JOINED_BYTES", len(frames[0]))  # the first alone fits, not all
    here, worker = Pipe()
    vllm_worker.send_end(worker, {"t": "end", "fired": []}, frames)
    vllm_worker.send_end(worker, {"t": "end", "fired": []}, [])
    worker.send_bytes(b"next")
    header = json.loads(here.recv_bytes())
    assert (header["t"], header["values"], header["joined"]) == ("end", 4, joined)
    got = _receive_values(here, header)
    assert got[1] is None and len(got) == 4
    decoded = [None if v is None else codec.decode_value(v) for v in got]
    assert torch.equal(decoded[0], values[0]) and torch.equal(decoded[2]["x"], values[2]["x"])
    assert decoded[3].shape == (0,)
    empty = json.loads(here.recv_bytes())
    assert _receive_values(here, empty) == []
    assert here.recv_bytes() == b"next"  # nothing was read past a step's own values


@pytest.mark.parametrize(("header", "sent", "words"), [
    ({"values": 2, "sizes": [3, 4], "joined": True}, [b"abcdef"], "carried 6 bytes of values, its header 7"),
    ({"values": 2, "sizes": [3, 4], "joined": False}, [b"abc", b"abcde"], "carried 5 bytes, its header 4"),
    ({"values": 3, "sizes": [3, 4], "joined": True}, [], "names 3 values and 2 sizes"),
])
def test_values_that_disagree_with_their_header_are_refused(header: dict[str, Any], sent: list[bytes],
                                                            words: str) -> None:
    from multiprocessing import Pipe

    from hookwire_server.engine.vllm_link import _receive_values

    here, worker = Pipe()
    for data in sent:
        worker.send_bytes(data)
    with pytest.raises(ValueError, match=words):
        _receive_values(here, header)
