"""The simulator's models of torch's DDP hooks (PostLocalSGD, PowerSGD, fp16), torchft's peers and the codecs' CPU time.

PowerSGD's factor sizes are checked against torch's own ``PowerSGDState`` counters after a
compressed step; the rest against closed forms computed here.
"""

import math
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from benchmarks.fit_model import with_hook_warmup, with_whole_rounds
from lightning_hier.models.networks import mlp, small_cnn
from lightning_hier.planner import Link
from lightning_hier.simulator import Cluster, Workload, all_reduce, predict
from lightning_hier.simulator.calibrate import codec_seconds
from lightning_hier.simulator.peers import TORCHFT_ROUND_S, powersgd_words
from lightning_hier.simulator.sweep import recommend, tune

ALPHA, BYTE_S = 1e-5, 1e-9
LINK = Link(alpha=ALPHA, beta=4 * BYTE_S)
SHAPES = ((64, 3, 3, 3), (64,), (128, 64), (128,), (10, 128), (10,))


def _workload(shapes=SHAPES, buffers: int = 0) -> Workload:
    words = tuple(math.prod(s) for s in shapes)
    return Workload(
        "w",
        params=sum(words),
        batch_size=32,
        samples_per_epoch=32 * 2 * 10,
        forward_s=1e-3,
        backward_s=2e-3,
        step_s=0.01,
        buffers=buffers,
        tensors=len(words),
        tensor_words=words,
        tensor_shapes=shapes,
    )


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("rank", [1, 4])
@pytest.mark.parametrize(
    "net",
    [
        lambda: mlp((3, 32, 32), 10, hidden=(256, 256)),
        lambda: small_cnn((3, 32, 32), 10),
        lambda: nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 4)),  # too small to compress: all uncompressed
    ],
)
def test_powersgd_words_are_torchs_own_count(one_rank_group, net, rank):
    model = net()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1000)
    state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=2)
    ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    inputs = torch.randn(2, *((3, 32, 32) if not isinstance(model[0], nn.Linear) else (6,)))
    for _ in range(3):  # two plain warm-up steps, then one compressed
        ddp(inputs).sum().backward()
    uncompressed, p_words, q_words, compressed = powersgd_words([p.shape for p in model.parameters()], rank)
    assert state.total_numel_before_compression == sum(p.numel() for p in model.parameters())
    assert state.total_numel_after_compression == uncompressed + p_words + q_words
    assert compressed + uncompressed == state.total_numel_before_compression


def test_powersgd_step_is_compute_codec_and_three_all_reduces_in_turn():
    w = replace(_workload(), codec_s_per_byte={"powersgd": 2e-9})
    c = Cluster(2, LINK)
    p = predict("ddp_powersgd", w, c, powersgd_rank=2)
    # (64, 27): 91 * 2 * 2 < 1728, compressed; (128, 64) and (10, 128) too; every vector is not
    uncompressed, ps, qs = 64 + 128 + 10, 2 * (64 + 128 + 10), 2 * (27 + 64 + 128)
    comms = [all_reduce(4 * n, 2, c) for n in (uncompressed, ps, qs)]
    codec = 2e-9 * 4 * (64 * 27 + 128 * 64 + 10 * 128)
    assert p.step_s == pytest.approx(32 * 3e-3 + 0.01 + codec + sum(x.time_s for x in comms))
    assert p.wire_bytes == pytest.approx(sum(x.wire_bytes for x in comms))
    assert p.payload_bytes == 4 * (uncompressed + ps + qs)
    assert p.staleness == 0
    # a warm-up step: the whole bucket after the backward
    assert p.detail["warmup_step_s"] == pytest.approx(32 * 3e-3 + 0.01 + all_reduce(w.param_bytes, 2, c).time_s)


def test_powersgd_needs_the_tensors_shapes():
    with pytest.raises(ValueError, match="tensor_shapes"):
        predict("ddp_powersgd", replace(_workload(), tensor_shapes=()), Cluster(2, LINK))
    with pytest.raises(ValueError, match="must hold `tensor_words`"):
        replace(_workload(), tensor_shapes=((3, 3), *SHAPES[1:]))


def test_post_local_sgd_averages_the_parameters_every_period_and_broadcasts_buffers_every_step():
    w = _workload(buffers=1000)
    c = Cluster(2, LINK)
    p = predict("ddp_post_local_sgd", w, c, model_averaging_period=4)
    average = all_reduce(w.param_bytes, 2, c)
    broadcast_s = ALPHA + 4000 * BYTE_S  # ring broadcast over 2 ranks: one message of the buffers
    assert p.step_s == pytest.approx(32 * 3e-3 + 0.01 + broadcast_s + average.time_s / 4)
    assert p.wire_bytes == pytest.approx(average.wire_bytes / 4 + 0.5 * 4000)
    assert p.staleness == 3
    # as Local SGD without its consensus distance, when there are no buffers
    bare = _workload()
    local = predict("localsgd", bare, c, tau=4, sync_buffers=False)
    post = predict("ddp_post_local_sgd", bare, c, model_averaging_period=4)
    assert post.step_s == pytest.approx(local.step_s - all_reduce(8, 2, c).time_s / 4)


def test_fp16_halves_ddps_gradient_bytes_in_the_same_buckets():
    w, c = _workload(), Cluster(2, LINK)
    full, half = predict("ddp", w, c), predict("ddp_fp16", w, c)
    assert half.wire_bytes == pytest.approx(full.wire_bytes / 2)
    assert half.step_s < full.step_s


