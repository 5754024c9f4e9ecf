"""The lock-step decoupled pipeline's iteration, played out event by event.

Stage ``k`` of ``K`` runs one iteration per step (:mod:`lightning_hier.algorithms.decoupled`):
its forward, the activation sent to stage ``k + 1``, the delayed backward of the oldest batch in
flight (with its update and data-parallel mean) and the activation gradient sent to stage
``k - 1``; the last stage runs forward and backward at once and sends the gradient. FDG's order
(``backward_first``) runs the delayed backward before the forward. A message of a *decoupled*
direction is used one iteration after it was sent (activations for ``fdg``; gradients for ``fdg``
and ``ddg``), a *locked* one within the iteration (``sync`` both, ``ddg`` the activations).

Each direction of a boundary is its own connection (the pipeline sends activations and their
gradients on two process groups), carrying one message at a time: a message leaves when it is
sent and the previous one on the same direction has arrived (the sender waits for that before
it reuses the link's buffer), and arrives its transfer time later. A locked send is blocking.

The iterations are played from the first; the period is the steady state's: stage 0's mean
iteration over the last :data:`WINDOW` of :data:`ITERATIONS`. A max-plus system like this one
becomes periodic after a transient, with a cycle of a few iterations that divides the window, so
the mean is exact to round-off once the transient is over.

For two stages (``C`` a stage's compute, ``L`` a transfer each way) this gives
``T = max(C_0, C_1, L_a, L_g, (C_0 + C_1 + L_a + L_g) / n)``: one round trip of the activation
and its gradient may span ``n`` iterations. ``n = 3`` with the forward first (stage 0 needs the
gradient only after its next forward) and ``n = 2`` with the backward first (before it). For
``sync`` the round trip is the iteration: ``T = C_0 + C_1 + L_a + L_g``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

ORDERS = ("forward_first", "backward_first")
ITERATIONS, WINDOW = 480, 120
SCHEDULES = ("fdg", "ddg", "sync")


@dataclass(frozen=True)
class StageTimes:
    """One stage's work per iteration.

    Attributes:
        forward_s: The forward, up to sending the activation (the last stage: forward, backward
            and update, up to sending the gradient).
        backward_s: The delayed backward, update and data-parallel mean (0 on the last stage).
    """

    forward_s: float
    backward_s: float = 0.0


class _Direction:
    """One connection, one message at a time.

    Message ``i`` leaves when it is sent and message ``i - 1`` has arrived; it arrives
    ``transfer_s`` later.
    """

    def __init__(self, transfer_s: float, locked: bool) -> None:
        self.transfer_s = transfer_s
        self.locked = locked
        self.arrivals: list[float] = []

    def send(self, at: float) -> float:
        """Send the next message at ``at``; returns when the sender goes on (it first waits for the last one)."""
        if self.arrivals:
            at = max(at, self.arrivals[-1])
        self.arrivals.append(at + self.transfer_s)
        return self.arrivals[-1] if self.locked else at

    def ready(self, iteration: int, at: float) -> float:
        """When a receiver there at ``at`` has the message of ``iteration`` (decoupled: the one before)."""
        sent = iteration if self.locked else iteration - 1
        return max(at, self.arrivals[sent]) if sent >= 0 else at


def iteration_period(
    stages: Sequence[StageTimes],
    activations_s: Sequence[float],
    gradients_s: Sequence[float],
    schedule: str = "fdg",
    order: str = "forward_first",
) -> float:
    """Steady seconds per iteration of the pipeline.

    Args:
        stages: Each stage's work, in stage order.
        activations_s: Transfer time of the activation from stage ``k`` to ``k + 1`` (``K - 1`` values).
        gradients_s: Transfer time of the gradient from stage ``k + 1`` back to ``k`` (``K - 1`` values).
        schedule: ``'fdg'``, ``'ddg'`` or ``'sync'``.
        order: ``'forward_first'`` or ``'backward_first'`` (``fdg`` only).
    """
    if schedule not in SCHEDULES or order not in ORDERS:
        raise ValueError(f"iteration_period: schedule {schedule!r} / order {order!r} not in {SCHEDULES} / {ORDERS}.")
    if order == "backward_first" and schedule != "fdg":
        raise ValueError(f"iteration_period: order 'backward_first' needs schedule 'fdg', got {schedule!r}.")
    k_max = len(stages) - 1
    if len(activations_s) != k_max or len(gradients_s) != k_max:
        raise ValueError(f"iteration_period: {len(stages)} stages need {k_max} transfer times each way.")
    down = [_Direction(t, schedule != "fdg") for t in activations_s]
    up = [_Direction(t, schedule == "sync") for t in gradients_s]
    ends = [0.0] * len(stages)
    first: list[float] = []  # stage 0's iteration ends
    for i in range(ITERATIONS):
        waiting = []
        for k in range(k_max + 1):  # up to each forward's send, first stage first
            if not _first_phase(k, k_max, order, ends, stages, down, up, i):
                waiting.append(k)
        for k in reversed(waiting):  # the delayed backwards, last stage first (sync needs this iteration's)
            ends[k] = _second_phase(k, ends[k], stages[k], down, up, i)
        first.append(ends[0])
    return (first[-1] - first[-1 - WINDOW]) / WINDOW


def _first_phase(
    k: int,
    k_max: int,
    order: str,
    ends: list[float],
    stages: Sequence[StageTimes],
    down: list[_Direction],
    up: list[_Direction],
    i: int,
) -> bool:
    """Stage ``k``'s iteration up to its forward's send; ``True`` if that is the whole iteration."""
    t = down[k - 1].ready(i, ends[k]) if k > 0 else ends[k]
    work = stages[k]
    if k == k_max:
        t += work.forward_s
        ends[k] = up[k - 1].send(t) if k > 0 else t
        return True
    if order == "backward_first":
        t = up[k].ready(i, t) + work.backward_s
        t = up[k - 1].send(t) if k > 0 else t
        ends[k] = down[k].send(t + work.forward_s)
        return True
    ends[k] = down[k].send(t + work.forward_s)
    return False


def _second_phase(k: int, t: float, work: StageTimes, down: list[_Direction], up: list[_Direction], i: int) -> float:
    """The delayed backward of stage ``k`` (forward first) from ``t``; returns when its iteration ends."""
    t = up[k].ready(i, t) + work.backward_s
    return up[k - 1].send(t) if k > 0 else t
