"""Checkpoints of a strategy whose ranks hold different state: every rank's state in the one file rank 0 writes.

The steps :class:`~lightning_hier.strategies.HierStrategy` takes in Lightning's checkpoint hooks:
``trainer.save_checkpoint`` gathers every rank's model, optimizer, RNG and the state of each of
the strategy's objects (its ``algorithm``, its ``allocation``, the communication accounting, the
data position), with the rank's checksum of it, to rank 0 (:func:`gather_rank_states`), which
writes one file atomically (:func:`write`); the checkpoint's ``state_dict`` is the *consensus*
model (what validation sees). On resume each rank takes its own state back, checked against this
run's strategy, layout and world size and against its checksum; the ranks agree on the damaged
states before any raises (:func:`agree_on_damaged`). The format lives in
:mod:`lightning_hier.strategies._checkpoint`, the file handling in
:mod:`lightning_hier.strategies._checkpoint_file`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightning_hier.comm import gather_objects
from lightning_hier.strategies import _checkpoint as ckpt
from lightning_hier.strategies._checkpoint_file import atomic_save

if TYPE_CHECKING:
    from lightning.fabric.plugins import CheckpointIO
    from lightning.fabric.utilities.types import _PATH


def gather_rank_states(state: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]] | None:
    """Every rank's ``state`` and its checksum, on rank 0 (``None`` elsewhere); a collective.

    Each rank checksums its own state, so what rank 0 writes is checked against what the rank had.
    """
    gathered = gather_objects((state, ckpt.state_digest(state)), dst=0, group=dist.group.WORLD)
    if gathered is None:
        return None
    return [s for s, _ in gathered], [d for _, d in gathered]


def write(
    checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None, checkpoint_io: CheckpointIO
) -> None:
    """Write on rank 0: atomically to a local path, through Lightning's ``checkpoint_io`` otherwise."""
    if storage_options is None and "://" not in str(filepath):
        atomic_save(checkpoint, filepath)
    else:
        checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)


def agree_on_damaged(mine: bool, rank: int, world: int, device: torch.device) -> list[int]:
    """The ranks whose saved state failed its checksum (each checks its own; one small all-reduce)."""
    if not dist.is_initialized():
        return [rank] if mine else []
    flags = torch.zeros(world, device=device)
    flags[rank] = float(mine)
    dist.all_reduce(flags, group=dist.group.WORLD)
    return [r for r, flag in enumerate(flags.tolist()) if flag]
