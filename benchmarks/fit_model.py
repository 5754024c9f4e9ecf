"""The steady-state prediction over a measured fit: what a run does beside its steady steps.

The simulator predicts the steady state (:mod:`lightning_hier.simulator`); a benchmark run is a
short fit around it. This module adds what the fit has beside the steady steps, each from the
run's configuration and counts (never from its timings): each validation's consensus on the
training clock, DBS's warm-up at the initial batch sizes, the pipeline's drain, the averaging
rounds a fit actually completes (a round every ``tau`` steps, counted over the fit), the
asynchronous GRAWA workers' final partial reports, the grid's validation forwards and torch's
DDP hooks' plain warm-up steps.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from lightning_hier.algorithms.diloco import fragment_offsets
from lightning_hier.simulator import Cluster, Prediction, Workload, predict


def mean_steps(run: dict[str, Any]) -> float:
    """The run's optimizer steps per rank, on average: with ``sampler='shared'`` a fast rank takes more."""
    steps = run.get("rank_steps") or [run["steps"]]
    return sum(steps) / len(steps)


def with_consensus(p: Prediction, cluster: Cluster, run: dict[str, Any]) -> Prediction:
    """The fit's mean step with the consensus each validation needs (:func:`validation_bytes`).

    The Recorder keeps that consensus on the training clock (the strategy builds it after the
    validation hook), and the calibration already leaves the ``no-comm`` run's own out. It is one
    transfer of the model per epoch, blocking: its wire bytes at the link's rate, or at a blocking
    collective's own CPU cost per byte where that is slower. At 100 Mbit/s the MLP's 21 MB take 1.8 s, a fifth of a
    16-step run. HPSGD sends nothing for it but waits for the window in flight: at most one
    window's reduction, which is what is charged.
    """
    _, wire = validation_bytes(p, run)
    if p.strategy == "hpsgd":
        consensus_s = float(p.detail.get("round_comm_s", 0.0))
    else:
        consensus_s = wire * max(cluster.byte_s, cluster.collective_s_per_byte)
    if not consensus_s or not run.get("steps"):
        return p
    step_s = p.step_s + run["epochs"] * consensus_s / mean_steps(run)
    return replace(p, step_s=step_s, detail={**p.detail, "consensus_s": consensus_s})


REBALANCED = ("dbs", "dbs_async")
"""DBS's strategies: their first ``warmup_steps + rebalance_every`` steps keep the initial batch sizes."""


def with_warmup(steady: Prediction, workload: Workload, cluster: Cluster, run: dict[str, Any]) -> Prediction:
    """DBS over the run's whole fit: its first steps at the initial sizes, the rest at the steady shares.

    DBS measures nothing in its first ``warmup_steps`` steps and rebalances first after
    ``warmup_steps + rebalance_every``; until then every worker keeps its initial size (equal,
    unless ``initial_sizes`` is given). A short run spends much of its fit there: 25 of 48 steps.
    The fit's mean step is the step-weighted mean of the two predictions (closed form).
    """
    config = run.get("strategy_config") or {}
    early = int(config.get("warmup_steps", 5)) + int(config.get("rebalance_every", 20))
    steps = round(mean_steps(run))
    sizes = config.get("initial_sizes") or [workload.batch_size] * cluster.workers
    initial = predict(steady.strategy, workload, cluster, **steady.args, shares=sizes)
    if steady.args.get("sampler") == "shared":
        return with_claimed_warmup(steady, initial, early, steps * steady.samples_per_step)
    n = min(early, steps)
    step_s = (n * initial.step_s + (steps - n) * steady.step_s) / steps
    detail = {**steady.detail, "initial_steps": n, "initial_step_s": initial.step_s, "steady_step_s": steady.step_s}
    return replace(steady, step_s=step_s, detail=detail)


def with_claimed_warmup(steady: Prediction, initial: Prediction, early: int, samples: float) -> Prediction:
    """:func:`with_warmup` with the shared queue: the initial sizes last until the *slowest* worker
    has made its first ``early`` claims (each worker measures its own speed), and meanwhile the
    fast workers claim more of the epoch. The fit's ``samples`` are split by time: the first
    ``early`` slowest cycles at the initial rate, the rest at the steady one; the bytes per step are
    mixed by the same share of the samples (a 1-epoch run at 100 Mbit/s: the straggler's 20 claims
    never reach its first estimate, so every claim keeps the initial size)."""
    warm_s = early * max(initial.detail["cycle_s"])
    warm = min(samples, warm_s * initial.samples_per_s)
    fit_s = warm / initial.samples_per_s + (samples - warm) / steady.samples_per_s
    share = warm / samples
    detail = {
        **steady.detail,
        "initial_step_s": initial.step_s,
        "steady_step_s": steady.step_s,
        "initial_cycle_s": initial.detail["cycle_s"],
        "initial_samples_share": share,
    }
    return replace(
        steady,
        step_s=fit_s / (samples / steady.samples_per_step),
        wire_bytes=share * initial.wire_bytes + (1 - share) * steady.wire_bytes,
        detail=detail,
    )


