"""DBS arithmetic: the batch split, shard sizes and the throughput EMA, against independent references."""

import itertools
import math
import random
import threading
import time

import pytest

from lightning_hier.algorithms.dbs import (
    DynamicBatchSize,
    ThroughputMeter,
    check_split,
    shard_sizes,
    split_batch,
    split_remainder,
)


def reference_split(total: int, weights: list[float], low: int, high: int) -> list[int]:
    """Clamped proportional shares by bisection on the scale, then Hamilton's largest-remainder method."""
    lo_lam, hi_lam = 0.0, high / min(weights)
    for _ in range(200):
        mid = (lo_lam + hi_lam) / 2
        if sum(min(high, max(low, mid * w)) for w in weights) < total:
            lo_lam = mid
        else:
            hi_lam = mid
    shares = [min(high, max(low, hi_lam * w)) for w in weights]
    sizes = [math.floor(s + 1e-9) for s in shares]
    order = sorted(range(len(weights)), key=lambda r: (-(shares[r] - sizes[r]), r))
    for r in order[: total - sum(sizes)]:
        sizes[r] += 1
    return sizes


@pytest.mark.parametrize(
    ("total", "weights", "low", "high", "expected"),
    [
        (10, [1, 1, 1], 1, None, [4, 3, 3]),  # ties: lower rank first
        (128, [2, 1], 1, None, [85, 43]),  # 85.33 / 42.67: the larger remainder gets the spare sample
        (128, [1, 1], 1, None, [64, 64]),
        (12, [100, 1], 1, 9, [9, 3]),  # capped at max; the rest goes to the other rank
        (20, [100, 1, 1], 4, None, [12, 4, 4]),  # raised to min
        (7, [1, 2, 4], 1, None, [1, 2, 4]),
        (8, [3, 3, 3, 3], 2, 2, [2, 2, 2, 2]),  # min == max leaves one choice
    ],
)
def test_hand_computed_splits(total, weights, low, high, expected):
    assert split_batch(total, weights, low, high) == expected


@pytest.mark.parametrize("seed", range(40))
def test_random_splits_sum_exactly_respect_bounds_and_match_the_reference(seed):
    rng = random.Random(seed)
    world = rng.choice([2, 3, 4, 7, 16])
    low = rng.randint(1, 8)
    high = rng.choice([None, low + rng.randint(0, 200)])
    cap = world * (high if high is not None else 10**4)
    total = rng.randint(world * low, min(cap, world * low + 2000))
    weights = [rng.uniform(0.05, 20.0) for _ in range(world)]
    sizes = split_batch(total, weights, low, high)
    hi = total if high is None else high
    assert sum(sizes) == total
    assert all(low <= b <= hi for b in sizes)
    assert sizes == reference_split(total, weights, low, hi)


@pytest.mark.parametrize("seed", range(20))
def test_unbounded_split_is_proportional_within_rounding(seed):
    rng = random.Random(1000 + seed)
    weights = [rng.uniform(1.0, 3.0) for _ in range(rng.randint(2, 8))]
    total = rng.randint(64, 4096)
    sizes = split_batch(total, weights)
    for b, w in zip(sizes, weights, strict=True):
        assert abs(b - total * w / sum(weights)) < 1.0
    # faster ranks never get fewer samples
    for b1, w1 in zip(sizes, weights, strict=True):
        for b2, w2 in zip(sizes, weights, strict=True):
            if w1 > w2:
                assert b1 >= b2


def test_speed_ratio_two_to_one():
    assert split_batch(300, [2.0, 1.0]) == [200, 100]
    assert split_batch(300, [1.0, 1.0, 2.0, 4.0]) == [38, 37, 75, 150]


@pytest.mark.parametrize(
    ("total", "world", "low", "high", "match"),
    [
        (3, 4, 1, None, r"global batch of 3 cannot be split over 4 ranks .* must lie in \[4, 12\]"),
        (10, 2, 6, None, r"must lie in \[12, 20\]"),
        (100, 2, 1, 40, r"must lie in \[2, 80\]"),
        (10, 2, 5, 4, "1 <= min <= max"),
        (10, 2, 0, None, "1 <= min <= max"),
    ],
)
def test_infeasible_splits_are_rejected(total, world, low, high, match):
    with pytest.raises(ValueError, match=match):
        check_split(total, world, low, high)
    with pytest.raises(ValueError, match=match):
        split_batch(total, [1.0] * world, low, high)


@pytest.mark.parametrize("weights", [[1.0, 0.0], [1.0, -2.0], [1.0, float("nan")], [float("inf"), 1.0]])
def test_weights_must_be_positive_and_finite(weights):
    with pytest.raises(ValueError, match="positive and finite"):
        split_batch(10, weights)


