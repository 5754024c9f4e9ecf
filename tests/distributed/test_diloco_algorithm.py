"""(Streaming) DiLoCo from a plain torch loop under real gloo groups, against the single-process reference."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_hier.algorithms import float_buffers
from lightning_hier.algorithms.diloco import DiLoCo, fragment_offsets, split_fragments
from lightning_hier.testing import run_workers
from tests.diloco_reference import Reference
from tests.toy_problem import cross_entropy as _loss
from tests.toy_problem import tiny_net as _net
from tests.toy_problem import worker_batch as _batch

STEPS, LR = 13, 0.1


def _sgd(module: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(module.parameters(), lr=LR, momentum=0.9, nesterov=True)


def _algorithm(net: nn.Module, batch_norm: bool, **hp: Any) -> DiLoCo:
    group = dist.group.WORLD if dist.is_initialized() else None
    buffers = float_buffers(net) if batch_norm else ()
    return DiLoCo(net.parameters(), group, buffers=buffers, bucket_bytes=64, **hp)


def _train(batch_norm: bool = False, resume_at: int | None = None, **hp: Any) -> dict[str, Any]:
    """One rank trains its own data; with ``resume_at``, the run restarts there from state dicts."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    net, sent = _net(batch_norm), []
    opt = _sgd(net)
    algo = _algorithm(net, batch_norm, **hp)
    for step in range(STEPS):
        if step == resume_at:  # a new process would rebuild everything and load the three states
            saved = (net.state_dict(), opt.state_dict(), algo.state_dict())
            net = _net(batch_norm)
            opt, algo = _sgd(net), _algorithm(net, batch_norm, **hp)
            net.load_state_dict(saved[0])
            opt.load_state_dict(saved[1])
            algo.load_state_dict(saved[2])
        opt.zero_grad()
        _loss(net, _batch(rank, step)).backward()
        opt.step()
        before = algo.stats.bytes
        algo.step()
        sent.append(algo.stats.bytes - before)
    algo.finalize()
    return {"params": [p.detach().clone() for p in net.parameters()], "sent": sent, "syncs": algo.syncs}


def _grid(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    dist.init_process_group("gloo")
    try:
        return [_train(**case) for case in cases]
    finally:
        dist.destroy_process_group()


def _reference(world: int, batch_norm: bool = False, **hp: Any) -> list[list[torch.Tensor]]:
    window, count = hp.get("window", 32), hp.get("fragments", 1)
    compression = hp.get("compression", "none")
    params = list(_net(batch_norm).parameters())
    ids = {id(p): i for i, p in enumerate(params)}
    fragments = [[ids[id(p)] for p in group] for group in split_fragments(params, count)]
    ref = Reference(
        partial(_net, batch_norm),
        _sgd,
        _loss,
        world,
        window,
        fragments,
        fragment_offsets(window, len(fragments)),
        outer_lr=hp.get("outer_lr", 0.7),
        outer_momentum=hp.get("outer_momentum", 0.9),
        delay=hp.get("delay", 0),
        alpha=hp.get("alpha", 0.0),
        quantized={"int8": 8, "int4": 4}.get(compression),
    )
    return ref.run(_batch, STEPS)


CASES: list[dict[str, Any]] = [
    {"window": 4},  # DiLoCo: one fragment, outer Nesterov (0.7, 0.9); 13 steps end mid-window
    {"window": 4, "outer_lr": 1.0, "outer_momentum": 0.0},  # Local SGD
    {"window": 4, "fragments": 3},  # streaming, staggered, applied at once
    {"window": 6, "fragments": 2, "delay": 2, "alpha": 0.5, "batch_norm": True},
    {"window": 4, "fragments": 2, "delay": 1, "compression": "int8"},
    {"window": 5, "fragments": 2, "delay": 3, "alpha": 0.25, "compression": "int4"},
]


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_ends_at_the_reference_model(world):
    cases = CASES if world == 2 else CASES[2:]
    reports = run_workers(_grid, cases, devices=world)
    for index, case in enumerate(cases):
        expected = _reference(world, **case)
        for rank, report in enumerate(reports):
            for got, want in zip(report[index]["params"], expected[rank], strict=True):
                assert torch.allclose(got, want, atol=1e-6, rtol=0), f"{case} rank {rank}: {(got - want).abs().max()}"


def test_resume_from_state_dicts_is_bit_identical():
    """A restart with a reduction in flight (delay 3) and quantization residuals continues exactly."""
    case = {"window": 5, "fragments": 2, "delay": 3, "alpha": 0.25, "compression": "int4"}
    straight, resumed = run_workers(_grid, [case, {**case, "resume_at": 7}], devices=2)[0]
    assert 7 % 5 < 5 and straight["syncs"] == resumed["syncs"]
    for a, b in zip(straight["params"], resumed["params"], strict=True):
        assert torch.equal(a, b)


def test_a_fragment_sends_its_own_share_on_its_own_steps():
    """F fragments: each step sends at most one fragment, and a window sends the model once."""
    report = run_workers(_grid, [{"window": 4, "fragments": 2}, {"window": 4}], devices=2)[0]
    streamed, whole = report[0]["sent"], report[1]["sent"]
    assert [s > 0 for s in streamed[:8]] == [False, True, False, True] * 2
    assert [s > 0 for s in whole[:8]] == [False, False, False, True] * 2
    assert sum(streamed[:8]) == sum(whole[:8])
    assert 0 < max(streamed) < max(whole)


def test_one_worker_without_a_group_is_its_own_average():
    """No process group: the outer step moves S by the replica's own change (no collective)."""
    final = _train(window=3)["params"]
    assert all(torch.isfinite(p).all() for p in final)
    expected = _reference(1, window=3)[0]
    for got, want in zip(final, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
