"""Straggler emulation: one rank slowed by a factor, outside the algorithm.

Two modes:

- ``cgroup`` (default): the rank's processes go into a cgroup whose CPU quota is ``1/factor`` of
  one core (cgroup v2 ``cpu.max`` when the ``cpu`` controller is enabled at the root, else the
  cgroup v1 ``cpu`` hierarchy's ``cpu.cfs_quota_us``). Since every rank is pinned to one core,
  everything the rank does (compute *and* its communication threads) runs ``factor`` times
  slower, like a slower machine.
- ``delay``: a Lightning callback, built on every rank by a factory ``module:attr`` called as
  ``factory(ranks=[rank], factor=factor)``; it slows the listed ranks. Default: the library's
  :class:`lightning_hier.callbacks.Straggler` (stalls after each backward for ``factor - 1``
  times the measured forward + backward).

This module imports no Lightning, so the runner and ``--cleanup`` stay light.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.leftovers import stale_cgroups

MODES = ("cgroup", "delay")
DEFAULT_DELAY_CALLBACK = "lightning_hier.callbacks.straggler:Straggler"
CGROUP_ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 20_000  # short periods throttle smoothly at the time scale of one training step
MIN_QUOTA_US = 1_000  # the kernel's minimum quota


@dataclass(frozen=True)
class Straggler:
    """Slowed ranks (one rank, or every rank of a slow node).

    Attributes:
        ranks: The ranks that run slower.
        factor: How many times slower (> 1).
        mode: ``'cgroup'`` or ``'delay'``.
        callback: ``module:attr`` of the delay-mode callback factory.
    """

    ranks: tuple[int, ...]
    factor: float
    mode: str = "cgroup"
    callback: str = DEFAULT_DELAY_CALLBACK

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"straggler mode must be one of {', '.join(MODES)}, got {self.mode!r}.")
        max_factor = PERIOD_US / MIN_QUOTA_US
        if not 1.0 < self.factor <= max_factor:
            raise ValueError(f"straggler factor must be in (1, {max_factor:g}], got {self.factor!r}.")
        if not self.ranks or min(self.ranks) < 0:
            raise ValueError(f"straggler ranks must be one or more ranks >= 0, got {self.ranks!r}.")


def cgroup_flavour(root: Path = CGROUP_ROOT) -> tuple[str, Path] | None:
    """``('v2', dir)`` or ``('v1', dir)`` of a usable CPU-quota hierarchy, or ``None``."""
    controllers = root / "cgroup.controllers"
    subtree = root / "cgroup.subtree_control"
    if controllers.is_file() and subtree.is_file() and "cpu" in subtree.read_text().split():
        return "v2", root
    if (root / "cpu" / "cpu.cfs_quota_us").is_file():
        return "v1", root / "cpu"
    return None


def quota_us(factor: float, period_us: int = PERIOD_US, cores: int = 1) -> int:
    """CPU time per period that makes ``cores`` one-core processes ``factor`` times slower."""
    return max(MIN_QUOTA_US, round(period_us * cores / factor))


class CpuQuota:
    """A cgroup limiting its members to ``cores/factor`` CPUs; remove it with :meth:`remove`.

    Args:
        name: Directory name of the cgroup (should start with the harness prefix).
        factor: Slow-down factor (> 1).
        root: The cgroup filesystem's mount point.
        cores: Single-core members it will hold (the ranks of a slow node), sharing the quota.
    """

    def __init__(self, name: str, factor: float, root: Path = CGROUP_ROOT, cores: int = 1) -> None:
        flavour = cgroup_flavour(root)
        if flavour is None:
            raise RuntimeError(
                f"no cgroup CPU controller under {root} (neither v2 with 'cpu' in cgroup.subtree_control nor "
                "v1 cpu/cpu.cfs_quota_us); use --straggler-mode delay"
            )
        self.version, parent = flavour
        self.path = parent / name
        self.path.mkdir(exist_ok=True)
        quota = quota_us(factor, cores=cores)
        if self.version == "v2":
            (self.path / "cpu.max").write_text(f"{quota} {PERIOD_US}\n")
        else:
            (self.path / "cpu.cfs_period_us").write_text(f"{PERIOD_US}\n")
            (self.path / "cpu.cfs_quota_us").write_text(f"{quota}\n")

    def join(self) -> None:
        """Move the calling process into the cgroup (use as ``preexec_fn`` of the rank's process)."""
        (self.path / "cgroup.procs").write_text(f"{os.getpid()}\n")

    def throttled_s(self) -> float:
        """Seconds the cgroup's members were held back by the quota so far."""
        for line in (self.path / "cpu.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "throttled_usec":
                return int(value) / 1e6
            if key == "throttled_time":  # v1, nanoseconds
                return int(value) / 1e9
        return 0.0

    def remove(self) -> None:
        """Delete the cgroup (its processes must have exited)."""
        if self.path.is_dir():
            self.path.rmdir()


def remove_stale_cgroups(root: Path = CGROUP_ROOT) -> list[str]:
    """Delete empty cgroups left by killed runs (``lhb-<pid>-...`` whose pid is gone)."""
    parent = cgroup_parent(root)
    removed = []
    for name in stale_cgroups(parent):
        assert parent is not None
        try:
            (parent / name).rmdir()
            removed.append(name)
        except OSError:
            pass  # still has members: leave it (reported by the runner)
    return removed


def cgroup_parent(root: Path = CGROUP_ROOT) -> Path | None:
    """The folder that holds the harness's cgroups, or ``None`` without a CPU controller."""
    flavour = cgroup_flavour(root)
    return flavour[1] if flavour is not None else None


def load_factory(spec: str) -> Callable[..., Any]:
    """Import ``module:attr`` (the delay-mode callback factory)."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"straggler callback must be 'module:attr', got {spec!r}.")
    try:
        factory = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"straggler callback {spec!r} cannot be imported: {err}") from err
    if not callable(factory):
        raise ValueError(f"straggler callback {spec!r} is not callable.")
    return factory
