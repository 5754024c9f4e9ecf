"""The two options of every strategy whose algorithm reduces flat buckets, defined once.

``sync_buffers`` (average float buffers such as BatchNorm statistics along with the parameters)
and ``bucket_size_mb`` (size bound of one flat buffer) mean the same for HPSGD, DBS and the
averaging family: one validation.
"""

from __future__ import annotations

from lightning_hier import _validate as v

MIN_BUCKET_MB = 0.001
"""Smallest bucket bound, about 1 KiB: a bound under one byte (2**-20 MiB) rounds to 0 bytes, which no bucket fits."""


def check_bucket_options(owner: str, sync_buffers: bool, bucket_size_mb: float) -> tuple[bool, float]:
    """Validated ``(sync_buffers, bucket_size_mb)``; a clear error naming ``owner`` otherwise."""
    return v.check_bool(owner, "sync_buffers", sync_buffers), check_bucket_mb(owner, "bucket_size_mb", bucket_size_mb)


def check_bucket_mb(owner: str, name: str, value: float) -> float:
    """A bucket size bound in MiB: finite and at least :data:`MIN_BUCKET_MB`."""
    return v.check_float(owner, name, value, low=MIN_BUCKET_MB)


def bucket_bytes(bucket_size_mb: float) -> int:
    """A bound in MiB as the algorithms take it (bytes)."""
    return int(bucket_size_mb * 2**20)
