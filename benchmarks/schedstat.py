"""The calling thread's time on a CPU and time runnable but waiting for one (``schedstat``).

On a machine shared with other work, a rank pinned to one core waits for that core whenever
another process holds it. The wait is invisible in wall-clock step times but shows here, so a
run that was slowed by load can be told from one slowed by its strategy.
"""

from pathlib import Path

SCHEDSTAT = Path("/proc/thread-self/schedstat")


def thread_schedstat(path: Path = SCHEDSTAT) -> tuple[float, float]:
    """Seconds the calling thread has run on a CPU and seconds it was runnable but queued.

    Args:
        path: The ``schedstat`` file (the kernel's: ``run_ns queued_ns timeslices``).

    Returns:
        ``(on_cpu_s, queued_s)`` since the thread started (zeros where the kernel has no
        ``schedstat``, so that a run never fails for want of it).
    """
    try:
        run, queued, _ = path.read_text().split()
    except (OSError, ValueError):
        return 0.0, 0.0
    return int(run) / 1e9, int(queued) / 1e9
