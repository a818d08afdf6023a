"""hooks/widths.py: which modules state the width a rule's operand must fit."""

from __future__ import annotations

import types

import torch
from torch import nn

from hookwire.v1 import hook_pb2
from hookwire_server.hooks.rules import Target
from hookwire_server.hooks.widths import target_width
from hookwire_server.models.model_registry import ModelHost


class DecoderLayer(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class VisionBlock(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class Multimodal(nn.Module):
    """A language model of 2 layers, 64 wide (its config), beside a vision tower of 3
    blocks of another width, which the config's hidden_size does not describe."""

    def __init__(self) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(hidden_size=64, num_hidden_layers=2)
        self.layers = nn.ModuleList([DecoderLayer() for _ in range(2)])
        self.blocks = nn.ModuleList([VisionBlock() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_only_the_stack_of_the_config_s_layers_has_its_hidden_size() -> None:
    host = ModelHost("m", Multimodal())
    output = Target("output", "output", ())
    known = target_width(host, "layers.1", hook_pb2.PHASE_FORWARD, output)
    assert known is not None and known[0] == 64
    # Another stack (its length is not num_hidden_layers): its width is not known, so a
    # right-width operand there is not refused for the language model's width.
    assert target_width(host, "blocks.0", hook_pb2.PHASE_FORWARD, output) is None
