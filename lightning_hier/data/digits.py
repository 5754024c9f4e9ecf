"""scikit-learn's bundled 8x8 handwritten digits: the embedded default, no download needed."""

from __future__ import annotations

import torch
from typing_extensions import override

from lightning_hier import _validate as v
from lightning_hier.data.arrays import Arrays, split_indices
from lightning_hier.data.datamodule import ArrayDataModule


def load_digits_arrays(val_fraction: float = 0.2, seed: int = 0) -> Arrays:
    """1797 images, 1 x 8 x 8, values 0-16, 10 classes; a seeded train/validation split."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.tensor(bunch.data, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    y = torch.tensor(bunch.target, dtype=torch.long)
    train, val = split_indices(len(x), round(len(x) * val_fraction), seed)
    mean, std = float(x[train].mean()), float(x[train].std())
    return Arrays(x[train], y[train], x[val], y[val], 10, (mean,), (std,))


class DigitsDataModule(ArrayDataModule):
    """The 8x8 digits (1437 train / 360 validation samples by default).

    Args:
        val_fraction: Share of the 1797 samples held out for validation.
        seed: Seed of the split.
        **kwargs: See :class:`~lightning_hier.data.datamodule.ArrayDataModule`.
    """

    name = "digits"

    def __init__(self, val_fraction: float = 0.2, seed: int = 0, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.val_fraction = v.check_float(
            type(self).__name__, "val_fraction", val_fraction, 0.0, 1.0, low_inclusive=False, high_inclusive=False
        )
        self.seed = seed

    @override
    def load_arrays(self) -> Arrays:
        return load_digits_arrays(self.val_fraction, self.seed)
