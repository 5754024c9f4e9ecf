"""The sample window of DBS x HPSGD / Local SGD, and what the composite strategies reject."""

from __future__ import annotations

from typing import Any

import pytest

from lightning_hier.algorithms.dbs_compose import SampleWindow
from lightning_hier.strategies import HPSGDStrategy
from lightning_hier.strategies.dbs_compose import SampleWeighted


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


class _TwoLevelHPSGD(HPSGDStrategy):
    """Stands for HPSGD with the two-level arguments of issue 20 (built on another branch)."""

    def __init__(self, inter_node_every: int | None = None, intra_node: str = "window", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.inter_node_every, self.intra_node = inter_node_every, intra_node


class _Composite(SampleWeighted, _TwoLevelHPSGD):
    pass


@pytest.mark.parametrize(("args", "shown"), [({"inter_node_every": 2}, "2"), ({"intra_node": "step"}, "'step'")])
def test_two_level_averaging_is_rejected_with_the_reason(args, shown):
    name = next(iter(args))
    with pytest.raises(ValueError, match=rf"_Composite: argument `{name}`={shown} is not supported with DBS shares"):
        _Composite(**args)
    _Composite()  # the flat defaults are fine
