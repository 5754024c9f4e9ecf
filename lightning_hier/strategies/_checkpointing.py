"""Checkpoints of every lightning-hier strategy: each rank's full state in one file, the consensus as ``state_dict``.

:class:`CheckpointingStrategy` is the layer of :class:`~lightning_hier.strategies._base.HierStrategy`
that talks to Lightning's checkpoint hooks. ``trainer.save_checkpoint`` gathers every rank's
model, optimizer, RNG, algorithm state and data position, with the rank's checksum of it, to rank
0, which writes one file atomically; the checkpoint's ``state_dict`` is the *consensus* model
(what validation sees). On resume each rank takes its own state back, checked against this run's
strategy, layout and world size and against its checksum; the ranks agree on the damaged states
before any raises (the format lives in :mod:`lightning_hier.strategies._checkpoint`, the file
handling in :mod:`lightning_hier.strategies._checkpoint_file`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from math import inf
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from lightning.fabric.utilities.optimizer import _optimizer_to_device
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_hier.comm import CommStats, gather_objects
from lightning_hier.rng import capture_rng
from lightning_hier.strategies import _checkpoint as ckpt
from lightning_hier.strategies._checkpoint_file import atomic_save, read_checkpoint

if TYPE_CHECKING:
    from lightning.fabric.utilities.types import _PATH

    from lightning_hier.strategies._data_position import DataPosition
    from lightning_hier.topology import Topology


class CheckpointingStrategy(ParallelStrategy):
    """Lightning's checkpoint hooks for strategies whose ranks hold different state (see the module docstring).

    Subclasses provide :attr:`topology`, and override :meth:`_consensus` and
    :meth:`_algorithm_state` (the defaults: the replica is the consensus, no algorithm state).
    """

    strategy_name: ClassVar[str] = ""
    """Registry name; also written into checkpoints, which are refused by another strategy."""

    comm_stats: CommStats
    data_position: DataPosition
    _restored: dict[str, Any] | None = None  # this rank's saved state, between load and on_train_start
    _eval_stack: ExitStack | None = None  # the consensus entered for validation

    @property
    def topology(self) -> Topology:
        """The rank layout, written into checkpoints and checked on resume."""
        raise NotImplementedError

    @contextmanager
    def _consensus(self) -> Iterator[None]:
        """Temporarily hold the consensus model in the module (validation during fit, saving)."""
        yield

    def _algorithm_state(self) -> dict[str, Any]:
        """This rank's algorithm state for checkpoints (tensors and plain types)."""
        return {}

    # ------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The consensus model: what ``trainer.save_checkpoint`` stores as ``state_dict``."""
        assert self.lightning_module is not None
        with self._consensus():
            return ckpt.detach_state(self.lightning_module.state_dict())

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Gather every rank's state into the checkpoint; rank 0 writes it atomically.

        A collective: every rank must call it (``trainer.save_checkpoint`` does). Calling it on
        rank 0 only (``if trainer.is_global_zero: trainer.save_checkpoint(...)``) deadlocks.
        """
        filepath = self.broadcast(filepath)
        full = "optimizer_states" in checkpoint  # not weights_only
        states: list[tuple[dict[str, Any], str]] | None = None
        if full:
            with self._replicas_in_place():
                state = self._rank_state(checkpoint)
                # each rank checksums its own state: what rank 0 writes is checked against what the rank had
                states = gather_objects((state, ckpt.state_digest(state)), dst=0, group=dist.group.WORLD)
        if not self.is_global_zero:
            return
        checkpoint[ckpt.STATE_KEY] = ckpt.strategy_section(
            self.strategy_name or type(self).__name__,
            self.topology.describe(),
            checkpoint.get("state_dict", {}),
            [s for s, _ in states] if states is not None else None,
            [d for _, d in states] if states is not None else None,
        )
        if storage_options is None and "://" not in str(filepath):
            atomic_save(checkpoint, filepath)
        else:
            self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @contextmanager
    def _replicas_in_place(self) -> Iterator[None]:
        """Put the replicas back while inside validation's consensus (a checkpoint saved there).

        Each rank must store its own replica, not the consensus it is validating; the consensus is
        entered again afterwards (a collective for some algorithms: every rank saves together).
        """
        if self._eval_stack is None:
            yield
            return
        self._eval_stack.close()
        try:
            yield
        finally:
            self._eval_stack = ExitStack()
            self._eval_stack.enter_context(self._consensus())

    def _rank_state(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        assert self.lightning_module is not None
        return {
            "model": ckpt.detach_state(self.lightning_module.state_dict()),
            "optimizer_states": checkpoint.get("optimizer_states", []),
            "rng": capture_rng(),
            "algorithm": ckpt.detach_state(self._algorithm_state()),
            "comm": self.comm_stats.state_dict(),
            "data": self.data_position.state_dict(self._batches_per_epoch()),
        }

    def _batches_per_epoch(self) -> float:
        module = self.lightning_module
        return module.trainer.num_training_batches if module is not None and module._trainer is not None else inf

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        path = str(checkpoint_path)
        load = super().load_checkpoint
        checkpoint = read_checkpoint(path, lambda: load(path, weights_only))
        module = self.lightning_module
        fitting = module is not None and module._trainer is not None and module.trainer.state.fn == TrainerFn.FITTING
        if not fitting:  # validate / test / predict: the consensus state_dict is what is used
            ckpt.check_state_dict(checkpoint, path)
            return checkpoint
        name = self.strategy_name or type(self).__name__
        restored = ckpt.select_rank_state(checkpoint, path, name, self.topology.describe(), self.global_rank)
        damaged = self._agree_on_damaged(ckpt.rank_state_damaged(checkpoint, self.global_rank))
        if damaged:  # every rank raises the same error, so none waits for a damaged peer
            raise ckpt.damaged_ranks_error(path, name, damaged)
        self._restored = restored
        return checkpoint

    def _agree_on_damaged(self, mine: bool) -> list[int]:
        """The ranks whose saved state failed its checksum (each checks its own; one small all-reduce)."""
        if not dist.is_initialized():
            return [self.global_rank] if mine else []
        flags = torch.zeros(self.world_size, device=self.root_device)
        flags[self.global_rank] = float(mine)
        dist.all_reduce(flags, group=dist.group.WORLD)
        return [rank for rank, flag in enumerate(flags.tolist()) if flag]

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        assert self.lightning_module is not None
        state = self._restored["model"] if self._restored is not None else checkpoint["state_dict"]
        self.lightning_module.load_state_dict(state, strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        states = self._restored["optimizer_states"] if self._restored is not None else checkpoint["optimizer_states"]
        for optimizer, state in zip(self.optimizers, states, strict=True):
            optimizer.load_state_dict(state)
            _optimizer_to_device(optimizer, self.root_device)
