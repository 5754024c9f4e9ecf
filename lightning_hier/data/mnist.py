"""MNIST from the original IDX files (gzipped or not)."""

from __future__ import annotations

import gzip
import logging
import struct
from pathlib import Path

import numpy as np
import torch
from typing_extensions import override

from lightning_hier import _validate as v
from lightning_hier.data.arrays import Arrays, split_indices
from lightning_hier.data.datamodule import ArrayDataModule
from lightning_hier.data.errors import DatasetCorruptError, DatasetNotFoundError

log = logging.getLogger(__name__)

FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
MEAN, STD = (0.1307,), (0.3081,)


def read_idx(path: str | Path) -> np.ndarray:
    """Read an IDX file of unsigned bytes (``.gz`` or plain) into an array of its declared shape.

    Raises:
        DatasetCorruptError: Truncated or not an unsigned-byte IDX file.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
    except (OSError, EOFError) as err:
        raise DatasetCorruptError(f"MNIST: cannot read {path}: {err}. Replace the file with the original.") from err
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08 or not 1 <= raw[3] <= 4:
        raise DatasetCorruptError(f"MNIST: {path} is not an IDX file of unsigned bytes (bad header {raw[:4]!r}).")
    ndim = raw[3]
    if len(raw) < 4 + 4 * ndim:
        raise DatasetCorruptError(f"MNIST: {path} is truncated inside its header.")
    dims = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    payload = raw[4 + 4 * ndim :]
    expected = int(np.prod(dims))
    if len(payload) != expected:
        raise DatasetCorruptError(
            f"MNIST: {path} declares shape {dims} ({expected} bytes) but holds {len(payload)} bytes: truncated "
            "or corrupt. Replace the file with the original."
        )
    return np.frombuffer(payload, dtype=np.uint8).reshape(dims)


def find_idx(root: str | Path, name: str) -> Path | None:
    """``root/name``, ``root/name.gz`` or torchvision's ``root/MNIST/raw/...``; None if absent."""
    root = Path(root).expanduser()
    for folder in (root, root / "MNIST" / "raw"):
        for candidate in (folder / name, folder / f"{name}.gz"):
            if candidate.is_file():
                return candidate
    return None


def read_mnist_split(root: str | Path, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Images ``[N, 1, 28, 28]`` (uint8) and labels of the ``'train'`` or ``'test'`` split."""
    images_name, labels_name = FILES[split]
    images_path, labels_path = find_idx(root, images_name), find_idx(root, labels_name)
    if images_path is None or labels_path is None:
        raise DatasetNotFoundError(
            f"MNIST: {split} files {images_name}[.gz] and {labels_name}[.gz] not found in {Path(root).expanduser()}. "
            "Put the IDX files there, or install the 'vision' extra and pass download=True."
        )
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise DatasetCorruptError(
            f"MNIST: {images_path} has shape {images.shape} and {labels_path} has shape {labels.shape}; "
            "expected [N, 28, 28] images and N labels."
        )
    if labels.max(initial=0) > 9:
        raise DatasetCorruptError(f"MNIST: {labels_path} holds labels outside 0-9.")
    x = torch.from_numpy(images.copy()).unsqueeze(1)
    return x, torch.from_numpy(labels.astype(np.int64))


def load_mnist_arrays(root: str | Path, split: str = "auto", val_size: int = 2000, seed: int = 0) -> Arrays:
    """Train on ``train`` and validate on ``test`` ('standard'), or split the test set ('test').

    ``'auto'`` uses the standard split when the training files exist, else the test-set split
    (only the test set is available offline in some places).
    """
    if split == "auto":
        split = "standard" if find_idx(root, FILES["train"][0]) is not None else "test"
        if split == "test":
            log.warning("MNIST: no training files in %s; training on a split of the test set.", root)
    if split == "standard":
        x_train, y_train = read_mnist_split(root, "train")
        x_val, y_val = read_mnist_split(root, "test")
    else:
        x, y = read_mnist_split(root, "test")
        train, val = split_indices(len(x), val_size, seed)
        x_train, y_train, x_val, y_val = x[train], y[train], x[val], y[val]
    return Arrays(x_train, y_train, x_val, y_val, 10, MEAN, STD)


class MNISTDataModule(ArrayDataModule):
    """MNIST from IDX files.

    Args:
        root: Folder with the IDX files (``.gz`` or not).
        split: ``'standard'`` (train / t10k), ``'test'`` (t10k split into train and validation)
            or ``'auto'`` (standard when the training files exist).
        val_size: Validation samples of the ``'test'`` split.
        seed: Seed of the ``'test'`` split.
        download: Download through torchvision when files are missing (torchvision is optional: see
            :mod:`lightning_hier.data.download`).
        **kwargs: See :class:`~lightning_hier.data.datamodule.ArrayDataModule`.
    """

    name = "mnist"

    def __init__(
        self,
        root: str = "data/mnist",
        split: str = "auto",
        val_size: int = 2000,
        seed: int = 0,
        download: bool = False,
        **kwargs: object,
    ) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        owner = type(self).__name__
        self.root = root
        self.split = v.check_choice(owner, "split", split, ("auto", "standard", "test"))
        self.val_size = v.check_int(owner, "val_size", val_size, minimum=1)
        self.seed = seed
        self.download = v.check_bool(owner, "download", download)

    @override
    def prepare_data(self) -> None:
        if self.download and find_idx(self.root, FILES["test"][0]) is None:
            from lightning_hier.data.download import torchvision_download

            torchvision_download("MNIST", self.root)

    @property
    @override
    def input_shape(self) -> tuple[int, ...]:
        return (1, 28, 28)  # known without reading the files (the model is built before they are)

    @property
    @override
    def num_classes(self) -> int:
        return 10

    @override
    def load_arrays(self) -> Arrays:
        return load_mnist_arrays(self.root, self.split, self.val_size, self.seed)
