"""Index arithmetic of the lock-step pipeline schedules (pure Python, no tensors).

Iterations are counted from the moment an empty pipeline is fed its first batch (batch 0 enters
stage 0 at iteration 0). Within an iteration every stage forwards first, then applies its delayed
gradient, so the weights a stage used to forward batch ``b`` lack exactly ``staleness(k)`` of the
updates that precede ``b``'s own update: every schedule follows the stale-gradient rule
``w_{t+1} = w_t - lr * g_{t - tau_k}(w_{t - tau_k})`` on each stage (``t`` counting stage ``k``'s
updates), with ``tau_k`` below.

=========  ================  ================  ====================================
schedule   forward           backward          staleness ``tau_k`` of stage ``k``
=========  ================  ================  ====================================
``fdg``    decoupled         decoupled         ``2 (K - 1 - k)`` (FDG, the default)
``ddg``    locked (a chain)  decoupled         ``K - 1 - k`` (DDG)
``sync``   locked            locked            ``0``: plain backpropagation
=========  ================  ================  ====================================

A decoupled direction moves one hop per iteration (messages are exchanged at the end of each
iteration); a locked one crosses the whole pipeline inside one iteration.

Order within an iteration (a decision): forward first, delayed backward second. With the other
order the forward would already see the update made in the same iteration, so FDG's stages
``k < K - 1`` would lag ``2 (K - 1 - k) - 1`` updates while the last lags 0; forward-first makes
the update lag equal the index lag ``tau_k`` on every stage and schedule (one rule for all), and it
is the only order in which DDG's locked forward chain can run without waiting on backward passes.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("fdg", "ddg", "sync")


@dataclass(frozen=True)
class Schedule:
    """One schedule on ``num_stages`` stages.

    Args:
        name: ``'fdg'``, ``'ddg'`` or ``'sync'``.
        num_stages: Number of pipeline stages ``K``.
    """

    name: str
    num_stages: int

    def __post_init__(self) -> None:
        if self.name not in SCHEDULES:
            raise ValueError(f"Schedule: `name` must be one of {', '.join(map(repr, SCHEDULES))}, got {self.name!r}.")
        if self.num_stages < 1:
            raise ValueError(f"Schedule: `num_stages` must be >= 1, got {self.num_stages}.")

    @property
    def forward_locked(self) -> bool:
        """Whether a batch crosses every stage's forward within one iteration."""
        return self.name != "fdg"

    @property
    def backward_locked(self) -> bool:
        """Whether a gradient crosses every stage's backward within one iteration."""
        return self.name == "sync"

    def _check(self, stage: int) -> None:
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"Schedule: stage {stage} out of range [0, {self.num_stages}).")

    def staleness(self, stage: int) -> int:
        """``tau_k``: updates between the forward of a batch on ``stage`` and the update with its gradient."""
        self._check(stage)
        hops = self.num_stages - 1 - stage
        return hops * (int(not self.forward_locked) + int(not self.backward_locked))

    def forward_lag(self, stage: int) -> int:
        """Stage ``stage`` forwards batch ``b`` at iteration ``b + forward_lag``."""
        self._check(stage)
        return 0 if self.forward_locked else stage

    def update_lag(self, stage: int) -> int:
        """Stage ``stage`` applies batch ``b``'s gradient at iteration ``b + update_lag``."""
        return self.forward_lag(stage) + self.staleness(stage)

    @property
    def drain_iterations(self) -> int:
        """Iterations without new input after the last batch until every stage applied it."""
        return max(self.update_lag(k) for k in range(self.num_stages)) if self.num_stages else 0
