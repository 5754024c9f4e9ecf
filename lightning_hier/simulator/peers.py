"""torch's DDP communication hooks and torchft's algorithms as the benchmarks run them.

The hooks are :mod:`lightning_hier.strategies.peers`, torchft's ``LocalSGD`` and ``DiLoCo``
:mod:`lightning_hier.strategies.torchft_peer`. These are the peers a user would pick instead of
this library's strategies, so the simulator predicts them beside its own (per optimizer step,
steady state; ``P`` parameter bytes, ``F`` float-buffer bytes):

==================  ==================================================================================
strategy            per optimizer step
==================  ==================================================================================
ddp_post_local_sgd  DDP's step whose hook sends nothing (``post_local_gradient_allreduce=False``), ``F``
                    broadcast before every forward; every ``model_averaging_period`` steps a blocking
                    all-reduce of ``P`` (torch's ``average_parameters`` flattens the parameters into one)
ddp_powersgd        the model in one DDP bucket (what gloo needs): after the backward, three blocking
                    all-reduces in turn (the tensors left uncompressed; the ``P`` factors; the ``Q``
                    factors) and the codec's CPU time (``Workload.codec_s_per_byte['powersgd']``)
ddp_fp16            DDP (:func:`~lightning_hier.simulator.strategies.ddp`) with float16 gradients: half
                    the bytes in the same buckets
torchft_local_sgd   torchft's ``LocalSGD`` (:mod:`lightning_hier.sync.torchft_peer`): local steps; every
                    ``sync_every`` steps a quorum through the lighthouse, one blocking all-reduce per
                    parameter tensor (float32; buffers are not synchronised) and ``should_commit``
torchft_diloco      torchft's ``DiLoCo``: the same traffic (the pseudo-gradients in place of the
                    parameters); its outer step's arithmetic is not modelled
==================  ==================================================================================

PowerSGD (Vogels, Karimireddy and Jaggi, NeurIPS 2019) views each gradient as a ``n x m`` matrix
(``shape[0] x rest``) and, at rank ``r = min(n, m, powersgd_rank)``, sends ``(n + m) r`` words
in place of ``n m`` when ``(n + m) r * min_compression_rate < n m``; the others (every vector)
go uncompressed (torch's ``_should_compress``). The first ``warmup_steps`` steps of both hooks
are plain all-reduces; that warm-up, and PostLocalSGD's averaging after the last step, belong to
the fit, not the steady state (``benchmarks/fit_model.py`` adds them to a run's prediction).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from lightning_hier.simulator.collectives import Comm, all_reduce, broadcast
from lightning_hier.simulator.inputs import Cluster, Workload
from lightning_hier.simulator.jitter import sync_wait
from lightning_hier.simulator.prediction import Prediction, compute_s
from lightning_hier.simulator.strategies import blocking_round, ddp, ddp_with_gradients, periodic

MIN_COMPRESSION_RATE = 2.0
"""torch's ``PowerSGDState`` default: a matrix is compressed only if that shrinks it at least twice."""


def powersgd_words(
    shapes: Sequence[Sequence[int]], rank: int, min_compression_rate: float = MIN_COMPRESSION_RATE
) -> tuple[int, int, int, int]:
    """``(uncompressed, p_factors, q_factors, compressed_numel)``: the words of PowerSGD's three all-reduces.

    ``compressed_numel`` is the gradients' words that the factors stand for (what the codec reads).
    """
    uncompressed = p_words = q_words = compressed = 0
    for shape in shapes:
        n = int(shape[0]) if shape else 1
        m = math.prod(shape) // n if n else 0
        r = min(n, m, rank)
        if (n + m) * r * min_compression_rate < n * m:
            p_words, q_words, compressed = p_words + n * r, q_words + m * r, compressed + n * m
        else:
            uncompressed += n * m
    return uncompressed, p_words, q_words, compressed


def _prediction(
    name: str,
    workload: Workload,
    cluster: Cluster,
    args: dict[str, Any],
    elapsed: float,
    comm: Comm,
    warmup_s: float,
    warmup: Comm,
    period: int = 1,
) -> Prediction:
    """``period`` steps that take ``elapsed`` seconds in all and send ``comm``.

    A warm-up step (gradients all-reduced plainly) takes ``warmup_s`` and sends ``warmup``.
    """
    busy = period * min(compute_s(workload, cluster))
    prediction = periodic(name, workload, cluster, args, period, elapsed, busy, comm, float(period - 1))
    detail = {
        "warmup_step_s": warmup_s,
        "warmup_wire_bytes": warmup.wire_bytes,
        "warmup_payload_bytes": warmup.payload_bytes,
    }
    return replace(prediction, detail=detail)