def test_shard_sizes_give_every_rank_the_same_number_of_steps():
    steps, shards = shard_sizes(1437, [85, 43])
    assert steps == 11 and shards == [935, 473]
    assert [s // b for s, b in zip(shards, [85, 43], strict=True)] == [steps, steps]
    assert sum(shards) <= 1437 < sum(shards) + 128


def test_throughput_meter_is_an_ema_of_window_rates():
    meter = ThroughputMeter(ema=0.5)
    assert meter.close_window()["samples_per_s"] == 0.0  # nothing measured: no estimate
    meter.add(60, 0.5, 0.1)
    meter.add(40, 0.5, 0.3)
    first = meter.close_window()
    assert first == {"compute_s": 0.5, "idle_s": pytest.approx(0.2), "samples_per_s": 100.0}  # 100 / 1.0 s
    meter.add(300, 1.0, 0.0)
    assert meter.close_window()["samples_per_s"] == 0.5 * 100.0 + 0.5 * 300.0
    meter.add(10, 0.0, 0.0)  # no compute time: the window is ignored
    assert meter.close_window()["samples_per_s"] == 200.0
    restored = ThroughputMeter(ema=0.5)
    restored.load_state_dict(meter.state_dict())
    assert restored.state_dict() == meter.state_dict()


def test_ema_zero_uses_the_last_window_only():
    meter = ThroughputMeter(ema=0.0)
    for rate in (100, 400):
        meter.add(rate, 1.0, 0.0)
        assert meter.close_window()["samples_per_s"] == rate
    with pytest.raises(ValueError, match="ema"):
        ThroughputMeter(ema=1.0)


@pytest.mark.parametrize(
    ("total", "sizes", "expected"),
    [
        (8, [12, 12], [4, 4]),
        (5, [12, 12], [3, 2]),  # ties: lower rank first
        (3, [20, 4], [3, 0]),  # 2.5 / 0.5: the slow rank gets no sample
        (10, [20, 4], [8, 2]),  # 8.33 / 1.67
        (2, [1, 1, 1], [1, 1, 0]),  # fewer samples than ranks
        (0, [5, 5], [0, 0]),
    ],
)
def test_the_last_smaller_batch_is_split_by_the_same_shares(total, sizes, expected):
    assert split_remainder(total, sizes) == expected


@pytest.mark.parametrize("seed", range(20))
def test_remainder_splits_sum_exactly_and_stay_within_one_of_the_share(seed):
    rng = random.Random(2000 + seed)
    sizes = [rng.randint(1, 50) for _ in range(rng.randint(2, 8))]
    total = rng.randint(0, sum(sizes) - 1)
    out = split_remainder(total, sizes)
    assert sum(out) == total
    for r, b in zip(out, sizes, strict=True):
        assert 0 <= r <= b and abs(r - total * b / sum(sizes)) < 1.0


@pytest.mark.parametrize(("total", "sizes"), [(10, [5, 5]), (-1, [5, 5]), (3, [5, -1])])
def test_remainder_split_rejects_a_total_that_is_not_smaller_than_the_batch(total, sizes):
    with pytest.raises(ValueError, match="split_remainder: need 0 <= total < sum"):
        split_remainder(total, sizes)


def test_initial_sizes_are_the_first_split_and_are_checked_against_the_global_batch():
    dbs = DynamicBatchSize([], None, initial_sizes=[7])
    assert dbs.bind(7).sizes == [7]
    with pytest.raises(ValueError, match=r"`initial_sizes` must sum to the global batch 8, got \[7\] \(sum 7\)"):
        DynamicBatchSize([], None, initial_sizes=[7]).bind(8)
    with pytest.raises(ValueError, match=r"one batch size per data-parallel rank \(1\), got 2"):
        DynamicBatchSize([], None, initial_sizes=[4, 4]).bind(8)
    restored = DynamicBatchSize([], None, initial_sizes=[7])
    restored.load_state_dict({**dbs.state_dict(), "sizes": [9]})
    assert restored.bind(9).sizes == [9]  # a checkpoint's split takes precedence


@pytest.mark.parametrize(
    ("span", "expected_s"),
    [
        ("compute", [1.0, 1.0, 1.0]),  # batch start to step end, the 0.5 s wait for the server taken out
        # from the previous step's end: + the 2 s between steps and the wait; the step after restart() alone
        ("iteration", [3.5, 3.5, 1.5]),
    ],
)
def test_a_step_spans_its_compute_or_its_whole_iteration(span, expected_s):
    now = [0.0]
    dbs = DynamicBatchSize([], None, warmup_steps=0, rebalance_every=100, span=span)
    dbs.clock = lambda: now[0]
    allocation = dbs.bind(4)
    measured = []
    for step in range(4):
        allocation.take_claimed(4)  # what the sampler does when it hands the loop a batch
        if step == 3:
            dbs.restart()  # e.g. a validation ran since the last step
        now[0] += 2.0  # data, the loop, a claim: between steps
        dbs.begin_micro_batch()
        now[0] += 1.5  # compute and the push, of which 0.5 s blocked on the server's reply
        dbs.stats.blocked_s += 0.5
        dbs.end_step()
        measured.append(dbs.meter.compute_s)
    # the first step (fresh) is never measured; then each step's time adds to the window
    assert [b - a for a, b in itertools.pairwise(measured)] == pytest.approx(expected_s)


def test_span_is_checked():
    with pytest.raises(ValueError, match=r"span in .*'compute', 'iteration'.*'step'"):
        DynamicBatchSize([], None, span="step")


def test_the_thread_timer_leaves_out_another_threads_work():
    # rank 0's process runs the parameter server's threads beside its training thread: timer='thread'
    # (what dbs_async reads for timer='cpu') must not count their CPU time, timer='cpu' does
    dbs = DynamicBatchSize([], None, timer="thread")
    burned = []

    def server_work() -> None:
        start = time.thread_time()
        while time.thread_time() - start < 0.2:
            pass
        burned.append(time.thread_time() - start)

    thread_start, process_start = dbs.clock(), DynamicBatchSize([], None, timer="cpu").clock()
    worker = threading.Thread(target=server_work)
    worker.start()
    worker.join()  # this thread waits without running
    assert dbs.clock() - thread_start < 0.05
    assert time.process_time() - process_start >= burned[0] >= 0.2
