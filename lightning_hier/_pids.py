"""Whether a process still exists, for clean-up that must never touch a live process's files."""

from __future__ import annotations

import os


def pid_exists(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (one owned by another user counts as existing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True
