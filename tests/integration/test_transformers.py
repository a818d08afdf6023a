"""A Hugging Face transformers model from a local folder (no downloads), hooked remotely."""

from __future__ import annotations

import pathlib

import torch
import transformers

import hookwire
from hookwire_server import ModelConfig, build_registry
from support import Recorder, ServerThread, assert_same, collect


def _tiny_bert(folder: pathlib.Path) -> transformers.PreTrainedModel:
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.BertModel(config).eval()
    model.save_pretrained(str(folder))  # safetensors
    return model


async def test_local_transformers_model_with_dict_output(tmp_path: pathlib.Path) -> None:
    local = _tiny_bert(tmp_path / "bert")
    registry = build_registry([ModelConfig(name="bert", transformers=str(tmp_path / "bert"))])
    server = ServerThread(registry).start()
    try:
        ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(1))
        mask = torch.ones(2, 7, dtype=torch.long)
        mask[0, 5:] = 0
        oracle = Recorder()
        oracle.hook(local, "encoder.layer.0.output", "forward")
        oracle.hook(local, "encoder.layer.1.output", "forward")
        with torch.no_grad():
            expected = local(ids, attention_mask=mask)
        async with hookwire.connect(server.target) as client:
            model = client.model("bert")
            info = await model.info()
            assert info.modules[0].type == "BertModel"
            async with model.hook("encoder.layer.*.output", posthook=hookwire.capture("args", "output")) as hook:
                out = await model(ids, attention_mask=mask)
                events = await collect(hook, 2)
        assert list(out) == ["last_hidden_state", "pooler_output"]  # ModelOutput keys, in order
        assert_same(out["last_hidden_state"], expected.last_hidden_state)
        assert_same(out["pooler_output"], expected.pooler_output)
        for event, want in zip(events, oracle.events):
            assert_same(event.args, want["args"])
            assert_same(event.output, want["output"])
    finally:
        server.stop()
