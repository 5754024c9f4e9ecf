"""Dataset readers against the real files, synthetic trees and corrupted copies."""

import gzip
import io
import pickle
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from lightning_hier.data import (
    CIFAR10DataModule,
    DatasetCorruptError,
    DatasetNotFoundError,
    DigitsDataModule,
    MNISTDataModule,
    SyntheticDataModule,
    load_cifar10_arrays,
    load_mnist_arrays,
    read_cifar10_split,
    read_idx,
)
from lightning_hier.data.augment import normalize, random_crop_flip
from lightning_hier.data.cifar10 import CLASSES


# ---------------------------------------------------------------- real files
def test_cifar10_reads_the_real_jpeg_archive_and_caches_it(shared_datasets, tmp_path):
    archive = shared_datasets / "cifar10-jpeg.tar.gz"
    x, y = read_cifar10_split(archive, "test", cache_dir=tmp_path)
    assert x.shape == (10000, 3, 32, 32) and x.dtype == np.uint8
    assert np.bincount(y).tolist() == [1000] * 10
    assert len(list(tmp_path.glob("cifar10-test-*.npz"))) == 1
    x2, _ = read_cifar10_split(archive, "test", cache_dir=tmp_path)  # from the cache
    assert np.array_equal(x, x2)


def test_mnist_reads_the_real_idx_files(shared_datasets):
    images = read_idx(shared_datasets / "mnist" / "t10k-images-idx3-ubyte.gz")
    assert images.shape == (10000, 28, 28)
    arrays = load_mnist_arrays(shared_datasets / "mnist")  # no training files: 8k/2k split of t10k
    assert (len(arrays.x_train), len(arrays.x_val)) == (8000, 2000)
    assert arrays.y_train.max() == 9 and arrays.input_shape == (1, 28, 28)