def ddp_post_local_sgd(workload: Workload, cluster: Cluster, model_averaging_period: int = 4) -> Prediction:
    """Post-local SGD (torch's hook): local steps, the parameters averaged every ``model_averaging_period`` steps.

    ``detail``: the averaging round alone (``round_s``, ``round_wire_bytes``, ``round_payload_bytes``)
    and a warm-up step (DDP's, gradients all-reduced).
    """
    p, period = cluster.workers, int(model_averaging_period)
    buffers = broadcast(workload.buffers * workload.word_bytes, p, cluster)
    average = all_reduce(workload.param_bytes, p, cluster)
    round_s = sync_wait(cluster, period) + average.time_s  # the average waits for the slowest replica
    elapsed = period * (max(compute_s(workload, cluster)) + buffers.time_s) + round_s
    args = {"model_averaging_period": period}
    plain = ddp(workload, cluster)
    warmup = Comm(0.0, plain.wire_bytes, plain.payload_bytes)
    comm = buffers.times(period) + average
    prediction = _prediction("ddp_post_local_sgd", workload, cluster, args, elapsed, comm, plain.step_s, warmup, period)
    round_detail = {
        "round_s": round_s,
        "round_wire_bytes": average.wire_bytes,
        "round_payload_bytes": average.payload_bytes,
    }
    return replace(prediction, detail={**prediction.detail, **round_detail})


def ddp_powersgd(
    workload: Workload, cluster: Cluster, powersgd_rank: int = 4, min_compression_rate: float = MIN_COMPRESSION_RATE
) -> Prediction:
    """PowerSGD (torch's hook) on one bucket: three all-reduces after the backward, with the codec's CPU time.

    ``detail``: ``codec_s`` and a warm-up step (the whole bucket all-reduced after the backward).
    """
    if not workload.tensor_shapes:
        raise ValueError(
            "ddp_powersgd: the workload needs `tensor_shapes` (PowerSGD compresses each tensor as a matrix)."
        )
    p, word = cluster.workers, workload.word_bytes
    uncompressed, p_words, q_words, compressed = powersgd_words(
        workload.tensor_shapes, powersgd_rank, min_compression_rate
    )
    buffers = broadcast(workload.buffers * word, p, cluster)
    comm = sum((all_reduce(words * word, p, cluster) for words in (uncompressed, p_words, q_words)), buffers)
    codec = workload.codec_s("powersgd", compressed * word)
    compute = max(compute_s(workload, cluster)) + sync_wait(cluster, 1)
    plain = buffers + all_reduce(workload.param_bytes, p, cluster)
    args = {"powersgd_rank": powersgd_rank}
    elapsed = compute + codec + comm.time_s
    prediction = _prediction("ddp_powersgd", workload, cluster, args, elapsed, comm, compute + plain.time_s, plain)
    return replace(prediction, detail={**prediction.detail, "codec_s": codec})


def ddp_fp16(workload: Workload, cluster: Cluster, bucket_mb: float = 25.0) -> Prediction:
    """DDP with its gradients cast to float16 for the all-reduce (the cast's CPU time is not modelled).

    torch's hook casts each bucket after DDP filled it, so the buckets are DDP's own.
    """
    return ddp_with_gradients(workload, cluster, bucket_mb, 2, "ddp_fp16")


TORCHFT_ROUND_S = 0.004
"""What a torchft synchronisation costs besides its all-reduces: the quorum (a request to the
lighthouse that returns when every replica has asked) and ``should_commit`` (its own manager
server). Measured on the benchmark machine's CPUs, two ranks over loopback, Lightning's
``BoringModel`` (2 tensors, 264 bytes) synchronised every step: 4.0-4.9 ms blocked per round,
the two all-reduces of a few hundred bytes included
(``benchmarks/notes/2026-11-29-torchft-peers.md``)."""


def _torchft(name: str, workload: Workload, cluster: Cluster, sync_every: int) -> Prediction:
    """``sync_every`` local steps, then a quorum and one blocking all-reduce per parameter tensor."""
    p, period = cluster.workers, int(sync_every)
    tensors = workload.tensor_words or (workload.params,)
    quorum = Comm(TORCHFT_ROUND_S)  # no payload: the lighthouse's request and should_commit
    comm = sum((all_reduce(words * workload.word_bytes, p, cluster) for words in tensors), quorum)
    work = [period * t for t in compute_s(workload, cluster)]
    return blocking_round(name, workload, cluster, {"sync_every": period}, period, work, comm)


def torchft_local_sgd(workload: Workload, cluster: Cluster, sync_every: int = 8) -> Prediction:
    """Predict torchft's LocalSGD: the parameters averaged every ``sync_every`` steps, a tensor at a time."""
    return _torchft("torchft_local_sgd", workload, cluster, sync_every)


def torchft_diloco(workload: Workload, cluster: Cluster, sync_every: int = 8) -> Prediction:
    """Predict torchft's DiLoCo: its pseudo-gradients travel as LocalSGD's parameters do."""
    return _torchft("torchft_diloco", workload, cluster, sync_every)


__all__ = [
    "MIN_COMPRESSION_RATE",
    "TORCHFT_ROUND_S",
    "ddp_fp16",
    "ddp_post_local_sgd",
    "ddp_powersgd",
    "powersgd_words",
    "torchft_diloco",
    "torchft_local_sgd",
]
