"""Undo the global state a Lightning launcher leaves behind in the calling process.

Launchers leave ``LOCAL_RANK``, ``MASTER_PORT``, ``NODE_RANK`` and ``MASTER_ADDR`` in the parent's
environment (a leaked ``LOCAL_RANK`` makes the next Trainer wait forever instead of launching), set
``rank_zero_only.rank``, and may leave a process group initialised.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only


@contextmanager
def isolated_global_state() -> Iterator[None]:
    """Restore the environment, the rank-zero flag and the process-group state on exit."""
    env = dict(os.environ)
    rank = getattr(rank_zero_only, "rank", 0)
    utils_rank = getattr(utils_rank_zero_only, "rank", 0)
    try:
        yield
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(env)
        rank_zero_only.rank = rank  # type: ignore[attr-defined]
        utils_rank_zero_only.rank = utils_rank  # type: ignore[attr-defined]
