"""The simulator against closed forms computed here by hand: pure compute, pure communication,
perfect overlap, one straggler, and the collective formulas of its docstring."""

import math
from dataclasses import replace

import pytest

from lightning_hier.planner import Link
from lightning_hier.simulator import Cluster, Workload, all_reduce, broadcast, one_straggler, p2p, predict
from lightning_hier.simulator.strategies import ddp_buckets

P = 1_000_000  # parameters: 4 MB per full-model collective
ALPHA, BYTE_S = 1e-5, 1e-9  # 10 us per message, 1 GB/s
LINK = Link(alpha=ALPHA, beta=4 * BYTE_S)
FREE = Link(alpha=0.0, beta=0.0)


def _workload(forward_s: float = 1e-3, backward_s: float = 2e-3, step_s: float = 0.01, batch: int = 32) -> Workload:
    return Workload(
        "w",
        params=P,
        batch_size=batch,
        samples_per_epoch=batch * 4 * 10,
        forward_s=forward_s,
        backward_s=backward_s,
        step_s=step_s,
    )


SYNC = [
    ("ddp", {}),
    ("hpsgd", {"window": 4}),
    ("hpsgd", {"window": 4, "delay": 1}),
    ("diloco", {"window": 8}),
    ("diloco", {"window": 8, "fragments": 4, "fragment_sync_delay": 2}),
    ("localsgd", {"tau": 8}),
    ("easgd", {"tau": 4}),
    ("lsgd", {"tau": 4}),
    ("mgrawa", {"tau": 32, "probe": "step"}),
    ("lgrawa", {"tau": 32, "probe": "step"}),
    ("dbs", {}),
]


@pytest.mark.parametrize(("strategy", "args"), SYNC)
def test_pure_compute_is_the_compute_bound(strategy, args):
    w, c = _workload(), Cluster(4, FREE)
    p = predict(strategy, w, c, **args)
    step = 32 * 3e-3 + 0.01
    assert p.step_s == pytest.approx(step)
    assert p.samples_per_s == pytest.approx(4 * 32 / step)
    assert p.epoch_s == pytest.approx(10 * step)
    assert p.blocked_s == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize(
    ("algorithm", "time"),
    [
        ("ring", 2 * 3 * ALPHA + 2 * 0.75 * 4e6 * BYTE_S),
        ("tree", 2 * 2 * (ALPHA + 4e6 * BYTE_S)),
        ("halving_doubling", 2 * 2 * ALPHA + 2 * 0.75 * 4e6 * BYTE_S),
    ],
)
def test_pure_communication_is_the_all_reduce(algorithm, time):
    w, c = _workload(0.0, 0.0, 0.0), Cluster(4, LINK, algorithm)
    assert all_reduce(4e6, 4, c).time_s == pytest.approx(time)
    # Local SGD with tau = 1 and no buffers: the parameters' all-reduce and the 8-byte distance, every step
    p = predict("localsgd", w, c, tau=1)
    assert p.step_s == pytest.approx(time + all_reduce(8, 4, c).time_s)
    assert p.wire_bytes == pytest.approx(2 * 0.75 * (4e6 + 8))
    assert p.payload_bytes == 4e6 + 8
    # DDP's buckets: 1 MiB, then the rest (25 MiB cap): two all-reduces
    first, rest = 2**20, 4e6 - 2**20
    assert predict("ddp", w, c).step_s == pytest.approx(all_reduce(first, 4, c).time_s + all_reduce(rest, 4, c).time_s)


def test_broadcast_and_point_to_point():
    c = Cluster(8, LINK, "tree")
    assert broadcast(1e6, 8, c).time_s == pytest.approx(3 * (ALPHA + 1e6 * BYTE_S))
    ring = Cluster(8, LINK, "ring")
    assert broadcast(1e6, 8, ring).time_s == pytest.approx(7 * ALPHA + 1e6 * BYTE_S)
    assert broadcast(1e6, 8, ring).wire_bytes == pytest.approx(7 / 8 * 1e6)  # every worker but the last forwards it
    hd = Cluster(8, LINK, "halving_doubling")
    assert broadcast(1e6, 8, hd).time_s == pytest.approx((3 + 7) * ALPHA + 2 * 7 / 8 * 1e6 * BYTE_S)
    assert p2p(1e6, ring).time_s == pytest.approx(ALPHA + 1e6 * BYTE_S)
    assert all_reduce(1e6, 1, ring).time_s == 0.0


