"""Lightning adapter of DBS, performance-aware dynamic batch size (Ji et al. 2019; Ye et al. 2020).

:class:`DBSStrategy` (registered as ``dbs``, ``dbs_spawn``, ``dbs_fork``). The algorithm lives in
:mod:`lightning_hier.algorithms.dbs`, the batch sampler in :mod:`lightning_hier.algorithms.dbs_sampler`;
the strategy holds DBS's allocation (:class:`~lightning_hier.sync.SpeedShares`) and its gradient
rule (:class:`~lightning_hier.sync.ShareWeightedGradients`).

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

from collections.abc import Sequence
from typing import Any

from lightning_hier.strategies.adapter import HierStrategy
from lightning_hier.sync.dbs import ShareWeightedGradients, SpeedShares


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
        **kwargs: See :class:`~lightning_hier.strategies.HierStrategy` (``timeout``,
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
        owner = type(self).__name__
        shares = SpeedShares(
            global_batch_size,
            rebalance_every,
            ema,
            min_batch_size,
            max_batch_size,
            warmup_steps,
            initial_sizes,
            timer,
            owner=owner,
        )
        sync = ShareWeightedGradients(shares, sync_buffers, bucket_size_mb, owner)
        super().__init__(sync=sync, allocation=shares, **kwargs)
