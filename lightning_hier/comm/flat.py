"""Persistent flat buffers whose slices *are* the model's tensors.

Collectives on many small tensors pay a latency per tensor; copying them into a temporary flat
buffer at every synchronisation pays a copy each way. :class:`FlatTensors` instead moves the
tensors into a few contiguous buckets once and re-points each tensor at its slice, so an
all-reduce of the buckets *is* an all-reduce of the model, with no copies (the same trick as
DDP's ``gradient_as_bucket_view``, applied to parameters).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Segment:
    """Where tensor ``index`` lives: ``buckets[bucket][offset : offset + numel]``."""

    index: int
    bucket: int
    offset: int
    numel: int
    shape: torch.Size


class FlatTensors:
    """Groups tensors by (device, dtype) into contiguous buckets and turns them into views.

    Args:
        tensors: Parameters or buffers (leaf tensors); they keep their identity (optimizer state
            keyed by parameter stays valid), only their storage moves.
        bucket_bytes: Upper bound on one bucket's size; ``None`` gives one bucket per
            (device, dtype). A single tensor larger than the bound gets a bucket of its own.

    Example:
        >>> lin = torch.nn.Linear(3, 2)
        >>> flat = FlatTensors(list(lin.parameters()))
        >>> flat.buckets[0].numel()
        8
        >>> flat.buckets[0].zero_(); float(lin.weight.abs().sum())
        0.0
    """

    def __init__(self, tensors: Sequence[Tensor], bucket_bytes: int | None = None) -> None:
        if bucket_bytes is not None and bucket_bytes <= 0:
            raise ValueError(f"FlatTensors: `bucket_bytes` must be positive or None, got {bucket_bytes}.")
        self.tensors: list[Tensor] = list(tensors)
        self.segments: list[Segment] = []
        self.buckets: list[Tensor] = []
        for members in self._plan(bucket_bytes):
            self._allocate(members)
        self.segments.sort(key=lambda s: s.index)

    def _plan(self, bucket_bytes: int | None) -> list[list[int]]:
        by_kind: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, t in enumerate(self.tensors):
            by_kind.setdefault((t.device, t.dtype), []).append(i)
        plan: list[list[int]] = []
        for members in by_kind.values():
            current: list[int] = []
            size = 0
            for i in members:
                nbytes = self.tensors[i].numel() * self.tensors[i].element_size()
                if current and bucket_bytes is not None and size + nbytes > bucket_bytes:
                    plan.append(current)
                    current, size = [], 0
                current.append(i)
                size += nbytes
            if current:
                plan.append(current)
        return plan

    def _allocate(self, members: list[int]) -> None:
        first = self.tensors[members[0]]
        total = sum(self.tensors[i].numel() for i in members)
        bucket = torch.empty(total, dtype=first.dtype, device=first.device)
        b = len(self.buckets)
        offset = 0
        with torch.no_grad():
            for i in members:
                t = self.tensors[i]
                n = t.numel()
                view = bucket[offset : offset + n]
                view.copy_(t.detach().reshape(-1))
                t.data = view.view_as(t)
                self.segments.append(Segment(i, b, offset, n, t.shape))
                offset += n
        self.buckets.append(bucket)

    @property
    def numel(self) -> int:
        return sum(b.numel() for b in self.buckets)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buckets)

    def is_aliased(self) -> bool:
        """Whether every tensor still points into its bucket (``module.to(...)`` breaks this)."""
        for seg in self.segments:
            t, bucket = self.tensors[seg.index], self.buckets[seg.bucket]
            expected = bucket.data_ptr() + seg.offset * bucket.element_size()
            if t.device != bucket.device or t.data_ptr() != expected:
                return False
        return True

    def clone(self, device: torch.device | str | None = None) -> list[Tensor]:
        """A detached copy of the buckets (e.g. a window start or a global model), on ``device`` (theirs)."""
        return [b.detach().to(b.device if device is None else device, copy=True) for b in self.buckets]

    def zeros_like(self) -> list[Tensor]:
        return [torch.zeros_like(b) for b in self.buckets]

    @torch.no_grad()
    def copy_(self, src: Sequence[Tensor]) -> None:
        """Overwrite the tensors with ``src`` (flat buckets of the same layout)."""
        self._check_layout(src)
        torch._foreach_copy_(self.buckets, list(src))

    def split(self, flat: Sequence[Tensor]) -> list[Tensor]:
        """Per-tensor views of ``flat`` (a bucket list of this layout), in the original tensor order."""
        self._check_layout(flat)
        return [flat[s.bucket][s.offset : s.offset + s.numel].view(s.shape) for s in self.segments]

    def load(self, flat: Sequence[Tensor], values: Sequence[Tensor], owner: str, name: str) -> None:
        """Copy per-tensor ``values`` (as :meth:`split` gives them: a checkpoint's) into ``flat``.

        Raises:
            ValueError: ``values`` are not this layout's tensors (a checkpoint of another model);
                the message names ``owner`` and the entry ``name``.
        """
        views = self.split(flat)
        if len(values) != len(views) or any(a.shape != b.shape for a, b in zip(values, views, strict=True)):
            raise ValueError(f"{owner}: checkpoint entry `{name}` does not match this model's parameters.")
        torch._foreach_copy_(views, [t.to(v.device, v.dtype) for t, v in zip(values, views, strict=True)])

    def segment_numels(self, bucket: int) -> list[int]:
        """Numbers of elements of the tensors in ``bucket``, in bucket order."""
        return [s.numel for s in sorted(self.segments, key=lambda s: s.offset) if s.bucket == bucket]

    def segment_indices(self, bucket: int) -> list[int]:
        """Original indices of the tensors in ``bucket``, in bucket order."""
        return [s.index for s in sorted(self.segments, key=lambda s: s.offset) if s.bucket == bucket]

    def _check_layout(self, flat: Sequence[Tensor]) -> None:
        if len(flat) != len(self.buckets) or any(
            a.numel() != b.numel() for a, b in zip(flat, self.buckets, strict=True)
        ):
            raise ValueError("FlatTensors: buffers do not match this bucket layout.")
