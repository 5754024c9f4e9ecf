"""Lightning adapter of DBS, performance-aware dynamic batch size (Ji et al. 2019; Ye et al. 2020).

:class:`DBSStrategy` (registered as ``dbs``, ``dbs_spawn``, ``dbs_fork``). The algorithm lives in
:mod:`lightning_hier.algorithms.dbs`, the batch sampler in :mod:`lightning_hier.algorithms.dbs_sampler`.

How it plugs into Lightning:

- **Checks before launch.** The split of the global batch, ``initial_sizes`` against the world
  size, and (when ``fit`` gets a DataLoader) the dataset size against the global batch are checked
  in the main process, before any rank starts; a DataModule's loader is checked on every rank when
  it is built, with the same message.
- **Data.** In ``process_dataloader`` (training stage only) the strategy rebuilds the training
  DataLoader around a :class:`~lightning_hier.algorithms.dbs_sampler.DynamicBatchSampler` over the
  same dataset: an ordinary map-style dataset and DataLoader are all it needs, with Lightning's
  default ``use_distributed_sampler=True`` or without it. The loader's ``drop_last`` applies to
  global batches. Validation and test loaders are left to Lightning's ``DistributedSampler``.
- **Gradients.** A wrapped closure weights each rank's gradient by ``b_r / B`` after backward (and
  after all accumulated micro-batches), before gradient clipping, and sums it over the ranks. In a
  step that mixes full batches and the smaller last batch (``drop_last=False`` with gradient
  accumulation), ``backward`` scales the last micro-batch's loss so the weights stay exact.
- **Throughput.** Timed from ``on_train_batch_start`` of a step's first micro-batch to the end of
  its optimizer step, minus the time blocked in collectives.
- **Rebalance.** Every ``rebalance_every`` optimizer steps (steps, not epochs: it reacts within an
  epoch and, since the number of steps per epoch never changes, needs no dataloader reloading),
  triggered by :class:`~lightning_hier.callbacks.DBSCallback`, which the strategy adds when the
  Trainer has none.

Limits: one training DataLoader (a torch ``DataLoader`` over a map-style dataset); a
``training_step`` that takes ``dataloader_iter`` is not supported; BatchNorm statistics are computed
per local batch, as with DDP (then averaged with the batch weights, ``sync_buffers``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from torch.utils.data import DataLoader, IterableDataset
from typing_extensions import override

from lightning_hier import _validate as v
from lightning_hier.algorithms.dbs import TIMERS, DynamicBatchSize, check_initial_sizes, check_split
from lightning_hier.algorithms.dbs_sampler import dynamic_batch_loader
from lightning_hier.callbacks.dbs import DBSCallback
from lightning_hier.strategies._base import HierStrategy
from lightning_hier.strategies._buckets import bucket_arguments, check_bucket_options
from lightning_hier.strategies._launchers import _ReportingLauncher

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from torch import Tensor, nn
    from torch.optim import Optimizer


class DBSStrategy(HierStrategy):
    """Dynamic batch size: a fixed global batch split over the ranks in proportion to their speed.

    Every rank keeps the same model (synchronous SGD); a slow rank gets a smaller share of each
    global batch, so all ranks finish their steps at about the same time. With any split, a step
    equals single-process SGD on the whole global batch (gradients are weighted by ``b_r / B``), and
    the global batch of each step holds the same samples as under DDP with ``B / W`` per rank.

    The training DataLoader's ``drop_last`` applies to global batches: ``True`` skips the
    ``N mod B`` samples left after the last full global batch of an epoch; ``False`` (a DataLoader's
    default) trains on them as one smaller global batch, split by the same shares (a rank may get no
    sample: it then runs the step on a stand-in sample with gradient weight 0) and weighted so that
    this step too equals single-process SGD on those samples. That step is not used to measure
    throughput. A rank's part of it may be a single sample, which ``BatchNorm1d`` rejects in training
    mode: keep ``drop_last=True`` for such models. With ``drop_last=False`` a dataset smaller than
    one global batch trains one such step per epoch; with ``drop_last=True`` it is an error (raised
    before the ranks start when ``fit`` gets the DataLoader itself).

    Args:
        global_batch_size: ``B``, samples per step over all ranks. ``None``: the sum of
            ``initial_sizes`` if given, else the training DataLoader's ``batch_size`` times the
            number of ranks (what DDP would use). When set, the loader's ``batch_size`` is ignored.
            With gradient accumulation, ``B`` is per micro-batch.
        rebalance_every: Optimizer steps between rebalances.
        ema: Smoothing of each rank's throughput across rebalance periods,
            ``v = ema * v + (1 - ema) * v_period``, in ``[0, 1)``; 0 uses the last period only.
        min_batch_size: Smallest per-rank batch (>= 1).
        max_batch_size: Largest per-rank batch, e.g. the memory limit (``None``: no bound but ``B``).
        warmup_steps: Optimizer steps at the start of training that are not measured (one-off
            costs); the first rebalance is after ``warmup_steps + rebalance_every`` steps.
        initial_sizes: The split to start from: one batch size per data-parallel rank (integers
            within ``[min_batch_size, max_batch_size]``) whose sum is the global batch (equal to
            ``global_batch_size`` when both are set). ``None``: the equal split. Sizes rather than
            shares, so a run starts from exactly the split given (reproducible heterogeneity
            experiments); a checkpoint's split takes precedence on resume. The length is checked
            against the number of ranks before any rank starts.
        timer: How compute time is measured: ``'wall'`` (elapsed time minus the time blocked in
            collectives: what a step really costs; the default) or ``'cpu'`` (the process's CPU time:
            on a shared CPU machine, other processes' load is then not taken for slowness; CPU
            training only, e.g. with :class:`~lightning_hier.callbacks.Straggler` in ``'spin'`` mode), or
            ``'thread'`` (the CPU time of the training thread alone; torch's intra-op threads are not
            counted, so set ``torch.set_num_threads(1)``).
        sync_buffers: Average floating-point buffers (BatchNorm statistics) with the same weights
            at every step, so every rank holds the same model.
        bucket_size_mb: Size bound of the flat gradient buffers reduced in one call (MiB, >= 0.001).
        **kwargs: See :class:`~lightning_hier.strategies._base.HierStrategy` (``timeout``,
            ``start_method``, ...).

    Example:
        >>> import lightning.pytorch as pl
        >>> import lightning_hier  # registers the names
        >>> from lightning_hier import DBSStrategy
        >>> strategy = DBSStrategy(global_batch_size=256, rebalance_every=20, timeout=120)
        >>> trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2)  # doctest: +SKIP
        >>> skewed = DBSStrategy(initial_sizes=[192, 64], rebalance_every=10**9)  # a fixed 3:1 split
    """

    strategy_name = "dbs"

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
        sync_buffers: bool = True,
        bucket_size_mb: float = 25.0,
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
        self.sync_buffers, self.bucket_size_mb = check_bucket_options(owner, sync_buffers, bucket_size_mb)
        self.algorithm: DynamicBatchSize | None = None

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
            self.algorithm = None  # a new fit builds a new algorithm (see _build_algorithm)
        super().setup(trainer)

    @override
    def _setup_algorithm(self, trainer: pl.Trainer) -> None:
        self._require_single_optimizer()
        self._build_algorithm()
        callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
        if not any(isinstance(c, DBSCallback) for c in callbacks):
            # first, so checkpoints saved at the end of a batch already hold that step's rebalance
            callbacks.insert(0, DBSCallback())

    def _build_algorithm(self) -> DynamicBatchSize:
        """The algorithm, built once per fit: by the training loader when that comes first.

        A learning-rate schedule reads ``trainer.estimated_stepping_batches`` inside
        ``configure_optimizers``, which makes Lightning build the training loader before the
        optimizers (and so before ``_setup_algorithm``); the loader still needs the allocation.
        """
        if self.algorithm is not None:
            return self.algorithm
        module: nn.Module = self.lightning_module  # type: ignore[assignment]
        self.algorithm = DynamicBatchSize(
            module.parameters(),
            group=self.groups.data,
            rebalance_every=self.rebalance_every,
            ema=self.ema,
            min_batch_size=self.min_batch_size,
            max_batch_size=self.max_batch_size,
            warmup_steps=self.warmup_steps,
            initial_sizes=self.initial_sizes,
            timer=self._clock(),
            **bucket_arguments(module, self.sync_buffers, self.bucket_size_mb),
            stats=self.comm_stats,
        )
        return self.algorithm

    def _clock(self) -> str:
        """The timer the algorithm reads (the ``timer`` argument here)."""
        return self.timer

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Training loader: batches from the strategy's allocation; other stages: unchanged."""
        module = self.lightning_module
        stage = module.trainer.state.stage if module is not None and module._trainer is not None else None
        if stage != RunningStage.TRAINING:
            return dataloader
        if not isinstance(dataloader, DataLoader):
            raise TypeError(
                f"{type(self).__name__}: the training data must be a torch DataLoader over a map-style dataset, "
                f"got {type(dataloader).__name__}."
            )
        # every rank raises the same error here, before any collective of the fit, so none hangs
        global_batch = self._check_training_loader(dataloader)
        allocation = self._build_algorithm().bind(global_batch)
        return super().process_dataloader(dynamic_batch_loader(dataloader, allocation, seed=_global_seed()))

    # ------------------------------------------------------------------ per step
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self.algorithm is not None:
            self.algorithm.begin_micro_batch()

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """Backward of the loss scaled by :meth:`DynamicBatchSize.loss_scale` (1.0 but in mixed steps)."""
        scale = self.algorithm.loss_scale() if self.algorithm is not None else 1.0
        if scale != 1.0:  # keep the common case bit-identical: no multiplication by 1
            closure_loss = closure_loss * scale
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        algorithm = self.algorithm
        assert algorithm is not None

        def closure_and_reduce() -> Any:
            output = closure()
            algorithm.reduce_gradients()
            return output

        output = super().optimizer_step(optimizer, closure_and_reduce, model, **kwargs)
        algorithm.end_step()
        return output

    def rebalance_if_due(self) -> dict[str, Any] | None:
        """Rebalance when a period ended (called by :class:`DBSCallback` after every batch); the report."""
        if self.algorithm is None or not self.algorithm.due():
            return None
        module = self.lightning_module
        align = module.trainer.accumulate_grad_batches if module is not None and module._trainer else 1
        return self.algorithm.rebalance(align=align)

    # ------------------------------------------------------------------ checkpoints
    @override
    def _algorithm_state(self) -> dict[str, Any]:
        return self.algorithm.state_dict() if self.algorithm is not None else {}

    @override
    def _load_algorithm_state(self, state: dict[str, Any]) -> None:
        if self.algorithm is not None and state:
            self.algorithm.load_state_dict(state)


class _CheckedScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's popen launcher, checking ``fit``'s training DataLoader before the children start."""

    def __init__(self, strategy: DBSStrategy, *args: Any) -> None:
        super().__init__(*args)
        self._dbs = strategy

    @override
    def launch(self, function: Callable[..., Any], *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        self._dbs._check_fit_arguments(trainer, args)
        return super().launch(function, *args, trainer=trainer, **kwargs)


class _CheckedLauncher(_ReportingLauncher):
    """The spawn/fork launcher, checking ``fit``'s training DataLoader before the children start."""

    @override
    def launch(self, function: Callable[..., Any], *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        strategy = self._strategy
        assert isinstance(strategy, DBSStrategy)
        strategy._check_fit_arguments(trainer, args)
        return super().launch(function, *args, trainer=trainer, **kwargs)


def _global_seed() -> int:
    # the seed Lightning gives its DistributedSampler: the same on every rank (seed_everything sets it)
    return int(os.environ.get("PL_GLOBAL_SEED", 0))
