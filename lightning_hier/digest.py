"""A digest of nested state (tensors, containers, plain values): equal content, equal digest.

Checkpoints carry it to detect damaged rank states (:mod:`lightning_hier.strategies._checkpoint`),
and the start of a fit compares the ranks' weights with it before sending any
(:func:`lightning_hier.comm.collectives.broadcast_unless_equal_`).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor


def state_digest(state: Any) -> str:
    """SHA-256 (hex) of a nested state: tensors, mappings, sequences and plain values, in order.

    The same content gives the same digest before saving and after loading (with or without
    ``weights_only``): tensors contribute their dtype, shape and raw bytes, containers their kind
    and length, plain values their type and ``repr``. Anything else contributes its type name
    and its pickle (the format only holds tensors and plain types).
    """
    digest = hashlib.sha256()
    _feed(digest, state)
    return digest.hexdigest()


def _feed(digest: Any, obj: Any) -> None:
    if isinstance(obj, Tensor):
        _feed_tensor(digest, obj)
    elif isinstance(obj, Mapping):
        _tag(digest, "map", len(obj))
        for key, value in obj.items():
            _feed(digest, key)
            _feed(digest, value)
    elif isinstance(obj, list | tuple):
        _tag(digest, type(obj).__name__, len(obj))
        for value in obj:
            _feed(digest, value)
    elif obj is None or isinstance(obj, bool | int | float | complex | str | bytes):
        _tag(digest, type(obj).__name__, repr(obj))
    else:
        try:
            data = pickle.dumps(obj, protocol=4)
        except Exception:  # an unpicklable object could not have been saved either
            data = b""
        _tag(digest, f"object:{type(obj).__qualname__}", len(data))
        digest.update(data)


def _feed_tensor(digest: Any, tensor: Tensor) -> None:
    t = tensor.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    _tag(digest, f"tensor:{t.dtype}", tuple(t.shape))
    if t.numel() and t.device.type != "meta":
        raw = t.to("cpu").contiguous().reshape(-1).view(torch.uint8)
        digest.update(raw.numpy().data)


def _tag(digest: Any, kind: str, detail: object) -> None:
    text = f"{kind}:{detail}".encode()
    digest.update(len(text).to_bytes(8, "little"))  # length-prefixed: no two encodings run together
    digest.update(text)
