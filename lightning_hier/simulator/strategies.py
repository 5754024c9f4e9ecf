"""Per-strategy predictions: time per step and epoch, bytes per worker, blocked time, staleness.

Each model follows its algorithm module's communication pattern (what is sent per round, how
often, what overlaps). ``t_w = (b * (forward + backward) + step) / s_w`` is worker ``w``'s compute
per optimizer step (``b`` its batch, ``s_w`` its speed); synchronous collectives wait for the
slowest worker. Collective costs come from :mod:`lightning_hier.simulator.collectives`.

============  =====================================================================================
strategy      per optimizer step (``P`` parameter bytes, ``F`` float-buffer bytes, ``W`` workers)
============  =====================================================================================
no-comm       ``max_w t_w``: the compute-only bound (Local SGD with an infinite period)
ddp           all-reduce of ``P`` in DDP's buckets (first 1 MiB, then ``bucket_mb``; whole tensors
              in reverse order when the workload lists them) behind the
              backward; the last bucket (the first layers' gradients) is ready only at its end;
              ``F`` broadcast before every forward (``broadcast_buffers``)
diloco        every ``window`` steps an all-reduce of each of ``F`` fragments (``P / F``, compressed as
              hpsgd's, with the codec's CPU time), blocking, or hidden behind ``fragment_sync_delay`` steps
hpsgd         every ``window`` steps one all-reduce of ``P`` (bf16: ``P / 2``; int8 / int4: 1 or 1/2
              byte per parameter + a 4-byte scale per 64; the codec's CPU time) + ``F``, hidden
              behind the next window: ``max(H t + cpu cost, all-reduce) / H``; staleness ``H``
              (``delay`` ``D``: hidden behind ``D`` steps, ``(H - D) t + max(D t + cpu, all-reduce)``)
localsgd      every ``tau`` steps a blocking all-reduce of ``P`` + ``F`` + the 8-byte consensus distance
easgd         as localsgd (the center is the mean of the replicas)
lsgd          as localsgd, with the leader's replica *broadcast* after an all-reduce of ``W`` losses
mgrawa        as localsgd + an all-reduce of the ``W x 2`` float64 score table (``lgrawa``:
lgrawa        ``W x (tensors + 1)``) + the norm probe: one more forward and backward per round
              (``probe='step'``: none)
dbs           batch shares proportional to speed (every worker's step takes ``B c / sum s``), then
              a blocking all-reduce of ``P`` + ``F``; every ``rebalance_every`` steps a ``W x 4``
              float64 table
decoupled     ``N x K``: stages cut from the workload's blocks (balanced as the strategy does); each
              stage's forward, delayed backward and all-reduce over the ``N`` replicas, with its
              activations and gradients each on their own connection, played out iteration by
              iteration (:mod:`lightning_hier.simulator.pipeline`); ``schedule='sync'``
              serialises the stages; staleness ``2 (K - 1)`` (``ddg``: ``K - 1``)
grid2d        the planner's alpha-beta cost of the ``Pr x Pc`` grid (blocking), compute ``B c / W``
============  =====================================================================================

Assumptions (docs: README, "Predicting performance"): steady state (start-up, the first
windows, DBS's warm-up and end-of-fit rounds are left out of the per-step numbers); compute does
not depend on the batch split beyond being linear in samples; all links are equal (no node
hierarchy); with ``Cluster.jitter_s > 0`` every synchronisation of all workers (a DDP step, an
HPSGD window, an averaging round, a DBS step, a grid or pipeline iteration) adds the expected
wait for the slowest worker (:mod:`lightning_hier.simulator.jitter`). The asynchronous strategies
(``asgd``, ``softsync``, ``dbs_async``, GRAWA with ``rounds='async'``) are in
:mod:`lightning_hier.simulator.asynchronous`; the registry of every model is
:mod:`lightning_hier.simulator.registry`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from lightning_hier.algorithms.decoupled.schedule import Schedule
from lightning_hier.algorithms.hpsgd import auto_delay
from lightning_hier.planner.cost import Layer, inference_cost, network_cost
from lightning_hier.simulator.collectives import NONE, Comm, all_reduce, broadcast, overlapped, p2p
from lightning_hier.simulator.inputs import Cluster, Workload, split_blocks
from lightning_hier.simulator.jitter import sync_wait
from lightning_hier.simulator.pipeline import StageTimes, epoch_time, iteration_period
from lightning_hier.simulator.prediction import FLOAT64, Prediction, batch_shares, compute_s, steps_per_epoch

MiB = 2**20


def _buffer_bytes(workload: Workload, sync_buffers: bool) -> int:
    return workload.buffers * workload.word_bytes if sync_buffers else 0


def periodic(
    name: str,
    workload: Workload,
    cluster: Cluster,
    args: dict[str, Any],
    period: int,
    elapsed: float,
    busy: float,
    comm: Comm,
    staleness: float,
) -> Prediction:
    """A strategy that repeats ``period`` steps taking ``elapsed`` seconds, ``comm`` once per repetition.

    ``busy`` is the least loaded worker's own work in a repetition (the rest it waits).
    """
    return Prediction(
        name,
        args,
        cluster.workers,
        step_s=elapsed / period,
        samples_per_step=workload.batch_size * cluster.workers,
        steps_per_epoch=steps_per_epoch(workload, cluster.workers),
        wire_bytes=comm.wire_bytes / period,
        payload_bytes=comm.payload_bytes / period,
        blocked_s=max(0.0, elapsed - busy) / period,
        staleness=staleness,
        detail={"round_comm_s": comm.time_s, "round_payload_bytes": comm.payload_bytes},
    )


def blocking_round(
    name: str, workload: Workload, cluster: Cluster, args: dict[str, Any], period: int, work: list[float], comm: Comm
) -> Prediction:
    """``period`` steps of compute (``work``: each worker's seconds for them), then a blocking ``comm``.

    The collective waits for every worker, so the slowest one's jitter since the last round too.
    """
    elapsed = max(work) + sync_wait(cluster, period) + comm.time_s
    return periodic(name, workload, cluster, args, period, elapsed, min(work), comm, float(period - 1))


# ---------------------------------------------------------------------------- the strategies
def no_comm(workload: Workload, cluster: Cluster) -> Prediction:
    """Compute only: every worker trains alone (the throughput bound of any strategy; nobody waits)."""
    work = compute_s(workload, cluster)
    return periodic("no-comm", workload, cluster, {}, 1, max(work), min(work), NONE, 0.0)


def ddp_buckets(nbytes: int, bucket_mb: float = 25.0, tensor_bytes: Sequence[int] = ()) -> list[float]:
    """DDP's gradient buckets in reduction order: 1 MiB first, then ``bucket_mb`` MiB.

    With ``tensor_bytes`` (the parameter tensors in registration order) the buckets hold whole
    tensors as DDP assigns them: in reverse order, a bucket closes once it reaches its cap, so a
    big tensor near the output fills the first bucket and the last one holds only the first
    layers. Without them the bytes are cut at the caps.
    """
    sizes: list[float] = []
    cap, current = float(MiB), 0.0
    if tensor_bytes:
        for size in reversed(tensor_bytes):
            current += size
            if current >= cap:
                sizes.append(current)
                current, cap = 0.0, bucket_mb * MiB
        return [*sizes, current] if current else sizes
    left = float(nbytes)
    while left > 0:
        sizes.append(min(cap, left))
        left -= sizes[-1]
        cap = bucket_mb * MiB
    return sizes


def ddp(workload: Workload, cluster: Cluster, bucket_mb: float = 25.0) -> Prediction:
    """Lightning's DDP: bucketed gradient all-reduce overlapped with the backward."""
    return ddp_with_gradients(workload, cluster, bucket_mb, workload.word_bytes, "ddp")


def ddp_with_gradients(
    workload: Workload, cluster: Cluster, bucket_mb: float, gradient_bytes: float, name: str
) -> Prediction:
    """DDP whose buckets carry ``gradient_bytes`` per parameter (float16 gradients: 2); buckets fill as float32."""
    p, speed = cluster.workers, min(cluster.speed_list)
    tensors = [w * workload.word_bytes for w in workload.tensor_words]
    scale = gradient_bytes / workload.word_bytes
    buckets = [all_reduce(n * scale, p, cluster) for n in ddp_buckets(workload.param_bytes, bucket_mb, tensors)]
    early = sum(buckets[:-1], NONE)
    last = buckets[-1] if buckets else NONE
    buffers = broadcast(workload.buffers * workload.word_bytes, p, cluster)
    b = workload.batch_size
    backward, blocked_early = overlapped(b * workload.backward_s / speed, early, cluster)
    slowest = b * workload.forward_s / speed + backward + workload.step_s / speed
    # the forward's buffer broadcast and the last bucket wait for every worker: one synchronisation per step
    step = slowest + sync_wait(cluster, 1) + last.time_s + buffers.time_s
    comm = early + last + buffers
    fastest = min(compute_s(workload, cluster))
    return Prediction(
        name,
        {"bucket_mb": bucket_mb},
        p,
        step_s=step,
        samples_per_step=b * p,
        steps_per_epoch=steps_per_epoch(workload, p),
        wire_bytes=comm.wire_bytes,
        payload_bytes=comm.payload_bytes,
        blocked_s=step - fastest - cluster.cpu_s_per_byte * early.wire_bytes,
        detail={"allreduce_s": sum(c.time_s for c in buckets), "exposed_s": last.time_s + blocked_early},
    )


# bytes per parameter on the wire: bfloat16, or int8 / 4-bit codes with a float32 scale per 64 (comm.quantized)
_WIRE_WORD = {"bf16": 2.0, "int8": 1.0 + 4 / 64, "int4": 0.5 + 4 / 64}


def _change_reduction(workload: Workload, cluster: Cluster, params: float, compression: str, extra: float) -> Comm:
    """The all-reduce of a change of ``params`` words (compressed as asked) and ``extra`` bytes beside it.

    The quantized all-reduce (:mod:`lightning_hier.comm.quantized`) moves a ring all-reduce's bytes;
    CommStats counts its all-to-all's input and its all-gather's (a ``1 / W`` shard) as payload.
    """
    change = params * _WIRE_WORD.get(compression, workload.word_bytes)
    comm = all_reduce(change + extra, cluster.workers, cluster)
    if compression in ("int8", "int4"):
        comm = replace(comm, payload_bytes=comm.payload_bytes + change / cluster.workers)
    return comm


def hpsgd(
    workload: Workload,
    cluster: Cluster,
    window: int = 2,
    compression: str = "none",
    sync_buffers: bool = True,
    delay: int | str | None = None,
) -> Prediction:
    """HPSGD: one all-reduce per window, hidden behind the next window's compute.

    The quantized forms (``int8``, ``int4``) are costed as a ring all-reduce of their payload
    (the all-to-all and all-gather of :mod:`lightning_hier.comm.quantized` move the same bytes),
    and every compressed form adds its codec's CPU time (``Workload.codec_s_per_byte``) to the
    window: the training thread encodes and decodes. With ``delay`` the reduction hides behind
    ``delay`` steps instead of the window's ``window``; ``'auto'`` is
    :func:`~lightning_hier.algorithms.hpsgd.auto_delay`'s, from the predicted reduction.
    """
    comm = _change_reduction(workload, cluster, workload.params, compression, _buffer_bytes(workload, sync_buffers))
    work = compute_s(workload, cluster)
    if delay == "auto":
        phases = 2 if compression in ("int8", "int4") else 1  # the quantized exchange and gather
        delay = auto_delay([comm.time_s / phases] * phases, max(work), window)
    hidden = window if delay is None else int(delay)
    codec = workload.codec_s(compression, workload.param_bytes)  # encoded at the launch, on the training thread
    period, _ = overlapped(hidden * max(work), comm, cluster)
    period += codec + (window - hidden) * max(work) + sync_wait(cluster, window)  # each reduction needs every replica
    fastest = window * min(work) + codec + cluster.cpu_s_per_byte * comm.wire_bytes
    args = {"window": window, "compression": compression, "sync_buffers": sync_buffers, "delay": delay}
    return periodic("hpsgd", workload, cluster, args, window, period, fastest, comm, float(hidden))


def diloco(
    workload: Workload,
    cluster: Cluster,
    window: int = 64,
    fragments: int = 1,
    fragment_sync_delay: int = 0,
    compression: str = "none",
    sync_buffers: bool = True,
) -> Prediction:
    """DiLoCo: every ``window`` steps an all-reduce of each of ``F`` fragments (about ``P / F``).

    ``fragment_sync_delay = 0``: each fragment's reduction blocks. Otherwise it hides behind that
    many steps' compute, and only what exceeds them (``max(0, all-reduce - D t - cpu cost)``) is
    waited for. The buffers go with the first fragment. Each fragment's codec CPU time
    (``Workload.codec_s_per_byte``) is on the training thread, as HPSGD's.
    """
    count = max(1, min(int(fragments), workload.tensors or int(fragments)))
    work = compute_s(workload, cluster)
    step = max(work)
    buffers = _buffer_bytes(workload, sync_buffers)
    comms = [
        _change_reduction(workload, cluster, workload.params / count, compression, buffers if f == 0 else 0)
        for f in range(count)
    ]
    # each fragment's encoding (on the training thread) and what gloo takes from the compute it overlaps
    codec = workload.codec_s(compression, workload.param_bytes / count)
    cpu = [codec + cluster.cpu_s_per_byte * c.wire_bytes for c in comms]
    if fragment_sync_delay == 0:
        waited = sum(c.time_s for c in comms)
    else:
        waited = sum(max(0.0, c.time_s - fragment_sync_delay * step - u) for c, u in zip(comms, cpu, strict=True))
    total = sum(comms[1:], comms[0])
    period = window * step + sum(cpu) + waited + sync_wait(cluster, window)
    args = {
        "window": window,
        "fragments": count,
        "fragment_sync_delay": fragment_sync_delay,
        "compression": compression,
        "sync_buffers": sync_buffers,
    }
    return periodic(
        "diloco",
        workload,
        cluster,
        args,
        window,
        period,
        window * min(work) + sum(cpu),
        total,
        float(window - 1 + fragment_sync_delay),  # as Local SGD's, and a fragment's sum lands D steps late
    )


def _round(workload: Workload, cluster: Cluster, sync_buffers: bool, center: Comm) -> Comm:
    """One averaging round: the center's collectives, the consensus distance, the buffers."""
    p = cluster.workers
    return center + all_reduce(FLOAT64, p, cluster) + all_reduce(_buffer_bytes(workload, sync_buffers), p, cluster)


def _averaging(
    name: str, workload: Workload, cluster: Cluster, tau: int, sync_buffers: bool, center: Comm, probe: float = 0.0
) -> Prediction:
    work = [tau * t + probe / s for t, s in zip(compute_s(workload, cluster), cluster.speed_list, strict=True)]
    comm = _round(workload, cluster, sync_buffers, center)
    return blocking_round(name, workload, cluster, {"tau": tau, "sync_buffers": sync_buffers}, tau, work, comm)


def localsgd(workload: Workload, cluster: Cluster, tau: int = 8, sync_buffers: bool = True) -> Prediction:
    """Local SGD: a blocking mean of the replicas every ``tau`` steps."""
    center = all_reduce(workload.param_bytes, cluster.workers, cluster)
    return _averaging("localsgd", workload, cluster, tau, sync_buffers, center)


def easgd(workload: Workload, cluster: Cluster, tau: int = 4, sync_buffers: bool = True) -> Prediction:
    """EASGD: the elastic round needs the replicas' mean, as Local SGD's."""
    center = all_reduce(workload.param_bytes, cluster.workers, cluster)
    return _averaging("easgd", workload, cluster, tau, sync_buffers, center)


def lsgd(workload: Workload, cluster: Cluster, tau: int = 4, sync_buffers: bool = True) -> Prediction:
    """LSGD: the running losses (all-reduce of ``W`` float64), then the leader's replica (broadcast)."""
    p = cluster.workers
    center = all_reduce(p * FLOAT64, p, cluster) + broadcast(workload.param_bytes, p, cluster)
    return _averaging("lsgd", workload, cluster, tau, sync_buffers, center)


def _grawa(
    name: str,
    workload: Workload,
    cluster: Cluster,
    width: int,
    tau: int,
    sync_buffers: bool,
    probe: str,
    rounds: str,
    **async_args: Any,
) -> Prediction:
    """GRAWA's model (``width`` weights per worker); ``async_args`` are the asynchronous rounds' options.

    ``async_args`` (``sampler``, ``server_shares_core``) only apply to ``rounds='async'``; a shared
    queue with lock-step rounds is an error (every worker takes the same steps there).
    """
    if rounds == "async":
        # imported here: the asynchronous models build on this module's shared pieces
        from lightning_hier.simulator.asynchronous import grawa_async

        return grawa_async(name, workload, cluster, tau, probe, width, **async_args)
    if rounds != "sync":
        raise ValueError(f"{name}: `rounds` must be 'sync' or 'async', got {rounds!r}.")
    sampler = async_args.get("sampler", "split")
    if sampler != "split":
        raise ValueError(f"{name}: `sampler`={sampler!r} needs rounds='async' (lock-step rounds: equal steps).")
    p = cluster.workers
    center = all_reduce(p * (width + 1) * FLOAT64, p, cluster) + all_reduce(workload.param_bytes, p, cluster)
    extra = 0.0 if probe == "step" else workload.batch_size * workload.sample_s
    prediction = _averaging(name, workload, cluster, tau, sync_buffers, center, probe=extra)
    prediction.args["probe"] = probe
    return prediction


def mgrawa(
    workload: Workload,
    cluster: Cluster,
    tau: int = 32,
    sync_buffers: bool = True,
    probe: str = "fresh",
    rounds: str = "sync",
    sampler: str = "split",
    server_shares_core: bool = True,
) -> Prediction:
    """MGRAWA: one weight per worker (the score table has a score and a norm per worker)."""
    async_args = {"sampler": sampler, "server_shares_core": server_shares_core}
    return _grawa("mgrawa", workload, cluster, 1, tau, sync_buffers, probe, rounds, **async_args)


def lgrawa(
    workload: Workload,
    cluster: Cluster,
    tau: int = 32,
    sync_buffers: bool = True,
    probe: str = "fresh",
    rounds: str = "sync",
    sampler: str = "split",
    server_shares_core: bool = True,
) -> Prediction:
    """LGRAWA: one weight per worker and parameter tensor."""
    async_args = {"sampler": sampler, "server_shares_core": server_shares_core}
    return _grawa("lgrawa", workload, cluster, workload.tensors, tau, sync_buffers, probe, rounds, **async_args)


def dbs(
    workload: Workload,
    cluster: Cluster,
    rebalance_every: int = 20,
    sync_buffers: bool = True,
    shares: Sequence[float] | None = None,
) -> Prediction:
    """DBS: shares of the global batch proportional to speed, then a blocking gradient all-reduce.

    ``shares`` fixes the per-worker batches instead (DBS before its first rebalance keeps its
    initial sizes, equal by default: :func:`~.prediction.batch_shares`).
    """
    shares = batch_shares(workload, cluster, shares)
    work = compute_s(workload, cluster, shares)
    p = cluster.workers
    grads = all_reduce(workload.param_bytes + _buffer_bytes(workload, sync_buffers), p, cluster)
    table = all_reduce(p * 4 * FLOAT64, p, cluster).times(1 / rebalance_every)
    prediction = blocking_round("dbs", workload, cluster, {"rebalance_every": rebalance_every}, 1, work, grads + table)
    prediction.detail["shares"] = shares
    return prediction


def decoupled(
    workload: Workload,
    cluster: Cluster,
    pipe: int = 2,
    schedule: str = "fdg",
    order: str = "forward_first",
    wire_dtype: str | None = None,
) -> Prediction:
    """The N x K decoupled pipeline: an epoch of lock-step iterations, played out by :func:`~.pipeline.epoch_time`.

    Per step means per iteration, over an epoch of ``steps_per_epoch`` iterations: its batches and
    its drain. ``step_s`` is the epoch's mean iteration (``detail['period_s']``: the steady one of
    a long epoch); the samples and bytes per step are the epoch's over its iterations, so
    ``samples_per_s`` is the epoch's trained samples over its time.

    ``wire_dtype='bf16'`` sends activations and their gradients as 2-byte words (the labels stay
    int64). A stage's forward is the workload's measured forward share of its blocks' compute.
    """
    if wire_dtype not in (None, "bf16"):
        raise ValueError(f"decoupled: `wire_dtype` must be None or 'bf16', got {wire_dtype!r}.")
    word = 2 if wire_dtype == "bf16" else workload.word_bytes
    if not workload.blocks:
        raise ValueError(f"decoupled: workload {workload.name!r} has no per-block costs; calibrate it with blocks.")
    if cluster.workers % pipe:
        raise ValueError(f"decoupled: `pipe` {pipe} must divide the {cluster.workers} workers.")
    replicas, b, speed = cluster.workers // pipe, workload.batch_size, min(cluster.speed_list)
    plan = Schedule(schedule, pipe, order)
    stages = split_blocks(workload.blocks, pipe)
    step_share = workload.step_s / max(1, workload.params)
    forward_share = workload.forward_share
    labels = b * FLOAT64  # int64 targets travel with the activations
    activations = [p2p(b * blocks[-1].out_words * word + labels, cluster) for blocks in stages[:-1]]
    gradients = [p2p(b * blocks[-1].out_words * word, cluster) for blocks in stages[:-1]]
    wire, payload, times, compute = 0.0, 0.0, [], []
    for k, blocks in enumerate(stages):
        params = sum(bl.params for bl in blocks)
        work = (b * sum(bl.compute_s for bl in blocks) + step_share * params) / speed
        reduce = all_reduce(params * workload.word_bytes, replicas, cluster)
        sent = (activations[k] if k < pipe - 1 else NONE) + (gradients[k - 1] if k > 0 else NONE)
        # a decoupled message travels while the stage computes, and its copies run on the same core; a
        # locked one is waited for, its copies are its transfer time
        behind = (NONE if plan.forward_locked else _boundaries(activations, k)) + (
            NONE if plan.backward_locked else _boundaries(gradients, k)
        )
        busy = work + cluster.cpu_s_per_byte * behind.wire_bytes
        last = k == pipe - 1
        # the mean over the replicas runs where the stage's update does: after its (delayed) backward
        forward = busy + reduce.time_s if last else forward_share * busy
        times.append(StageTimes(forward, 0.0 if last else (1 - forward_share) * busy + reduce.time_s))
        compute.append(work)
        out = sent + reduce
        wire, payload = wire + out.wire_bytes, payload + out.payload_bytes
    links = ([c.time_s for c in activations], [c.time_s for c in gradients])
    batches = int(steps_per_epoch(workload, replicas))
    iterations = batches + plan.drain_iterations
    period = iteration_period(times, *links, schedule, order)
    epoch = epoch_time(times, *links, batches, schedule, order, period)
    # every iteration's activations, gradients and reductions tie each worker to its neighbours
    step = epoch / iterations + sync_wait(cluster, 1)
    # only the batches' messages and updates travel: the fill's and the drain's iterations send none
    wire, payload = wire * batches / iterations, payload * batches / iterations
    arguments = {"pipe": pipe, "schedule": schedule, "order": order}
    if wire_dtype:
        arguments["wire_dtype"] = wire_dtype
    return Prediction(
        "decoupled",
        arguments,
        cluster.workers,
        step_s=step,
        samples_per_step=b * replicas * batches / iterations,
        steps_per_epoch=iterations,
        wire_bytes=wire / pipe,
        payload_bytes=payload / pipe,
        blocked_s=step - min(compute),
        staleness=float(plan.staleness(0)),
        detail={
            "stage_s": [t.forward_s + t.backward_s for t in times],
            "stage_blocks": [len(s) for s in stages],
            "drain": plan.drain_iterations,
            "period_s": period,
        },
    )


def _boundaries(messages: Sequence[Comm], k: int) -> Comm:
    """Stage ``k``'s share of one direction's messages: those of its boundaries before and after it."""
    return sum((messages[j] for j in (k - 1, k) if 0 <= j < len(messages)), NONE)


def grid2d(
    workload: Workload, cluster: Cluster, layers: Sequence[Layer] = (), grid: tuple[int, int] | None = None
) -> Prediction:
    """The ``Pr x Pc`` grid: the planner's cost model, blocking, compute split evenly over the grid."""
    from lightning_hier.planner.plan import best_grid

    if not layers:
        raise ValueError(f"grid2d: workload {workload.name!r} needs its layer list (planner.model_layers).")
    p, total = cluster.workers, workload.batch_size * cluster.workers
    if grid is None:
        grid = best_grid(list(layers), total, p, links=cluster.link).grid
    pr, pc = grid
    cost = network_cost(list(layers), pr, pc, total)
    comm_s = cost.time(cluster.link)
    work = [total * workload.sample_s / p / s + workload.step_s / pr / s for s in cluster.speed_list]
    step = max(work) + sync_wait(cluster, 1) + comm_s
    words = cost.words * workload.word_bytes
    return Prediction(
        "grid2d",
        {"grid": (pr, pc)},
        p,
        step_s=step,
        samples_per_step=total,
        steps_per_epoch=max(1, workload.samples_per_epoch // total),
        wire_bytes=words,
        payload_bytes=words,
        blocked_s=step - min(work),
        detail={
            "comm_s": comm_s,
            "messages": cost.messages,
            # a validation sample's forward through the grid (one per batch column) communicates too
            "validation_bytes_per_sample": inference_cost(list(layers), pr, pc, pc).words * workload.word_bytes,
        },
    )
