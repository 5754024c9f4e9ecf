"""A cgroup CPU quota for every rank of a forked job: quotas, not contention for the cores, set the speeds.

A quota on the straggler alone is only fair when every rank has a core of its own; with more
ranks than cores the other ranks fight over the cores and run at whatever share the scheduler
gives them. So each rank gets its own cgroup: ``share`` of one core, and ``share / factor`` for
the slowed rank. With the sum below the machine's cores every rank runs at its quota (as long as
nothing else loads the machine). A rank's quota covers every thread of its process, so on rank 0
it covers the parameter server's threads too, as the server shares its node in the seed papers.

The parent (root) makes the cgroups and writes their quota files; each forked rank moves itself
in with :meth:`RankQuotas.join` first thing, before it starts any thread. Names follow the
harness's ``lhb-<pid of the run>-...`` (see :mod:`benchmarks.leftovers`), so ``python -m
benchmarks.run --cleanup`` removes those of a killed run.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from benchmarks.leftovers import PREFIX
from benchmarks.straggler import CGROUP_ROOT, CpuQuota


class RankQuotas:
    """One :class:`~benchmarks.straggler.CpuQuota` per rank; use :func:`rank_quotas` to make and remove them.

    Args:
        quotas: The cgroups, by rank.
        shares: Each rank's quota in cores, by rank.
    """

    def __init__(self, quotas: list[CpuQuota], shares: list[float]) -> None:
        self.quotas = quotas
        self.shares = shares

    def join(self, rank: int) -> None:
        """Move the calling process (all its threads, and those it starts later) into ``rank``'s cgroup."""
        self.quotas[rank].join()

    def throttled_s(self) -> list[float]:
        """Seconds each rank was held back by its quota so far, by rank."""
        return [q.throttled_s() for q in self.quotas]


def shares(ranks: int, share: float, slow_rank: int, factor: float) -> list[float]:
    """Cores per rank: ``share`` each, ``share / factor`` for ``slow_rank``.

    Raises:
        ValueError: ``share`` not in (0, 1], ``factor`` below 1 or ``slow_rank`` not a rank.
    """
    if not 0.0 < share <= 1.0 or factor < 1.0 or not 0 <= slow_rank < ranks:
        raise ValueError(
            f"rank_quotas: need 0 < share <= 1, factor >= 1 and 0 <= slow_rank < ranks={ranks}; got share={share!r}, "
            f"factor={factor!r}, slow_rank={slow_rank!r}."
        )
    return [share / factor if r == slow_rank else share for r in range(ranks)]


@contextmanager
def rank_quotas(
    ranks: int, share: float, slow_rank: int, factor: float, tag: str | None = None, root: Path = CGROUP_ROOT
) -> Iterator[RankQuotas]:
    """Make a cgroup per rank (``lhb-<tag>-rank<r>``) for the block; remove them after it, also on failure.

    The ranks must have exited by the end of the block (a cgroup with members cannot be removed).

    Args:
        ranks: Number of ranks.
        share: Cores of a normal rank (e.g. ``0.6``).
        slow_rank: The straggler.
        factor: How many times slower the straggler is (its quota is ``share / factor``).
        tag: Name component after the prefix (default: this process's id, which tells a dead
            run's leftovers from a live run's).
        root: The cgroup filesystem's mount point.
    """
    cores = shares(ranks, share, slow_rank, factor)
    tag = tag if tag is not None else str(os.getpid())
    made: list[CpuQuota] = []
    try:
        for r, c in enumerate(cores):
            # CpuQuota's factor is relative to one full core: c cores is 1 / c times slower
            made.append(CpuQuota(f"{PREFIX}-{tag}-rank{r}", 1.0 / c, root=root))
        yield RankQuotas(made, cores)
    finally:
        for q in made:
            q.remove()
