"""two_level_mean_: the mean over the data dimension in two levels, each rank carrying a chunk across nodes."""

import pytest
import torch
import torch.distributed as dist

from lightning_hier.comm import CommStats
from lightning_hier.comm.two_level import two_level_mean_
from lightning_hier.testing import run_workers
from lightning_hier.topology import Topology

SIZES = (7, 1, 10)  # 7 and 1 do not split evenly over a node's 2 or 4 ranks: padded chunks


def _values(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(700 + rank)
    return [torch.randn(n, generator=g, dtype=torch.float64) for n in SIZES]


def _mean(devices: int, nodes: int) -> dict:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    groups = Topology(world_size=devices * nodes, num_nodes=nodes).build(rank)
    tensors, stats = _values(rank), CommStats()
    two_level_mean_(tensors, groups.data_intra, groups.data_inter, stats)
    return {"tensors": tensors, "bytes": stats.bytes}


@pytest.mark.parametrize(("devices", "nodes"), [(2, 2), (4, 2), (1, 4)])
def test_equals_the_flat_mean_on_every_rank(devices, nodes):
    world = devices * nodes
    out = run_workers(_mean, devices, nodes, devices=devices, num_nodes=nodes)
    everyone = [_values(r) for r in range(world)]
    for got in out:
        for i, t in enumerate(got["tensors"]):
            want = torch.stack([v[i] for v in everyone]).mean(0)
            torch.testing.assert_close(t, want, atol=1e-12, rtol=0)
            assert torch.equal(t, out[0]["tensors"][i])  # the same bits on every rank
    if devices > 1:  # what crosses nodes per rank: a padded chunk of each tensor, not the whole tensor
        chunks = sum(-(-n // devices) for n in SIZES) * 8
        assert out[0]["bytes"] == sum(SIZES) * 8 + 2 * chunks  # node mean, chunk across, chunk gathered
