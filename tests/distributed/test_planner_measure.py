"""Alpha and beta measured on live gloo groups: positive, and the same on every rank (no timing asserts)."""

import pytest
import torch.distributed as dist

from lightning_hier.planner import Link, Links, measure_link, measure_links
from lightning_hier.testing import run_workers


def _measure() -> tuple[Link, Links, Links]:
    dist.init_process_group("gloo")
    whole = measure_link(None, large_words=1 << 14, repeats=2)
    links = measure_links(num_nodes=2)
    return whole, links(2, 2), links(4, 1)


def test_links_are_positive_and_agreed_by_every_rank():
    out = run_workers(_measure, devices=2, num_nodes=2)
    assert all(r == out[0] for r in out)  # every rank must pick the same grid
    whole, grid_2x2, grid_4x1 = out[0]
    assert all(link.alpha > 0 and link.beta > 0 for link in (whole, grid_2x2.model, grid_4x1.model))
    intra, inter = grid_2x2.model, grid_2x2.batch  # MODEL groups of 2 stay inside a node of 2 ranks
    assert grid_4x1.model == grid_4x1.grid == inter  # a MODEL group of 4 crosses nodes
    assert intra is not inter


def test_a_single_rank_has_nothing_to_measure():
    def one() -> None:
        dist.init_process_group("gloo")
        measure_link(None)

    with pytest.raises(Exception, match="single rank"):
        run_workers(one, devices=1)
