"""The asynchronous strategies' model against closed forms derived by hand: one worker, equal
speeds, a 2x straggler (per-worker staleness), a saturated server, pure communication, and
rank 0's core shared with the serving thread."""

import pytest

from lightning_hier.planner import Link
from lightning_hier.simulator import Cluster, Workload, one_straggler, predict
from lightning_hier.simulator.asynchronous import HEADER_BYTES, queue_wait, staleness

P = 1_000_000  # parameters: 4 MB per push
ALPHA, BYTE_S = 1e-5, 1e-9
LINK = Link(alpha=ALPHA, beta=4 * BYTE_S)
FREE = Link(alpha=0.0, beta=0.0)
T = 32 * 3e-3  # forward and backward of one step at speed 1
ALONE = {"server_shares_core": False}  # the serving thread has a core of its own


def _workload(step_s: float = 0.0, sample_s: float = 3e-3, tensors: int = 1) -> Workload:
    return Workload(
        "w",
        params=P,
        batch_size=32,
        samples_per_epoch=32 * 4 * 10,
        forward_s=sample_s / 3,
        backward_s=2 * sample_s / 3,
        step_s=step_s,
        tensors=tensors,
    )


@pytest.mark.parametrize(
    ("strategy", "args"),
    [("asgd", {}), ("softsync", {"n": 1}), ("dbs_async", {}), ("mgrawa", {"rounds": "async", "probe": "step"})],
)
def test_one_worker_is_plain_sgd_with_no_staleness(strategy, args):
    p = predict(strategy, _workload(step_s=0.01), Cluster(1, LINK), **args)
    assert p.staleness == 0.0
    assert p.step_s == pytest.approx(T + 0.01)  # the server's update replaces the worker's own step
    # the wait for the server's update is blocked time (as PSAdapter's CommStats counts it); GRAWA steps locally
    assert p.blocked_s == pytest.approx(0.0 if strategy == "mgrawa" else 0.01, abs=1e-12)


