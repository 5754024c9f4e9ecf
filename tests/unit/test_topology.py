import pytest

from lightning_hier.topology import Topology, factorizations


def test_data_parallel_layout_is_the_world():
    topo = Topology(world_size=4)
    assert topo.data == 4
    assert topo.group_ranks("data", 2) == [0, 1, 2, 3]
    assert topo.all_groups("pipe") == [[0], [1], [2], [3]]


def test_pipeline_layout_places_stages_of_a_replica_on_consecutive_ranks():
    # rank(d, k) = d * K + k (docs/algorithms.md, section 3)
    topo = Topology(world_size=4, pipe=2)
    assert [topo.coords(r) for r in range(4)] == [
        topo.coords(topo.rank_of(data=d, pipe=k)) for d in range(2) for k in range(2)
    ]
    assert topo.rank_of(data=1, pipe=0) == 2
    assert topo.group_ranks("pipe", 3) == [2, 3]  # the pipeline of replica 1
    assert topo.all_groups("data") == [[0, 2], [1, 3]]  # data-parallel group of each stage


def test_grid_layout_is_model_major_inside_batch():
    # rank = c * Pr + r (docs/algorithms.md, section 5): MODEL groups are consecutive ranks
    topo = Topology(world_size=8, model=4)
    assert topo.data == 2
    c = topo.coords(6)
    assert (c.data, c.model) == (1, 2)
    assert topo.all_groups("model") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert topo.all_groups("data") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_node_groups_are_contiguous_blocks():
    assert Topology(world_size=4, num_nodes=2).node_groups() == [[0, 1], [2, 3]]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world_size": 6, "pipe": 4}, "not divisible by pipe x model"),
        ({"world_size": 0}, "world_size"),
        ({"world_size": 4, "pipe": 0}, "`pipe` must be an integer >= 1, got 0"),
        ({"world_size": 5, "num_nodes": 2}, "num_nodes"),
        ({"world_size": 2, "model": True}, "`model`"),
    ],
)
def test_invalid_layouts_are_rejected_with_the_bad_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Topology(**kwargs)


def test_rank_out_of_range():
    with pytest.raises(ValueError, match="rank 4 out of range"):
        Topology(world_size=4).coords(4)


def test_describe_is_plain():
    assert Topology(world_size=4, pipe=2).describe() == {
        "world_size": 4,
        "data": 2,
        "pipe": 2,
        "model": 1,
        "num_nodes": 1,
    }


def test_factorizations():
    assert factorizations(8) == [(1, 8), (2, 4), (4, 2), (8, 1)]


def test_two_level_data_groups_split_the_data_dimension_by_node():
    topo = Topology(world_size=8, num_nodes=2)
    assert topo.data_per_node == 4
    assert topo.data_level_groups("intra") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert topo.data_level_groups("inter") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_two_level_groups_keep_pipeline_and_grid_inner_dimensions_inside_a_node():
    # 2 nodes x 4 ranks, K=2 stages: replicas 0,1 on node 0 and 2,3 on node 1
    topo = Topology(world_size=8, pipe=2, num_nodes=2)
    assert topo.data_level_groups("intra") == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert topo.data_level_groups("inter") == [[0, 4], [2, 6], [1, 5], [3, 7]]
    grid = Topology(world_size=8, model=2, num_nodes=2)
    assert grid.data_level_groups("intra") == [[0, 2], [4, 6], [1, 3], [5, 7]]


def test_every_intra_then_inter_pair_covers_the_data_group_once():
    topo = Topology(world_size=12, model=2, num_nodes=3)
    for line in topo.all_groups("data"):
        intra = [g for g in topo.data_level_groups("intra") if g[0] in line]
        inter = [g for g in topo.data_level_groups("inter") if g[0] in line]
        assert sorted(r for g in intra for r in g) == line == sorted(r for g in inter for r in g)
        assert {len(g) for g in intra} == {topo.data_per_node} and {len(g) for g in inter} == {3}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world_size": 4}, r"one node \(num_nodes=1\)"),
        ({"world_size": 4, "pipe": 4, "num_nodes": 2}, "pipe x model = 4 ranks do not fit in the 2 ranks of a node"),
    ],
)
def test_two_level_groups_name_why_they_cannot_exist(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Topology(**kwargs).data_level_groups("intra")
