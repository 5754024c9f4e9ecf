"""Predictions of the asynchronous strategies: ``asgd``, ``softsync``, ``dbs_async``, GRAWA's async rounds.

Every one of them trains through a parameter server, a thread of rank 0 that also trains
(:mod:`lightning_hier.algorithms.ps_service`). The model, per worker ``w`` (rank 0 is local:
no network between its worker and the server):

- **think time** ``Z_w``: its own work between two requests (``tau`` steps of compute for GRAWA,
  one step's forward and backward for the parameter-server rules, whose optimizer step runs on
  the server) plus, for a remote worker, the transfer of its request (``2 alpha + (n + h) b``:
  a :mod:`~lightning_hier.comm.ps_wire` message is a ``h = 104``-byte float64 header and one
  send per tensor).
- **service time** ``S_w``: the serving thread's time on the request, served one at a time in
  arrival order: the update (the optimizer step over the flat model, ``step_s``, once per
  ``ceil(W / n)`` gradients for softsync) and, for a remote worker, the reply's send (the
  serving thread sends it before it takes the next request). The server's link thus carries
  ``W - 1`` workers' pushes in and their replies out.
- **queueing**: the serving thread is a single FIFO station of a closed network; when the
  requests' load ``sum_w S_w / (Z_w + S_w)`` exceeds 1, every request waits the same ``Q``,
  solved from ``sum_w S_w / (Z_w + S_w + Q) = 1`` (the asymptotic bound of mean-value analysis:
  deterministic workers, no random collisions below saturation). A worker's cycle is
  ``c_w = Z_w + S_w + Q``.
- **rank 0's core** (``server_shares_core``, the benchmark's one core per rank): the serving
  thread's CPU work on the *other* workers' requests (the update, ``cpu_s_per_byte`` per byte
  it receives and sends) takes its share ``u`` of the core, so rank 0 computes at ``1 - u`` of
  its speed (solved as a fixed point; rank 0's own request is served while it waits).
- **meetings**: the workers meet in a collective every ``k`` steps (each of their own: the end
  of an epoch, where validation and checkpoints are, every worker having the same number of
  batches; every ``rebalance_every`` steps for ``dbs_async``), so a period lasts
  ``k max_w c_w`` and faster workers wait at its end.
- **the shared queue** (``sampler='shared'``): the workers claim the epoch's batches, so each
  takes requests at its own rate ``1 / c_w`` until the queue runs dry, and the epoch lasts
  ``N / sum_w (n_w / c_w)`` (``n_w`` samples per request) plus the batch the slowest worker
  has in flight then, half of one on average (``max_w c_w / 2`` for the parameter servers; a
  GRAWA request is ``tau`` batches, each claimed alone: ``max_w c_w / (2 tau)``). No worker waits for another
  inside the epoch and ``dbs_async`` has no rebalance meeting (the server sizes each claim).
  Every worker is busy throughout, so the staleness is the always-busy value, averaged over
  the applied contributions (a fast worker's count more); rank 0's share of the requests,
  ``(1 / c_0) / sum_w (1 / c_w)``, crosses no link.
- **staleness** of a contribution (what ``ps/staleness_mean`` counts): server updates between the
  worker's pull and the update that applies it. While workers ``A`` are busy, worker ``w``'s
  contribution sees the others' ``c_w sum_{v in A, v != w} 1 / c_v`` requests, ``1 / ceil(W / n)``
  update each (random phase of the softsync groups). With every worker always busy the mean
  over applied gradients is ``(W - 1) / ceil(W / n)`` whatever the speeds (ASGD: ``W - 1``); a
  fast worker sees less, a slow one more (two workers, one 2x slower: 0.5 and 2). Faster workers
  that wait at the period's end leave the slow ones alone, which lowers their staleness: the
  prediction averages over the period's phases (``detail['staleness_busy']`` keeps the
  always-busy values).

``softsync`` with ``n = 1`` is synchronous: every worker's reply waits for the group's update, so
a step is the slowest worker's compute and push, the update, and the ``W - 1`` replies sent one
after the other; staleness 0.

Not modelled: the server's center computation of asynchronous GRAWA (its CPU cost is left out),
the drain, pull and consensus broadcast at every meeting (per epoch), the lower server load
once fast workers wait, and with the shared queue the claims (one small round trip to the
server per batch of a remote worker).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import ceil
from typing import Any

from lightning_hier.algorithms.claim_sampler import SAMPLERS
from lightning_hier.comm.ps_wire import HEADER_LEN
from lightning_hier.simulator.collectives import NONE, Comm, all_reduce, sent
from lightning_hier.simulator.inputs import Cluster, Workload
from lightning_hier.simulator.prediction import FLOAT64, Prediction, batch_shares, compute_s, steps_per_epoch

HEADER_BYTES = HEADER_LEN * FLOAT64
"""Bytes of a parameter-server message's header (:mod:`lightning_hier.comm.ps_wire`)."""
MAX_CORE_SHARE = 0.95
"""Largest share of rank 0's core the model lets the serving thread take (keeps the fixed point finite)."""


