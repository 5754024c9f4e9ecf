"""Gradient reduction of a grid model: one rule per parameter kind, implemented once.

========================  =====================================  =============================
kind                      which parameters                       reduction
========================  =====================================  =============================
``SHARDED``               grid Linear rows (a piece per r)       mean over BATCH
``REPLICATED``            identical and computed identically     mean over BATCH
                          on every r (layers after a gather,
                          or a Linear too narrow to shard)
``PARTIAL``               identical, but each r sees only its    sum over MODEL, mean over BATCH
                          slab (domain Conv2d, BatchNorm2d)      (one all-reduce over the grid)
========================  =====================================  =============================

Gradients are flattened per (rule, dtype) into one buffer, so each step costs at most two
all-reduces per dtype whatever the number of layers (the cost model counts one per layer; the
words are the same).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from lightning_hier.layers.collectives import all_reduce_sum_raw_
from lightning_hier.layers.context import GridContext, ParamKind

# which all-reduce each kind's gradients join: "batch" (sum over BATCH) or "grid" (over all ranks)
RULES: dict[ParamKind, str] = {ParamKind.SHARDED: "batch", ParamKind.REPLICATED: "batch", ParamKind.PARTIAL: "grid"}


def parameter_kinds(module: nn.Module) -> Iterator[tuple[str, nn.Parameter, ParamKind]]:
    """``(name, parameter, kind)`` of every parameter (once), from the module that owns it.

    Grid layers declare their kind (class attribute ``param_kind``); parameters of every other
    module are ``REPLICATED``: the converter only leaves modules unconverted where their input is
    identical on every rank of the MODEL group.
    """
    seen: set[int] = set()
    for prefix, owner in module.named_modules():
        kind = getattr(type(owner), "param_kind", ParamKind.REPLICATED)
        for name, p in owner.named_parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                yield (f"{prefix}.{name}" if prefix else name), p, kind


class GradientReducer:
    """Reduces the gradients of a grid model after backward, before the optimizer step.

    Args:
        module: The converted model (see :func:`lightning_hier.layers.to_grid`).
        grid: This rank's grid context.

    Example:
        >>> reducer = GradientReducer(model, grid)                     # doctest: +SKIP
        >>> loss.backward(); reducer.reduce(); optimizer.step()        # doctest: +SKIP
    """

    def __init__(self, module: nn.Module, grid: GridContext) -> None:
        self.grid = grid
        self.params: dict[str, list[nn.Parameter]] = {"batch": [], "grid": []}
        for _, p, kind in parameter_kinds(module):
            if p.requires_grad:
                self.params[RULES[kind]].append(p)

    @torch.no_grad()
    def reduce(self) -> None:
        """Mean over BATCH (sum over MODEL first for partial gradients), in place.

        Parameters without a gradient are skipped; every rank runs the same graph, so they are the
        same on every rank.
        """
        g = self.grid
        plans = {"batch": (g.batch_group, g.pc, "grad_batch"), "grid": (g.grid_group, g.world, "grad_grid")}
        for rule, params in self.params.items():
            group, size, kind = plans[rule]
            if group is None or size == 1:
                continue
            grads = [p.grad for p in params if p.grad is not None]
            for same_dtype in _by_dtype(grads):
                flat = torch.cat([t.reshape(-1) for t in same_dtype])
                all_reduce_sum_raw_(flat, group, size, g, kind)
                flat.div_(g.pc)
                pieces = torch.split(flat, [t.numel() for t in same_dtype])
                torch._foreach_copy_(same_dtype, [v.view_as(t) for v, t in zip(pieces, same_dtype, strict=True)])


def _by_dtype(tensors: list[Tensor]) -> list[list[Tensor]]:
    groups: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return list(groups.values())
