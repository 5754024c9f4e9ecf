"""Time and bytes of one collective on a :class:`~lightning_hier.simulator.inputs.Cluster`.

The alpha-beta model (Hockney; Thakur, Rabenseifner and Gropp, "Optimization of Collective
Communication Operations in MPICH", IJHPCA 2005), ``n`` bytes of payload over ``p`` workers,
``b`` = seconds per byte:

=====================  =====================================  =======================
collective             time                                   bytes each worker sends
=====================  =====================================  =======================
all-reduce, ring       ``2 (p-1) alpha + 2 (p-1)/p n b``      ``2 (p-1)/p n``
all-reduce, tree       ``2 ceil(lg p) (alpha + n b)``         ``2 (p-1)/p n`` (mean)
all-reduce, h/d        ``2 ceil(lg p) alpha + 2 (p-1)/p n b`` ``2 (p-1)/p n``
broadcast, tree        ``ceil(lg p) (alpha + n b)``           ``(p-1)/p n`` (mean)
broadcast, ring        pipelined chain: ``(p-1) alpha + n b`` ``(p-1)/p n`` (mean)
broadcast, h/d         scatter + all-gather:                  ``2 (p-1)/p n`` (mean)
                       ``(ceil(lg p) + p-1) alpha + 2 (p-1)/p n b``
point-to-point         ``alpha + n b``                        ``n`` (the sender)
=====================  =====================================  =======================

h/d is recursive halving and doubling (Rabenseifner), the planner's all-reduce. A tree
all-reduce is a binomial reduce then broadcast: every worker but the root sends ``n`` once in
each, ``2 (p-1)/p n`` on average. ``payload`` is what
:class:`~lightning_hier.comm.CommStats` counts for the call (the tensor's bytes, whatever the
algorithm sends). With ``collective_s_per_byte > 0`` a collective lasts at least the CPU time of
the bytes it sends (:func:`sent`).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil, log2

from lightning_hier.simulator.inputs import Cluster


@dataclass(frozen=True)
class Comm:
    """One or more collectives: elapsed seconds, bytes sent per worker, payload bytes per worker, calls."""

    time_s: float = 0.0
    wire_bytes: float = 0.0
    payload_bytes: float = 0.0
    calls: int = 0

    def __add__(self, other: Comm) -> Comm:
        return Comm(
            self.time_s + other.time_s,
            self.wire_bytes + other.wire_bytes,
            self.payload_bytes + other.payload_bytes,
            self.calls + other.calls,
        )

    def times(self, k: float) -> Comm:
        """``k`` repetitions (``k`` may be fractional: a rate per step)."""
        return Comm(self.time_s * k, self.wire_bytes * k, self.payload_bytes * k, round(self.calls * k))


NONE = Comm()


def sent(network_s: float, wire_bytes: float, payload_bytes: float, cluster: Cluster) -> Comm:
    """One collective that takes ``network_s`` on the link and sends ``wire_bytes`` per worker.

    Its time is the longer of the link's and the cores' (``collective_s_per_byte``: gloo copies and
    reduces every byte it sends, pipelined with the transfer). On the benchmark's cores a blocking
    all-reduce alone runs at 0.8-0.9 ns per byte sent, faster than the unlimited link's 1.0 ns, so
    there the link bounds it. What a collective costs the compute it overlaps is another number,
    ``cpu_s_per_byte`` (:func:`overlapped`).
    """
    return Comm(max(network_s, cluster.collective_s_per_byte * wire_bytes), wire_bytes, payload_bytes, 1)


def _lg(p: int) -> int:
    return ceil(log2(p)) if p > 1 else 0


def all_reduce(nbytes: float, p: int, cluster: Cluster) -> Comm:
    """An all-reduce of ``nbytes`` over ``p`` workers with the cluster's algorithm."""
    if p <= 1 or nbytes <= 0:
        return NONE
    a, b, share = cluster.link.alpha, cluster.byte_s, (p - 1) / p * nbytes
    if cluster.algorithm == "ring":
        time = 2 * (p - 1) * a + 2 * share * b
    elif cluster.algorithm == "tree":
        time = 2 * _lg(p) * (a + nbytes * b)
    else:
        time = 2 * _lg(p) * a + 2 * share * b
    return sent(time, 2 * share, nbytes, cluster)


def broadcast(nbytes: float, p: int, cluster: Cluster) -> Comm:
    """A broadcast of ``nbytes`` from one worker to ``p``."""
    if p <= 1 or nbytes <= 0:
        return NONE
    a, b, share = cluster.link.alpha, cluster.byte_s, (p - 1) / p * nbytes
    if cluster.algorithm == "tree":
        return sent(_lg(p) * (a + nbytes * b), share, nbytes, cluster)
    if cluster.algorithm == "ring":  # pipelined along the chain: every worker but the last forwards n
        return sent((p - 1) * a + nbytes * b, share, nbytes, cluster)
    return sent((_lg(p) + p - 1) * a + 2 * share * b, 2 * share, nbytes, cluster)


def p2p(nbytes: float, cluster: Cluster) -> Comm:
    """One message of ``nbytes`` to a neighbour."""
    if nbytes <= 0:
        return NONE
    return sent(cluster.link.alpha + nbytes * cluster.byte_s, nbytes, nbytes, cluster)


def overlapped(compute_s: float, comm: Comm, cluster: Cluster) -> tuple[float, float]:
    """Elapsed and blocked seconds of ``compute_s`` of work with ``comm`` running behind it.

    The communication is hidden as far as the compute lasts; what it costs the compute cores
    (``cpu_s_per_byte`` per byte sent) is added to the compute. Returns ``(elapsed, blocked)``.
    """
    busy = compute_s + cluster.cpu_s_per_byte * comm.wire_bytes
    elapsed = max(busy, comm.time_s)
    return elapsed, elapsed - busy