def message(payload: float, tensors: int, cluster: Cluster) -> Comm:
    """One ps_wire message of ``payload`` bytes in ``tensors`` tensors: a header, then one send per tensor."""
    wire = HEADER_BYTES + payload
    return sent((1 + tensors) * cluster.link.alpha + wire * cluster.byte_s, wire, payload, cluster)


def queue_wait(think: Sequence[float], service: Sequence[float]) -> float:
    """The common wait ``Q >= 0`` of a saturated FIFO server: ``sum S / (Z + S + Q) = 1`` (0 below saturation)."""

    def load(q: float) -> float:
        return sum(s / (z + s + q) for z, s in zip(think, service, strict=True) if s > 0)

    if load(0.0) <= 1.0:
        return 0.0
    low, high = 0.0, sum(service)  # at Q = sum(S) the load is below 1
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if load(mid) > 1.0 else (low, mid)
    return high


def served_cycles(
    compute: Sequence[float], think: Sequence[float], service: Sequence[float], server_cpu: Sequence[float]
) -> list[float]:
    """Each worker's seconds per request through the server (rank 0 = index 0 shares its core with it).

    Args:
        compute: Worker ``w``'s compute per request on a free core (rank 0's is stretched).
        think: The rest of its time between a reply and its request reaching the server (the push).
        service: The serving thread's time on its request.
        server_cpu: Of that, CPU seconds on rank 0's core (empty: the server has a core of its own).
    """
    stretch = 1.0
    cycles: list[float] = []
    for _ in range(200):  # fixed point of rank 0's slowdown; the share falls as cycles grow, so it settles
        z = [c + t for c, t in zip(compute, think, strict=True)]
        z[0] = compute[0] * stretch + think[0]
        q = queue_wait(z, service)
        cycles = [zi + s + q for zi, s in zip(z, service, strict=True)]
        if not server_cpu:
            break
        share = min(MAX_CORE_SHARE, sum(cpu / c for cpu, c in zip(server_cpu, cycles, strict=True)))
        new = 1.0 / (1.0 - share)
        if abs(new - stretch) < 1e-12:
            break
        stretch = (stretch + new) / 2
    return cycles


def busy_staleness(cycles: Sequence[float], group: int = 1) -> list[float]:
    """Each worker's staleness while every worker is busy: the others' requests in its cycle, per update."""
    rates = [1 / c for c in cycles]
    return [c * (sum(rates) - r) / group for c, r in zip(cycles, rates, strict=True)]


def staleness(cycles: Sequence[float], k: float, group: int = 1) -> tuple[list[float], list[float]]:
    """Per-worker mean staleness over a period of ``k`` requests each, and the always-busy values.

    Worker ``w`` finishes its ``k`` requests at ``k c_w``; between finishing times the busy set
    shrinks. Returns ``(over the period, always busy)``.
    """
    rates = [1 / c for c in cycles]
    busy = busy_staleness(cycles, group)
    ends = sorted({k * c for c in cycles})
    total = [0.0] * len(cycles)
    start = 0.0
    for end in ends:
        active = [w for w, c in enumerate(cycles) if k * c >= end]
        others = sum(rates[v] for v in active)
        for w in active:  # (end - start) / c_w requests, each seeing the other active workers' requests
            total[w] += (end - start) * rates[w] * cycles[w] * (others - rates[w]) / group
        start = end
    return [t / k for t in total], busy


