"""Calibration: time a model's forward, backward and optimizer step on this machine (pure torch).

The simulator's compute inputs come from a short run of the user's own model on one worker:
:func:`measure_workload` times whole training steps at the real batch size (forward, backward
and optimizer step separately, median of ``repeats`` after a warm-up) and, for an
``nn.Sequential``, each block's forward + backward and output size (what a pipeline stage
computes and sends), with the pipeline strategy's own block timer
(:func:`~lightning_hier.algorithms.decoupled.partition.measure_block_costs`). Block times are
rescaled so that they add up to the whole model's forward + backward.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from statistics import median
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_hier.algorithms.averaging import float_buffers
from lightning_hier.algorithms.decoupled.partition import measure_block_costs
from lightning_hier.simulator.inputs import Block, Workload


def time_step(
    model: nn.Module, inputs: Tensor, targets: Tensor, optimizer: torch.optim.Optimizer, repeats: int = 5
) -> tuple[float, float, float]:
    """Median ``(forward, backward, step)`` seconds of one training step on this batch.

    The model is trained by these steps (``repeats + 1`` of them); pass a copy to keep it.
    """
    forward, backward, step = [], [], []
    for i in range(repeats + 1):  # the first step warms allocators and lazy optimizer state up
        optimizer.zero_grad()
        start = time.perf_counter()
        loss = F.cross_entropy(model(inputs), targets)
        mid = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
        optimizer.step()
        if i:
            forward.append(mid - start)
            backward.append(end - mid)
            step.append(time.perf_counter() - end)
    return median(forward), median(backward), median(step)


def measure_workload(
    name: str,
    model: nn.Module,
    input_shape: Sequence[int],
    batch_size: int,
    samples_per_epoch: int,
    classes: int = 10,
    repeats: int = 5,
    model_spec: dict[str, Any] | None = None,
) -> Workload:
    """A :class:`Workload` measured on this machine with SGD (momentum 0.9) and cross-entropy.

    Args:
        name: Label of the workload.
        model: The network (left trained by a few steps on random data).
        input_shape: One sample's shape, without the batch.
        batch_size: Samples per worker per step.
        samples_per_epoch: Training samples per epoch over all workers.
        classes: Output classes (random targets are drawn from them).
        repeats: Timed steps (median).
        model_spec: How to rebuild the network later (:attr:`Workload.model`).
    """
    g = torch.Generator().manual_seed(0)
    inputs = torch.randn(batch_size, *input_shape, generator=g)
    targets = torch.randint(0, classes, (batch_size,), generator=g)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    forward, backward, step = time_step(model, inputs, targets, optimizer, repeats)
    params = [p for p in model.parameters() if p.requires_grad]
    return Workload(
        name,
        params=sum(p.numel() for p in params),
        batch_size=batch_size,
        samples_per_epoch=samples_per_epoch,
        forward_s=forward / batch_size,
        backward_s=backward / batch_size,
        step_s=step,
        buffers=sum(b.numel() for b in float_buffers(model)),
        tensors=len(params),
        tensor_words=tuple(p.numel() for p in params),
        blocks=_blocks(model, inputs, (forward + backward) / batch_size, repeats),
        model=model_spec,
    )


def _blocks(model: nn.Module, inputs: Tensor, sample_s: float, repeats: int) -> tuple[Block, ...]:
    """Per-block costs of an ``nn.Sequential`` (none for other modules), summing to ``sample_s``."""
    if not isinstance(model, nn.Sequential) or len(model) < 2:
        return ()
    blocks = list(model)
    costs = measure_block_costs(blocks, inputs, repeats)
    scale = sample_s / sum(costs) if sum(costs) > 0 else 0.0
    out, h = [], inputs
    with torch.no_grad():
        for block, cost in zip(blocks, costs, strict=True):
            h = block(h)
            params = sum(p.numel() for p in block.parameters() if p.requires_grad)
            out.append(Block(cost * scale, params, h[0].numel()))
    return tuple(out)
