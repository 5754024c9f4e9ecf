"""Unpickling data files that may hold numpy arrays, numpy scalars and plain values only (CIFAR-10's python batches).

``pickle.loads`` calls whatever callable a pickle names, so a crafted data file runs code as soon as
it is read. :func:`load_arrays` resolves only the few globals a pickled numpy array needs (written
by Python 2's cPickle, which made the original CIFAR-10 files, or by Python 3 with numpy 1.x or
2.x); any other global stops the load at that opcode, before anything it names is called. Dicts,
lists, tuples, str, bytes, int, float, bool and None need no global at all.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import numpy as np
from typing_extensions import override


class ForbiddenGlobal(pickle.UnpicklingError):
    """The pickle names a global (its ``module.name`` is the message) that is not part of a numpy array."""


def _latin1(text: str, encoding: str = "latin1") -> bytes:
    """``_codecs.encode`` as Python 3 pickles ``bytes`` in protocols 0-2, for latin-1 only."""
    if encoding != "latin1":
        raise pickle.UnpicklingError(f"bytes pickled with encoding {encoding!r}, expected 'latin1'")
    return text.encode("latin1")


def _empty_bytes() -> bytes:
    """``bytes()`` as Python 3 pickles ``b''`` in protocols 0-2 (no arguments: ``bytes(n)`` would allocate n)."""
    return b""


def _allowed() -> dict[tuple[str, str], Any]:
    # numpy's own pickling functions, taken from numpy itself: no import of numpy.core (deprecated in 2.x)
    reconstruct = np.ndarray.__reduce__(np.zeros(1))[0]
    frombuffer = np.zeros(1).__reduce_ex__(5)[0]
    scalar = np.int64(0).__reduce__()[0]  # a numpy scalar, e.g. a label taken from an array
    allowed: dict[tuple[str, str], Any] = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype}
    for package in ("numpy.core", "numpy._core"):  # numpy 1.x / 2.x names of the same functions
        allowed[(f"{package}.multiarray", "_reconstruct")] = reconstruct
        allowed[(f"{package}.multiarray", "scalar")] = scalar
        allowed[(f"{package}.numeric", "_frombuffer")] = frombuffer
    allowed[("_codecs", "encode")] = _latin1
    for builtins in ("builtins", "__builtin__"):  # Python 3 writes protocols 0-2 with Python 2 names
        allowed[(builtins, "bytes")] = _empty_bytes
    return allowed


class _ArraysOnly(pickle.Unpickler):
    _globals = _allowed()

    @override
    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._globals[(module, name)]
        except KeyError:
            raise ForbiddenGlobal(f"{module}.{name}") from None


def load_arrays(blob: bytes, encoding: str = "bytes") -> Any:
    """Unpickle ``blob``, which may hold numpy arrays and scalars and plain Python values only.

    Args:
        blob: The pickle.
        encoding: How Python 2 ``str`` objects are decoded (``'bytes'`` keeps them as bytes, as the
            CIFAR-10 batches' keys ``b'data'`` and ``b'labels'``).

    Raises:
        ForbiddenGlobal: The pickle names any other global (a class or function it would call).
        pickle.UnpicklingError: It is not a valid pickle.
    """
    return _ArraysOnly(io.BytesIO(blob), encoding=encoding).load()