SERVED = ("asgd", "softsync", "dbs_async")
"""The parameter-server strategies: each meeting pulls the server's model and broadcasts it (not in CommStats)."""


def validation_bytes(p: Prediction, run: dict[str, Any]) -> tuple[float, float]:
    """``(payload, wire)`` bytes per rank of the consensus that each epoch's validation needs.

    The averaging family when an epoch does not end on a round: one all-reduce of the parameters
    (LSGD: a broadcast); HPSGD: none (it validates ``S`` advanced by the window in flight, which
    every rank already has); GRAWA's asynchronous rounds: a pull of the server's center at
    every validation (point-to-point); the parameter-server strategies: a pull and a broadcast
    of the server's model, neither counted by ``CommStats``.
    """
    per_epoch = run["steps"] / run["epochs"]
    model = 4 * float((run.get("model") or {}).get("parameters") or 0)  # float32 parameters
    share = (p.workers - 1) / p.workers
    if p.strategy in SERVED:
        return 0.0, 2 * share * model  # the pull's reply and the broadcast, both from rank 0
    if p.args.get("rounds") == "async":
        return model, share * model
    if "tau" in p.args and per_epoch % int(p.args["tau"]) != 0:
        return model, share * model * (1 if p.strategy == "lsgd" else 2)
    return 0.0, 0.0


def validation_forward_bytes(p: Prediction, run: dict[str, Any]) -> float:
    """Bytes per rank and epoch that the validation forwards themselves send (payload and wire).

    The grid's: each validated sample's activations are gathered across the MODEL rows
    (``detail['validation_bytes_per_sample']``, times the samples the run's rank 0 validated). The
    other strategies validate a whole model on every rank. Not on the training clock: the
    Recorder stops it at the first validation batch. Runs recorded before ``val_samples``: 0.
    """
    per_sample = float(p.detail.get("validation_bytes_per_sample", 0.0))
    return per_sample * float(run.get("val_samples") or 0) / int(run["epochs"])


def with_whole_rounds(p: Prediction, compute_s: float, run: dict[str, Any]) -> Prediction:
    """Lock-step averaging over the fit: the rounds the fit completes, not the steady state's share of them.

    A round fires every ``tau`` steps counted over the fit, so a fit of ``S`` steps completes
    ``floor(S / tau)`` rounds where the steady state spreads ``S / tau`` (a partial period at the end
    is the final round, which :func:`validation_bytes` counts as each epoch's consensus; torchft's
    peers, whose validation needs none, count it here). A 24-step fit with GRAWA's default ``tau=32``
    completes none: its steady state would add three quarters of a round's bytes and time.
    ``compute_s``: the slowest worker's compute per step; the rest of the steady step (the round,
    its probe and the wait for the slowest worker) scales with the rounds.
    """
    tau = p.args.get("tau", p.args.get("sync_every"))
    steps = mean_steps(run) if run.get("steps") else 0.0
    if tau is None or p.args.get("rounds") == "async" or steps <= 0:
        return p
    rounds = math.floor(steps / int(tau))
    if "sync_every" in p.args and rounds * int(tau) < steps:
        rounds += 1  # torchft's peers: the end of fit averages the steps since the last round once
    share = rounds * int(tau) / steps
    if share == 1.0:
        return p
    return replace(
        p,
        step_s=compute_s + share * max(0.0, p.step_s - compute_s),
        wire_bytes=share * p.wire_bytes,
        payload_bytes=share * p.payload_bytes,
        blocked_s=share * p.blocked_s,
        detail={**p.detail, "rounds_share": share},
    )


