"""DBS under real gloo groups: with any split, a step equals single-process SGD on the whole batch."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_hier.algorithms.dbs import DynamicBatchSize
from lightning_hier.comm import CommStats
from lightning_hier.testing import run_workers

B, LR = 24, 0.3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3), nn.Linear(3, 3))


def _batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _dbs_steps(sizes: list[int], micro: int, steps: int) -> dict:
    """``steps`` SGD steps of ``micro`` micro-batches each; rank r takes its slice of every global batch."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = _model()
    model[2].weight.requires_grad_(False)  # frozen parameters are left out of the reduction
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    stats = CommStats()
    dbs = DynamicBatchSize(model.parameters(), dist.group.WORLD, stats=stats)
    alloc = dbs.bind(B)
    alloc.update(sizes, 0)
    offset = sum(sizes[:rank])
    for step in range(steps):
        for m in range(micro):
            x, y = _batch(B, seed=100 * step + m)
            alloc.draw()
            dbs.begin_micro_batch()
            sl = slice(offset, offset + sizes[rank])
            # like Lightning: each micro-batch's mean loss is divided by the accumulation factor
            (nn.functional.cross_entropy(model(x[sl]), y[sl]) / micro).backward()
        dbs.reduce_gradients()
        opt.step()
        opt.zero_grad()
        dbs.end_step()
    return {"params": _params(model), "bytes": stats.bytes}


def _reference(micro: int, steps: int) -> torch.Tensor:
    model = _model()
    model[2].weight.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step in range(steps):
        for m in range(micro):
            x, y = _batch(B, seed=100 * step + m)
            (nn.functional.cross_entropy(model(x), y) / micro).backward()
        opt.step()
        opt.zero_grad()
    return _params(model)


@pytest.mark.parametrize(
    ("sizes", "micro"),
    [([5, 19], 1), ([13, 11], 2), ([1, 7, 3, 13], 1), ([6, 6, 2, 10], 2)],
)
def test_any_split_equals_single_process_sgd_on_the_concatenated_batch(sizes, micro):
    out = run_workers(_dbs_steps, sizes, micro, 3, devices=len(sizes), timeout=60)
    ref = _reference(micro, 3)
    for o in out:
        torch.testing.assert_close(o["params"], ref, atol=1e-6, rtol=0)
        assert torch.equal(o["params"], out[0]["params"])
    trainable = sum(p.numel() for p in _model().parameters()) - 16 * 3  # all but the frozen weight
    assert out[0]["bytes"] == 3 * trainable * 4  # one fp32 all-reduce of the gradients per step


def _unweighted_mean_is_wrong(sizes: list[int]) -> torch.Tensor:
    """What plain gradient averaging (DDP's rule) would give with unequal batches."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = _model()
    x, y = _batch(B, seed=0)
    offset = sum(sizes[:rank])
    sl = slice(offset, offset + sizes[rank])
    nn.functional.cross_entropy(model(x[sl]), y[sl]).backward()
    grads = [p.grad for p in model.parameters()]
    for g in grads:
        dist.all_reduce(g)
        g /= len(sizes)
    return torch.cat([g.reshape(-1) for g in grads])


def test_the_weighting_matters():
    plain = run_workers(_unweighted_mean_is_wrong, [5, 19], devices=2)[0]
    model = _model()
    x, y = _batch(B, seed=0)
    nn.functional.cross_entropy(model(x), y).backward()
    full = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert (plain - full).abs().max() > 1e-3  # so the equality above is not a coincidence


def _buffers(sizes: list[int]) -> list[float]:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = nn.Linear(2, 1)
    buf = torch.full((3,), float(rank + 1))
    dbs = DynamicBatchSize(model.parameters(), dist.group.WORLD, buffers=[buf])
    alloc = dbs.bind(sum(sizes))
    alloc.update(sizes, 0)
    alloc.draw()
    dbs.begin_micro_batch()
    model(torch.ones(1, 2)).sum().backward()
    dbs.reduce_gradients()
    return buf.tolist()


def test_buffers_are_averaged_with_the_batch_weights():
    out = run_workers(_buffers, [1, 3], devices=2)
    expected = 0.25 * 1.0 + 0.75 * 2.0  # a running mean of the global batch, not of the ranks
    assert out == [[expected] * 3, [expected] * 3]
