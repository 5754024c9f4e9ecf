"""HPSGD as a :class:`~lightning_hier.sync.base.Sync`: each window's change all-reduced behind the next window.

Hierarchical Parallel SGD (Zhou, Ye, Zhang and Lv, arXiv 2009.02701, 2020); the rules are in
:mod:`lightning_hier.algorithms.hpsgd` (and :mod:`~lightning_hier.algorithms.hpsgd_two_level` for
two levels). :class:`HPSGDSync` validates the options, builds one HPSGD per optimizer over the
levels it is given, advances it after every optimizer step and reports each merge.

Plain PyTorch::

    sync = HPSGDSync(window=8, compression="bf16")
    with sync.attach(model, optimizer):
        for x, y in loader:
            loss_fn(model(x), y).backward()
            optimizer.step()  # every 8 steps: the window's change leaves, the previous one merges
            optimizer.zero_grad()
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hier import _validate as v
from lightning_hier.algorithms.averaging import float_buffers
from lightning_hier.algorithms.compression import COMPRESSIONS
from lightning_hier.algorithms.hpsgd import AUTO, HPSGD, MERGES, MODES, Merge, check_delay
from lightning_hier.algorithms.hpsgd_two_level import TwoLevelHPSGD
from lightning_hier.algorithms.round_guard import RoundGuard
from lightning_hier.sync.base import (
    SAMPLE_WEIGHTS_PROBLEM,
    Binding,
    Sync,
    all_consensus,
    join_states,
    regroup_all,
    split_state,
)
from lightning_hier.sync.buckets import bucket_bytes, check_bucket_options
from lightning_hier.sync.dbs_compose import SampleWeights
from lightning_hier.sync.levels import Levels
from lightning_hier.topology import ProcessGroups, Topology


class HPSGDSync(Sync):
    """HPSGD windows (see :class:`~lightning_hier.strategies.HPSGDStrategy` for every argument).

    Args:
        window: ``H``, optimizer steps per window (mode ``'poll'``: the minimum).
        mode: ``'fixed'`` or ``'poll'``.
        merge: ``'eager'`` or ``'paper'``.
        outer_lr: Outer learning rate on the averaged window change.
        outer_momentum: Outer Nesterov momentum in ``[0, 1)``.
        compression: ``'none'``, ``'bf16'``, ``'int8'`` or ``'int4'``.
        sync_buffers: Average floating-point buffers (BatchNorm statistics) at each merge.
        reset_optimizer_state: Clear the inner optimizer's state at every merge.
        bucket_size_mb: Size bound of one flat buffer in MiB.
        delay: Optimizer steps from a window's launch to its merge, in ``[1, window]``; ``None``:
            ``window`` (the paper's one-window-late average); ``'auto'``: the steps the second
            window's reduction takes (:class:`~lightning_hier.algorithms.hpsgd.HPSGD`).
        levels: Flat (default) or two-level synchronisation.
        weights: DBS's sample weights of each rank's change (``dbs_hpsgd``); ``None``: the plain mean.
        owner: The name in error messages.
    """

    lock_step = False  # the windows' own collectives keep the ranks together

    def __init__(
        self,
        window: int = 2,
        mode: str = "fixed",
        merge: str = "eager",
        outer_lr: float = 1.0,
        outer_momentum: float = 0.0,
        compression: str = "none",
        sync_buffers: bool = True,
        reset_optimizer_state: bool = False,
        bucket_size_mb: float = 25.0,
        delay: int | str | None = None,
        levels: Levels | None = None,
        weights: SampleWeights | None = None,
        owner: str = "HPSGDSync",
    ) -> None:
        self.owner = owner
        self.window = v.check_int(owner, "window", window, minimum=1)
        self.mode = v.check_choice(owner, "mode", mode, MODES)
        self.merge = v.check_choice(owner, "merge", merge, MERGES)
        self.outer_lr = v.check_float(owner, "outer_lr", outer_lr, low=0.0, low_inclusive=False)
        self.outer_momentum = v.check_float(
            owner, "outer_momentum", outer_momentum, low=0.0, high=1.0, high_inclusive=False
        )
        self.compression = v.check_choice(owner, "compression", compression, COMPRESSIONS)
        self.sync_buffers, self.bucket_size_mb = check_bucket_options(owner, sync_buffers, bucket_size_mb)
        self.reset_optimizer_state = v.check_bool(owner, "reset_optimizer_state", reset_optimizer_state)
        self.levels = levels if levels is not None else Levels(owner)
        self.delay = check_delay(owner, delay, self.window, self.merge, self.mode)
        if self.delay == AUTO or (isinstance(self.delay, int) and self.delay < self.window):
            self.levels.refuse("delay", self.delay, "two levels merge every window; leave delay unset")
        if self.compression in ("int8", "int4"):
            self.levels.refuse("compression", self.compression, "the quantized all-reduce runs over one flat group")
        if self.mode == "poll":
            self.levels.refuse(
                "mode", "poll", "the readiness agreement of mode 'poll' is over one flat group; use mode='fixed'"
            )
        self.weights = weights
        self.algorithms: list[HPSGD | TwoLevelHPSGD] = []
        self._binding: Binding | None = None
        self._control_group: dist.ProcessGroup | None = None

    @property
    def algorithm(self) -> HPSGD | TwoLevelHPSGD | None:
        """The first (with one optimizer: the only) optimizer's HPSGD; ``None`` before :meth:`bind`."""
        return self.algorithms[0] if self.algorithms else None

    @override
    def check_layout(self, topology: Topology) -> None:
        self.levels.check(topology)

    @override
    def bind(self, binding: Binding) -> None:
        self._binding = binding
        groups, levels = binding.groups, self.levels
        two = levels.window_levels(groups)
        levels.bind(binding.stats)
        self.algorithms = []
        for index, params in enumerate(binding.parameter_sets()):
            node = HPSGD(
                params,
                group=two.intra if two is not None else levels.periodic_group(groups),
                window=self.window * levels.period_factor,
                mode=self.mode,
                merge=self.merge,
                outer_lr=self.outer_lr,
                outer_momentum=self.outer_momentum,
                compression=self.compression,
                buffers=float_buffers(binding.module) if self.sync_buffers and index == 0 else (),
                bucket_bytes=bucket_bytes(self.bucket_size_mb),
                stats=binding.stats,
                control_group=self._poll_group(binding),
                optimizer=binding.optimizers[index] if binding.optimizers else None,
                reset_optimizer_state=self.reset_optimizer_state,
                delay=self.delay if two is None else None,
            )
            self.algorithms.append(TwoLevelHPSGD(node, two) if two is not None else node)
        if self.weights is not None:
            self.weights.reset()

    @override
    def fault_tolerance_problem(self) -> str | None:
        if self.mode != "fixed":
            return "mode='poll' agrees on readiness every step"
        if self.delay == AUTO:
            return "delay='auto' agrees on its choice over a control group of the starting ranks; give a number"
        if self.levels.enabled:
            return "two-level windows keep groups per node; fault tolerance is for one flat group"
        if self.compression in ("int8", "int4"):
            return f"compression={self.compression!r} splits the change into shards fixed by the number of replicas"
        if self.weights is not None:
            return SAMPLE_WEIGHTS_PROBLEM
        return None

    @override
    def regroup(self, groups: ProcessGroups, guard: RoundGuard) -> None:
        # one level only (fault_tolerance_problem refuses two): every algorithm is a flat HPSGD
        regroup_all(self._binding, groups, self.levels.periodic_group(groups), self.algorithms, guard)

    @override
    def settle(self) -> None:
        for algorithm in self.algorithms:
            if isinstance(algorithm, HPSGD):
                algorithm.settle()

    def _poll_group(self, binding: Binding) -> dist.ProcessGroup | None:
        """A second data group for the readiness flag (mode 'poll', delay 'auto'): it never queues behind the bulk."""
        if (self.mode != "poll" and self.delay != AUTO) or binding.groups.data is None:
            return None
        if self._control_group is None:  # a collective, once: every rank builds it in the same order
            self._control_group = binding.topology.build_second_group("data", binding.rank, binding.timeout)
        return self._control_group

    def _of(self, optimizer: Optimizer) -> HPSGD | TwoLevelHPSGD:
        assert self._binding is not None, "bind() first"
        return self.algorithms[self._binding.index_of(optimizer)]

    @override
    def reduce_gradients(self, optimizer: Optimizer) -> None:
        self.levels.average_in_node(self._binding, optimizer, self.sync_buffers)  # DDP inside the node

    @override
    def before_step(self, optimizer: Optimizer) -> None:
        if self.weights is not None:  # flat HPSGD only: SampleWeights refuses two levels
            node = self._of(optimizer)
            assert isinstance(node, HPSGD)
            node.change_weight = self.weights.add_step()

    @override
    def after_step(self, optimizer: Optimizer) -> dict[str, float]:
        algorithm = self._of(optimizer)
        merge = algorithm.step()
        if self.weights is not None and isinstance(algorithm, HPSGD) and algorithm.since_launch == 0:
            self.weights.reset()  # the window was sent: the next one counts anew
        return self._metrics(algorithm, merge) if merge is not None else {}

    def _metrics(self, algorithm: HPSGD | TwoLevelHPSGD, merge: Merge) -> dict[str, float]:
        assert self._binding is not None
        stats = self._binding.stats
        levels = algorithm.metrics() if isinstance(algorithm, TwoLevelHPSGD) else self.levels.metrics(None, stats)
        delay = {"hpsgd/delay": float(algorithm.delay)} if isinstance(algorithm, HPSGD) else {}
        return {
            **levels,
            **delay,
            "hpsgd/window": float(merge.window),
            "hpsgd/blocked_s": merge.blocked_s,
            "hpsgd/bytes": float(merge.bytes),
            "hpsgd/consensus_distance": merge.distance,
            "hpsgd/merges": float(merge.merges),
            "comm/bytes": float(stats.bytes),
            "comm/blocked_s": stats.blocked_s,
        }

    @override
    def consensus(self) -> Any:
        return all_consensus([a.consensus for a in self.algorithms])

    @override
    def finalize(self) -> dict[str, float]:
        for algorithm in self.algorithms:
            algorithm.finalize()  # the steps since the last launch leave with the weight set last
        if self.weights is not None:
            self.weights.reset()
        return {}

    @override
    def state_dict(self) -> dict[str, Any]:
        if not self.algorithms:
            return {}
        state = join_states([a.state_dict() for a in self.algorithms])
        return self.weights.wrap(state) if self.weights is not None else state

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state or not self.algorithms:
            return
        if self.weights is not None:
            state = self.weights.unwrap(state)
        for algorithm, mine in zip(self.algorithms, split_state(state, len(self.algorithms), self.owner), strict=True):
            algorithm.load_state_dict(mine)
