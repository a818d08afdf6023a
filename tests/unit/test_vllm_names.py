"""The transformers names of a vLLM model's parameters (engine/vllm_names.py) and the
host's parameter views GetParameters reads them through (ModelHost.parameter_views), on
stand-ins with vLLM's names and shapes: no vLLM needed (tests/vllm_engine checks a real
vLLM model against transformers bit for bit)."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from hookwire.wire.framing import GET_PARAMETERS_CHUNK, Framing
from hookwire_server.calls.parameters import copy_parameters, select_parameters
from hookwire_server.engine.vllm_names import add_transformers_names, transformers_views
from hookwire_server.errors import NotFound
from hookwire_server.models.model_registry import ModelHost, ParameterView

#: A Llama config's sizes: 4 heads of 8, 2 KV heads, MLP 48, vocabulary 50 (vLLM pads to 64).
CONFIG = types.SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, hidden_size=32, head_dim=None,
                               intermediate_size=48, vocab_size=50)
PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def _linear(rows: int, cols: int, bias: bool = False) -> nn.Module:
    layer = nn.Module()
    layer.weight = nn.Parameter(torch.randn(rows, cols), requires_grad=False)
    if bias:
        layer.bias = nn.Parameter(torch.randn(rows), requires_grad=False)
    return layer


class VllmLlama(nn.Module):
    """vLLM's Llama parameter names and shapes (one layer, q 32 + k 16 + v 16 rows)."""

    packed_modules_mapping = PACKED

    def __init__(self, qkv_rows: int = 64, bias: bool = False, config: object = CONFIG) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.config = config
        self.model = nn.Module()
        self.model.embed_tokens = _linear(64, 32)
        layer = nn.Module()
        layer.self_attn = nn.Module()
        layer.self_attn.qkv_proj = _linear(qkv_rows, 32, bias)
        layer.self_attn.o_proj = _linear(32, 32)
        layer.mlp = nn.Module()
        layer.mlp.gate_up_proj = _linear(96, 32)
        layer.mlp.down_proj = _linear(32, 48)
        self.model.layers = nn.ModuleList([layer])
        self.lm_head = _linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_the_fused_parameters_split_by_the_configs_sizes_as_views() -> None:
    model = VllmLlama(bias=True)
    params = dict(model.named_parameters())
    views, gaps = transformers_views(params, CONFIG, PACKED)
    assert not gaps
    qkv = "model.layers.0.self_attn.qkv_proj"
    assert views["model.layers.0.self_attn.q_proj.weight"] == ParameterView(f"{qkv}.weight", 0, 0, 32)
    assert views["model.layers.0.self_attn.k_proj.weight"] == ParameterView(f"{qkv}.weight", 0, 32, 16)
    assert views["model.layers.0.self_attn.v_proj.bias"] == ParameterView(f"{qkv}.bias", 0, 48, 16)
    assert views["model.layers.0.mlp.up_proj.weight"] == ParameterView("model.layers.0.mlp.gate_up_proj.weight", 0, 48, 48)
    # The embeddings answer to their own names, trimmed to the vocabulary.
    assert views["model.embed_tokens.weight"] == ParameterView("model.embed_tokens.weight", 0, 0, 50)
    assert views["lm_head.weight"] == ParameterView("lm_head.weight", 0, 0, 50)
    v = views["model.layers.0.self_attn.v_proj.weight"].of(params[f"{qkv}.weight"])
    assert v.data_ptr() == params[f"{qkv}.weight"][48:].data_ptr() and v.shape == (16, 32)  # a view, no copy
    assert len(views) == 2 * 3 + 2 + 2


