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

Order within an iteration (:data:`ORDERS`; a stage's index arithmetic does not depend on it,
only which weights its forward sees):

- ``'forward_first'`` (the default): forward, then the delayed backward and update. The update lag
  equals the index lag ``tau_k`` on every stage and schedule (one rule for all), it is the only
  order in which DDG's locked forward chain runs without waiting on backward passes, and it lets
  the activation leave a stage in the middle of its iteration.
- ``'backward_first'`` (``fdg`` only): the delayed backward and update, then the forward, as the
  FDG reference code (github.com/ZHUANGHP/FDG, ``TrainDg``) runs a module. The forward already
  sees the update made in the same iteration, so stages ``k < K - 1`` lag ``2 (K - 1 - k) - 1``
  updates (one fewer) while the last stage lags 0.

Decision: ``forward_first`` stays the default. With one message hop per iteration, FDG's order
sends the activation only when the stage's whole iteration is done, so the link's transfer time
joins the pipeline's critical cycle: for ``K = 2`` an iteration takes at least
``(C_0 + C_1) / 2 + L`` (``C_k`` a stage's compute, ``L`` one transfer) against
``max(C_0, C_1, C_1 / 2 + L)`` forward first; and checkpoints, tests and earlier results assume
the forward-first staleness. The price is one update more staleness: on the recipe's CNN (K = 2,
beta 0.5, 8 epochs, mean of 3 seeds) FDG's order ended at 0.672 validation accuracy, forward
first at 0.666, plain backprop at 0.678, while FDG's order ran 5-9 % fewer samples/s
(``recipes/decoupled/README.md``). Choose ``backward_first`` when accuracy per epoch matters more.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("fdg", "ddg", "sync")
ORDERS = ("forward_first", "backward_first")


@dataclass(frozen=True)
class Schedule:
    """One schedule on ``num_stages`` stages.

    Args:
        name: ``'fdg'``, ``'ddg'`` or ``'sync'``.
        num_stages: Number of pipeline stages ``K``.
        order: ``'forward_first'`` or ``'backward_first'`` (FDG's order; ``fdg`` only): see the
            module docstring.
    """

    name: str
    num_stages: int
    order: str = "forward_first"

    def __post_init__(self) -> None:
        if self.name not in SCHEDULES:
            raise ValueError(f"Schedule: `name` must be one of {', '.join(map(repr, SCHEDULES))}, got {self.name!r}.")
        if self.num_stages < 1:
            raise ValueError(f"Schedule: `num_stages` must be >= 1, got {self.num_stages}.")
        if self.order not in ORDERS:
            raise ValueError(f"Schedule: `order` must be one of {', '.join(map(repr, ORDERS))}, got {self.order!r}.")
        if self.order == "backward_first" and self.name != "fdg":
            raise ValueError(
                f"Schedule: order='backward_first' (FDG's order) needs schedule 'fdg', got {self.name!r}: a locked "
                "direction crosses the pipeline within the iteration, so it runs forward first."
            )

    @property
    def backward_first(self) -> bool:
        """Whether a stage applies its delayed gradient before it forwards (FDG's order)."""
        return self.order == "backward_first"

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
        lag = hops * (int(not self.forward_locked) + int(not self.backward_locked))
        # FDG's order: the forward already saw the update of its own iteration (none on the last stage)
        return lag - 1 if self.backward_first and hops > 0 else lag

    def forward_lag(self, stage: int) -> int:
        """Stage ``stage`` forwards batch ``b`` at iteration ``b + forward_lag``."""
        self._check(stage)
        return 0 if self.forward_locked else stage

    def update_lag(self, stage: int) -> int:
        """Stage ``stage`` applies batch ``b``'s gradient at iteration ``b + update_lag`` (either order)."""
        self._check(stage)
        hops = self.num_stages - 1 - stage
        return self.forward_lag(stage) + hops * (int(not self.forward_locked) + int(not self.backward_locked))

    def forwards(self, stage: int, iteration: int, fed: int) -> bool:
        """Whether ``stage`` forwards a batch at ``iteration``, ``fed`` batches having entered stage 0 by then."""
        self._check(stage)
        return 0 <= iteration - self.forward_lag(stage) < fed

    def applies(self, stage: int, iteration: int, fed: int) -> bool:
        """Whether ``stage`` backpropagates and applies a batch's gradient at ``iteration`` (see :meth:`forwards`)."""
        self._check(stage)
        return 0 <= iteration - self.update_lag(stage) < fed

    def sends_activation(self, stage: int, iteration: int, fed: int) -> bool:
        """Whether ``stage`` sends an activation to ``stage + 1`` at ``iteration`` (see :meth:`forwards`).

        Only a batch's activation travels: an iteration of the fill or the drain with none sends no
        message (both ends know it from these counters, so none is posted either).
        """
        return stage < self.num_stages - 1 and self.forwards(stage, iteration, fed)

    def sends_gradient(self, stage: int, iteration: int, fed: int) -> bool:
        """Whether ``stage`` sends an input gradient to ``stage - 1`` at ``iteration``: when it applies a batch."""
        return stage > 0 and self.applies(stage, iteration, fed)

    @property
    def drain_iterations(self) -> int:
        """Iterations without new input after the last batch until every stage applied it."""
        return max(self.update_lag(k) for k in range(self.num_stages)) if self.num_stages else 0
