"""The small problem the algorithm tests train on real gloo groups and in their references.

A 5-8-3 MLP (optionally with BatchNorm) and, for worker ``w`` at step ``t``, a batch of ``BATCH``
random inputs and labels drawn from a generator seeded ``1000 w + t``: every worker sees its own
data, and a reference in one process can draw exactly what each rank drew.
"""

from __future__ import annotations

import torch
from torch import nn

BATCH = 6


def tiny_net(batch_norm: bool = False) -> nn.Module:
    """The same initial weights on every call (seed 0)."""
    torch.manual_seed(0)
    mid = [nn.BatchNorm1d(8)] if batch_norm else []
    return nn.Sequential(nn.Linear(5, 8), *mid, nn.Tanh(), nn.Linear(8, 3))


def worker_batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker ``worker``'s batch at 0-based ``step``."""
    g = torch.Generator().manual_seed(1000 * worker + step)
    return torch.randn(BATCH, 5, generator=g), torch.randint(0, 3, (BATCH,), generator=g)


def cross_entropy(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The loss of ``module`` on ``batch``."""
    return nn.functional.cross_entropy(module(batch[0]), batch[1])