def with_whole_windows(p: Prediction, run: dict[str, Any]) -> Prediction:
    """HPSGD's and DiLoCo's reductions over the fit, where the steady state counts ``S / H``.

    HPSGD launches at step 1, then every ``window`` steps, and at the end of the fit sends the
    steps since the last launch (:meth:`~lightning_hier.algorithms.hpsgd.HPSGD.finalize`): a fit of
    ``S`` steps makes ``1 + ceil((S - 1) / H)`` reductions. DiLoCo's fragment ``f`` reduces at the
    steps ``t`` with ``t mod H`` its offset (:func:`~lightning_hier.algorithms.diloco.fragment_offsets`)
    and once more at the end if steps followed its last one, each ``1 / F`` of the model. Only the
    bytes change: HPSGD's first reduction is hidden and the end of fit's follows the training.
    """
    steps = int(run.get("steps") or 0)
    window = p.args.get("window")
    if p.strategy not in ("hpsgd", "diloco") or window is None or steps <= 0:
        return p
    h = int(window)
    reductions: float
    if p.strategy == "hpsgd":
        reductions = 1 + math.ceil((steps - 1) / h)
    else:
        offsets = fragment_offsets(h, int(p.args.get("fragments", 1)))
        synced = [range(o or h, steps + 1, h) for o in offsets]  # offset 0 first syncs at step H
        reductions = sum(len(s) + (not s or s[-1] < steps) for s in synced) / len(offsets)
    share = reductions * h / steps
    return replace(
        p,
        wire_bytes=share * p.wire_bytes,
        payload_bytes=share * p.payload_bytes,
        detail={**p.detail, "reductions_share": share},
    )


def with_hook_warmup(p: Prediction, run: dict[str, Any]) -> Prediction:
    """torch's DDP hooks over the fit: their plain warm-up steps, and PostLocalSGD's rounds counted.

    The first ``warmup_steps`` steps all-reduce the gradients as DDP does (PowerSGD's minimum is 2:
    on a 100 Mbit/s link those two steps are a third of a 96-step run's communication time). Then
    PostLocalSGD averages right after the first local step and every ``model_averaging_period``
    steps, and the strategy averages once more after the last step: a fit of ``S`` local steps makes
    ``ceil(S / period) + 1`` rounds where the steady state counts ``S / period``.
    """
    steps = int(run.get("steps") or 0)
    if "warmup_step_s" not in p.detail or steps <= 0:
        return p
    warm = min(int((run.get("strategy_config") or {}).get("warmup_steps") or 0), steps)
    local = steps - warm
    seconds = warm * p.detail["warmup_step_s"] + local * p.step_s
    wire = warm * p.detail["warmup_wire_bytes"] + local * p.wire_bytes
    payload = warm * p.detail["warmup_payload_bytes"] + local * p.payload_bytes
    period = p.args.get("model_averaging_period")
    if period:
        extra = math.ceil(local / int(period)) + 1 - local / int(period)  # rounds beyond the steady share
        seconds += extra * p.detail["round_s"]
        wire += extra * p.detail["round_wire_bytes"]
        payload += extra * p.detail["round_payload_bytes"]
    return replace(
        p,
        step_s=seconds / steps,
        wire_bytes=wire / steps,
        payload_bytes=payload / steps,
        detail={**p.detail, "warmup_steps": warm},
    )


def with_final_reports(p: Prediction, run: dict[str, Any]) -> Prediction:
    """GRAWA's asynchronous rounds over the fit: each remote worker's round trips, its final partial one included.

    A worker reports after every ``tau`` of its own steps and, at the end of the fit, once more for
    a partial period (the server records the trained replica: ``PeriodicAveraging.finalize`` in
    :mod:`lightning_hier.algorithms.averaging`), each report answered by the center. So worker ``w``
    crosses the link ``ceil(S_w / tau)`` times, where the steady state counts ``S_w / tau``: with
    the shared queue a slow worker's 40 steps are two round trips, not 1.25. ``S_w``: the fit's
    steps split by the prediction's share of requests (equal without the shared queue); rank 0's
    cross no link. Only the bytes change (the last report follows the training).
    """
    if p.args.get("rounds") != "async" or not run.get("epochs") or "request_wire_bytes" not in p.detail:
        return p
    fit_steps = p.steps_per_epoch * int(run["epochs"])  # per worker, on average
    shares = p.detail.get("requests_share") or [1.0 / p.workers] * p.workers
    tau = float(p.args["tau"])
    trips = sum(math.ceil(fit_steps * p.workers * share / tau - 1e-9) for share in shares[1:])
    wire = trips * p.detail["request_wire_bytes"] / p.workers / fit_steps
    return replace(p, wire_bytes=wire, detail={**p.detail, "remote_round_trips": trips})
