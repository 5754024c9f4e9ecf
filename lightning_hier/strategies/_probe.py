"""GRAWA's fresh probe batches: samples drawn from the whole training set, apart from training.

Dimlioglu and Choromanska, "GRAWA: Gradient-based Weighted Averaging for Distributed Training of
Deep Learning Models", AISTATS 2024 (code: github.com/tolgadimli/GRAWA): every worker measures its
gradient norm on a batch drawn from the *whole* training set, independently of the worker's own
data shard. Measured on the batch a replica has just stepped on, the norm is small for every
replica that fits its own batch well, whatever its loss elsewhere, and the weights can favour the
worse replica (a user's demo: weights [3e-9, 1.0] with the own-batch probe, [0.39, 0.61] with a
fresh batch).

:class:`FreshBatches` draws such a batch from a training DataLoader's dataset (random access: a
map-style dataset) with the loader's batch size and collate function, from a generator seeded by
``(seed, rank, step)``: every rank draws its own batch, the same one again after a resume (no
state to checkpoint), and the training DataLoader's iteration is never touched.
:func:`isolated_rng` runs the probe with every global generator seeded from the same numbers and
then puts the training streams back, so dropout or augmentation in the probe neither consume nor
depend on the training RNG stream.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset
from torchmetrics import Metric

from lightning_hier.rng import capture_rng, restore_rng
from lightning_hier.strategies._finite import loss_of
from lightning_hier.strategies._user_model import muted_logs

_MASK = (1 << 63) - 1


class FreshBatches:
    """Probe batches of ``batch_size`` samples drawn without replacement from the whole of ``dataset``.

    Args:
        dataset: A map-style dataset (``len`` and integer indexing): the full training set, not a shard.
        collate_fn: Turns a list of samples into a batch (the training DataLoader's).
        batch_size: Samples per probe batch (the training batch size; capped at ``len(dataset)``).
        seed: Base seed shared by all ranks.
        rank: This rank's index; every rank draws its own batches.
    """

    def __init__(
        self, dataset: Any, collate_fn: Callable[[list[Any]], Any], batch_size: int, seed: int, rank: int
    ) -> None:
        self.dataset, self.collate_fn = dataset, collate_fn
        self.size = len(dataset)
        if self.size < 1:
            raise ValueError("FreshBatches: the training dataset is empty; nothing to draw a probe batch from.")
        self.batch_size = min(batch_size, self.size)
        self.seed, self.rank = seed, rank

    @classmethod
    def from_loader(cls, loader: DataLoader[Any], seed: int, rank: int, owner: str) -> FreshBatches:
        """The probe batches of one training DataLoader (its dataset, batch size and collate function)."""
        dataset = loader.dataset
        random_access = hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")
        if isinstance(dataset, IterableDataset) or not random_access:
            raise ValueError(
                f"{owner}(probe='fresh') draws probe batches at random from the training dataset and needs a "
                f"map-style dataset (__len__ and __getitem__); the training DataLoader's dataset is "
                f"{type(dataset).__name__}. Use probe='batch' or probe='step' with an iterable dataset."
            )
        batch_size = loader.batch_size or getattr(loader.batch_sampler, "batch_size", None)
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(
                f"{owner}(probe='fresh') draws probe batches of the training batch size, but the training "
                f"DataLoader's batch size is {batch_size!r} (a custom batch_sampler without `batch_size`); "
                "give the batch sampler a `batch_size` attribute, or use probe='batch' or probe='step'."
            )
        return cls(dataset, loader.collate_fn, batch_size, seed, rank)

    def seed_for(self, step: int) -> int:
        """The seed of the batch drawn after optimizer step ``step`` (also seeds the probe's RNG)."""
        return ((self.seed * 1_000_003 + self.rank) * 1_000_033 + step) & _MASK

    def indices(self, step: int) -> Tensor:
        """Dataset indices of the batch drawn after optimizer step ``step``."""
        generator = torch.Generator().manual_seed(self.seed_for(step))
        return torch.randperm(self.size, generator=generator)[: self.batch_size]

    def draw(self, step: int) -> Any:
        """The collated batch drawn after optimizer step ``step`` (fetched as a DataLoader fetches a batch)."""
        indices = [int(i) for i in self.indices(step)]
        fetch_many = getattr(self.dataset, "__getitems__", None)
        samples = fetch_many(indices) if fetch_many else [self.dataset[i] for i in indices]
        return self.collate_fn(samples)


Loaders = Any
"""A DataLoader, or a dict, list or tuple of them (Lightning's combined training loaders)."""


def fresh_batches_of(loaders: Loaders, seed: int, rank: int, owner: str) -> Any:
    """A :class:`FreshBatches` for every training DataLoader, in the loaders' structure."""
    if isinstance(loaders, DataLoader):
        return FreshBatches.from_loader(loaders, seed, rank, owner)
    if isinstance(loaders, Mapping):
        return {k: fresh_batches_of(v, seed, rank, owner) for k, v in loaders.items()}
    if isinstance(loaders, Sequence) and not isinstance(loaders, str):
        return type(loaders)(fresh_batches_of(v, seed, rank, owner) for v in loaders)  # type: ignore[call-arg]
    raise ValueError(
        f"{owner}(probe='fresh') draws probe batches from the training DataLoaders' datasets, but the training "
        f"data is a {type(loaders).__name__}, not a DataLoader (or a dict or list of them). Use probe='batch' "
        "or probe='step'."
    )


def draw(batches: Any, step: int) -> Any:
    """The batch drawn after ``step`` from every :class:`FreshBatches` in ``batches``, in its structure."""
    if isinstance(batches, FreshBatches):
        return batches.draw(step)
    if isinstance(batches, Mapping):
        return {k: draw(v, step) for k, v in batches.items()}
    return type(batches)(draw(v, step) for v in batches)


def first(batches: Any) -> FreshBatches:
    """The first :class:`FreshBatches` in the structure (its seed stands for the whole probe)."""
    if isinstance(batches, FreshBatches):
        return batches
    return first(next(iter(batches.values() if isinstance(batches, Mapping) else batches)))


@contextmanager
def isolated_rng(seed: int) -> Iterator[None]:
    """Run with Python's, NumPy's and torch's global generators seeded from ``seed``; restore them after."""
    saved = capture_rng()
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    try:
        yield
    finally:
        restore_rng(saved)


PROBES = ("fresh", "batch", "step")


class TrainingStepProbe:
    """GRAWA's probe under Lightning: the module's own ``training_step`` re-run on the side for its loss.

    A :class:`~lightning_hier.sync.averaging.NormSource`: ``'fresh'`` draws a batch from the whole
    training set (:class:`FreshBatches`, seeded by ``(seed, rank, step)``), ``'batch'`` re-uses the
    round's last training batch, ``'step'`` does not probe (the step's own gradients). The probe
    logs nothing, keeps torchmetrics states, and leaves the training RNG stream where it was.

    Under manual optimization the user's ``training_step`` steps the optimizers itself, so it
    cannot be re-run as a probe: the rounds then weigh the step's own gradients (``'step'``), and
    a message says so once.

    Args:
        kind: ``'fresh'``, ``'batch'`` or ``'step'``.
        seed: Base seed of the fresh probe batches.
        owner: The strategy's name, in messages.
    """

    def __init__(self, kind: str = "fresh", seed: int = 0, owner: str = "GrawaStrategy") -> None:
        self.probe, self.probe_seed, self.owner = kind, seed, owner
        self._strategy: Any = None
        self._fresh: Any = None  # the FreshBatches of every training DataLoader, drawn on first use

    def bind(self, binding: Any) -> bool:
        """Keep the strategy that runs the loop; whether this probe measures (False: the step's gradients)."""
        strategy, self._fresh = binding.host, None
        self._strategy = strategy
        module = strategy.lightning_module if strategy is not None else None
        if self.probe == "step" or module is None:
            return False
        if not module.automatic_optimization:
            rank_zero_info(
                f"{self.owner}(probe={self.probe!r}): the module uses manual optimization, so its training_step "
                "steps the optimizers itself and cannot be re-run as a probe; the rounds weigh the gradients of "
                "each round's last step (probe='step')."
            )
            return False
        return True

    def loss(self, step: int) -> Tensor:
        """``training_step``'s loss at the current weights, as a side computation (see the class docstring)."""
        strategy = self._strategy
        args, kwargs = strategy.last_step_args if strategy.last_step_args is not None else ((), {})
        if self.probe == "batch":
            if not args and not kwargs:
                raise RuntimeError(f"{self.owner}(probe='batch'): no training batch seen yet.")
            return self._training_loss(args, kwargs)
        if self._fresh is None:
            # the training DataLoaders exist from here on (Lightning set them up before the first step)
            loaders = strategy.lightning_module.trainer.train_dataloader
            self._fresh = fresh_batches_of(loaders, self.probe_seed, strategy.global_rank, self.owner)
        # the batch and every random draw of the probe come from (seed, rank, step): put back after
        with isolated_rng(first(self._fresh).seed_for(step)):
            batch = strategy.batch_to_device(draw(self._fresh, step))  # the module's transfer hooks
            rest: tuple[Any, ...] = tuple(args[1:]) if args else (0,)  # batch_idx of the latest batch
            return self._training_loss((batch, *rest), kwargs)

    def _training_loss(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
        strategy = self._strategy
        module = strategy.lightning_module
        with side_effect_free(module), strategy.precision_plugin.train_step_context():
            loss = loss_of(module.training_step(*args, **kwargs))
        if loss is None:
            raise RuntimeError(
                f"{self.owner}(probe={self.probe!r}): training_step returned no loss tensor; use probe='step'."
            )
        return loss


@contextmanager
def side_effect_free(module: Any) -> Iterator[None]:
    """Re-run a LightningModule hook as a side computation: nothing logged, torchmetrics states kept."""
    metrics = [m for m in module.modules() if isinstance(m, Metric)]
    saved = [(m._copy_state_dict(), m._update_count, m._computed, m._forward_cache) for m in metrics]
    try:
        with muted_logs(module):
            yield
    finally:
        for metric, (state, count, computed, cache) in zip(metrics, saved, strict=True):
            for name, value in state.items():
                setattr(metric, name, value)
            metric._update_count, metric._computed, metric._forward_cache = count, computed, cache
