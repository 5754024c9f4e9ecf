"""The two-level schedule and argument checks (no processes)."""

import pytest

from lightning_hier import EasgdStrategy, GrawaStrategy, HPSGDStrategy, LocalSGDStrategy, LsgdStrategy
from lightning_hier.algorithms.two_level import TwoLevel, two_level_problem
from lightning_hier.topology import Topology


@pytest.mark.parametrize(
    ("every", "across"), [(1, [1, 1, 1, 1, 1, 1]), (2, [0, 1, 0, 1, 0, 1]), (3, [0, 0, 1, 0, 0, 1])]
)
def test_every_m_th_synchronisation_reaches_across_nodes(every, across):
    levels = TwoLevel(None, None, every)
    assert [int(levels.reaches_across(k)) for k in range(6)] == across


@pytest.mark.parametrize("every", [0, -1, 1.5, True])
def test_a_bad_period_is_rejected(every):
    with pytest.raises(ValueError, match="TwoLevel: argument `every` must be an integer >= 1"):
        TwoLevel(None, None, every)


def test_the_problem_names_the_reason():
    assert two_level_problem(None, "window", 1, None) is None
    assert two_level_problem(2, "step", 2, Topology(world_size=4, num_nodes=2).two_level_problem()) is None
    assert "num_nodes > 1" in (two_level_problem(2, "window", 1, "the job has one node (num_nodes=1)") or "")
    # a replica of 4 pipeline stages does not fit in a node of 2 ranks
    layout = Topology(world_size=8, pipe=4, num_nodes=4).two_level_problem()
    assert "cannot split into node levels: a replica's pipe x model = 4 ranks" in (
        two_level_problem(2, "window", 4, layout) or ""
    )


@pytest.mark.parametrize("cls", [HPSGDStrategy, LocalSGDStrategy, GrawaStrategy])
def test_the_arguments_are_kept(cls):
    levels = cls(inter_node_every=3, intra_node="step").sync.levels
    assert (levels.inter_node_every, levels.intra_node, levels.enabled) == (3, "step", True)
    assert not cls().sync.levels.enabled


@pytest.mark.parametrize("cls", [EasgdStrategy, LsgdStrategy])
def test_easgd_and_lsgd_say_why_they_have_no_two_levels(cls):
    with pytest.raises(
        ValueError, match=rf"{cls.__name__}: argument `inter_node_every`=2 is not offered: .* not defined"
    ):
        cls(inter_node_every=2)
