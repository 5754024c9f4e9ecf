import torch
import torch.distributed as dist

from lightning_hier.comm import (
    CommStats,
    all_reduce_mean_,
    all_reduce_sum_async,
    broadcast_,
    broadcast_unless_equal_,
    gather_objects,
    wait_all,
)
from lightning_hier.testing import run_workers
from lightning_hier.topology import Topology


def _groups(pipe: int, model: int) -> dict:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    groups = Topology(world_size=4, pipe=pipe, model=model).build(rank)
    out = {}
    for dim in ("data", "pipe", "model"):
        t = torch.tensor([float(rank)])
        g = groups.group(dim)
        if g is not None:
            dist.all_reduce(t, group=g)
        out[dim] = t.item()
    out["neighbours"] = groups.pipe_neighbours()
    return out


def test_pipeline_groups_reduce_over_the_right_ranks():
    out = run_workers(_groups, 2, 1, devices=4)
    # data groups {0,2} {1,3}; pipeline groups {0,1} {2,3}
    assert [o["data"] for o in out] == [2.0, 4.0, 2.0, 4.0]
    assert [o["pipe"] for o in out] == [1.0, 1.0, 5.0, 5.0]
    assert [o["neighbours"] for o in out] == [(None, 1), (0, None), (None, 3), (2, None)]


def test_grid_groups_reduce_over_the_right_ranks():
    out = run_workers(_groups, 1, 2, devices=4)
    # MODEL groups {0,1} {2,3}; BATCH groups {0,2} {1,3}
    assert [o["model"] for o in out] == [1.0, 1.0, 5.0, 5.0]
    assert [o["data"] for o in out] == [2.0, 4.0, 2.0, 4.0]


def _collectives() -> dict:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    stats = CommStats()
    a = torch.full((4,), float(rank))
    all_reduce_mean_([a], dist.group.WORLD, stats)
    b = torch.full((2,), float(rank + 1))
    wait_all(all_reduce_sum_async([b], dist.group.WORLD, stats), stats)
    c = torch.full((3,), float(rank))
    broadcast_([c], src=1, group=dist.group.WORLD)
    gathered = gather_objects({"rank": rank}, dst=0, group=dist.group.WORLD)
    return {
        "mean": a.tolist(),
        "sum": b.tolist(),
        "bcast": c.tolist(),
        "gathered": gathered,
        "bytes": stats.bytes,
        "calls": stats.calls,
        "world": world,
    }


def test_collectives_and_accounting():
    out = run_workers(_collectives, devices=3)
    assert all(o["mean"] == [1.0] * 4 and o["sum"] == [6.0, 6.0] and o["bcast"] == [1.0] * 3 for o in out)
    assert out[0]["gathered"] == [{"rank": 0}, {"rank": 1}, {"rank": 2}] and out[1]["gathered"] is None
    assert out[0]["bytes"] == 4 * 4 + 2 * 4 and out[0]["calls"] == 2


def _start_states() -> dict:
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def state(differ: bool) -> list[torch.Tensor]:
        weights = torch.linspace(-1, 1, 7)
        if differ:  # one ulp in one element of rank 2's copy
            weights[3] = torch.nextafter(weights[3], torch.tensor(2.0))
        return [weights, torch.arange(5, dtype=torch.bfloat16), torch.tensor(float(rank == 1))]

    out = {}
    for case, differ in (("equal", False), ("one_ulp", rank == 2)):
        tensors = state(differ)
        tensors[2].fill_(1.0)  # a 0-dim buffer, equal on every rank
        sent = broadcast_unless_equal_(tensors, src=1, group=dist.group.WORLD)
        out[case] = (sent, [t.float().tolist() for t in tensors])
    return out


def test_the_start_up_broadcast_is_skipped_only_when_every_rank_already_holds_the_source_tensors():
    out = run_workers(_start_states, devices=3)
    expected = [torch.linspace(-1, 1, 7).tolist(), [0.0, 1.0, 2.0, 3.0, 4.0], 1.0]
    for o in out:
        assert o["equal"] == (False, expected)
        assert o["one_ulp"] == (True, expected)  # every rank sends or skips together, and ends equal


def test_no_group_means_nothing_to_do():
    t = torch.ones(2)
    all_reduce_mean_([t], None)
    assert gather_objects(5, group=None) == [5]
    assert torch.equal(t, torch.ones(2))
