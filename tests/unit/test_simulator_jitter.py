"""Jitter: the expected wait for the slowest worker at each synchronisation, in closed form."""

import itertools
import math

import pytest

from lightning_hier.planner import Link
from lightning_hier.simulator import Cluster, Workload, predict
from lightning_hier.simulator.jitter import expected_max_normal, gini_sigma, sync_wait

FREE = Link(alpha=0.0, beta=0.0)
SIGMA = 0.05
COMPUTE = 32 * 3e-3 + 0.01  # the workload's seconds per step


def _workload() -> Workload:
    return Workload(
        "w", params=1000, batch_size=32, samples_per_epoch=32 * 2 * 10, forward_s=1e-3, backward_s=2e-3, step_s=0.01
    )


def test_expected_max_of_standard_normals_matches_its_closed_forms():
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-9)
    assert expected_max_normal(3) == pytest.approx(3 / (2 * math.sqrt(math.pi)), rel=1e-9)
    # E[max of 4] = 6 / (pi sqrt(pi)) * atan(sqrt(2)) (Bose and Gupta, 1959)
    assert expected_max_normal(4) == pytest.approx(6 / math.pi**1.5 * math.atan(math.sqrt(2)), rel=1e-9)
    assert expected_max_normal(1024) == pytest.approx(3.2, abs=0.05)


def test_gini_sigma_makes_the_two_worker_wait_exact_for_any_distribution():
    samples = [0.2, 0.21, 0.25, 0.9, 0.22, 0.3]  # one preempted step: a heavy tail
    pairs = list(itertools.permutations(samples, 2))
    wait = sum(max(a, b) for a, b in pairs) / len(pairs) - sum(samples) / len(samples)
    assert gini_sigma(samples) * expected_max_normal(2) == pytest.approx(wait, rel=1e-12)
    assert gini_sigma([0.0, 1.0]) == pytest.approx(math.sqrt(math.pi) / 2)
    assert gini_sigma([0.3]) == 0.0


@pytest.mark.parametrize(
    ("strategy", "args", "period"),
    [
        ("ddp", {}, 1),
        ("dbs", {}, 1),
        ("hpsgd", {"window": 4}, 4),
        ("localsgd", {"tau": 8}, 8),
        ("mgrawa", {"tau": 32, "probe": "step"}, 32),
    ],
)
def test_every_synchronisation_waits_sigma_sqrt_period_m_w(strategy, args, period):
    w, c = _workload(), Cluster(2, FREE, jitter_s=SIGMA)
    p = predict(strategy, w, c, **args)
    wait = SIGMA * math.sqrt(period) / math.sqrt(math.pi) / period
    assert p.step_s == pytest.approx(COMPUTE + wait, rel=1e-9)
    assert p.blocked_s == pytest.approx(wait, rel=1e-9)


def test_nobody_waits_without_synchronisation_or_without_jitter():
    assert predict("no-comm", _workload(), Cluster(2, FREE, jitter_s=SIGMA)).step_s == pytest.approx(COMPUTE)
    assert predict("ddp", _workload(), Cluster(2, FREE)).step_s == pytest.approx(COMPUTE)
    assert sync_wait(Cluster(1, FREE, jitter_s=SIGMA), 1) == 0.0


def test_a_negative_jitter_is_refused_by_name():
    with pytest.raises(ValueError, match=r"Cluster: `jitter_s` must be >= 0 seconds, got -0.1"):
        Cluster(2, FREE, jitter_s=-0.1)