def test_what_cannot_be_derived_is_said_and_not_split() -> None:
    shard = dict(VllmLlama(qkv_rows=40).named_parameters())  # a tensor-parallel shard's rows
    views, gaps = transformers_views(shard, CONFIG, PACKED)
    assert "model.layers.0.self_attn.q_proj.weight" not in views
    assert "[40, 32], whose rows are not the config's 32 + 16 + 16" in gaps["model.layers.0.self_attn.k_proj.weight"]
    assert "model.layers.0.mlp.gate_proj.weight" in views  # the others still map
    _, gaps = transformers_views(dict(VllmLlama().named_parameters()), CONFIG, PACKED, tensor_parallel_size=2)
    assert "tensor_parallel_size 2" in gaps["model.layers.0.mlp.up_proj.weight"] and len(gaps) == 5
    emptied = VllmLlama()
    emptied.model.layers[0].self_attn.qkv_proj.weight = nn.Parameter(torch.empty(0), requires_grad=False)
    _, gaps = transformers_views(dict(emptied.named_parameters()), CONFIG, PACKED)
    assert "dropped the module's copy" in gaps["model.layers.0.self_attn.q_proj.weight"]
    _, gaps = transformers_views(dict(VllmLlama().named_parameters()), types.SimpleNamespace(vocab_size=50), PACKED)
    assert "no num_attention_heads, hidden_size, intermediate_size" in gaps["model.layers.0.self_attn.v_proj.weight"]


def test_modules_fused_in_transformers_too_are_not_split() -> None:
    """Phi-3: vLLM's packed_modules_mapping says its qkv_proj packs transformers' qkv_proj."""
    params = dict(VllmLlama().named_parameters())
    views, gaps = transformers_views(params, CONFIG, {"qkv_proj": ["qkv_proj"], "gate_up_proj": ["gate_up_proj"]})
    assert sorted(views) == ["lm_head.weight", "model.embed_tokens.weight"] and not gaps
    views, _ = transformers_views(params, CONFIG, None)
    assert sorted(views) == ["lm_head.weight", "model.embed_tokens.weight"]


def test_get_parameters_reads_the_views_by_name_and_glob_after_their_source() -> None:
    model = VllmLlama()
    host = ModelHost("fused", model, parameters_readable=True)
    try:
        add_transformers_names(host)
        names = host.parameter_names
        qkv = names.index("model.layers.0.self_attn.qkv_proj.weight")
        assert names[qkv + 1: qkv + 4] == [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
        assert names.count("model.embed_tokens.weight") == 1
        selection = select_parameters(host, ["model.layers.*.self_attn.?_proj.weight", "lm_head.weight"], None)
        assert selection.names == [*(f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkvo"), "lm_head.weight"]
        assert selection.sizes == [32 * 32 * 4, 16 * 32 * 4, 16 * 32 * 4, 32 * 32 * 4, 50 * 32 * 4]
        replies = copy_parameters(host, ["model.layers.0.self_attn.k_proj.weight", "model.embed_tokens.weight"], None,
                                  Framing(GET_PARAMETERS_CHUNK, 1 << 20))
        assert [list(msg.parameter.tensor.shape) for msg, _, _ in replies] == [[16, 32], [50, 32]]
        fused = model.model.layers[0].self_attn.qkv_proj.weight
        assert torch.equal(host.parameter_value("model.layers.0.self_attn.k_proj.weight"), fused[32:48])
        info = {m.path: m for m in host.describe(with_modules=True).modules}
        assert list(info["model.embed_tokens"].parameters[0].shape) == [50, 32]  # what GetParameters reads
        assert list(info["model.layers.0.self_attn.qkv_proj"].parameters[0].shape) == [64, 32]
    finally:
        host.shutdown()


def test_a_name_that_cannot_be_derived_is_refused_saying_why() -> None:
    host = ModelHost("shard", VllmLlama(qkv_rows=40), parameters_readable=True)
    try:
        add_transformers_names(host)
        with pytest.raises(NotFound, match=r"cannot answer to parameter 'model.layers.0.self_attn.q_proj.weight': "
                                           r"vLLM's model.layers.0.self_attn.qkv_proj.weight is \[40, 32\]"):
            select_parameters(host, ["model.layers.0.self_attn.q_proj.weight"], None)
        with pytest.raises(NotFound, match="matches no parameter"):
            select_parameters(host, ["model.layers.*.self_attn.q_proj.weight"], None)
        with pytest.raises(ValueError, match="past 'lm_head.weight'"):
            host.add_parameter_views({"x": ParameterView("lm_head.weight", 0, 60, 5)})
        with pytest.raises(ValueError, match="has no parameter 'nope'"):
            host.add_parameter_views({"x": ParameterView("nope", 0, 0, 1)})
    finally:
        host.shutdown()
