"""DiLoCo as a :class:`~lightning_hier.sync.base.Sync`: inner steps alone, an outer Nesterov step per window.

DiLoCo (Douillard et al., arXiv 2311.08105, 2023) and Streaming DiLoCo's fragments (arXiv
2501.18512, 2025); the rules are in :mod:`lightning_hier.algorithms.diloco`. :class:`DiLoCoSync`
validates the options, builds one :class:`~lightning_hier.algorithms.diloco.DiLoCo` per optimizer
over the data-parallel group and advances it after every optimizer step.

Plain PyTorch::

    sync = DiLoCoSync(window=64, fragments=4, compression="int4")
    with sync.attach(model, torch.optim.AdamW(model.parameters())):
        for x, y in loader:
            loss_fn(model(x), y).backward()
            optimizer.step()  # every 16 steps a quarter of the model leaves; every 64 all of it has
            optimizer.zero_grad()
"""

from __future__ import annotations

from typing import Any

from torch.optim import Optimizer
from typing_extensions import override

from lightning_hier import _validate as v
from lightning_hier.algorithms.averaging import float_buffers
from lightning_hier.algorithms.compression import COMPRESSIONS
from lightning_hier.algorithms.diloco import DiLoCo
from lightning_hier.algorithms.round_guard import RoundGuard
from lightning_hier.sync.base import Binding, Sync, all_consensus, join_states, regroup_all, split_state
from lightning_hier.sync.buckets import bucket_bytes, check_bucket_options
from lightning_hier.topology import ProcessGroups


class DiLoCoSync(Sync):
    """(Streaming) DiLoCo (see :class:`~lightning_hier.strategies.DiLoCoStrategy` for every argument).

    Args:
        window: ``H``, inner optimizer steps between two synchronisations of a fragment.
        outer_lr: Outer learning rate.
        outer_momentum: Outer Nesterov momentum in ``[0, 1)``.
        fragments: ``F``, staggered fragments of the model (1: DiLoCo).
        fragment_sync_delay: Steps a fragment's reduction overlaps with compute, in ``[0, window)``.
        fragment_update_alpha: Share of the replica's own values kept at a fragment's update, in ``[0, 1)``.
        compression: ``'none'``, ``'bf16'``, ``'int8'`` or ``'int4'``.
        sync_buffers: Average floating-point buffers (BatchNorm statistics) every ``window`` steps.
        bucket_size_mb: Size bound of one flat buffer in MiB.
        owner: The name in error messages.
    """

    lock_step = False  # ranks meet only in the fragments' reductions

    def __init__(
        self,
        window: int = 64,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        fragments: int = 1,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
        compression: str = "none",
        sync_buffers: bool = True,
        bucket_size_mb: float = 25.0,
        owner: str = "DiLoCoSync",
    ) -> None:
        self.owner = owner
        self.window = v.check_int(owner, "window", window, minimum=1)
        self.outer_lr = v.check_float(owner, "outer_lr", outer_lr, low=0.0, low_inclusive=False)
        self.outer_momentum = v.check_float(
            owner, "outer_momentum", outer_momentum, low=0.0, high=1.0, high_inclusive=False
        )
        self.fragments = v.check_int(owner, "fragments", fragments, minimum=1)
        self.fragment_sync_delay = v.check_int(
            owner, "fragment_sync_delay", fragment_sync_delay, minimum=0, maximum=self.window - 1
        )
        self.fragment_update_alpha = v.check_float(
            owner, "fragment_update_alpha", fragment_update_alpha, low=0.0, high=1.0, high_inclusive=False
        )
        self.compression = v.check_choice(owner, "compression", compression, COMPRESSIONS)
        self.sync_buffers, self.bucket_size_mb = check_bucket_options(owner, sync_buffers, bucket_size_mb)
        self.algorithms: list[DiLoCo] = []
        self._binding: Binding | None = None

    @property
    def algorithm(self) -> DiLoCo | None:
        """The first (with one optimizer: the only) optimizer's DiLoCo; ``None`` before :meth:`bind`."""
        return self.algorithms[0] if self.algorithms else None

    @override
    def bind(self, binding: Binding) -> None:
        self._binding = binding
        self.algorithms = [
            DiLoCo(
                params,
                binding.groups.data,
                window=self.window,
                outer_lr=self.outer_lr,
                outer_momentum=self.outer_momentum,
                fragments=self.fragments,
                delay=self.fragment_sync_delay,
                alpha=self.fragment_update_alpha,
                compression=self.compression,
                buffers=float_buffers(binding.module) if self.sync_buffers and index == 0 else (),
                bucket_bytes=bucket_bytes(self.bucket_size_mb),
                stats=binding.stats,
            )
            for index, params in enumerate(binding.parameter_sets())
        ]

    @override
    def fault_tolerance_problem(self) -> str | None:
        if self.fragments > 1 or self.fragment_sync_delay > 0:
            return (
                "Streaming DiLoCo's fragments synchronise at different steps and in the background; "
                "fault tolerance is for fragments=1, fragment_sync_delay=0"
            )
        if self.compression not in ("none", "bf16"):
            return f"compression={self.compression!r} sizes its shards by the number of replicas at the start"
        return None

    @override
    def regroup(self, groups: ProcessGroups, guard: RoundGuard) -> None:
        regroup_all(self._binding, groups, groups.data, self.algorithms, guard)

    @override
    def after_step(self, optimizer: Optimizer) -> dict[str, float]:
        assert self._binding is not None, "bind() first"
        algorithm = self.algorithms[self._binding.index_of(optimizer)]
        if not algorithm.step():
            return {}
        stats = self._binding.stats
        return {
            "diloco/syncs": float(algorithm.syncs),
            "comm/bytes": float(stats.bytes),
            "comm/blocked_s": stats.blocked_s,
        }

    @override
    def consensus(self) -> Any:
        return all_consensus([a.consensus for a in self.algorithms])

    @override
    def finalize(self) -> dict[str, float]:
        for algorithm in self.algorithms:
            algorithm.finalize()
        return {}

    @override
    def state_dict(self) -> dict[str, Any]:
        return join_states([a.state_dict() for a in self.algorithms]) if self.algorithms else {}

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state or not self.algorithms:
            return
        for algorithm, mine in zip(self.algorithms, split_state(state, len(self.algorithms), self.owner), strict=True):
            algorithm.load_state_dict(mine)
