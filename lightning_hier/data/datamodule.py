"""One LightningDataModule for every in-memory classification dataset of this package."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_hier import _validate as v
from lightning_hier.data.arrays import ArrayDataset, Arrays, collate_batch
from lightning_hier.data.augment import normalize, random_crop_flip


class ArrayDataModule(pl.LightningDataModule):
    """Whole dataset in memory; batches are normalised (and augmented) on the device.

    Args:
        batch_size: Samples per batch *per process* (the global batch is ``batch_size`` times the
            number of data-parallel replicas).
        val_batch_size: Validation batch size per process (default: ``batch_size``).
        augment: Random crop (padding 4) and horizontal flip of training images, on the device.
        num_workers: DataLoader workers; 0 is right for in-memory data.
    """

    name = "arrays"

    def __init__(
        self, batch_size: int = 64, val_batch_size: int | None = None, augment: bool = False, num_workers: int = 0
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        self.batch_size = v.check_int(owner, "batch_size", batch_size, minimum=1)
        self.val_batch_size = v.check_int(
            owner, "val_batch_size", batch_size if val_batch_size is None else val_batch_size, minimum=1
        )
        self.augment = v.check_bool(owner, "augment", augment)
        self.num_workers = v.check_int(owner, "num_workers", num_workers, minimum=0)
        self._arrays: Arrays | None = None

    @abstractmethod
    def load_arrays(self) -> Arrays:
        """Read (or build) the dataset; called once per process."""

    @property
    def arrays(self) -> Arrays:
        if self._arrays is None:
            self._arrays = self.load_arrays()
        return self._arrays

    @property
    def input_shape(self) -> tuple[int, ...]:
        return self.arrays.input_shape

    @property
    def num_classes(self) -> int:
        return self.arrays.num_classes

    @override
    def setup(self, stage: str | None = None) -> None:
        _ = self.arrays

    @override
    def train_dataloader(self) -> DataLoader[Any]:
        a = self.arrays
        # drop_last keeps every batch (and every rank's batch count) the same size
        return self._loader(a.x_train, a.y_train, self.batch_size, shuffle=True, drop_last=True)

    @override
    def val_dataloader(self) -> DataLoader[Any]:
        a = self.arrays
        return self._loader(a.x_val, a.y_val, self.val_batch_size, shuffle=False, drop_last=False)

    @override
    def test_dataloader(self) -> DataLoader[Any]:
        return self.val_dataloader()

    def _loader(self, x: Tensor, y: Tensor, batch_size: int, shuffle: bool, drop_last: bool) -> DataLoader[Any]:
        return DataLoader(
            ArrayDataset(x, y),
            batch_size=batch_size,
            shuffle=shuffle,
            drop_last=drop_last,
            num_workers=self.num_workers,
            collate_fn=collate_batch,
        )

    @override
    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        x, y = batch
        # the model's dtype: floating inputs were already converted by the precision plugin
        module = self.trainer.lightning_module if self.trainer is not None else None
        dtype = module.dtype if module is not None and isinstance(module.dtype, torch.dtype) else None
        x = normalize(x, self.arrays.mean, self.arrays.std, dtype)
        if self.augment and x.dim() == 4 and self.trainer is not None and self.trainer.training:
            x = random_crop_flip(x)
        return x, y
