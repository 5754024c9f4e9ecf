"""DBS shares inside periodic averaging: each rank's window change weighted by the samples it processed.

DBS (:mod:`lightning_hier.algorithms.dbs`) gives rank ``i`` a share ``b_i`` of every global batch
in proportion to its measured speed, so every rank takes the same number of steps in the same
time. Inside HPSGD or Local SGD the ranks no longer all-reduce gradients every step; they train
their replicas for a window (HPSGD's ``H`` steps, Local SGD's ``tau``) and then average the
*changes* ``delta_i = x_i - x_0`` of the window, all started from the same ``x_0``. With
``n_i`` the samples rank ``i`` processed in the window and ``N = sum_i n_i``, the merged change is::

    delta = sum_i n_i delta_i / N

Why samples are the right weights:

- **It is DBS's own rule, one step long.** A window of one plain SGD step gives
  ``delta_i = -lr g_i`` with ``g_i`` the mean gradient over rank ``i``'s ``n_i = b_i`` samples, so
  ``sum_i n_i delta_i / N = -lr sum_i (b_i / B) g_i``: exactly DBS's ``b_i / B``-weighted
  gradient, i.e. single-process SGD on the whole global batch. Longer windows keep every sample's
  weight equal instead of every rank's.
- **The plain mean would bias the model toward slow ranks.** Every rank takes the same number of
  steps, so ``delta_i`` has about the same size whatever ``b_i``; the plain mean gives a slow
  rank's few samples as much say as a fast rank's many, i.e. it up-weights the slow rank's shard
  by ``N / (W n_i)`` (the samples a rank sees are a fixed part of each global batch, so this is a
  reweighted objective, not noise).
- **With equal speeds it is the plain mean, bit for bit.** ``n_i = N / W`` makes each rank's
  factor ``W n_i / N`` exactly ``1.0`` (integer arithmetic, then one exact division), and the
  multiplication is skipped.

How it is computed, without any extra communication: every rank knows the whole split (DBS's
allocation is common knowledge, also for an epoch's smaller last batch), so it knows ``N`` and its
own ``n_i``. It scales its change (HPSGD) or its replica (Local SGD: the replicas all start the
window at ``x_0``, so ``sum_i n_i x_i / N = x_0 + delta``) by ``W n_i / N`` before the existing
uniform mean, ``sum_i (W n_i / N) v_i / W = sum_i n_i v_i / N``.

Pure torch: :class:`SampleWindow` counts, :class:`SampleWeightedCenter` is the Local SGD policy;
HPSGD takes the factor as :attr:`~lightning_hier.algorithms.hpsgd.HPSGD.change_weight`.
The Lightning composition is :mod:`lightning_hier.strategies.dbs_compose`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

from lightning_hier.algorithms.centers import RoundContext, UniformCenter

__all__ = ["SampleWeightedCenter", "SampleWindow"]


@dataclass
class SampleWindow:
    """Samples of the current averaging window: this rank's ``n_i`` and all ranks' ``N``.

    Attributes:
        own: ``n_i``, samples this rank processed since the window opened.
        total: ``N``, samples all ranks processed since the window opened.
    """

    own: int = 0
    total: int = 0

    def add(self, own: int, total: int) -> None:
        """Count one optimizer step: ``own`` samples here, ``total`` over all ranks."""
        if not 0 <= own <= total:
            raise ValueError(f"SampleWindow: need 0 <= own <= total, got own={own}, total={total}.")
        self.own += own
        self.total += total

    def weight(self, world: int) -> float:
        """``W n_i / N``, this rank's factor before a uniform mean over ``world`` ranks (1.0 when empty)."""
        if self.total == 0:
            return 1.0
        return world * self.own / self.total  # exact 1.0 when n_i = N / W: integer product, one division

    def reset(self) -> None:
        """The window was sent (or merged): the next one starts empty."""
        self.own = self.total = 0

    def state_dict(self) -> dict[str, int]:
        return {"own": self.own, "total": self.total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.own, self.total = int(state["own"]), int(state["total"])


class SampleWeightedCenter(UniformCenter):
    """Local SGD's center weighted by samples: ``c = sum_i n_i x_i / N`` (module docstring).

    The owner sets :attr:`weight` to ``W n_i / N`` of the window (:meth:`SampleWindow.weight`)
    before every step; the round scales this rank's replica by it, then takes the uniform mean.

    Attributes:
        weight: This rank's factor ``W n_i / N`` for the current window (1.0: the plain mean).
    """

    def __init__(self) -> None:
        self.weight = 1.0

    @override
    def combine(self, out: list[Tensor], ctx: RoundContext) -> dict[str, Any]:
        if self.weight != 1.0:  # equal shares: the plain mean, untouched
            torch._foreach_mul_(out, self.weight)
        return super().combine(out, ctx)
