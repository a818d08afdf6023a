"""Models for the benchmark scripts (served with `hookwire serve --model NAME=bench_models:FACTORY`)."""

from __future__ import annotations

import torch
from torch import nn


class Producer(nn.Module):
    """Makes a large activation from a tiny input and returns only its sum.

    forward(x: float32 [2]) -> scalar: the module ``inner`` sees and returns
    ``full((x[0] * 2**20,), x[1])``, so a hook on ``inner`` captures x[0] MiB*4 of
    float32 while the Infer response stays tiny.
    """

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = int(float(x[0]) * (1 << 20))
        return self.inner(torch.full((n,), float(x[1]))).sum()


def producer() -> nn.Module:
    return Producer()


class Scale(nn.Module):
    """x * 2: output as large as the input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def scale() -> nn.Module:
    return Scale()


def llama_1b() -> nn.Module:
    """A Llama of 1.1B parameters (TinyLlama's shape: hidden 2048, 22 layers, 32 heads, 4
    key-value heads, vocabulary 32000) with seeded random weights, in bfloat16, eval mode.
    Built on the GPU when there is one (the server then keeps it there with
    ``device = "cuda:0"``): its fp32 initialization would take 4.4 GB of host memory."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
        num_key_value_heads=4, max_position_embeddings=2048, tie_word_embeddings=False,
    )
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
    return model.to(torch.bfloat16).eval()
