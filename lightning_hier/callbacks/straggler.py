"""Straggler emulation for tests and benchmarks: one chosen rank runs ``factor`` times slower.

Heterogeneous clusters are emulated *outside* the algorithms, so a strategy sees only what a slow
machine would show it: longer compute. The slowdown is injected in proportion to the rank's own
measured compute, so it scales with the batch size as a slower processor would.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_hier import _validate as v

MODES = ("sleep", "spin")


class Straggler(Callback):
    """Slows the chosen ranks down by ``factor``: after each backward they stall ``(factor - 1) x`` its cost.

    The cost is the time from the start of the (micro-)batch to the end of its backward pass
    (forward, loss, backward and the module's hooks). Stalling inside the step, before the gradients
    are reduced, makes the other ranks wait for the straggler exactly as for a slow machine, under
    any strategy. The optimizer step itself is not slowed (it is small for SGD-like optimizers).

    Modes:

    - ``'sleep'`` (default): cost in wall time, stall by sleeping. The straggler uses no CPU while
      stalled, as a slower machine would not take CPU from its peers: use it for wall-clock
      benchmarks (each rank on its own core).
    - ``'spin'``: cost in CPU time (``time.process_time``), stall by busy-waiting until that much
      more CPU time is used. The slowdown then holds in CPU time even on a loaded shared machine;
      pair it with ``DBSStrategy(timer='cpu')`` in tests.

    Caveat: under DDP the measured backward includes DDP's overlapped gradient all-reduce; the
    straggler arrives last, so this adds only the transfer time of the last bucket (a slight
    overestimate of DDP's straggler cost on slow links).

    Args:
        ranks: Global rank(s) to slow down.
        factor: Slowdown factor (``2.0``: twice as slow; ``1.0``: no effect).
        mode: ``'sleep'`` or ``'spin'`` (see above).

    Attributes:
        compute_s: Total measured cost on this rank (0 on other ranks).
        delay_s: Total stall on this rank. The stall owed is the balance (see :func:`owed_delay`),
            which corrects oversleeping, so ``delay_s`` tracks ``(factor - 1) * compute_s``.
        last_compute_s, last_delay_s: The same, for the last (micro-)batch.
    """

    def __init__(self, ranks: int | Sequence[int] = 1, factor: float = 2.0, mode: str = "sleep") -> None:
        owner = type(self).__name__
        chosen = [ranks] if v.as_int(ranks) is not None else ranks  # one rank, of any integral type
        allowed = "a global rank or a non-empty list of them (integers >= 0)"
        self.ranks = v.check_int_list(owner, "ranks", chosen, minimum=0, allowed=allowed)
        self.factor = v.check_float(owner, "factor", factor, low=1.0, high=100.0)
        self.mode = v.check_choice(owner, "mode", mode, MODES)
        self.clock: Callable[[], float] = time.perf_counter if mode == "sleep" else time.process_time
        self.compute_s = self.delay_s = self.last_compute_s = self.last_delay_s = 0.0
        self._start: float | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if any(r >= trainer.world_size for r in self.ranks):
            raise ValueError(
                f"Straggler: argument `ranks` must be global ranks below the world size {trainer.world_size}, "
                f"got {self.ranks}."
            )

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if trainer.global_rank in self.ranks:
            self._start = self.clock()

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._start is None:
            return
        cost = self.clock() - self._start
        self._start = None
        self.compute_s += cost
        self.last_compute_s = cost
        owed = owed_delay(self.factor, self.compute_s, self.delay_s)
        start = self.clock()
        if owed > 0 and self.mode == "sleep":
            time.sleep(owed)
        while owed > 0 and self.mode == "spin" and self.clock() - start < owed:
            pass
        self.last_delay_s = self.clock() - start
        self.delay_s += self.last_delay_s


def owed_delay(factor: float, compute_s: float, stalled_s: float) -> float:
    """Stall still owed so that the total stall is ``(factor - 1)`` times the total compute.

    Stalling for the *balance* rather than ``(factor - 1) x`` the last cost corrects overshooting (a
    loaded machine wakes sleepers late), so the long-run slowdown is exactly ``factor``.
    """
    return max(0.0, (factor - 1.0) * compute_s - stalled_s)