def test_perfect_overlap_hides_the_window_reduction():
    c = Cluster(2, LINK)
    reduction = all_reduce(4e6, 2, c).time_s  # ~4 ms
    hidden = predict("hpsgd", _workload(1e-3, 2e-3, 0.0), c, window=2)  # 96 ms of compute per step
    assert hidden.step_s == pytest.approx(32 * 3e-3)
    assert hidden.blocked_s == 0.0
    assert hidden.staleness == 2
    exposed = predict("hpsgd", _workload(1e-6, 1e-6, 0.0), c, window=2)  # compute far below the reduction
    assert exposed.step_s == pytest.approx(reduction / 2)
    assert exposed.blocked_s == pytest.approx(reduction / 2 - 32 * 2e-6)
    # bf16 halves the payload
    assert predict("hpsgd", _workload(), c, window=2, compression="bf16").payload_bytes == pytest.approx(2e6 / 2)


def test_a_shorter_hpsgd_delay_hides_the_reduction_behind_fewer_steps():
    c = Cluster(2, LINK)
    reduction = all_reduce(4e6, 2, c).time_s  # ~4 ms; a step's compute here is 3.2 ms
    w = _workload(5e-5, 5e-5, 0.0)
    assert predict("hpsgd", w, c, window=4).step_s == pytest.approx(32 * 1e-4)  # 12.8 ms of compute hides it
    delayed = predict("hpsgd", w, c, window=4, delay=1)
    assert delayed.step_s == pytest.approx((3 * 32e-4 + reduction) / 4)
    assert delayed.staleness == 1
    assert delayed.payload_bytes == predict("hpsgd", w, c, window=4).payload_bytes


def test_an_automatic_hpsgd_delay_is_the_shortest_that_hides_the_predicted_reduction():
    c = Cluster(2, LINK)
    w = _workload(5e-5, 5e-5, 0.0)  # ~4 ms reductions, 3.2 ms steps: two steps hide one
    assert predict("hpsgd", w, c, window=4, delay="auto").step_s == predict("hpsgd", w, c, window=4, delay=2).step_s
    assert predict("hpsgd", w, c, window=4, delay="auto").staleness == 2
    slow = _workload(1e-6, 1e-6, 0.0)  # compute far below the reduction: the whole window
    assert predict("hpsgd", slow, c, window=4, delay="auto").staleness == 4


def test_diloco_blocks_on_each_fragment_or_hides_it_behind_the_delay():
    c = Cluster(2, LINK)
    w = _workload(1e-6, 1e-6, 0.0)  # compute far below the reductions
    whole = all_reduce(4e6, 2, c).time_s
    blocking = predict("diloco", w, c, window=8)
    assert blocking.step_s == pytest.approx((8 * 32 * 2e-6 + whole) / 8)
    assert blocking.wire_bytes == pytest.approx(4e6 / 8)  # a ring of 2: each sends the payload once
    quarter = all_reduce(1e6, 2, c).time_s
    w = replace(w, tensors=8)  # fragments are cut between tensors: one tensor makes one fragment
    assert predict("diloco", w, c, window=8, fragments=4).step_s == pytest.approx((8 * 32 * 2e-6 + 4 * quarter) / 8)
    streaming = predict("diloco", w, c, window=8, fragments=4, fragment_sync_delay=2)
    step = 32 * 2e-6
    assert streaming.step_s == pytest.approx((8 * step + 4 * (quarter - 2 * step)) / 8)
    # int4: half a byte per parameter and a float32 scale per 64; CommStats adds the all-gather's shard
    int4 = predict("diloco", w, c, window=8, compression="int4")
    assert int4.wire_bytes == pytest.approx(P * (0.5 + 4 / 64) / 8)
    assert int4.payload_bytes == pytest.approx(P * (0.5 + 4 / 64) * 1.5 / 8)


