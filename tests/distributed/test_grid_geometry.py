"""Domain parallelism on the paper's own geometry, against the unsharded network (gloo, fp64).

AlexNet's 11x11/4 first convolution and overlapping 3x3/2 max-pools on 227 and 224 rows, and a
torchvision-style ResNet stem (7x7/2 convolution with padding 3, 3x3/2 max-pool with padding 1):
uneven slabs, strides larger than the halo, windows reaching past the neighbouring slab and empty
slabs (13 rows on Pr = 4 hold 4, 3, 3, 3; a 1x1 output on Pr = 4 leaves three ranks without rows).
Each check trains two SGD steps and compares the output, the loss and every reduced gradient at
each step, then the parameters; the bytes each rank sends equal the planner's exact count. One
worker launch per grid runs every network.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_hier.layers import GradientReducer, GridContext, full_state_dict, to_grid
from lightning_hier.models import small_cnn
from lightning_hier.testing import run_workers
from tests.distributed.test_grid_layers import TOL, _bytes, _grad_errors, _grid, _max

GRIDS = [(2, 1), (4, 1), (2, 2), (1, 4)]


def _alexnet(padding: int) -> nn.Sequential:
    """AlexNet's geometry at a width of a few channels (torchvision's layout; conv1 padding 0 as Caffe on 227)."""
    return nn.Sequential(
        nn.Conv2d(3, 4, 11, stride=4, padding=padding), nn.ReLU(), nn.MaxPool2d(3, 2),
        nn.Conv2d(4, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(3, 2),
        nn.Conv2d(6, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 5, 3, padding=1), nn.ReLU(),
        nn.Conv2d(5, 5, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2),
        nn.Flatten(), nn.Linear(5 * 6 * 6, 12), nn.ReLU(), nn.Linear(12, 5),
    )  # fmt: skip


def _resnet_stem() -> nn.Sequential:
    """torchvision ResNet's stem and a basic convolution, then global pooling and a classifier."""
    return nn.Sequential(
        nn.Conv2d(3, 4, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
        nn.MaxPool2d(3, stride=2, padding=1),
        nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
        nn.AvgPool2d(3, stride=2, padding=1), nn.Conv2d(4, 6, 3, stride=2, padding=1),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 5),
    )  # fmt: skip


def _train(g: GridContext, name: str, ref: nn.Module, shape: tuple[int, ...], b: int) -> dict[str, float]:
    """Two SGD (momentum) steps on batch blocks of ``b`` samples, checked at every step."""
    net = to_grid(copy.deepcopy(ref), g, torch.zeros(1, *shape))
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    reducer = GradientReducer(net, g)
    errs: dict[str, float] = {}
    for step in range(2):
        x, y = torch.randn(b * g.pc, *shape), torch.randint(0, 5, (b * g.pc,))
        opt_ref.zero_grad()
        outs = [ref(xb) for xb in x.split(b)]
        losses = [F.cross_entropy(o, yb) for o, yb in zip(outs, y.split(b), strict=True)]
        sum(losses).div(g.pc).backward()  # the data-parallel mean of the per-block losses
        opt.zero_grad()
        out = net(x[g.c * b : (g.c + 1) * b])
        loss = F.cross_entropy(out, y[g.c * b : (g.c + 1) * b])
        loss.backward()
        reducer.reduce()
        errs[f"{name} step {step} out"] = _max(out, outs[g.c])
        errs[f"{name} step {step} loss"] = abs(float(loss - losses[g.c]))
        errs |= _grad_errors(net, ref, g, f"{name} step {step}")
        opt_ref.step()
        opt.step()
    full = full_state_dict(net)
    return errs | {f"{name} sgd {n}": _max(full[n], p) for n, p in ref.named_parameters()}


def _paper_geometry(pr: int) -> dict[str, float]:
    g = _grid(pr)
    torch.manual_seed(0)
    errs = _train(g, "alexnet 227", _alexnet(0), (3, 227, 227), 2)
    errs |= _train(g, "alexnet 224", _alexnet(2), (3, 224, 224), 2)
    errs |= _train(g, "resnet stem", _resnet_stem(), (3, 64, 64), 2)
    errs |= _train(g, "resnet stem odd", _resnet_stem(), (3, 37, 40), 2)
    # the planner's exact counts come from the same row plans: measured bytes equal predicted words
    return errs | _bytes(g, _alexnet(0), (3, 227, 227)) | _bytes(g, _resnet_stem(), (3, 37, 40))


@pytest.mark.parametrize(("pr", "pc"), GRIDS, ids=[f"{pr}x{pc}" for pr, pc in GRIDS])
def test_alexnet_and_resnet_stem_geometry_equal_the_unsharded_network(pr, pc):
    for rank, errs in enumerate(run_workers(_paper_geometry, pr, devices=pr * pc, timeout=240)):
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"rank {rank} on grid {pr}x{pc}: {bad}"
        assert len(errs) > 100  # every network and step ran


def _small_cnn_mnist(pr: int, b: int) -> dict[str, float]:
    g = _grid(pr)
    torch.manual_seed(1)
    return _train(g, "small_cnn 28", small_cnn((1, 28, 28), 5, channels=(4, 6), hidden=16), (1, 28, 28), b)


def test_small_cnn_on_28x28_runs_on_two_slabs():
    """28 -> 14 -> 7 rows: the second pooling's 14 rows split 7 + 7, the 7 rows after it 4 + 3."""
    for rank, errs in enumerate(run_workers(_small_cnn_mnist, 2, 3, devices=2, timeout=120)):
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"rank {rank}: {bad}"


def test_more_processes_than_samples_match_single_process_training():
    """A global batch of 2 on 4 processes (a 2 x 2 grid): one sample per batch block, split in two slabs.

    Pure batch parallelism cannot use more processes than samples; the grid trains exactly as one process.
    """
    for rank, errs in enumerate(run_workers(_small_cnn_mnist, 2, 1, devices=4, timeout=120)):
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"rank {rank}: {bad}"
        assert len(errs) > 20