@pytest.mark.parametrize("workers", [2, 3, 8])
def test_equal_speeds_give_staleness_w_minus_1_for_asgd_and_w_minus_1_over_c_for_softsync(workers):
    w, c = _workload(step_s=0.001), Cluster(workers, FREE)
    asgd = predict("asgd", w, c, **ALONE)
    assert asgd.staleness == pytest.approx(workers - 1)
    assert asgd.detail["staleness_per_worker"] == pytest.approx([workers - 1] * workers)
    assert asgd.step_s == pytest.approx(T + 0.001)  # the server is far from saturated
    n = 2
    group = -(-workers // n)
    soft = predict("softsync", w, c, n=n, **ALONE)
    assert soft.staleness == pytest.approx((workers - 1) / group)
    assert predict("softsync", w, c, n=1, **ALONE).staleness == 0.0


def test_a_2x_straggler_hand_derived_per_worker_staleness():
    """Two workers, worker 1 twice as slow (cycles t and 2t), free link, no update cost.

    Always busy: in its cycle the fast worker sees the slow one's 1/2 push (staleness 0.5), the
    slow one the fast one's 2 pushes (staleness 2); per applied gradient (2 fast for 1 slow) the
    mean is (2 * 0.5 + 2) / 3 = 1 = W - 1. The workers meet at the epoch's end with 10 steps
    each: the fast worker is done at 10 t, and the slow one's last 5 pushes see no one
    (staleness 0): its mean is (5 * 2 + 5 * 0) / 10 = 1, the epoch's (10 * 0.5 + 10 * 1) / 20 = 0.75.
    """
    c = Cluster(2, FREE, speeds=one_straggler(2, 2.0))
    p = predict("asgd", _workload(), c, **ALONE)
    assert p.detail["cycle_s"] == pytest.approx([T, 2 * T])
    assert p.detail["staleness_busy"] == pytest.approx([0.5, 2.0])
    assert p.detail["staleness_per_worker"] == pytest.approx([0.5, 1.0])
    assert p.staleness == pytest.approx(0.75)
    assert p.step_s == pytest.approx(2 * T)  # the epoch ends with the slow worker's last step
    assert p.blocked_s == pytest.approx(T)  # the fast worker waits half of it
    # DBS's shares make both cycles 4/3 t (64 samples split 2:1), so both always busy: staleness 1 each
    d = predict("dbs_async", _workload(), c, **ALONE)
    assert d.detail["shares"] == pytest.approx([128 / 3, 64 / 3])
    assert d.detail["cycle_s"] == pytest.approx([4 / 3 * T, 4 / 3 * T])
    assert d.staleness == pytest.approx(1.0)
    # with equal sizes (before DBS's first rebalance) it is ASGD: the slow worker's cycle is 2 t
    e = predict("dbs_async", _workload(), c, **ALONE, shares=[32, 32])
    assert e.detail["cycle_s"] == pytest.approx(p.detail["cycle_s"]) and e.step_s == pytest.approx(p.step_s)


def test_staleness_is_w_minus_1_on_average_whatever_the_speeds_while_all_are_busy():
    cycles = [1.0, 1.5, 2.0, 7.0]
    _, busy = staleness(cycles, k=1e9)
    rates = [1 / c for c in cycles]
    assert sum(r * s for r, s in zip(rates, busy, strict=True)) / sum(rates) == pytest.approx(3.0)


def test_a_saturated_server_paces_every_worker():
    """Updates of 0.1 s against 1 ms of compute: the server applies one gradient per 0.1 s, and each
    of the 4 workers gets one reply per 0.4 s (the common wait solves 4 S / (Z + S + Q) = 1)."""
    w = _workload(step_s=0.1, sample_s=1e-3 / 32)
    p = predict("asgd", w, Cluster(4, FREE), **ALONE)
    assert p.detail["cycle_s"] == pytest.approx([0.4] * 4)
    assert p.samples_per_s == pytest.approx(32 / 0.1)
    assert queue_wait([1.0, 1.0], [0.1, 0.1]) == 0.0  # below saturation nobody waits


def test_pure_communication_bytes_and_the_synchronous_replies():
    """No compute, no update: n=1 softsync's step is one push and the W-1 replies sent one by one."""
    w, c = _workload(sample_s=0.0), Cluster(4, LINK)
    message = 2 * ALPHA + (4e6 + HEADER_BYTES) * BYTE_S  # a header and one tensor
    sync = predict("softsync", w, c, n=1)
    assert sync.step_s == pytest.approx(message + 3 * message)
    for p in (sync, predict("asgd", w, c)):
        assert p.payload_bytes == 4e6  # CommStats counts the pushed gradient
        assert p.wire_bytes == pytest.approx(2 * 3 / 4 * (4e6 + HEADER_BYTES))  # 3 pushes in, 3 replies out per step
        assert p.detail["server_link_bytes_per_step"] == pytest.approx(3 * (4e6 + HEADER_BYTES))


def test_rank_0_shares_its_core_with_the_serving_thread():
    """Two workers, free link, update S: serving worker 1 takes u = S / c1 of rank 0's core (rank 0's
    own update runs while it waits), so rank 0's compute stretches to t / (1 - u), its cycle to t / (1 - u) + S."""
    s = 0.02
    p = predict("asgd", _workload(step_s=s), Cluster(2, FREE))
    c0, c1 = p.detail["cycle_s"]
    assert c1 == pytest.approx(T + s)
    u = s / c1
    assert c0 == pytest.approx(T / (1 - u) + s, rel=1e-9)
    assert c0 > predict("asgd", _workload(step_s=s), Cluster(2, FREE), **ALONE).detail["cycle_s"][0]


def test_async_grawa_reports_every_tau_steps():
    w, c = _workload(step_s=0.0, tensors=6), Cluster(2, LINK)
    for name, width in (("mgrawa", 1), ("lgrawa", 6)):
        p = predict(name, w, c, tau=8, rounds="async", probe="step")
        report, reply = 4e6 + (width + 2) * 8, 4e6 + 2 * (width + 1) * 8
        assert p.payload_bytes == pytest.approx((report + reply) / 8)  # both directions are counted
        assert p.staleness < 1.0  # rank 0 reports without the network, so it finishes first
        assert predict(name, w, Cluster(2, FREE), tau=8, rounds="async", probe="step").staleness == pytest.approx(1.0)
    fresh = predict("mgrawa", w, Cluster(1, FREE), tau=8, rounds="async")
    assert fresh.step_s == pytest.approx((8 * T + T) / 8)  # one probe's forward and backward per round


def test_bad_async_arguments_name_the_argument():
    with pytest.raises(ValueError, match=r"softsync: `n` must be .*\[1, 2\].*got 3"):
        predict("softsync", _workload(), Cluster(2, LINK), n=3)
    with pytest.raises(ValueError, match=r"mgrawa: `rounds` must be 'sync' or 'async', got 'later'"):
        predict("mgrawa", _workload(), Cluster(2, LINK), rounds="later")


def test_the_shared_queue_with_a_2x_straggler_hand_derived():
    """Two workers, worker 1 twice as slow (cycles t and 2t), free link, no update cost, 20 steps of 64.

    Claiming from the queue, worker 0 takes 2 requests for each of worker 1's: 48 samples per t,
    so the 1,280 samples take 80/3 t, plus half the slow worker's cycle in flight at the end (t).
    Both are busy throughout: staleness 0.5 and 2, and per applied gradient (2 fast for 1 slow)
    the mean is W - 1 = 1. The split (each worker 640 samples) lasts 20 slow cycles, 40 t.
    """
    c = Cluster(2, FREE, speeds=one_straggler(2, 2.0))
    shared = predict("asgd", _workload(), c, sampler="shared", **ALONE)
    split = predict("asgd", _workload(), c, **ALONE)
    assert shared.epoch_s == pytest.approx(80 / 3 * T + T)
    assert split.epoch_s == pytest.approx(40 * T)
    assert shared.staleness == pytest.approx(1.0)
    assert shared.detail["staleness_per_worker"] == pytest.approx([0.5, 2.0])
    assert shared.detail["requests_share"] == pytest.approx([2 / 3, 1 / 3])
    assert shared.blocked_s == pytest.approx(T / 20)  # the fast worker waits only for the epoch's tail
    # DBS's claims sized 2:1 already even the cycles out: the queue changes only the meetings (none)
    d = predict("dbs_async", _workload(), c, sampler="shared", **ALONE)
    assert d.detail["cycle_s"] == pytest.approx([4 / 3 * T, 4 / 3 * T])
    assert d.epoch_s == pytest.approx(20 * 4 / 3 * T + 2 / 3 * T)


def test_the_shared_queue_sends_rank_0s_requests_over_no_link():
    """Equal speeds: on a free link every worker takes 1 / W of the requests, the bytes are the split's and
    the epoch is the split's plus half a batch (the last one in flight: a whole request for the parameter
    servers, one of GRAWA's tau steps). On a real link rank 0 (in
    process, no transfer) cycles faster and takes more, so fewer requests cross a link. (The serving
    thread has a core of its own here: sharing rank 0's would slow rank 0 instead.)"""
    w = _workload(step_s=0.001)
    cases = (("asgd", {}, 1), ("softsync", {"n": 2}, 1), ("mgrawa", {"rounds": "async", "tau": 4}, 4))
    for name, args, batches in cases:
        split = predict(name, w, Cluster(3, FREE), **args, **ALONE)
        shared = predict(name, w, Cluster(3, FREE), sampler="shared", **args, **ALONE)
        assert shared.detail["requests_share"] == pytest.approx([1 / 3] * 3)
        assert (shared.wire_bytes, shared.payload_bytes) == pytest.approx((split.wire_bytes, split.payload_bytes))
        # half a batch in flight at the end: a GRAWA request is tau batches, each claimed alone
        assert shared.epoch_s == pytest.approx(split.epoch_s + max(split.detail["cycle_s"]) / batches / 2)
        split = predict(name, w, Cluster(3, LINK), **args, **ALONE)
        shared = predict(name, w, Cluster(3, LINK), sampler="shared", **args, **ALONE)
        share = shared.detail["requests_share"][0]
        assert share > 1 / 3
        assert shared.wire_bytes == pytest.approx(split.wire_bytes * (1 - share) / (2 / 3))
        assert shared.payload_bytes == pytest.approx(split.payload_bytes)  # CommStats counts rank 0's too


def test_bad_sampler_arguments_name_the_argument():
    w, c = _workload(), Cluster(2, LINK)
    with pytest.raises(ValueError, match=r"asgd: `sampler` must be one of 'split', 'shared', got 'queue'"):
        predict("asgd", w, c, sampler="queue")
    with pytest.raises(ValueError, match=r"softsync: `sampler`='shared' needs n >= 2"):
        predict("softsync", w, c, n=1, sampler="shared")
    with pytest.raises(ValueError, match=r"mgrawa: `sampler`='shared' needs rounds='async'"):
        predict("mgrawa", w, c, sampler="shared")