def test_one_straggler_paces_synchronous_steps_and_dbs_rebalances_it():
    w, factor = _workload(step_s=0.0), 3.0
    c = Cluster(4, FREE, speeds=one_straggler(4, factor))
    t = 32 * 3e-3
    assert predict("ddp", w, c).step_s == pytest.approx(factor * t)
    assert predict("localsgd", w, c, tau=8).step_s == pytest.approx(factor * t)
    # the fast workers wait (factor - 1) t per step
    assert predict("ddp", w, c).blocked_s == pytest.approx((factor - 1) * t)
    # DBS: shares proportional to speed, so each worker needs B c / sum(s)
    dbs = predict("dbs", w, c)
    assert dbs.step_s == pytest.approx(4 * 32 * 3e-3 / (3 + 1 / factor))
    assert dbs.detail["shares"][-1] == pytest.approx(128 / (3 + 1 / factor) / factor)
    # before its first rebalance DBS keeps equal sizes: the straggler paces it as it paces DDP
    equal = predict("dbs", w, c, shares=[32] * 4)
    assert equal.step_s == pytest.approx(factor * t) and equal.detail["shares"] == [32.0] * 4
    with pytest.raises(ValueError, match=r"dbs: `shares` must be 4 positive batch sizes .* got \[32, 32\]"):
        predict("dbs", w, c, shares=[32, 32])


def test_averaging_bytes_per_round():
    w = Workload(
        "w", params=P, batch_size=8, samples_per_epoch=8 * 2 * 64, forward_s=0.0, backward_s=0.0, buffers=10, tensors=6
    )
    c = Cluster(2, LINK)
    assert predict("localsgd", w, c, tau=8).payload_bytes == pytest.approx((4e6 + 8 + 40) / 8)
    assert predict("lsgd", w, c, tau=4).payload_bytes == pytest.approx((2 * 8 + 4e6 + 8 + 40) / 4)
    assert predict("mgrawa", w, c, tau=32).payload_bytes == pytest.approx((2 * 2 * 8 + 4e6 + 8 + 40) / 32)
    assert predict("lgrawa", w, c, tau=32).payload_bytes == pytest.approx((2 * 7 * 8 + 4e6 + 8 + 40) / 32)
    assert predict("localsgd", w, c, tau=8).payload_bytes_per_epoch == pytest.approx((4e6 + 48) / 8 * 64)


def test_grid2d_uses_the_planners_cost():
    from lightning_hier.planner import FCLayer, network_cost

    layers = [FCLayer(1024, 1024), FCLayer(1024, 10)]
    w = _workload(0.0, 0.0, 0.0, batch=64)
    c = Cluster(4, LINK)
    p = predict("grid2d", w, c, layers=layers, grid=(2, 2))
    cost = network_cost(layers, 2, 2, 256)
    assert p.step_s == pytest.approx(cost.time(LINK))
    assert p.wire_bytes == pytest.approx(4 * cost.words)
    assert predict("grid2d", w, c, layers=layers).args["grid"] in {(1, 4), (2, 2), (4, 1)}


def test_decoupled_pipeline_runs_at_its_slowest_stage():
    from lightning_hier.simulator import Block

    blocks = (Block(2e-3, 100, 50), Block(1e-3, 100, 20), Block(1e-3, 100, 10))
    w = Workload(
        "p", params=300, batch_size=16, samples_per_epoch=16 * 10, forward_s=0.0, backward_s=4e-3, blocks=blocks
    )
    p = predict("decoupled", w, Cluster(2, FREE), pipe=2)
    assert p.detail["period_s"] == pytest.approx(16 * 2e-3)  # stages [block 0] and [blocks 1, 2]
    # the epoch's 10 batches and its drain: stage 1 waits for batch 0, stage 0 for the last gradient
    assert 10 * 16 * 2e-3 < p.epoch_s < 12 * 16 * 2e-3
    assert p.staleness == 2 and p.steps_per_epoch == 10 + 2
    sync = predict("decoupled", w, Cluster(2, FREE), pipe=2, schedule="sync")
    assert sync.step_s == pytest.approx(16 * 4e-3)
    # activations + labels and gradients, one of each per batch (none in the fill or the drain)
    per_batch = (16 * 50 * 4 + 16 * 8 + 16 * 50 * 4) / 2
    assert p.payload_bytes_per_epoch == pytest.approx(10 * per_batch)
    # a slow link: the activations (+ int64 labels) and gradients each take their own direction; a
    # round trip spans 3 iterations with the forward first, 2 with the backward first
    slow = Cluster(2, Link(alpha=0.0, beta=4e-5))  # 1e-5 s per byte
    trip = 2 * 16 * 2e-3 + (16 * 50 * 4 + 16 * 8) * 1e-5 + 16 * 50 * 4 * 1e-5  # [block 0] | [blocks 1, 2]
    assert predict("decoupled", w, slow, pipe=2).detail["period_s"] == pytest.approx(trip / 3)
    assert predict("decoupled", w, slow, pipe=2, order="backward_first").detail["period_s"] == pytest.approx(trip / 2)
    bf16 = predict("decoupled", w, Cluster(2, FREE), pipe=2, wire_dtype="bf16")  # 2-byte activations, int64 labels
    assert bf16.payload_bytes_per_epoch == pytest.approx(10 * (16 * 50 * 2 + 16 * 8 + 16 * 50 * 2) / 2)
    with pytest.raises(ValueError, match=r"decoupled: `wire_dtype` must be None or 'bf16', got 'fp8'"):
        predict("decoupled", w, Cluster(2, FREE), wire_dtype="fp8")


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match=r"strategy.*'nope'"):
        predict("nope", _workload(), Cluster(2, LINK))
    with pytest.raises(ValueError, match=r"algorithm.*'mesh'"):
        Cluster(2, LINK, "mesh")
    with pytest.raises(ValueError, match="speeds"):
        Cluster(2, LINK, speeds=(1.0,))
    assert math.isfinite(predict("no-comm", _workload(), Cluster(2, LINK)).samples_per_s)


