"""The quantized all-reduce on 2 and 4 gloo ranks equals a single-process reference, error feedback included.

The reference (:mod:`tests.quantized_reference`) simulates every rank in one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_hier.comm import CommStats
from lightning_hier.comm.quantized import QuantizedErrorFeedback, padded_length
from lightning_hier.testing import run_workers
from tests.quantized_reference import quantized_sum

ROUNDS, SIZES, BLOCK = 5, (37, 100), 16  # two tensors of odd sizes: padding and shard borders inside them


def _payload(rank: int, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return [torch.randn(n, generator=g) * (1 + rank) for n in SIZES]


def _reference(world: int, bits: int, mean: bool) -> list[torch.Tensor]:
    residuals = [torch.zeros(sum(SIZES)) for _ in range(world)]
    return [
        quantized_sum([torch.cat(_payload(r, step)) for r in range(world)], residuals, bits, BLOCK, mean)
        for step in range(ROUNDS)
    ]


def _reduce(bits: int, mean: bool) -> dict:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = [torch.zeros(n) for n in SIZES]
    codec = QuantizedErrorFeedback(out, bits, world, BLOCK)
    stats = CommStats()
    results, per_round = [], []
    for step in range(ROUNDS):
        before = stats.bytes
        work = codec.launch(_payload(rank, step), out, dist.group.WORLD, stats, mean=mean)
        while not work.is_completed():  # the two phases advance as communication finishes
            pass
        results.append(torch.cat([t.clone() for t in out]))
        per_round.append(stats.bytes - before)
    dist.destroy_process_group()
    return {"results": results, "bytes": per_round}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(("bits", "mean"), [(8, False), (4, True)])
def test_every_rank_gets_the_reference_result(world, bits, mean):
    reports = run_workers(_reduce, bits, mean, devices=world)
    expected = _reference(world, bits, mean)
    for report in reports:
        for got, want in zip(report["results"], expected, strict=True):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    # the payload handed to the two collectives: the whole quantized payload and one shard of it
    n = padded_length(sum(SIZES), world, BLOCK)
    quantized = n * bits // 8 + 4 * n // BLOCK
    assert reports[0]["bytes"] == [quantized + quantized // world] * ROUNDS


def test_wait_finishes_what_polling_would():
    def reduce_waiting() -> list[torch.Tensor]:
        dist.init_process_group("gloo")
        out = [torch.zeros(n) for n in SIZES]
        codec = QuantizedErrorFeedback(out, 4, dist.get_world_size(), BLOCK)
        results = []
        for step in range(ROUNDS):
            codec.launch(_payload(dist.get_rank(), step), out, dist.group.WORLD, CommStats(), mean=True).wait()
            results.append(torch.cat([t.clone() for t in out]))
        dist.destroy_process_group()
        return results

    for got, want in zip(run_workers(reduce_waiting, devices=2)[1], _reference(2, 4, True), strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
