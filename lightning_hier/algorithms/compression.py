"""Compressed payloads for model-change reductions, with error feedback.

A window's change ``d`` is sent in bfloat16 (half the bytes of float32), int8 or 4 bits (a
quarter or an eighth, plus one float32 scale per block of 64). Rounding alone would drop the low
bits of every element every window; *error feedback* (Seide et al., "1-bit SGD", Interspeech
2014; Karimireddy et al., "Error Feedback Fixes SignSGD", ICML 2019) adds the previous rounding
error back before the next rounding, so nothing is lost over time::

    p <- round(d + e)       # the payload that is summed over the ranks
    e <- (d + e) - p        # what rounding left out, sent with the next window

bfloat16 payloads are summed by an ordinary all-reduce (:class:`Bf16ErrorFeedback`); int8 and
4-bit ones by the quantized all-reduce of :mod:`lightning_hier.comm.quantized`
(:class:`QuantizedChange`: blockwise absmax scales, round half to even; a rank sends about two
quantized payloads whatever the number of ranks). The receiver accumulates the summed payload
into its float32 model (see :class:`~lightning_hier.algorithms.outer.OuterNesterov`), so the
global model itself stays float32.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_hier.comm import CommStats
from lightning_hier.comm.collectives import Group
from lightning_hier.comm.quantized import QUANTIZED, QuantizedErrorFeedback, QuantizedWork, padded_length

COMPRESSIONS = ("none", "bf16", "int8", "int4")


class Bf16ErrorFeedback:
    """bfloat16 payload buckets and the float32 residual ``e`` of the same layout.

    Args:
        like: The float32 buckets whose changes are compressed.
    """

    def __init__(self, like: Sequence[Tensor]) -> None:
        self.payload: list[Tensor] = [torch.zeros_like(t, dtype=torch.bfloat16) for t in like]
        self.residual: list[Tensor] = [torch.zeros_like(t) for t in like]

    @torch.no_grad()
    def encode_(self, change: Sequence[Tensor]) -> list[Tensor]:
        """Round ``change + e`` into :attr:`payload` (returned) and keep the new residual.

        ``change`` is left untouched.
        """
        torch._foreach_add_(self.residual, list(change))  # e <- d + e
        torch._foreach_copy_(self.payload, self.residual)  # p <- bf16(d + e)
        torch._foreach_sub_(self.residual, self.payload)  # e <- (d + e) - p
        return self.payload


class QuantizedChange:
    """An int8 or 4-bit change with error feedback, summed over the ranks by the quantized all-reduce.

    Args:
        like: The float32 buckets whose changes are sent.
        compression: ``'int8'`` or ``'int4'``.
        world: Ranks of the group.
    """

    def __init__(self, like: Sequence[Tensor], compression: str, world: int) -> None:
        self.feedback = QuantizedErrorFeedback(like, QUANTIZED[compression], world)
        self.total: list[Tensor] = [torch.zeros_like(t) for t in like]
        """Where a reduction's sum lands (float32, the buckets' layout)."""
        offsets = [0]
        for t in like:
            offsets.append(offsets[-1] + t.numel())
        flat = self.feedback.residual  # padded with zeros that stay zero: a padding's residual is always 0
        self.residual: list[Tensor] = [
            flat[a:b].view_as(t) for a, b, t in zip(offsets, offsets[1:], like, strict=False)
        ]
        padded = padded_length(offsets[-1], world, self.feedback.block)
        self.payload_bytes = padded * self.feedback.bits // 8 + 4 * padded // self.feedback.block
        """Bytes of one quantized payload (codes and scales)."""

    def launch(self, change: Sequence[Tensor], group: Group, stats: CommStats) -> QuantizedWork:
        """Quantize ``change + e``, keep the new residual, launch the SUM into :attr:`total`."""
        return self.feedback.launch(change, self.total, group, stats)


def make_codec(compression: str, like: list[Tensor], world: int) -> Bf16ErrorFeedback | QuantizedChange | None:
    """The codec of ``compression`` for changes shaped as ``like`` over ``world`` ranks (``'none'``: ``None``)."""
    if compression == "bf16":
        return Bf16ErrorFeedback(like)
    if compression in QUANTIZED:
        return QuantizedChange(like, compression, world)
    return None
