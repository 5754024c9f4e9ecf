"""Single-process references of DBS shares inside HPSGD and Local SGD: W workers simulated in one process.

Written from the rule (docs/algorithms.md, DBS section), not from lightning_hier's classes: each
worker's batch at every step has its own size, and every window's changes enter the global model
as ``sum_i n_i delta_i / N``, with ``n_i`` the samples worker ``i`` processed in the window.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.nn.utils import vector_to_parameters

from tests.hpsgd_reference import Batch, Reference, fixed_merge_steps, params_of

Sizes = Sequence[Sequence[int]]  # sizes[step][worker], 0-based steps


def window_samples(sizes: Sizes, ends: Sequence[int]) -> list[list[int]]:
    """Per-worker samples of the windows ending at the 1-based steps ``ends`` (each after the previous)."""
    out, start = [], 0
    for end in ends:
        out.append([sum(step[w] for step in sizes[start:end]) for w in range(len(sizes[0]))])
        start = end
    return out


class _WeightedHPSGD(Reference):
    """The HPSGD reference whose global model advances by ``sum_i n_i delta_i / N`` of each window."""

    def __init__(self, windows: list[list[int]], *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.windows = windows  # in the order the windows are applied

    def _outer_step(self, sent: list[Tensor]) -> None:
        counts = self.windows.pop(0)
        self.S = self.S + sum(n * d for n, d in zip(counts, sent, strict=True)) / sum(counts)


def weighted_hpsgd(
    make_module: Callable[[], nn.Module],
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    loss: Callable[[nn.Module, Batch], Tensor],
    data: Callable[[int, int], Batch],
    sizes: Sizes,
    window: int,
    merge: str,
) -> Tensor:
    """HPSGD in mode 'fixed' over ``len(sizes)`` steps, then the drain at the end of training; the model."""
    steps = len(sizes)
    merges = fixed_merge_steps(window, steps)
    ends = [1, *merges] + ([steps] if not merges or merges[-1] < steps else [])
    windows = window_samples(sizes, ends)
    ref = _WeightedHPSGD(windows, make_module, make_optimizer, loss, len(sizes[0]), merge=merge)
    return ref.run(data, steps, merges)[-1]


def weighted_localsgd(
    make_module: Callable[[], nn.Module],
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    loss: Callable[[nn.Module, Batch], Tensor],
    data: Callable[[int, int], Batch],
    sizes: Sizes,
    tau: int,
) -> Tensor:
    """W replicas; every ``tau`` steps and at the end each becomes ``sum_i n_i x_i / N``; the model."""
    workers, steps = len(sizes[0]), len(sizes)
    modules = [make_module() for _ in range(workers)]
    opts = [make_optimizer(m) for m in modules]
    start = 0
    for step in range(1, steps + 1):
        for w, (module, opt) in enumerate(zip(modules, opts, strict=True)):
            opt.zero_grad()
            loss(module, data(w, step - 1)).backward()
            opt.step()
        if step % tau == 0 or step == steps:
            (counts,) = window_samples(sizes[start:step], [step - start])
            mean = sum(n * params_of(m) for n, m in zip(counts, modules, strict=True)) / sum(counts)
            for module in modules:
                vector_to_parameters(mean.clone(), module.parameters())
            start = step
    return params_of(modules[0])
