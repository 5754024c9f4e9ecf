"""A single-process reference of the quantized all-reduce with error feedback (every rank simulated).

Each rank quantizes its values plus its residual and keeps the new residual; the owner of each of
the W shards sums the dequantized copies in rank order (divides by W for a mean) and quantizes the
sum again; every rank dequantizes the gathered shards. Written from the rules in
:mod:`lightning_hier.comm.quantized`'s docstring, with only its ``quantize``/``dequantize`` reused.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_hier.comm.quantized import DEFAULT_BLOCK, dequantize, padded_length, quantize


def quantized_sum(
    values: list[Tensor], residuals: list[Tensor], bits: int, block: int = DEFAULT_BLOCK, mean: bool = False
) -> Tensor:
    """The reduction of every rank's flat ``values``; ``residuals`` (one per rank, same length) are updated."""
    world, n = len(values), values[0].numel()
    padded = padded_length(n, world, block)
    sent = []
    for rank, v in enumerate(values):
        x = torch.zeros(padded)
        x[:n] = v + residuals[rank]
        deq = dequantize(*quantize(x, bits, block), bits, block)
        residuals[rank].copy_((x - deq)[:n])  # a padding element quantizes to 0 exactly: no residual there
        sent.append(deq)
    shards = []
    for j in range(world):  # the owner of shard j sums every rank's copy in rank order
        total = sent[0].chunk(world)[j]
        for rank in range(1, world):
            total = total + sent[rank].chunk(world)[j]
        total = total / world if mean else total
        shards.append(dequantize(*quantize(total, bits, block), bits, block))
    return torch.cat(shards)[:n]
