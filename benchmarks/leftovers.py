"""Leftovers of killed benchmark runs (network namespaces, cgroups): what they are and how to remove them.

A run removes its namespaces and cgroup when it ends, fails or is interrupted (Ctrl-C, SIGTERM,
SIGHUP); SIGKILL cannot be caught and leaves them. So a run says up front how to remove its own
(:func:`killed_run_notice`), and the next run removes those of dead runs and names what it could
not remove (:func:`remaining_message`). Every name carries the pid of the run that made it
(``lhb-<pid>-...``), which tells a dead run's leftovers from a live run's.

Nothing here needs root: the names are inputs (``ip netns list``, the cgroup folder) and the text
is plain, so both are unit-tested.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_hier._pids import pid_exists

PREFIX = "lhb"
"""First part of every namespace and cgroup name the harness makes: ``lhb-<pid of the run>-...``."""
CLEANUP_COMMAND = "python -m benchmarks.run --cleanup"


@dataclass(frozen=True)
class Leftovers:
    """Namespaces and cgroups of runs that are gone."""

    namespaces: tuple[str, ...] = ()
    cgroups: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.namespaces or self.cgroups)

    def describe(self) -> str:
        parts = []
        if self.namespaces:
            parts.append(f"network namespace(s) {', '.join(self.namespaces)}")
        if self.cgroups:
            parts.append(f"cgroup(s) {', '.join(self.cgroups)}")
        return " and ".join(parts) or "nothing"


def owner_alive(name: str, prefix: str = PREFIX) -> bool:
    """Whether the run that made ``<prefix>-<pid>-...`` still runs (names not of that form: never ours, alive)."""
    parts = name.split("-")
    if len(parts) < 3 or parts[0] != prefix or not parts[1].isdigit():
        return True  # not a name this harness makes: never touch it
    return pid_exists(int(parts[1]))


def of_dead_runs(names: Iterable[str], prefix: str = PREFIX) -> tuple[str, ...]:
    """The names among ``names`` made by runs that are gone."""
    return tuple(sorted(n for n in names if n.startswith(f"{prefix}-") and not owner_alive(n, prefix)))


def stale_cgroups(parent: Path | None, prefix: str = PREFIX) -> tuple[str, ...]:
    """Cgroups of dead runs under ``parent`` (the CPU hierarchy; ``None``: no cgroups here)."""
    if parent is None or not parent.is_dir():
        return ()
    return of_dead_runs((p.name for p in parent.glob(f"{prefix}-*") if p.is_dir()), prefix)


def find(namespaces: Iterable[str], cgroup_parent: Path | None, prefix: str = PREFIX) -> Leftovers:
    """The leftovers of dead runs among ``namespaces`` (``ip netns list``) and the cgroups under ``cgroup_parent``."""
    return Leftovers(of_dead_runs(namespaces, prefix), stale_cgroups(cgroup_parent, prefix))


def killed_run_notice(tag: str, prefix: str = PREFIX) -> str:
    """What a run prints before it builds its cluster, for the case that it is killed with SIGKILL."""
    return (
        f"[bench] network namespaces {prefix}-{tag}-* and cgroups {prefix}-{tag}-* are removed when this run ends "
        f"or is interrupted; if it is killed (SIGKILL), `{CLEANUP_COMMAND}` removes them."
    )


def remaining_message(left: Leftovers) -> str:
    """The error text for leftovers of killed runs that are still there."""
    return (
        f"benchmarks: leftovers of a killed run: {left.describe()}. `{CLEANUP_COMMAND}` removes them (as root; a "
        "cgroup once the processes in it have exited)."
    )


def exit_on_termination() -> None:
    """Make SIGTERM and SIGHUP raise ``SystemExit`` (call from the main thread).

    Python's default for them ends the process at once, skipping the ``finally`` blocks that end
    the ranks and remove their namespaces and cgroups; as an exception they unwind through them.
    """
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _terminate)


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)
