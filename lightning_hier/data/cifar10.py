"""CIFAR-10 from the python-pickle batches or an image-folder tree, decoded once and cached.

Accepted sources (``root``):

- a folder holding ``cifar-10-batches-py/`` (what torchvision downloads) or being it;
- a folder holding ``train/<class>/*.jpg|png`` and ``test/<class>/*.jpg|png``;
- a ``.tar.gz`` / ``.tgz`` / ``.tar`` archive of either (e.g. ``cifar10-jpeg.tar.gz``).

Decoding 60,000 JPEGs takes about 13 s on one core, so each split is decoded once and cached as
``uint8`` arrays in ``cache_dir``, keyed by the source's path, size and modification time.

The python batches are pickles: they are read with :func:`lightning_hier.data.safe_pickle.load_arrays`
(numpy arrays and plain values only), so a crafted batch file is refused before anything in it runs.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from typing_extensions import override

from lightning_hier import _validate as v
from lightning_hier.data.arrays import Arrays
from lightning_hier.data.datamodule import ArrayDataModule
from lightning_hier.data.errors import DatasetCorruptError, DatasetNotFoundError
from lightning_hier.data.safe_pickle import ForbiddenGlobal, load_arrays

log = logging.getLogger(__name__)

CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
_BATCHES = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]}
_IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
_ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar")


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "lightning_hier"


def read_cifar10_split(
    root: str | Path, split: str, cache_dir: str | Path | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Images ``[N, 3, 32, 32]`` (uint8) and labels of ``split`` ('train' or 'test'), cached.

    Raises:
        DatasetNotFoundError: ``root`` holds no recognisable CIFAR-10 source.
        DatasetCorruptError: A file of the source cannot be decoded.
    """
    source = Path(root).expanduser()
    if not source.exists():
        raise _not_found(source)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    cached = cache / f"cifar10-{split}-{_fingerprint(source)}.npz"
    if cached.is_file():
        with np.load(cached) as f:
            return f["x"], f["y"]
    log.info("CIFAR-10: decoding the %s split of %s once; caching it in %s", split, source, cached)
    x, y = _decode(source, split)
    _save_atomic(cached, x, y)
    return x, y


