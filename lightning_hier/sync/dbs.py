"""DBS, performance-aware dynamic batch size, as an allocation and a gradient rule (Ji et al. 2019; Ye et al. 2020).

- :class:`SpeedShares` (an :class:`~lightning_hier.sync.base.Allocation`): a fixed global batch
  split over the data-parallel ranks in proportion to their measured speed, the training loader
  re-batched by :class:`~lightning_hier.algorithms.dbs_sampler.DynamicBatchSampler` (or, with a
  server, claims the server sizes), each step timed, the split rebalanced every
  ``rebalance_every`` steps (:meth:`SpeedShares.rebalance_if_due`, which
  :class:`~lightning_hier.callbacks.DBSCallback` calls after every batch).
- :class:`ShareWeightedGradients` (a :class:`~lightning_hier.sync.base.Sync`): DBS's own
  synchronisation, every gradient replaced by ``sum_w (b_w / B) grad_w`` after backward.

What synchronises the ranks is whichever rule goes with the shares: the weighted gradients
(``dbs``), HPSGD's or Local SGD's window weighted by samples (``dbs_hpsgd``, ``dbs_localsgd``;
:class:`~lightning_hier.sync.dbs_compose.SampleWeights`), or a parameter server (``dbs_async``).
The state machine underneath is :class:`~lightning_hier.algorithms.dbs.DynamicBatchSize`.

Plain PyTorch (one batch per optimizer step)::

    shares = SpeedShares(global_batch_size=256, timer="cpu")
    sync = ShareWeightedGradients(shares)
    with sync.attach(model, optimizer, allocation=shares) as binding:
        loader = shares.training_loader(DataLoader(dataset, batch_size=128, shuffle=True), seed=0)
        for epoch in range(epochs):
            loader.batch_sampler.set_epoch(epoch)
            for x, y in loader:
                loss_fn(model(x), y).backward()
                optimizer.step()  # gradients weighted b_w / B and summed; the step timed
                optimizer.zero_grad()
                shares.rebalance_if_due()
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch.distributed as dist
from torch.optim import Optimizer
from torch.utils.data import DataLoader, IterableDataset
from typing_extensions import override

from lightning_hier import _validate as v
from lightning_hier.algorithms.averaging import float_buffers
from lightning_hier.algorithms.claim_sampler import ClaimQueue, ServerShares, claim_batch_loader
from lightning_hier.algorithms.dbs import TIMERS, DynamicBatchSize, check_initial_sizes, check_split, reduce_weighted_
from lightning_hier.algorithms.dbs_sampler import Allocation as Split
from lightning_hier.algorithms.dbs_sampler import dynamic_batch_loader
from lightning_hier.comm import FlatTensors
from lightning_hier.sync.base import Allocation, Binding, Sync
from lightning_hier.sync.buckets import bucket_bytes, check_bucket_options
from lightning_hier.topology import Topology

SPEED_GROUPS = ("data", "own")


class Server(Protocol):
    """A parameter server the shares may work with (``dbs_async``): its state and its claims."""

    @property
    def running(self) -> bool:
        """Whether the server is serving this rank (training is under way)."""

    @property
    def workers(self) -> list[int]:
        """The ranks that compute gradients."""

    claims: Any

    def claim(self, epoch: int, n: int, num_samples: int, speed: float = 0.0) -> tuple[int, int]:
        """Claim ``n`` samples of ``epoch`` (0: the server's share for ``speed``)."""


class SpeedShares(Allocation):
    """A fixed global batch split over the ranks in proportion to their measured speed.

    Arguments as :class:`~lightning_hier.strategies.DBSStrategy`'s: ``global_batch_size``,
    ``rebalance_every``, ``ema``, ``min_batch_size``, ``max_batch_size``, ``warmup_steps``,
    ``initial_sizes``, ``timer``. Further:

    Args:
        span: ``'compute'`` (a step's time without the time blocked in collectives) or
            ``'iteration'`` (from the previous step's end: an asynchronous worker's round trips are
            part of its cost); see :class:`~lightning_hier.algorithms.dbs.DynamicBatchSize`.
        speed_group: ``'data'`` (speeds all-gathered over the data group) or ``'own'`` (over a
            second data group, so a rebalance never queues behind a window's reduction in flight).
        server: A parameter server the workers train through (``dbs_async``): the first step after a
            pause is timed alone, and its ``claims`` get the server's DBS split.
        shared: With ``server``: the ranks claim their batches from the server's queue, each claim
            sized by the server from the speeds the workers report (no all-gather).
        owner: The name in error messages.
    """

    def __init__(
        self,
        global_batch_size: int | None = None,
        rebalance_every: int = 20,
        ema: float = 0.5,
        min_batch_size: int = 1,
        max_batch_size: int | None = None,
        warmup_steps: int = 5,
        initial_sizes: Sequence[int] | None = None,
        timer: str = "wall",
        span: str = "compute",
        speed_group: str = "data",
        server: Server | None = None,
        shared: bool = False,
        owner: str = "SpeedShares",
    ) -> None:
        self.owner = owner
        self.global_batch_size = (
            None if global_batch_size is None else v.check_int(owner, "global_batch_size", global_batch_size, minimum=1)
        )
        self.rebalance_every = v.check_int(owner, "rebalance_every", rebalance_every, minimum=1)
        self.ema = v.check_float(owner, "ema", ema, 0.0, 1.0, high_inclusive=False)
        self.min_batch_size = v.check_int(owner, "min_batch_size", min_batch_size, minimum=1)
        self.max_batch_size = (
            None
            if max_batch_size is None
            else v.check_int(owner, "max_batch_size", max_batch_size, minimum=self.min_batch_size)
        )
        if self.global_batch_size is not None:
            v.check_int(owner, "global_batch_size", self.global_batch_size, minimum=self.min_batch_size)
        self.warmup_steps = v.check_int(owner, "warmup_steps", warmup_steps, minimum=0)
        self.initial_sizes = (
            None
            if initial_sizes is None
            else check_initial_sizes(
                owner, initial_sizes, self.global_batch_size, None, self.min_batch_size, self.max_batch_size
            )
        )
        self.timer = v.check_choice(owner, "timer", timer, TIMERS)
        self.span = span
        self.speed_group = v.check_choice(owner, "speed_group", speed_group, SPEED_GROUPS)
        self.server = server
        self.shared = shared
        self.equal_steps = not shared  # a shared queue: each rank takes as many steps as its speed allows
        self.dbs: DynamicBatchSize | None = None
        self._binding: Binding | None = None
        self._own_group: dist.ProcessGroup | None = None
        self._restored: dict[str, Any] | None = None
        self._started = False  # a plain loop: a batch began since the last step
        self._world = 0  # data-parallel ranks (known from check_layout on)
        self._claim_batch = 0  # the global batch the server splits (shared queue)

    # ------------------------------------------------------------------ before any rank starts
    @override
    def check_layout(self, topology: Topology) -> None:
        if self.initial_sizes is not None:
            check_initial_sizes(
                self.owner, self.initial_sizes, None, topology.data, self.min_batch_size, self.max_batch_size
            )
        fixed = self._fixed_global_batch()
        if fixed is not None:
            self._check_split(topology.data, *fixed)
        self._world = topology.data

    def _fixed_global_batch(self) -> tuple[int, str] | None:
        """The global batch set by the arguments and where it came from (``None``: from the loader)."""
        if self.global_batch_size is not None:
            return self.global_batch_size, f"argument `global_batch_size`={self.global_batch_size}"
        if self.initial_sizes is not None:
            total = sum(self.initial_sizes)
            return total, f"argument `initial_sizes`={self.initial_sizes} (sum {total})"
        return None

    def _global_batch(self, loader: DataLoader[Any]) -> tuple[int, str]:
        """The global batch of ``loader`` and a phrase saying where it came from (for messages)."""
        fixed = self._fixed_global_batch()
        if fixed is not None:
            return fixed
        if loader.batch_size is None:
            raise ValueError(
                f"{self.owner}: the training DataLoader has no batch_size (custom batch sampler); "
                "set `global_batch_size`."
            )
        total = loader.batch_size * self._world
        derived = f"the DataLoader's batch_size {loader.batch_size} x {self._world} ranks = {total}"
        return total, f"`global_batch_size`=None gives {derived}"

    def _check_split(self, world: int, global_batch: int, source: str) -> None:
        try:
            check_split(global_batch, world, self.min_batch_size, self.max_batch_size)
        except ValueError as err:
            raise ValueError(f"{self.owner}: {source}: {err}") from None

    @override
    def check_training_loader(self, loader: Any) -> None:
        if isinstance(loader, DataLoader):
            self._checked_global_batch(loader)

    def _checked_global_batch(self, loader: DataLoader[Any]) -> int:
        """The global batch of ``loader`` after checking it can be split and the dataset holds a step."""
        global_batch, source = self._global_batch(loader)
        self._check_split(self._world, global_batch, source)
        if isinstance(loader.dataset, IterableDataset):
            return global_batch  # rejected with its own message when the loader is rebuilt
        samples = len(loader.dataset)  # type: ignore[arg-type]
        drop_last = bool(getattr(loader.batch_sampler, "drop_last", loader.drop_last))
        if samples == 0 or (drop_last and samples < global_batch):
            if self.global_batch_size is not None:
                change = "lower `global_batch_size`"
            elif self.initial_sizes is not None:
                change = "lower `initial_sizes`"
            else:
                change = "lower the DataLoader's batch_size or set `global_batch_size`"
            raise ValueError(
                f"{self.owner}: the training dataset has {samples} samples, fewer than one global batch "
                f"of {global_batch} ({source}), and the DataLoader has drop_last=True, so no step would run. "
                f"To train, {change}, or use a DataLoader with drop_last=False (the {samples} samples then form "
                "one smaller global batch per epoch)."
                if samples
                else f"{self.owner}: the training dataset is empty."
            )
        return global_batch

    # ------------------------------------------------------------------ a run of training
    @override
    def bind(self, binding: Binding) -> None:
        if self._binding is binding:
            return
        self._binding = binding
        self._world = binding.topology.data
        self.dbs = DynamicBatchSize(
            binding.module.parameters(),
            group=self._group(binding),
            rebalance_every=self.rebalance_every,
            ema=self.ema,
            min_batch_size=self.min_batch_size,
            max_batch_size=self.max_batch_size,
            warmup_steps=self.warmup_steps,
            initial_sizes=self.initial_sizes,
            timer=self.timer,
            stats=binding.stats,
            span=self.span,
        )
        if self.server is not None and self.shared:
            self.server.claims = self._claim_queue

    def _group(self, binding: Binding) -> Any:
        """The group whose ranks share the global batch (and all-gather their speeds to rebalance)."""
        if self.speed_group == "data":
            return binding.groups.data
        if self._own_group is None:  # a collective, once: every rank builds it in the same order
            self._own_group = binding.topology.build_second_group("data", binding.rank, binding.timeout)
        return self._own_group

    @property
    def world(self) -> int:
        """Ranks that share the global batch."""
        return self._require().world

    @property
    def step_samples(self) -> tuple[int, int]:
        """``(n_w, N)``: samples of the current step on this rank and over all ranks."""
        return self._require().step_samples

    @property
    def step_share(self) -> float:
        """``b_w / B`` of the current step (the weight of this rank's gradient)."""
        return self._require().step_share

    def _require(self) -> DynamicBatchSize:
        if self.dbs is None:
            raise RuntimeError(f"{self.owner}: the shares are built when training starts (bind()).")
        return self.dbs

    @override
    def training_loader(self, loader: Any, seed: int = 0) -> Any:
        if not isinstance(loader, DataLoader):
            raise TypeError(
                f"{self.owner}: the training data must be a torch DataLoader over a map-style dataset, "
                f"got {type(loader).__name__}."
            )
        # every rank raises the same error here, before any collective of the fit, so none hangs
        split = self._require().bind(self._checked_global_batch(loader))
        if self.server is not None and self.shared:
            self._claim_batch = split.global_batch
            return claim_batch_loader(loader, 0, self._claim, seed, self.owner, split.take_claimed)
        return dynamic_batch_loader(loader, split, seed=seed)

    def _claim(self, epoch: int, n: int, num_samples: int) -> tuple[int, int]:
        assert self.server is not None
        speed = self.dbs.meter.estimate if self.dbs is not None else 0.0
        return self.server.claim(epoch, n, num_samples, speed)

    def _claim_queue(self) -> ClaimQueue:
        assert self.server is not None
        shares = ServerShares(
            self._claim_batch, self.server.workers, self.min_batch_size, self.max_batch_size, self.initial_sizes
        )
        return ClaimQueue(shares)

    @property
    def split(self) -> Split | None:
        """The per-rank batch sizes in use (``None`` before the training loader is built)."""
        return self.dbs.allocation if self.dbs is not None else None

    # ------------------------------------------------------------------ per step
    @override
    def batch_started(self, batch: Any, batch_idx: int) -> None:
        dbs = self._require()
        if self.server is not None and (batch_idx == 0 or not self.server.running):
            dbs.restart()  # the time since the last step holds a pause: an epoch's end, validation
        dbs.begin_micro_batch()
        self._started = True

    @override
    def step_starting(self) -> None:
        if not self._started:
            self._require().begin_micro_batch()
        self._started = False

    @override
    def loss_scale(self) -> float:
        return self.dbs.loss_scale() if self.dbs is not None else 1.0

    @override
    def step_ended(self) -> None:
        self._require().end_step()

    def rebalance_if_due(self) -> dict[str, Any] | None:
        """Rebalance when a period ended (a collective on every rank; call after every batch); the report.

        With a shared queue the split is the server's: the period's speed is only folded into
        this rank's estimate, which goes to the server with the next claims (no report).
        """
        dbs = self.dbs
        if dbs is None or not dbs.due():
            return None
        if self.shared:
            dbs.measure()
            return None
        align = self._binding.accumulation if self._binding is not None else 1
        return dbs.rebalance(align=align)

    # ------------------------------------------------------------------ checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        """The split, its segments, the counters and throughput estimates of this rank."""
        return self.dbs.state_dict() if self.dbs is not None else {}

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.dbs is not None and state:
            self.dbs.load_state_dict(state)


class ShareWeightedGradients(Sync):
    """DBS's synchronisation: every gradient becomes ``sum_w (b_w / B) grad_w`` after backward.

    Each rank's gradient is the mean over its own share of the step, so the sum is the mean over
    the whole global batch: a step equals single-process SGD on it, whatever the split.

    Args:
        shares: The allocation whose current share weights this rank's gradient.
        sync_buffers: Average floating-point buffers (BatchNorm statistics) with the same weights at
            every step, so every rank holds the same model.
        bucket_size_mb: Size bound of the flat gradient buffers reduced in one call (MiB).
        owner: The name in error messages.
    """

    def __init__(
        self, shares: SpeedShares, sync_buffers: bool = True, bucket_size_mb: float = 25.0, owner: str = "DBS"
    ) -> None:
        self.owner = owner
        self.shares = shares
        self.sync_buffers, self.bucket_size_mb = check_bucket_options(owner, sync_buffers, bucket_size_mb)
        self._binding: Binding | None = None
        self._sets: list[list[Any]] = []
        self._buffers: FlatTensors | None = None

    @override
    def bind(self, binding: Binding) -> None:
        self._binding = binding
        self._sets = binding.parameter_sets()
        buffers = float_buffers(binding.module) if self.sync_buffers else []
        self._buffers = FlatTensors(buffers, bucket_bytes(self.bucket_size_mb)) if buffers else None

    @override
    def reduce_gradients(self, optimizer: Optimizer) -> None:
        binding, dbs = self._binding, self.shares.dbs
        assert binding is not None and dbs is not None, "bind() first"
        index = binding.index_of(optimizer)
        buffers = self._buffers.buckets if self._buffers is not None and index == 0 else []
        reduce_weighted_(
            self._sets[index], dbs.step_share, dbs.group, binding.stats, bucket_bytes(self.bucket_size_mb), buffers
        )
