"""Skip the emulated-cluster tests where they cannot run (not root, no `ip netns`); process checks."""

from pathlib import Path

import pytest

from benchmarks.netns import requirements_problem


@pytest.fixture
def emulation() -> None:
    problem = requirements_problem()
    if problem:
        pytest.skip(f"emulated cluster unavailable here: {problem}")


def processes_mentioning(text: str) -> list[int]:
    """Pids of live processes whose command line contains ``text`` (e.g. a test's tmp folder)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if text in (proc / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(proc.name))
            except OSError:
                pass  # exited meanwhile
    return pids