def _mean(per_worker: Sequence[float]) -> float:
    return sum(per_worker) / len(per_worker)  # every worker applies the same number k per period


def check_sampler(name: str, sampler: str) -> str:
    """``sampler`` if it is one of :data:`~lightning_hier.algorithms.claim_sampler.SAMPLERS`.

    Raises:
        ValueError: Any other value, naming ``name``'s argument.
    """
    if sampler not in SAMPLERS:
        raise ValueError(f"{name}: `sampler` must be one of {', '.join(map(repr, SAMPLERS))}, got {sampler!r}.")
    return sampler


@dataclass(frozen=True)
class Loop:
    """What a worker repeats between two replies, and how often the workers meet.

    Attributes:
        steps: Optimizer steps per request (GRAWA: ``tau``).
        extra_s: Compute per request beyond ``steps`` steps, at speed 1 (GRAWA's probe; minus the
            optimizer step that the server takes instead of the worker).
        apply_s: The serving thread's update per request, at speed 1.
        period: Requests of each worker between two meetings.
        meeting: The collective of a meeting (DBS's rebalance table).
        group: Requests per server update (softsync's ``ceil(W / n)``).
        shared: The workers claim the epoch's batches from the server (``sampler='shared'``):
            no meetings inside the epoch, ``period`` and ``meeting`` unused.
    """

    steps: float
    extra_s: float
    apply_s: float
    period: float
    meeting: Comm = NONE
    group: int = 1
    shared: bool = False


def _served(
    name: str,
    args: dict[str, Any],
    workload: Workload,
    cluster: Cluster,
    batches: Sequence[float],
    request: tuple[Comm, Comm],
    loop: Loop,
) -> Prediction:
    """Workers looping compute, request, reply (``batches``: samples per step; ``request``: push, reply)."""
    push, reply = request
    p, speeds = cluster.workers, cluster.speed_list
    apply = loop.apply_s / speeds[0] / loop.group  # the server runs on rank 0's machine
    compute = [
        loop.steps * t + loop.extra_s / s for t, s in zip(compute_s(workload, cluster, batches), speeds, strict=True)
    ]
    remote = [w != 0 for w in range(p)]
    think = [push.time_s if r else 0.0 for r in remote]
    service = [apply + (reply.time_s if r else 0.0) for r in remote]
    cpu_bytes = cluster.cpu_s_per_byte * (push.wire_bytes + reply.wire_bytes)
    # rank 0's own request is served while its training thread waits for the reply: no competition
    server_cpu = [apply + cpu_bytes if r else 0.0 for r in remote] if args.get("server_shares_core") else []
    cycles = served_cycles(compute, think, service, server_cpu)
    if loop.shared:
        return _claimed(name, args, workload, batches, request, loop, compute, cycles)
    k, steps = loop.period, loop.steps
    elapsed = k * max(cycles) + loop.meeting.time_s
    per_worker, busy = staleness(cycles, k, loop.group)
    wire = (p - 1) / p * (push.wire_bytes + reply.wire_bytes)
    return Prediction(
        name,
        args,
        p,
        step_s=elapsed / (k * steps),
        samples_per_step=sum(batches),
        steps_per_epoch=steps_per_epoch(workload, p),
        wire_bytes=(wire + loop.meeting.wire_bytes / k) / steps,
        payload_bytes=(push.payload_bytes + reply.payload_bytes + loop.meeting.payload_bytes / k) / steps,
        blocked_s=max(0.0, elapsed - k * min(compute)) / (k * steps),
        staleness=_mean(per_worker),
        detail={
            "cycle_s": cycles,
            "staleness_per_worker": per_worker,
            "staleness_busy": busy,
            "server_link_bytes_per_step": (p - 1) * push.wire_bytes / steps,
            "request_wire_bytes": push.wire_bytes + reply.wire_bytes,
        },
    )