def test_a_blocking_collective_lasts_at_least_the_cpu_time_of_its_bytes():
    """gloo touches every byte it sends: 4 MB over 2 ranks sends 4 MB per rank, 3 ns/byte is 12 ms,
    three times the link's 4 ms at 1 GB/s; on a slow link the link's time rules. The compute's
    charge for overlapped bytes (``cpu_s_per_byte``) is another number and sets no floor."""
    fast = Cluster(2, Link(alpha=0.0, beta=4 * BYTE_S), collective_s_per_byte=3e-9)
    assert all_reduce(4e6, 2, fast).time_s == pytest.approx(3e-9 * 4e6)
    assert p2p(1e6, fast).time_s == pytest.approx(3e-9 * 1e6)
    slow = Cluster(2, Link(alpha=0.0, beta=4 * 100 * BYTE_S), collective_s_per_byte=3e-9)  # 10 MB/s
    assert all_reduce(4e6, 2, slow).time_s == pytest.approx(4e6 * 100 * BYTE_S)
    charged = Cluster(2, Link(alpha=0.0, beta=4 * BYTE_S), cpu_s_per_byte=3e-9)
    assert all_reduce(4e6, 2, charged).time_s == pytest.approx(4e6 * BYTE_S)
    # Local SGD's blocking round pays it in full; DDP's last bucket too
    w = _workload(0.0, 0.0, 0.0)
    assert predict("localsgd", w, fast, tau=1).step_s == pytest.approx(3e-9 * (4e6 + 8))
    with pytest.raises(ValueError, match=r"`collective_s_per_byte` must be >= 0"):
        Cluster(2, LINK, collective_s_per_byte=-1.0)


def test_ddp_buckets_hold_whole_tensors_in_reverse_order():
    MiB = 2**20
    # the small CNN's shape: a big fully connected weight near the output, small convolutions first
    tensors = [100_000, 300_000, 2 * MiB, 500, 5_000]
    assert ddp_buckets(sum(tensors), 25.0, tensors) == [5_000 + 500 + 2 * MiB, 300_000 + 100_000]
    assert ddp_buckets(sum(tensors), 0.25, tensors) == [5_000 + 500 + 2 * MiB, 300_000, 100_000]
    assert ddp_buckets(3 * MiB) == [MiB, 2 * MiB]  # no tensor list: cut at the caps
    w = Workload(
        "w",
        params=sum(tensors) // 4,
        batch_size=1,
        samples_per_epoch=10,
        forward_s=0.0,
        backward_s=1.0,  # hides the first bucket: only the last one, the first layers' 400 KB, is exposed
        tensor_words=tuple(t // 4 for t in tensors),
    )
    c = Cluster(2, LINK)
    assert predict("ddp", w, c).step_s == pytest.approx(1.0 + all_reduce(400_000, 2, c).time_s)
