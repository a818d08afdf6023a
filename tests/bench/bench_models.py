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
