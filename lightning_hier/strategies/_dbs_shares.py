"""DBS's batch shares as a strategy mixin: the split follows measured speed, whatever synchronises the ranks.

:class:`DBSShares` holds everything about DBS that is not the gradient all-reduce: its arguments,
the checks before launch, the training DataLoader rebuilt around the
:class:`~lightning_hier.algorithms.dbs_sampler.DynamicBatchSampler`, the per-step timing, the
rebalance (triggered by :class:`~lightning_hier.callbacks.DBSCallback`) and its checkpoint state.
The state machine is ``self.shares``, a :class:`~lightning_hier.algorithms.dbs.DynamicBatchSize`.
What synchronises the ranks is the class it is mixed into:

- :class:`~lightning_hier.strategies.dbs.DBSStrategy`: the ``b_r / B``-weighted gradient
  all-reduce every step (the DBS papers);
- :class:`~lightning_hier.strategies.dbs_async.AsyncDBSStrategy`: an ASGD parameter server;
- :mod:`lightning_hier.strategies.dbs_compose`: HPSGD's or Local SGD's window average,
  weighted by samples.

Put it first among the bases (``class X(DBSShares, SomeStrategy)``): its hooks call ``super()``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import DataLoader, IterableDataset
from typing_extensions import override

from lightning_hier import _validate as v
from lightning_hier.algorithms.dbs import TIMERS, DynamicBatchSize, check_initial_sizes, check_split
from lightning_hier.algorithms.dbs_sampler import dynamic_batch_loader
from lightning_hier.callbacks.dbs import DBSCallback
from lightning_hier.comm.collectives import Group
from lightning_hier.strategies._base import HierStrategy
from lightning_hier.strategies._launchers import _ReportingLauncher

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from torch import Tensor, nn
    from torch.optim import Optimizer

    from lightning_hier.algorithms.dbs_sampler import Allocation


class DBSShares(HierStrategy):
    """Mixin: a fixed global batch split over the data-parallel ranks in proportion to their speed.

    The arguments are :class:`~lightning_hier.strategies.dbs.DBSStrategy`'s (``global_batch_size``,
    ``rebalance_every``, ``ema``, ``min_batch_size``, ``max_batch_size``, ``warmup_steps``,
    ``initial_sizes``, ``timer``), documented there; ``**kwargs`` go to the next base.
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
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        owner = type(self).__name__
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
        self.shares: DynamicBatchSize | None = None

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        # checked in the main process, before any rank starts
        if self.initial_sizes is not None:
            check_initial_sizes(
                type(self).__name__,
                self.initial_sizes,
                None,
                self.topology.data,
                self.min_batch_size,
                self.max_batch_size,
            )
        fixed = self._fixed_global_batch()
        if fixed is not None:
            self._check_split(*fixed)
        if isinstance(self._launcher, _SubprocessScriptLauncher):
            self._launcher = _CheckedScriptLauncher(self, self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = self._reporting_launcher(self._start_method, _CheckedLauncher)

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
                f"{type(self).__name__}: the training DataLoader has no batch_size (custom batch sampler); "
                "set `global_batch_size`."
            )
        world = self.topology.data
        total = loader.batch_size * world
        derived = f"the DataLoader's batch_size {loader.batch_size} x {world} ranks = {total}"
        return total, f"`global_batch_size`=None gives {derived}"

    def _check_split(self, global_batch: int, source: str) -> None:
        try:
            check_split(global_batch, self.topology.data, self.min_batch_size, self.max_batch_size)
        except ValueError as err:
            raise ValueError(f"{type(self).__name__}: {source}: {err}") from None

    def _check_training_loader(self, loader: DataLoader[Any]) -> int:
        """The global batch of ``loader`` after checking it can be split and the dataset holds a step."""
        global_batch, source = self._global_batch(loader)
        self._check_split(global_batch, source)
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
                f"{type(self).__name__}: the training dataset has {samples} samples, fewer than one global batch "
                f"of {global_batch} ({source}), and the DataLoader has drop_last=True, so no step would run. "
                f"To train, {change}, or use a DataLoader with drop_last=False (the {samples} samples then form "
                "one smaller global batch per epoch)."
                if samples
                else f"{type(self).__name__}: the training dataset is empty."
            )
        return global_batch

    def _check_fit_arguments(self, trainer: pl.Trainer | None, args: tuple[Any, ...]) -> None:
        """In the main process, before the ranks start: a DataLoader given to ``fit`` is checked."""
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        # Trainer.fit launches _fit_impl(model, train_dataloaders, val_dataloaders, datamodule, ...);
        # a DataModule's loader is only built in the ranks (its hooks may read or download data)
        if fitting and len(args) > 1 and isinstance(args[1], DataLoader):
            self._check_training_loader(args[1])

    # ------------------------------------------------------------------ set-up
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            self.shares = None  # a new fit builds a new algorithm (see _build_shares)
        super().setup(trainer)

    @override
    def _setup_algorithm(self, trainer: pl.Trainer) -> None:
        self._require_single_optimizer()
        self._build_shares()
        callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
        if not any(isinstance(c, DBSCallback) for c in callbacks):
            # first, so checkpoints saved at the end of a batch already hold that step's rebalance
            callbacks.insert(0, DBSCallback())
        super()._setup_algorithm(trainer)

    def _build_shares(self) -> DynamicBatchSize:
        """``self.shares``, built once per fit: by the training loader when that comes first.

        A learning-rate schedule reads ``trainer.estimated_stepping_batches`` inside
        ``configure_optimizers``, which makes Lightning build the training loader before the
        optimizers (and so before ``_setup_algorithm``); the loader still needs the allocation.
        """
        if self.shares is not None:
            return self.shares
        module: nn.Module = self.lightning_module  # type: ignore[assignment]
        self.shares = DynamicBatchSize(
            module.parameters(),
            group=self._shares_group(),
            rebalance_every=self.rebalance_every,
            ema=self.ema,
            min_batch_size=self.min_batch_size,
            max_batch_size=self.max_batch_size,
            warmup_steps=self.warmup_steps,
            initial_sizes=self.initial_sizes,
            timer=self._clock(),
            **self._shares_arguments(module),
            stats=self.comm_stats,
        )
        return self.shares

    def _shares_group(self) -> Group:
        """The group whose ranks share the global batch (and all-gather their speeds to rebalance)."""
        return self.groups.data

    def _shares_arguments(self, module: nn.Module) -> dict[str, Any]:
        """Further :class:`DynamicBatchSize` arguments (DBS's gradient all-reduce: its buffers and buckets)."""
        return {}

    def _clock(self) -> str:
        """The timer the algorithm reads (the ``timer`` argument here)."""
        return self.timer

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Training loader: batches from the strategy's allocation; other stages: unchanged."""
        if not self._training_stage:
            return dataloader
        if not isinstance(dataloader, DataLoader):
            raise TypeError(
                f"{type(self).__name__}: the training data must be a torch DataLoader over a map-style dataset, "
                f"got {type(dataloader).__name__}."
            )
        allocation = self._training_allocation(dataloader)
        return super().process_dataloader(dynamic_batch_loader(dataloader, allocation, seed=global_seed()))

    def _training_allocation(self, dataloader: DataLoader[Any]) -> Allocation:
        """The allocation of the training loader's global batch (built on first use)."""
        # every rank raises the same error here, before any collective of the fit, so none hangs
        return self._build_shares().bind(self._check_training_loader(dataloader))

    # ------------------------------------------------------------------ per step
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self.shares is not None:
            self.shares.begin_micro_batch()

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """Backward of the loss scaled by :meth:`DynamicBatchSize.loss_scale` (1.0 but in mixed steps)."""
        scale = self.shares.loss_scale() if self.shares is not None else 1.0
        if scale != 1.0:  # keep the common case bit-identical: no multiplication by 1
            closure_loss = closure_loss * scale
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def rebalance_if_due(self) -> dict[str, Any] | None:
        """Rebalance when a period ended (called by :class:`DBSCallback` after every batch); the report."""
        if self.shares is None or not self.shares.due():
            return None
        module = self.lightning_module
        align = module.trainer.accumulate_grad_batches if module is not None and module._trainer else 1
        return self.shares.rebalance(align=align)

    # ------------------------------------------------------------------ checkpoints
    def _shares_state(self) -> dict[str, Any]:
        """The split, its segments, the counters and throughput estimates of this rank."""
        return self.shares.state_dict() if self.shares is not None else {}

    def _load_shares_state(self, state: dict[str, Any]) -> None:
        if self.shares is not None and state:
            self.shares.load_state_dict(state)


class _CheckedScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's popen launcher, checking ``fit``'s training DataLoader before the children start."""

    def __init__(self, strategy: DBSShares, *args: Any) -> None:
        super().__init__(*args)
        self._shares = strategy

    @override
    def launch(self, function: Callable[..., Any], *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        self._shares._check_fit_arguments(trainer, args)
        return super().launch(function, *args, trainer=trainer, **kwargs)


class _CheckedLauncher(_ReportingLauncher):
    """The spawn/fork launcher, checking ``fit``'s training DataLoader before the children start."""

    @override
    def launch(self, function: Callable[..., Any], *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        strategy = self._strategy
        assert isinstance(strategy, DBSShares)
        strategy._check_fit_arguments(trainer, args)
        return super().launch(function, *args, trainer=trainer, **kwargs)


def global_seed() -> int:
    # the seed Lightning gives its DistributedSampler: the same on every rank (seed_everything sets it)
    return int(os.environ.get("PL_GLOBAL_SEED", 0))
