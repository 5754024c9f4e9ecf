"""Datamodules: whole datasets in memory, batches normalised and augmented on the device.

``digits`` (embedded, the default), ``synthetic`` (fast tests), ``cifar10`` (python batches or
an image-folder tree / archive, decoded once and cached) and ``mnist`` (IDX files).
"""

from lightning_hier.data.arrays import ArrayDataset, Arrays, collate_batch
from lightning_hier.data.cifar10 import CIFAR10DataModule, load_cifar10_arrays, read_cifar10_split
from lightning_hier.data.datamodule import ArrayDataModule
from lightning_hier.data.digits import DigitsDataModule, load_digits_arrays
from lightning_hier.data.errors import DatasetCorruptError, DatasetNotFoundError
from lightning_hier.data.mnist import MNISTDataModule, load_mnist_arrays, read_idx
from lightning_hier.data.synthetic import SyntheticDataModule, make_synthetic_arrays

__all__ = [
    "ArrayDataModule",
    "ArrayDataset",
    "Arrays",
    "CIFAR10DataModule",
    "DatasetCorruptError",
    "DatasetNotFoundError",
    "DigitsDataModule",
    "MNISTDataModule",
    "SyntheticDataModule",
    "collate_batch",
    "load_cifar10_arrays",
    "load_digits_arrays",
    "load_mnist_arrays",
    "make_synthetic_arrays",
    "read_cifar10_split",
    "read_idx",
]