def _claimed(
    name: str,
    args: dict[str, Any],
    workload: Workload,
    batches: Sequence[float],
    request: tuple[Comm, Comm],
    loop: Loop,
    compute: Sequence[float],
    cycles: Sequence[float],
) -> Prediction:
    """:func:`_served` with the shared queue: every worker busy at its own rate until the epoch runs dry."""
    push, reply = request
    p, steps = len(cycles), loop.steps
    rates = [1 / c for c in cycles]
    spe = steps_per_epoch(workload, p)
    throughput = sum(steps * b * r for b, r in zip(batches, rates, strict=True))  # samples per second
    # the slowest worker's batch in flight when the queue runs dry: each batch is claimed alone, so a
    # GRAWA worker stops within one of its tau steps (its partial round is the epoch's consensus)
    tail = max(cycles) / steps / 2
    epoch = spe * sum(batches) / throughput + tail
    busy = busy_staleness(cycles, loop.group)
    fastest = min(range(p), key=lambda w: compute[w])
    remote = 1 - rates[0] / sum(rates)  # the share of requests that cross a link (rank 0's do not)
    return Prediction(
        name,
        args,
        p,
        step_s=epoch / spe,
        samples_per_step=sum(batches),
        steps_per_epoch=spe,
        wire_bytes=remote * (push.wire_bytes + reply.wire_bytes) / steps,
        payload_bytes=(push.payload_bytes + reply.payload_bytes) / steps,
        blocked_s=max(0.0, cycles[fastest] - compute[fastest]) / steps + tail / spe,
        staleness=sum(r * s for r, s in zip(rates, busy, strict=True)) / sum(rates),
        detail={
            "cycle_s": list(cycles),
            "staleness_per_worker": busy,
            "staleness_busy": busy,
            "requests_share": [r / sum(rates) for r in rates],
            "server_link_bytes_per_step": remote * p * push.wire_bytes / steps,
            "request_wire_bytes": push.wire_bytes + reply.wire_bytes,
        },
    )


def _flat_push(workload: Workload, cluster: Cluster) -> tuple[Comm, Comm]:
    """A gradient push and the weights' reply; ``CommStats`` counts the pushed gradient only."""
    push = message(workload.param_bytes, 1, cluster)
    reply = message(workload.param_bytes, 1, cluster)
    return push, Comm(reply.time_s, reply.wire_bytes, 0.0, 1)


def _ps_rule(name: str, workload: Workload, cluster: Cluster, args: dict[str, Any], group: int) -> Prediction:
    batches = [float(workload.batch_size)] * cluster.workers
    shared = check_sampler(name, args["sampler"]) == "shared"
    # the worker's own optimizer step runs on the server instead; the workers meet at the epoch's end
    spe = steps_per_epoch(workload, cluster.workers)
    loop = Loop(1.0, -workload.step_s, workload.step_s, spe, group=group, shared=shared)
    return _served(name, args, workload, cluster, batches, _flat_push(workload, cluster), loop)


def asgd(
    workload: Workload,
    cluster: Cluster,
    staleness_lr: bool = False,
    server_shares_core: bool = True,
    sampler: str = "split",
) -> Prediction:
    """ASGD: every worker pushes its gradient to rank 0's server, which applies it at once and replies."""
    args = {"staleness_lr": staleness_lr, "server_shares_core": server_shares_core, "sampler": sampler}
    return _ps_rule("asgd", workload, cluster, args, 1)


