"""The harvest command's argument handling and the SDK's request building (no server)."""

from __future__ import annotations

import argparse

import pytest
import torch

from hookwire._cli import build_parser, parse_count
from hookwire._harvest import HarvestProgress, harvest_request
from hookwire.v1 import harvest_service_pb2 as hv
from hookwire.v1 import hook_pb2, tensor_pb2


@pytest.mark.parametrize("text,count", [("500000", 500_000), ("500k", 500_000), ("10M", 10_000_000),
                                        ("1.5G", 1_500_000_000), ("2b", 2_000_000_000), ("1_000", 1000)])
def test_token_counts(text: str, count: int) -> None:
    assert parse_count(text) == count


@pytest.mark.parametrize("text", ["", "ten", "-5", "1.5", "0.5k1", "M"])
def test_bad_token_counts(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_count(text)


def test_the_request_says_what_the_options_say() -> None:
    rule = hook_pb2.HookSpec(module="model.layers.0", posthook=hook_pb2.HookAction())
    req = harvest_request("m", "model.layers.*", data="d.jsonl", out="o", dtype="bfloat16", part="input",
                          select="[..., :4]", rules=[rule], length=64, batch_size=4, packing="pack", bos=False,
                          skip_first=1, positions=[1, 2], max_tokens=10, shard_tokens=100, shuffle=True,
                          shuffle_buffer=2, seed=3, overwrite=True, worker_index=1, num_workers=2, split="train")
    assert list(req.modules) == ["model.layers.*"] and req.part == hook_pb2.PART_ARGS
    assert req.dtype == tensor_pb2.DTYPE_BFLOAT16 and req.select == "[..., :4]"
    assert req.contexts == hv.HarvestContexts(length=64, batch_size=4, packing=hv.PACKING_PACK, bos=False)
    assert req.positions == hv.HarvestPositions(skip_first=1, only=[1, 2]) and req.max_tokens == 10
    assert req.output.shuffle == hv.HarvestShuffle(enabled=True, buffer_shards=2, seed=3) and req.output.overwrite
    assert req.source.text.path == "d.jsonl" and req.source.text.split == "train"
    assert (req.worker_index, req.num_workers) == (1, 2) and req.rules[0].module == "model.layers.0"
    assert not req.contexts.HasField("bos") or req.contexts.bos is False
    tokens = harvest_request("m", ["a"], tokens=torch.tensor([[1, 2, 0]]), pad_token_id=0, out="o")
    assert list(tokens.source.tokens.input_ids.shape) == [1, 3] and tokens.source.tokens.pad_token_id == 0
    with pytest.raises(ValueError, match="dtype"):
        harvest_request("m", ["a"], data="d", out="o", dtype="int8")
    with pytest.raises(ValueError, match="not both"):
        harvest_request("m", ["a"], out="o")


def test_progress_decodes_the_job() -> None:
    p = HarvestProgress.from_proto(hv.HarvestJob(job_id="hv-1", state=hv.HARVEST_STATE_CANCELLED, tokens_done=5))
    assert p.state == "cancelled" and p.ended and p.tokens_done == 5


def test_the_cli_parses_a_job_line() -> None:
    ns = build_parser().parse_args(["harvest", "m", "--modules", "a.*", "--modules", "b", "--data", "d.jsonl",
                                    "--out", "o", "--tokens", "10M", "--shuffle", "--num-workers", "3"])
    assert ns.words == ["m"] and ns.modules == ["a.*", "b"] and ns.tokens == 10_000_000 and ns.num_workers == 3
