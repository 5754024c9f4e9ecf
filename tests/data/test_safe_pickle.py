"""CIFAR-10's python batches are unpickled with numpy arrays and plain values only: a crafted file runs nothing."""

import io
import os
import pickle
import struct
import tarfile
from collections import OrderedDict

import numpy as np
import pytest

from lightning_hier.data import DatasetCorruptError, read_cifar10_split
from lightning_hier.data.safe_pickle import ForbiddenGlobal, load_arrays


def py2_batch(x: np.ndarray, labels: list[int]) -> bytes:
    """A batch as the original ``cifar-10-batches-py`` files hold it: Python 2 cPickle, protocol 2.

    Written opcode by opcode (Python 3 cannot write Python 2 ``str`` objects): a dict of
    ``labels`` (a list of ints) and ``data`` (a uint8 ndarray through ``numpy.core.multiarray._reconstruct``).
    """
    raw = x.tobytes()
    out = b"\x80\x02}q\x00(U\x06labelsq\x01]q\x02(" + b"".join(b"K" + bytes([y]) for y in labels) + b"eU\x04dataq\x03"
    out += b"cnumpy.core.multiarray\n_reconstruct\nq\x04cnumpy\nndarray\nq\x05K\x00\x85U\x01b\x87Rq\x06(K\x01"
    out += b"M" + struct.pack("<H", x.shape[0]) + b"M" + struct.pack("<H", x.shape[1]) + b"\x86"
    out += b"cnumpy\ndtype\nq\x07U\x02u1K\x00K\x01\x87Rq\x08(K\x03U\x01|NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb"
    return out + b"\x89T" + struct.pack("<I", len(raw)) + raw + b"tbu."


class _Touch:
    """Pickles as a call that creates ``path``: what a malicious batch file would do."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _batches_folder(root, blobs: dict[str, bytes]):
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for name, blob in blobs.items():
        (folder / name).write_bytes(blob)
    return root


def test_the_original_python2_format_loads(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (3, 3072), dtype=np.uint8)
    root = _batches_folder(tmp_path / "src", {"test_batch": py2_batch(images, [3, 7, 9])})
    x, y = read_cifar10_split(root, "test", cache_dir=tmp_path / "cache")
    assert np.array_equal(x, images.reshape(3, 3, 32, 32)) and y.tolist() == [3, 7, 9]


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_python3_pickles_of_arrays_scalars_and_plain_values_load(protocol):
    value = {
        b"data": np.arange(12, dtype=np.uint8).reshape(3, 4),
        b"labels": [np.int64(1), 2, 3.5, True, None],
        b"batch_label": "testing batch 1 of 1",
        b"filenames": [b"a.png", b"b.png"],
        b"empty": np.zeros((0, 2), dtype=np.float32),
    }
    got = load_arrays(pickle.dumps(value, protocol=protocol))
    assert got.keys() == value.keys() and np.array_equal(got[b"data"], value[b"data"])
    assert got[b"labels"] == value[b"labels"] and got[b"filenames"] == value[b"filenames"]
    assert got[b"empty"].dtype == np.float32 and got[b"empty"].shape == (0, 2)


@pytest.mark.parametrize("protocol", [0, 2, 5])
def test_a_crafted_batch_is_refused_naming_the_file_and_runs_nothing(tmp_path, protocol):
    marker = tmp_path / "code-ran"
    blob = pickle.dumps({b"data": _Touch(str(marker)), b"labels": [0]}, protocol=protocol)
    root = _batches_folder(tmp_path / "src", {"test_batch": blob})
    with pytest.raises(DatasetCorruptError, match=r"refusing to load batch file test_batch: it names posix\.system"):
        read_cifar10_split(root, "test", cache_dir=tmp_path / "cache")
    assert not marker.exists()
    assert not list(tmp_path.glob("cache/*"))  # nothing cached either


def test_a_crafted_batch_inside_an_archive_is_refused(tmp_path):
    marker = tmp_path / "code-ran"
    archive = tmp_path / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        blob = pickle.dumps({b"data": _Touch(str(marker))})
        info = tarfile.TarInfo("cifar-10-batches-py/test_batch")
        info.size = len(blob)
        tar.addfile(info, io.BytesIO(blob))
    with pytest.raises(DatasetCorruptError, match=r"cifar-10-batches-py/test_batch: it names posix\.system"):
        read_cifar10_split(archive, "test", cache_dir=tmp_path / "cache")
    assert not marker.exists()


@pytest.mark.parametrize(
    "value",
    [
        eval,  # builtins.eval
        np.load,  # a numpy function other than the array's own
        OrderedDict(a=1),  # any class
        {1, 2},  # sets need builtins.set
        complex(1, 2),
    ],
)
def test_every_other_global_is_forbidden(value):
    with pytest.raises(ForbiddenGlobal):
        load_arrays(pickle.dumps(value, protocol=2))