def softsync(
    workload: Workload,
    cluster: Cluster,
    n: int = 1,
    staleness_lr: bool = False,
    server_shares_core: bool = True,
    sampler: str = "split",
) -> Prediction:
    """n-softsync: the server applies the mean of every ``ceil(W / n)`` gradients (``n = 1``: synchronous)."""
    p = cluster.workers
    if not 1 <= n <= p:
        raise ValueError(f"softsync: `n` must be an integer in [1, {p}] (the number of workers), got {n!r}.")
    if check_sampler("softsync", sampler) == "shared" and n == 1:
        raise ValueError("softsync: `sampler`='shared' needs n >= 2 (n=1 is synchronous: equal steps), got n=1.")
    args = {"n": n, "staleness_lr": staleness_lr, "server_shares_core": server_shares_core, "sampler": sampler}
    if n > 1:
        return _ps_rule("softsync", workload, cluster, args, ceil(p / n))
    push, reply = _flat_push(workload, cluster)
    work = [t - workload.step_s / s for t, s in zip(compute_s(workload, cluster), cluster.speed_list, strict=True)]
    arrive = [t + (push.time_s if w else 0.0) for w, t in enumerate(work)]
    step = max(arrive) + workload.step_s / cluster.speed_list[0] + (p - 1) * reply.time_s
    return Prediction(
        "softsync",
        args,
        p,
        step_s=step,
        samples_per_step=workload.batch_size * p,
        steps_per_epoch=steps_per_epoch(workload, p),
        wire_bytes=(p - 1) / p * (push.wire_bytes + reply.wire_bytes),
        payload_bytes=push.payload_bytes,
        blocked_s=step - min(work),
        detail={"server_link_bytes_per_step": (p - 1) * push.wire_bytes},
    )


def dbs_async(
    workload: Workload,
    cluster: Cluster,
    rebalance_every: int = 20,
    server_shares_core: bool = True,
    shares: Sequence[float] | None = None,
    sampler: str = "split",
) -> Prediction:
    """DBS's speed-proportional batch shares driving ASGD workers; they meet every ``rebalance_every`` steps.

    ``shares``: fixed per-worker batches instead (before the first rebalance), as
    :func:`~.strategies.dbs` (:func:`~.prediction.batch_shares`). With ``sampler='shared'`` the
    server sizes each claim from the reported speeds: no meeting.
    """
    p = cluster.workers
    shares = batch_shares(workload, cluster, shares)
    table = all_reduce(p * 4 * FLOAT64, p, cluster)  # as DBS's rebalance (see the synchronous model)
    args = {"rebalance_every": rebalance_every, "server_shares_core": server_shares_core, "sampler": sampler}
    shared = check_sampler("dbs_async", sampler) == "shared"
    prediction = _served(
        "dbs_async",
        args,
        workload,
        cluster,
        shares,
        _flat_push(workload, cluster),
        Loop(1.0, -workload.step_s, workload.step_s, float(rebalance_every), table, shared=shared),
    )
    prediction.detail["shares"] = shares
    return prediction


def grawa_async(
    name: str,
    workload: Workload,
    cluster: Cluster,
    tau: int,
    probe: str,
    width: int,
    server_shares_core: bool = True,
    sampler: str = "split",
) -> Prediction:
    """GRAWA's asynchronous rounds: after its own ``tau`` steps a worker reports its replica and pulls the center.

    The report carries the replica and ``width + 2`` float64 (scores, lambda, model norm); the
    reply the center and the ``W x (width + 1)`` float64 weight table and norms. ``CommStats``
    counts both.
    """
    p = cluster.workers
    report = message(workload.param_bytes + (width + 2) * FLOAT64, 2, cluster)
    center = message(workload.param_bytes + p * (width + 1) * FLOAT64, 2, cluster)
    extra = 0.0 if probe == "step" else workload.batch_size * workload.sample_s
    args = {"tau": tau, "probe": probe, "rounds": "async", "server_shares_core": server_shares_core, "sampler": sampler}
    batches = [float(workload.batch_size)] * p
    shared = check_sampler(name, sampler) == "shared"
    # the server's update is the center of the replicas (its CPU cost is not modelled)
    loop = Loop(float(tau), extra, 0.0, steps_per_epoch(workload, p) / tau, shared=shared)
    return _served(name, args, workload, cluster, batches, (report, center), loop)
