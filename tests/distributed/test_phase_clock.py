"""PhaseClock on real gloo collectives: timed at completion, not at the wait."""

import time

import torch
import torch.distributed as dist

from lightning_hier.comm import PhaseClock
from lightning_hier.testing import run_workers

LATE_S = 0.5


def _late_second_rank() -> dict:
    """Rank 1 launches its all-reduce ``LATE_S`` after rank 0; both wait a while longer before waiting."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 1:
        time.sleep(LATE_S)
    clock = PhaseClock()
    work = dist.all_reduce(torch.ones(1000), async_op=True)
    clock.track([work], dist.group.WORLD)
    time.sleep(1.0)  # the collective finishes meanwhile; the clock must not count this
    work.wait()
    first = clock.elapsed()
    time.sleep(0.2)
    polled = PhaseClock()  # the polled form (what NCCL gets): read at the first poll that sees it done
    other = dist.all_reduce(torch.ones(10), async_op=True)
    polled.track([other], None)
    other.wait()
    time.sleep(0.3)
    polled.poll()
    seen = polled.elapsed()
    time.sleep(0.2)
    dist.destroy_process_group()
    return {"rank": rank, "elapsed": first, "again": clock.elapsed(), "polled": seen, "polled_again": polled.elapsed()}


def test_a_clock_times_the_collective_itself_and_the_early_rank_also_its_wait_for_the_late_one():
    early, late = run_workers(_late_second_rank, devices=2, timeout=60)
    assert early["elapsed"] == early["again"] and late["elapsed"] == late["again"]  # fixed once finished
    assert early["elapsed"] >= LATE_S - 0.1  # it launched first: the other rank's lateness is in its time
    assert late["elapsed"] < 0.9  # not the 1 s it slept before waiting
    assert early["elapsed"] > late["elapsed"] + 0.2
    for result in (early, late):  # polled: fixed at the poll, after the wait and 0.3 s more
        assert result["polled"] == result["polled_again"] >= 0.3
