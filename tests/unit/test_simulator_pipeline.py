"""The pipeline's event model against the closed forms of two stages (derived by hand, see below)."""

from __future__ import annotations

import random

import pytest

from lightning_hier.simulator.pipeline import ITERATIONS, StageTimes, epoch_time, iteration_period

# Two stages, C_k a stage's compute, L_a / L_g the activation's / gradient's transfer. Stage 1
# sends the gradient C_1 after it took the activation; stage 0 waits for it:
# - forward first: before its backward, one iteration after the forward that follows the one it
#   answers, so a round trip may span 3 iterations;
# - backward first (FDG's order): at the start of the next iteration, so it may span 2;
# - ddg: the activation is locked (stage 0's send blocks until it arrived), the gradient spans 2;
# - sync: the round trip is the iteration.
CLOSED_FORMS = {
    ("fdg", "forward_first"): lambda c0, c1, la, lg: max(c0, c1, la, lg, (c0 + c1 + la + lg) / 3),
    ("fdg", "backward_first"): lambda c0, c1, la, lg: max(c0, c1, la, lg, (c0 + c1 + la + lg) / 2),
    ("ddg", "forward_first"): lambda c0, c1, la, lg: max(c0 + la, c1, lg, (c0 + c1 + la + lg) / 2),
    ("sync", "forward_first"): lambda c0, c1, la, lg: c0 + c1 + la + lg,
}


@pytest.mark.parametrize(("schedule", "order"), list(CLOSED_FORMS))
def test_two_stages_match_the_closed_form(schedule: str, order: str) -> None:
    rng = random.Random(7)
    for _ in range(300):
        forward, backward, last, la, lg = (rng.uniform(0.01, 1.0) for _ in range(5))
        got = iteration_period([StageTimes(forward, backward), StageTimes(last)], [la], [lg], schedule, order)
        assert got == pytest.approx(CLOSED_FORMS[schedule, order](forward + backward, last, la, lg), rel=1e-9)


def test_free_links_run_at_the_slowest_stage() -> None:
    stages = [StageTimes(0.1, 0.2), StageTimes(0.15, 0.3), StageTimes(0.25)]
    for order in ("forward_first", "backward_first"):
        assert iteration_period(stages, [0.0, 0.0], [0.0, 0.0], "fdg", order) == pytest.approx(0.45)
    assert iteration_period(stages, [0.0, 0.0], [0.0, 0.0], "sync") == pytest.approx(1.0)


def test_a_link_slower_than_every_stage_paces_the_pipeline() -> None:
    """One message per direction per iteration: the slowest direction bounds the period from below."""
    stages = [StageTimes(0.01, 0.01), StageTimes(0.01, 0.01), StageTimes(0.01)]
    assert iteration_period(stages, [0.01, 5.0], [0.01, 0.01]) == pytest.approx(5.0)


def test_bad_arguments_are_named() -> None:
    two = [StageTimes(0.1, 0.1), StageTimes(0.1)]
    with pytest.raises(ValueError, match=r"`name` must be one of 'fdg', 'ddg', 'sync', got 'gpipe'"):
        iteration_period(two, [0.1], [0.1], "gpipe")
    with pytest.raises(ValueError, match=r"order='backward_first' \(FDG's order\) needs schedule 'fdg', got 'sync'"):
        iteration_period(two, [0.1], [0.1], "sync", "backward_first")
    with pytest.raises(ValueError, match=r"2 stages need 1 transfer times each way"):
        iteration_period(two, [0.1, 0.1], [0.1])


@pytest.mark.parametrize("batches", [1, 5, 40])
def test_a_locked_pipeline_runs_its_epoch_one_batch_at_a_time(batches: int) -> None:
    """sync has no fill or drain: every batch crosses both stages and both links in its own iteration."""
    stages = [StageTimes(0.1, 0.2), StageTimes(0.3)]
    assert epoch_time(stages, [0.05], [0.07], batches, "sync") == pytest.approx(batches * 0.72)


def test_one_stage_is_its_compute() -> None:
    assert epoch_time([StageTimes(0.25)], [], [], 12) == pytest.approx(3.0)


@pytest.mark.parametrize("batches", [1, 3, 12])
def test_on_a_slow_link_the_epoch_is_its_messages_and_the_last_gradient(batches: int) -> None:
    """Links of L, compute negligible: activation ``b`` arrives at ``(b + 1) L``, its gradient leaves then and
    arrives one ``L`` later; no message travels in the fill or the drain, so the epoch is ``(B + 1) L``
    (a steady iteration of ``L`` over the ``B + 2`` iterations would give ``(B + 2) L``)."""
    eps, link = 1e-9, 0.5
    stages = [StageTimes(eps, eps), StageTimes(eps)]
    assert epoch_time(stages, [link], [link], batches) == pytest.approx((batches + 1) * link, abs=1e-6)


@pytest.mark.parametrize(("schedule", "order"), list(CLOSED_FORMS))
def test_each_further_batch_adds_one_steady_iteration(schedule: str, order: str) -> None:
    stages = [StageTimes(0.12, 0.08), StageTimes(0.1, 0.05), StageTimes(0.17)]
    args = (stages, [0.3, 0.02], [0.01, 0.25])
    added = (epoch_time(*args, 300, schedule, order) - epoch_time(*args, 200, schedule, order)) / 100
    assert added == pytest.approx(iteration_period(*args, schedule, order), rel=1e-9)
    beyond = epoch_time(*args, 2 * ITERATIONS, schedule, order) - epoch_time(*args, ITERATIONS, schedule, order)
    assert beyond / ITERATIONS == pytest.approx(added, rel=1e-9)
