"""Synthetic classification data for fast tests: Gaussian clusters around random class centres."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from typing_extensions import override

from lightning_hier import _validate as v
from lightning_hier.data.arrays import Arrays
from lightning_hier.data.datamodule import ArrayDataModule


def make_synthetic_arrays(
    input_shape: Sequence[int] = (32,),
    num_classes: int = 10,
    train_size: int = 2048,
    val_size: int = 512,
    noise: float = 1.0,
    seed: int = 0,
) -> Arrays:
    """Samples ``centre[y] + noise * N(0, 1)``: learnable, with difficulty set by ``noise``."""
    g = torch.Generator().manual_seed(seed)
    shape = tuple(int(s) for s in input_shape)
    centres = torch.randn((num_classes, *shape), generator=g)

    def sample(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(0, num_classes, (n,), generator=g)
        return centres[y] + noise * torch.randn((n, *shape), generator=g), y

    x_train, y_train = sample(train_size)
    x_val, y_val = sample(val_size)
    channels = shape[0] if len(shape) > 1 else 1
    return Arrays(x_train, y_train, x_val, y_val, num_classes, (0.0,) * channels, (1.0,) * channels)


class SyntheticDataModule(ArrayDataModule):
    """Gaussian-cluster classification data of any input shape.

    Args:
        input_shape: Shape of one sample, e.g. ``[32]`` (features) or ``[3, 32, 32]`` (images, as
            convolutional networks need). ``None``: ``[32]``; the training entry
            (``python -m lightning_hier.train``) instead gives ``null`` the shape the model asks for.
        num_classes: Number of classes.
        train_size: Training samples.
        val_size: Validation samples.
        noise: Standard deviation of the noise around each class centre.
        seed: Seed of the generator.
        **kwargs: See :class:`~lightning_hier.data.datamodule.ArrayDataModule`.
    """

    name = "synthetic"

    def __init__(
        self,
        input_shape: Sequence[int] | None = (32,),
        num_classes: int = 10,
        train_size: int = 2048,
        val_size: int = 512,
        noise: float = 1.0,
        seed: int = 0,
        **kwargs: object,
    ) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        owner = type(self).__name__
        self.shape = _check_shape(owner, (32,) if input_shape is None else input_shape)
        self.classes = v.check_int(owner, "num_classes", num_classes, minimum=2)
        self.train_size = v.check_int(owner, "train_size", train_size, minimum=1)
        self.val_size = v.check_int(owner, "val_size", val_size, minimum=1)
        self.noise = v.check_float(owner, "noise", noise, low=0.0)
        self.seed = seed

    @override
    def load_arrays(self) -> Arrays:
        return make_synthetic_arrays(self.shape, self.classes, self.train_size, self.val_size, self.noise, self.seed)


def _check_shape(owner: str, shape: object) -> tuple[int, ...]:
    """A non-empty sequence of positive integers, as a tuple."""
    allowed = "a non-empty list of positive integers, e.g. [32] or [3, 32, 32]"
    return tuple(v.check_int_list(owner, "input_shape", shape, minimum=1, allowed=allowed))