# ---------------------------------------------------------------- synthetic CIFAR sources
def _png(value: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((32, 32, 3), value, dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _image_tree(root, per_class: int = 2):
    for split in ("train", "test"):
        for label, name in enumerate(CLASSES):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(per_class):
                (folder / f"{i:04d}.png").write_bytes(_png(label * 10 + i))


def test_cifar10_image_folder_tree(tmp_path):
    _image_tree(tmp_path / "tree")
    x, y = read_cifar10_split(tmp_path / "tree", "train", cache_dir=tmp_path / "cache")
    assert x.shape == (20, 3, 32, 32) and sorted(set(y.tolist())) == list(range(10))
    assert x[y == 3][0, 0, 0, 0] == 30  # pixels and labels stay paired


def test_cifar10_train_size_is_a_fixed_subset_with_every_class(tmp_path):
    # image-folder trees are decoded class by class: a prefix of 20 would hold classes 0 and 1 only
    _image_tree(tmp_path / "tree", per_class=10)
    a = load_cifar10_arrays(tmp_path / "tree", cache_dir=tmp_path / "cache", train_size=20)
    b = load_cifar10_arrays(tmp_path / "tree", cache_dir=tmp_path / "cache", train_size=20)
    assert len(a.y_train) == 20 and len(set(a.y_train.tolist())) >= 6
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_train, b.y_train)
    assert all(int(x[0, 0, 0]) // 10 == int(y) for x, y in zip(a.x_train, a.y_train, strict=True))


def test_cifar10_validation_order_is_fixed_and_mixed(tmp_path):
    # Lightning does not shuffle validation: a class-by-class tree's first 20 images are classes 0
    # and 1 only, so `limit_val_batches` would validate on two classes
    _image_tree(tmp_path / "tree", per_class=10)
    a = load_cifar10_arrays(tmp_path / "tree", cache_dir=tmp_path / "cache")
    b = load_cifar10_arrays(tmp_path / "tree", cache_dir=tmp_path / "cache")
    assert torch.equal(a.x_val, b.x_val) and torch.equal(a.y_val, b.y_val)
    assert sorted(a.y_val.tolist()) == sorted(i // 10 for i in range(100))  # every image once
    assert len(set(a.y_val[:20].tolist())) >= 6
    assert all(int(x[0, 0, 0]) // 10 == int(y) for x, y in zip(a.x_val, a.y_val, strict=True))


def test_cifar10_python_batches_in_an_archive(tmp_path):
    def batch(n: int, seed: int) -> bytes:
        rng = np.random.default_rng(seed)
        d = {b"data": rng.integers(0, 255, (n, 3072), dtype=np.uint8), b"labels": list(rng.integers(0, 10, n))}
        return pickle.dumps(d)

    archive = tmp_path / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, blob in [(f"data_batch_{i}", batch(5, i)) for i in range(1, 6)] + [("test_batch", batch(4, 9))]:
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    x, y = read_cifar10_split(archive, "train", cache_dir=tmp_path / "cache")
    assert x.shape == (25, 3, 32, 32) and y.shape == (25,)


def test_cifar10_missing_source_says_where_to_put_files(tmp_path):
    with pytest.raises(DatasetNotFoundError, match=r"CIFAR-10 not found at .*nowhere.*train/<class>"):
        read_cifar10_split(tmp_path / "nowhere", "train", cache_dir=tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetNotFoundError, match="download=True"):
        read_cifar10_split(tmp_path / "empty", "train", cache_dir=tmp_path)


def test_cifar10_corrupt_files_are_named(tmp_path):
    _image_tree(tmp_path / "tree", per_class=1)
    (tmp_path / "tree" / "train" / "cat" / "0000.png").write_bytes(b"not an image")
    with pytest.raises(DatasetCorruptError, match=r"cannot decode image train/cat/0000.png"):
        read_cifar10_split(tmp_path / "tree", "train", cache_dir=tmp_path / "cache")
    truncated = tmp_path / "broken.tar.gz"
    truncated.write_bytes(gzip.compress(b"x" * 10000)[:200])
    with pytest.raises(DatasetCorruptError, match=r"cannot read archive .*broken.tar.gz"):
        read_cifar10_split(truncated, "train", cache_dir=tmp_path / "cache")
    (tmp_path / "batches").mkdir()
    (tmp_path / "batches" / "test_batch").write_bytes(b"\x80\x04garbage")
    with pytest.raises(DatasetCorruptError, match="batch file test_batch is corrupt"):
        read_cifar10_split(tmp_path / "batches", "test", cache_dir=tmp_path / "cache")


# ---------------------------------------------------------------- MNIST IDX
def _idx(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def test_idx_plain_and_gzipped(tmp_path):
    a = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    (tmp_path / "a").write_bytes(_idx(a))
    (tmp_path / "a.gz").write_bytes(gzip.compress(_idx(a)))
    assert np.array_equal(read_idx(tmp_path / "a"), a) and np.array_equal(read_idx(tmp_path / "a.gz"), a)


def test_idx_corruption_is_reported_clearly(tmp_path):
    good = _idx(np.zeros((4, 2, 2)))
    cases = {
        "short": good[:-3],
        "header": b"\x12\x34" + good[2:],
        "gz": gzip.compress(good)[:-10],
    }
    messages = {"short": "declares shape", "header": "not an IDX file", "gz": "cannot read"}
    for name, blob in cases.items():
        (tmp_path / name).write_bytes(blob)
        with pytest.raises(DatasetCorruptError, match=messages[name]):
            read_idx(tmp_path / name)


def test_mnist_missing_files(tmp_path):
    with pytest.raises(DatasetNotFoundError, match=r"t10k-images-idx3-ubyte\[.gz\].*not found"):
        load_mnist_arrays(tmp_path)


def test_download_without_torchvision_is_a_clear_error(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_torchvision(name, *args, **kwargs):
        if name.startswith("torchvision"):
            raise ImportError("No module named 'torchvision'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torchvision)
    with pytest.raises(
        DatasetNotFoundError, match=r"needs torchvision, .*--index-url https://download.pytorch.org/whl/cpu"
    ):
        MNISTDataModule(root=str(tmp_path), download=True).prepare_data()


# ---------------------------------------------------------------- datamodules and augmentation
def test_digits_and_synthetic_datamodules():
    d = DigitsDataModule(batch_size=32)
    assert (d.input_shape, d.num_classes) == ((1, 8, 8), 10)
    assert len(d.arrays.x_train) + len(d.arrays.x_val) == 1797
    x, y = next(iter(d.train_dataloader()))
    assert x.shape == (32, 1, 8, 8) and y.dtype == torch.long
    s = SyntheticDataModule(input_shape=[3, 8, 8], num_classes=4, train_size=64, val_size=16, batch_size=16)
    assert s.input_shape == (3, 8, 8) and len(s.val_dataloader()) == 1
    assert CIFAR10DataModule(root="unused").input_shape == (3, 32, 32)  # known without reading files


def test_bad_datamodule_arguments():
    with pytest.raises(ValueError, match="`batch_size` must be an integer >= 1, got 0"):
        DigitsDataModule(batch_size=0)
    with pytest.raises(ValueError, match="`split` must be one of"):
        MNISTDataModule(split="train")


def test_augmentation_is_per_image_and_shape_preserving():
    x = torch.arange(2 * 3 * 8 * 8, dtype=torch.float32).view(2, 3, 8, 8)
    torch.manual_seed(0)
    out = random_crop_flip(x, padding=2)
    assert out.shape == x.shape
    torch.manual_seed(0)
    assert torch.equal(out, random_crop_flip(x, padding=2))  # deterministic given the RNG
    same = random_crop_flip(x, padding=0, flip=False)
    assert torch.equal(same, x)


def test_normalize_scales_uint8_and_standardises_channels():
    x = torch.full((1, 3, 2, 2), 255, dtype=torch.uint8)
    out = normalize(x, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    assert out.dtype == torch.float32 and torch.allclose(out, torch.full_like(out, 2.0))
    assert normalize(x, (0.5,) * 3, (0.25,) * 3, torch.float64).dtype == torch.float64
    assert normalize(torch.ones(2, 3, dtype=torch.float64), (0.0,), (1.0,)).dtype == torch.float64


@pytest.mark.parametrize("precision", ["64-true", "bf16-true"])
def test_datamodule_batches_follow_the_model_precision(precision):
    from lightning_hier.models import Classifier, small_cnn
    from tests.helpers import trainer

    # Lightning's default sanity check (2 validation batches) stays on: it validates in this precision
    t = trainer(devices=1, precision=precision, max_steps=2, limit_val_batches=1, num_sanity_val_steps=2)
    t.fit(Classifier(small_cnn((1, 8, 8), 10), 10), datamodule=DigitsDataModule(batch_size=16, augment=True))
    assert t.global_step == 2