@pytest.mark.parametrize(("warmup", "steps", "rounds"), [(0, 96, 25), (0, 97, 26), (3, 96, 25), (3, 98, 25)])
def test_post_local_sgd_over_a_fit_counts_its_warmup_and_rounds(warmup, steps, rounds):
    """Averaged after the first local step, every 4, and once after the last: ceil(S / 4) + 1 rounds."""
    w, c = _workload(), Cluster(2, LINK)
    p = predict("ddp_post_local_sgd", w, c, model_averaging_period=4)
    run = {"steps": steps, "strategy_config": {"warmup_steps": warmup}}
    fit = with_hook_warmup(p, run)
    plain = predict("ddp", w, c)
    expected = warmup * plain.wire_bytes + rounds * all_reduce(w.param_bytes, 2, c).wire_bytes
    assert fit.wire_bytes * steps == pytest.approx(expected)
    local_s = 32 * 3e-3 + 0.01
    round_s = all_reduce(w.param_bytes, 2, c).time_s
    assert fit.step_s * steps == pytest.approx(warmup * plain.step_s + (steps - warmup) * local_s + rounds * round_s)


def test_powersgd_over_a_fit_pays_its_plain_warmup_steps():
    w, c = _workload(), Cluster(2, LINK)
    p = predict("ddp_powersgd", w, c)
    fit = with_hook_warmup(p, {"steps": 10, "strategy_config": {"warmup_steps": 2}})
    assert fit.wire_bytes * 10 == pytest.approx(2 * all_reduce(w.param_bytes, 2, c).wire_bytes + 8 * p.wire_bytes)
    assert with_hook_warmup(predict("hpsgd", w, c), {"steps": 10}) == predict("hpsgd", w, c)  # not a hook


@pytest.mark.parametrize("name", ["torchft_local_sgd", "torchft_diloco"])
def test_torchft_sends_each_tensor_in_its_own_all_reduce_after_a_quorum(name):
    w, c = _workload(buffers=1000), Cluster(2, LINK)  # buffers: torchft does not synchronise them
    p = predict(name, w, c, sync_every=4)
    # a ring all-reduce of n float32 words over 2 ranks: 2 messages, 4 n bytes on the wire
    per_tensor = [2 * ALPHA + 4 * n * BYTE_S for n in w.tensor_words]
    assert p.step_s == pytest.approx(32 * 3e-3 + 0.01 + (TORCHFT_ROUND_S + sum(per_tensor)) / 4)
    assert p.wire_bytes == pytest.approx(4 * w.params / 4)
    assert (p.staleness, p.args) == (3, {"sync_every": 4})


@pytest.mark.parametrize(("steps", "rounds"), [(12, 3), (13, 4), (15, 4)])
def test_torchft_over_a_fit_averages_the_last_partial_period_once(steps, rounds):
    w, c = _workload(), Cluster(2, LINK)
    p = predict("torchft_local_sgd", w, c, sync_every=4)
    fit = with_whole_rounds(p, 32 * 3e-3 + 0.01, {"steps": steps})
    assert fit.wire_bytes * steps == pytest.approx(rounds * 4 * w.params)


def test_calibration_times_every_codec_on_a_group_of_one(one_rank_group):
    """With a process group already up, PowerSGD is left out (its DDP would wait for other ranks)."""
    costs = codec_seconds(nn.Linear(64, 64), codecs=("bf16", "int4", "powersgd"), repeats=1)
    assert set(costs) == {"bf16", "int4"} and min(costs.values()) > 0
    with pytest.raises(ValueError, match="`codecs` must be among"):
        codec_seconds(nn.Linear(4, 4), codecs=("fp8",))


def test_calibration_times_powersgd_on_a_group_it_creates():
    costs = codec_seconds(nn.Linear(64, 64), codecs=("powersgd",), repeats=1)
    assert set(costs) == {"powersgd"} and costs["powersgd"] >= 0
    assert not dist.is_initialized()


@pytest.mark.parametrize("strategy", ["hpsgd", "diloco"])
def test_a_codecs_cpu_time_is_added_once_per_window(strategy):
    free, c = _workload(), Cluster(2, LINK)
    charged = replace(free, codec_s_per_byte={"int4": 1e-8})
    plain = predict(strategy, free, c, window=8, compression="int4")
    costed = predict(strategy, charged, c, window=8, compression="int4")
    assert costed.step_s - plain.step_s == pytest.approx(1e-8 * free.param_bytes / 8)
    assert predict(strategy, charged, c, window=8, compression="bf16").step_s == pytest.approx(
        predict(strategy, free, c, window=8, compression="bf16").step_s
    )


def test_a_negative_codec_cost_is_refused_by_name():
    with pytest.raises(ValueError, match=r"`codec_s_per_byte\['int4'\]` must be >= 0 seconds, got -1.0"):
        replace(_workload(), codec_s_per_byte={"int4": -1.0})


def test_the_sweep_can_recommend_a_peer():
    """On a slow link with a model PowerSGD shrinks 100x, the synchronous peer is the pick."""
    w = replace(_workload(shapes=((1024, 1024), (1024,))), batch_size=256)
    slow = Cluster(8, Link(alpha=ALPHA, beta=4 * 1e-7))  # 10 MB/s
    row = {s: p for s in ("ddp", "ddp_powersgd", "localsgd") if (p := tune(s, w, slow)) is not None}
    assert row["ddp_powersgd"].args["powersgd_rank"] == 8  # the least compression within 5 % of the best
    pick = recommend(row)
    assert pick.strategy == "ddp_powersgd"
    assert row["localsgd"].samples_per_s < pick.samples_per_s / 0.95  # not more than 5 % faster
