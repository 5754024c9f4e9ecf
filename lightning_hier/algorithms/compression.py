"""Compressed payloads for model-change reductions, with error feedback.

A window's change ``d`` is sent in bfloat16 (half the bytes of float32). Rounding alone would
drop the low bits of every element every window; *error feedback* (Seide et al., "1-bit SGD",
Interspeech 2014; Karimireddy et al., "Error Feedback Fixes SignSGD", ICML 2019) adds the
previous rounding error back before the next rounding, so nothing is lost over time::

    p <- bf16(d + e)        # the payload that is summed over the ranks (in bfloat16)
    e <- (d + e) - p        # what rounding left out, sent with the next window

The receiver accumulates the summed payload into its float32 model (see
:class:`~lightning_hier.algorithms.outer.OuterNesterov`), so the global model itself stays
float32.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

COMPRESSIONS = ("none", "bf16")


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
