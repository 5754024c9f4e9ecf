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
Only a batch's messages travel: a stage with no batch in an iteration (the pipeline's fill and
drain, :class:`~lightning_hier.algorithms.decoupled.Schedule`'s counters) neither computes nor
sends there.

An epoch (:func:`epoch_time`) is played from the empty pipeline to the end of its drain. The
period (:func:`iteration_period`) is the steady state's, of an endless stream of batches: stage 0's
mean iteration over the last :data:`WINDOW` of :data:`ITERATIONS`. A max-plus system like this one
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

from lightning_hier.algorithms.decoupled.schedule import Schedule

ITERATIONS, WINDOW = 480, 120


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

    The message of iteration ``i`` leaves when it is sent and the previous one has arrived; it
    arrives ``transfer_s`` later. An iteration may send none.
    """

    def __init__(self, transfer_s: float, locked: bool) -> None:
        self.transfer_s = transfer_s
        self.locked = locked
        self.arrivals: dict[int, float] = {}
        self._last = 0.0

    def send(self, iteration: int, at: float, carries: bool) -> float:
        """Send the message of ``iteration`` (if it ``carries`` one) at ``at``; returns when the sender goes on."""
        if not carries:
            return at
        at = max(at, self._last)  # the sender first waits for the last message
        self._last = self.arrivals[iteration] = at + self.transfer_s
        return self._last if self.locked else at

    def ready(self, iteration: int, at: float) -> float:
        """When a receiver there at ``at`` has the message of ``iteration`` (decoupled: the one before), if any."""
        arrival = self.arrivals.get(iteration if self.locked else iteration - 1)
        return at if arrival is None else max(at, arrival)


class _Pipeline:
    """The stages' clocks over the iterations of one run of ``batches`` batches (``None``: endless)."""

    def __init__(
        self,
        stages: Sequence[StageTimes],
        activations_s: Sequence[float],
        gradients_s: Sequence[float],
        schedule: str,
        order: str,
        batches: int | None,
    ) -> None:
        self.schedule = Schedule(schedule, len(stages), order)
        self.k_max = len(stages) - 1
        if len(activations_s) != self.k_max or len(gradients_s) != self.k_max:
            raise ValueError(f"pipeline: {len(stages)} stages need {self.k_max} transfer times each way.")
        self.stages, self.batches = stages, batches
        self.down = [_Direction(t, self.schedule.forward_locked) for t in activations_s]
        self.up = [_Direction(t, self.schedule.backward_locked) for t in gradients_s]
        self.ends = [0.0] * len(stages)

    def play(self, i: int) -> None:
        """Iteration ``i`` on every stage."""
        fed = i + 1 if self.batches is None else min(i + 1, self.batches)
        waiting = [k for k in range(self.k_max + 1) if not self._first_phase(k, i, fed)]
        for k in reversed(waiting):  # the delayed backwards, last stage first (sync needs this iteration's)
            self.ends[k] = self._backward(k, i, fed, self.ends[k])

    def _first_phase(self, k: int, i: int, fed: int) -> bool:
        """Stage ``k``'s iteration up to its forward's send; ``True`` if that is the whole iteration."""
        sch, work = self.schedule, self.stages[k]
        t = self.down[k - 1].ready(i, self.ends[k]) if k > 0 else self.ends[k]
        forward = work.forward_s if sch.forwards(k, i, fed) else 0.0
        if k == self.k_max:
            self.ends[k] = self.up[k - 1].send(i, t + forward, sch.sends_gradient(k, i, fed)) if k > 0 else t + forward
            return True
        if sch.backward_first:
            t = self._backward(k, i, fed, t)
            self.ends[k] = self.down[k].send(i, t + forward, sch.sends_activation(k, i, fed))
            return True
        self.ends[k] = self.down[k].send(i, t + forward, sch.sends_activation(k, i, fed))
        return False

    def _backward(self, k: int, i: int, fed: int, t: float) -> float:
        """Stage ``k``'s delayed backward from ``t`` (it waits for its gradient); returns when it sent its own."""
        sch = self.schedule
        t = self.up[k].ready(i, t) + (self.stages[k].backward_s if sch.applies(k, i, fed) else 0.0)
        return self.up[k - 1].send(i, t, sch.sends_gradient(k, i, fed)) if k > 0 else t


def iteration_period(
    stages: Sequence[StageTimes],
    activations_s: Sequence[float],
    gradients_s: Sequence[float],
    schedule: str = "fdg",
    order: str = "forward_first",
) -> float:
    """Steady seconds per iteration of the pipeline, fed an endless stream of batches.

    Args:
        stages: Each stage's work, in stage order.
        activations_s: Transfer time of the activation from stage ``k`` to ``k + 1`` (``K - 1`` values).
        gradients_s: Transfer time of the gradient from stage ``k + 1`` back to ``k`` (``K - 1`` values).
        schedule: ``'fdg'``, ``'ddg'`` or ``'sync'``.
        order: ``'forward_first'`` or ``'backward_first'`` (``fdg`` only).
    """
    pipe = _Pipeline(stages, activations_s, gradients_s, schedule, order, None)
    first: list[float] = []  # stage 0's iteration ends
    for i in range(ITERATIONS):
        pipe.play(i)
        first.append(pipe.ends[0])
    return (first[-1] - first[-1 - WINDOW]) / WINDOW


def epoch_time(
    stages: Sequence[StageTimes],
    activations_s: Sequence[float],
    gradients_s: Sequence[float],
    batches: int,
    schedule: str = "fdg",
    order: str = "forward_first",
    period_s: float | None = None,
) -> float:
    """Seconds of an epoch of ``batches`` batches: from the empty pipeline to the last stage's end of its drain.

    Its fill and drain iterations do only the work and send only the messages of the batches they
    hold. Beyond :data:`ITERATIONS` batches the steady state repeats, so the batches after those
    add :func:`iteration_period` each (``period_s``, if the caller has it already). Other arguments
    as :func:`iteration_period`.
    """
    if batches < 1:
        raise ValueError(f"epoch_time: `batches` must be >= 1, got {batches}.")
    played = min(batches, ITERATIONS)
    pipe = _Pipeline(stages, activations_s, gradients_s, schedule, order, played)
    for i in range(played + pipe.schedule.drain_iterations):
        pipe.play(i)
    rest = batches - played
    if rest and period_s is None:
        period_s = iteration_period(stages, activations_s, gradients_s, schedule, order)
    return max(pipe.ends) + rest * (period_s or 0.0)
