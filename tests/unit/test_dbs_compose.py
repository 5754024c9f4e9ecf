"""The sample window of DBS x HPSGD / Local SGD, and which rules and allocations go together (one check)."""

from __future__ import annotations

import pytest

from lightning_hier.algorithms.dbs_compose import SampleWindow
from lightning_hier.strategies import (
    AsyncDBSStrategy,
    DBSHPSGDStrategy,
    DBSLocalSGDStrategy,
    DBSStrategy,
    HierStrategy,
)
from lightning_hier.sync import (
    AveragingSync,
    HPSGDSync,
    Levels,
    SampleWeights,
    SharedQueue,
    ShareWeightedGradients,
    SpeedShares,
)


def _window(steps: list[tuple[int, int]]) -> SampleWindow:
    window = SampleWindow()
    for own, total in steps:
        window.add(own, total)
    return window


def test_the_factors_of_all_ranks_average_to_one_and_equal_shares_give_exactly_one():
    split = [[18, 6], [12, 12], [7, 17]]  # a rank's batch over three steps, two ranks
    factors = [_window([(step[r], sum(step)) for step in split]).weight(2) for r in range(2)]
    assert factors == [2 * 37 / 72, 2 * 35 / 72]
    assert sum(factors) / 2 == pytest.approx(1.0, abs=1e-15)
    for world, size in [(2, 64), (3, 43), (4, 33), (7, 5)]:  # N / W samples each: 1.0, not 0.999...
        assert _window([(size, world * size)] * 5).weight(world) == 1.0
    assert SampleWindow().weight(4) == 1.0  # nothing counted yet: the plain mean


def test_the_window_restarts_and_round_trips_through_its_state():
    window = _window([(3, 8), (5, 8)])
    copy = SampleWindow()
    copy.load_state_dict(window.state_dict())
    assert (copy.own, copy.total) == (8, 16)
    window.reset()
    assert (window.own, window.total) == (0, 0)
    with pytest.raises(ValueError, match="SampleWindow: need 0 <= own <= total, got own=9, total=8"):
        window.add(9, 8)


def _shares() -> tuple[SpeedShares, SampleWeights]:
    shares = SpeedShares()
    return shares, SampleWeights(shares)


def test_two_level_windows_are_refused_with_dbs_shares_and_the_reason():
    shares, weights = _shares()
    sync = HPSGDSync(levels=Levels("X", inter_node_every=2), weights=weights)
    with pytest.raises(ValueError, match=r"HierStrategy: argument `inter_node_every`=2 is not supported with DBS"):
        HierStrategy(sync=sync, allocation=shares)
    HierStrategy(sync=HPSGDSync(weights=weights), allocation=shares)  # the flat rule is fine


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda w: AveragingSync.grawa(weights=w), "Local SGD's uniform center only"),
        (lambda w: AveragingSync.easgd(weights=w), "EASGD's elastic force is symmetric"),
        (lambda w: HPSGDSync(), "would weigh a slow rank's few samples like a fast rank's many"),
        (lambda w: AveragingSync.localsgd(), "would weigh a slow rank's few samples like a fast rank's many"),
    ],
)
def test_rules_without_sample_weights_are_refused_with_dbs_shares(make, reason):
    shares, weights = _shares()
    with pytest.raises(ValueError, match=reason):
        HierStrategy(sync=make(weights), allocation=shares)


def test_a_weighted_rule_needs_the_shares_and_a_shared_queue_needs_a_rule_that_runs_apart():
    shares, weights = _shares()
    with pytest.raises(ValueError, match="weighs each rank by its DBS batch share, but the allocation is Allocation"):
        HierStrategy(sync=HPSGDSync(weights=weights))
    with pytest.raises(ValueError, match="weighs each rank by its DBS batch share"):
        HierStrategy(sync=ShareWeightedGradients(shares))
    rounds = AveragingSync.localsgd()
    with pytest.raises(ValueError, match="meets every rank in lock-step collectives"):
        HierStrategy(sync=rounds, allocation=SharedQueue(rounds))
    async_rounds = AveragingSync.grawa(rounds="async")
    HierStrategy(sync=async_rounds, allocation=SharedQueue(async_rounds))


def test_every_registered_dbs_composition_passes_the_check():
    for cls in (DBSStrategy, DBSHPSGDStrategy, DBSLocalSGDStrategy, AsyncDBSStrategy):
        strategy = cls()
        assert isinstance(strategy.allocation, SpeedShares)