def _fingerprint(source: Path) -> str:
    st = source.stat()
    return hashlib.sha1(f"{source.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]


def _decode(source: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    if source.is_file() and source.name.endswith(_ARCHIVE_SUFFIXES):
        return _from_archive(source, split)
    if source.is_dir():
        for folder in (source / "cifar-10-batches-py", source):
            if (folder / _BATCHES[split][0]).is_file():
                return _stack_batches((p.name, p.read_bytes()) for p in (folder / n for n in _BATCHES[split]))
        if (source / split).is_dir():
            return _stack_images(
                (str(p.relative_to(source)), p.read_bytes())
                for p in sorted((source / split).rglob("*"))
                if p.suffix.lower() in _IMAGE_SUFFIXES
            )
    raise _not_found(source)


def _from_archive(path: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    batches: list[tuple[str, bytes]] = []
    images: list[tuple[str, bytes]] = []
    try:
        with tarfile.open(path) as tar:
            for member in tar:
                if not member.isfile():
                    continue
                name = member.name
                if Path(name).name in _BATCHES[split]:
                    batches.append((name, _read_member(tar, member)))
                elif name.lower().endswith(_IMAGE_SUFFIXES) and _image_split(name) == split:
                    images.append((name, _read_member(tar, member)))
    except (tarfile.TarError, OSError, EOFError) as err:
        raise DatasetCorruptError(
            f"CIFAR-10: cannot read archive {path}: {err}. Replace it with a complete copy."
        ) from err
    if batches:
        return _stack_batches(sorted(batches))
    if images:
        return _stack_images(sorted(images))
    raise _not_found(path)


def _read_member(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    f = tar.extractfile(member)
    assert f is not None
    return f.read()


def _image_split(name: str) -> str | None:
    parts = Path(name).parts
    for i in range(len(parts) - 2):
        if parts[i] in _BATCHES and parts[i + 1] in CLASSES:
            return parts[i]
    return None


def _stack_batches(batches: Iterator[tuple[str, bytes]] | list[tuple[str, bytes]]) -> tuple[np.ndarray, np.ndarray]:
    xs, ys = [], []
    for name, blob in batches:
        try:
            d = load_arrays(blob)  # never pickle.loads: a crafted batch file would run code
            x = np.asarray(d[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
            y = np.asarray(d[b"labels"], dtype=np.int64)
        except ForbiddenGlobal as err:
            raise DatasetCorruptError(
                f"CIFAR-10: refusing to load batch file {name}: it names {err}, which a CIFAR-10 batch never holds "
                "(only numpy arrays and plain values are read: dict, list, str, bytes, int, float); nothing in it "
                "was run. Replace it with the original cifar-10-batches-py files."
            ) from None
        except Exception as err:
            raise DatasetCorruptError(f"CIFAR-10: batch file {name} is corrupt ({err!r}).") from err
        if len(x) != len(y):
            raise DatasetCorruptError(f"CIFAR-10: batch file {name} has {len(x)} images but {len(y)} labels.")
        xs.append(x)
        ys.append(y)
    return np.concatenate(xs), np.concatenate(ys)


def _stack_images(files: Iterator[tuple[str, bytes]] | list[tuple[str, bytes]]) -> tuple[np.ndarray, np.ndarray]:
    xs, ys = [], []
    for name, blob in files:
        label = Path(name).parent.name
        if label not in CLASSES:
            raise DatasetCorruptError(f"CIFAR-10: {name} is in folder '{label}', which is not a CIFAR-10 class.")
        try:
            with Image.open(io.BytesIO(blob)) as img:
                arr = np.asarray(img.convert("RGB"), dtype=np.uint8)
        except (UnidentifiedImageError, OSError, SyntaxError) as err:
            raise DatasetCorruptError(f"CIFAR-10: cannot decode image {name}: {err}.") from err
        if arr.shape != (32, 32, 3):
            raise DatasetCorruptError(f"CIFAR-10: image {name} is {arr.shape[1]}x{arr.shape[0]}, expected 32x32.")
        xs.append(arr.transpose(2, 0, 1))
        ys.append(CLASSES.index(label))
    if not xs:
        raise DatasetCorruptError("CIFAR-10: the image folder holds no images.")
    return np.stack(xs), np.asarray(ys, dtype=np.int64)


def _save_atomic(path: Path, x: np.ndarray, y: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".npz")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, x=x, y=y)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _not_found(source: Path) -> DatasetNotFoundError:
    return DatasetNotFoundError(
        f"CIFAR-10 not found at {source}. Expected one of: a folder with cifar-10-batches-py/ (the python "
        "batches), a folder with train/<class>/*.jpg and test/<class>/*.jpg, or a .tar.gz archive of either. "
        "Put the files there, or install the 'vision' extra (pip install 'lightning-hier[vision]') and pass "
        "download=True."
    )


def load_cifar10_arrays(root: str | Path, cache_dir: str | Path | None = None, train_size: int | None = None) -> Arrays:
    """Train and test splits as :class:`Arrays` (the test split is used for validation).

    ``train_size`` keeps a fixed random subset of the training images (see :class:`CIFAR10DataModule`).
    The test split comes in a fixed random order (seed 0), whatever the source's order, so that its
    first batches hold every class in proportion.
    """
    x_train, y_train = read_cifar10_split(root, "train", cache_dir)
    x_val, y_val = read_cifar10_split(root, "test", cache_dir)
    if train_size is not None:
        # a fixed random subset, the same in every process: image-folder sources are stored class by
        # class, so the first `train_size` images would hold only one or two classes
        keep = np.sort(np.random.default_rng(0).permutation(len(x_train))[:train_size])
        x_train, y_train = x_train[keep], y_train[keep]
    # validation in a fixed mixed order: Lightning does not shuffle it, so with class-by-class image
    # folders `limit_val_batches=4` (or any first batches) validated on airplane to cat only
    mixed = np.random.default_rng(0).permutation(len(x_val))
    x_val, y_val = x_val[mixed], y_val[mixed]
    return Arrays(
        torch.from_numpy(x_train),
        torch.from_numpy(y_train),
        torch.from_numpy(x_val),
        torch.from_numpy(y_val),
        10,
        MEAN,
        STD,
    )


class CIFAR10DataModule(ArrayDataModule):
    """CIFAR-10 (50,000 train / 10,000 test images) with on-device crop-and-flip augmentation.

    Args:
        root: A source as described in the module docstring.
        cache_dir: Where decoded arrays are cached (default ``~/.cache/lightning_hier``).
        train_size: Use only ``train_size`` training images (quick experiments): a fixed random
            subset (seed 0), identical in every process and run, with every class represented.
        download: Download the python batches through torchvision (optional, not installed with
            the package: see :mod:`lightning_hier.data.download`).
        augment: Random crop (padding 4) and flip of training batches (default on).
        **kwargs: See :class:`~lightning_hier.data.datamodule.ArrayDataModule`.
    """

    name = "cifar10"

    def __init__(
        self,
        root: str = "data/cifar10",
        cache_dir: str | None = None,
        train_size: int | None = None,
        download: bool = False,
        augment: bool = True,
        **kwargs: object,
    ) -> None:
        super().__init__(augment=augment, **kwargs)  # type: ignore[arg-type]
        owner = type(self).__name__
        self.root = root
        self.cache_dir = cache_dir
        self.train_size = None if train_size is None else v.check_int(owner, "train_size", train_size, minimum=1)
        self.download = v.check_bool(owner, "download", download)

    @override
    def prepare_data(self) -> None:
        # runs on one process per node: decode and cache before every rank reads the cache
        if self.download and not Path(self.root).expanduser().exists():
            from lightning_hier.data.download import torchvision_download

            torchvision_download("CIFAR10", self.root)
        for split in ("train", "test"):
            read_cifar10_split(self.root, split, self.cache_dir)

    @property
    @override
    def input_shape(self) -> tuple[int, ...]:
        return (3, 32, 32)  # known without reading the files (the model is built before they are)

    @property
    @override
    def num_classes(self) -> int:
        return 10

    @override
    def load_arrays(self) -> Arrays:
        return load_cifar10_arrays(self.root, self.cache_dir, self.train_size)
