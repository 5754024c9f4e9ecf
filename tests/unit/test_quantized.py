"""Blockwise absmax quantization: the format, its rounding, and error feedback's bookkeeping (no process group)."""

from __future__ import annotations

import pytest
import torch

from lightning_hier.comm.quantized import QuantizedErrorFeedback, dequantize, padded_length, qmax, quantize


@pytest.mark.parametrize("bits", [8, 4])
def test_a_value_moves_by_at_most_half_a_step_of_its_block(bits):
    x = torch.randn(8 * 64, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 10, 8 * 64)
    codes, scales = quantize(x, bits, 64)
    assert codes.dtype == torch.uint8 and codes.numel() == x.numel() * bits // 8 and scales.numel() == 8
    back = dequantize(codes, scales, bits, 64)
    step = scales.repeat_interleave(64)
    assert torch.all((back - x).abs() <= step / 2 + 1e-6)
    # the largest magnitude of each block is exact: it maps to +-qmax
    blocks = x.reshape(8, 64)
    peak = blocks.abs().argmax(1)
    assert torch.allclose(back.reshape(8, 64)[torch.arange(8), peak], blocks[torch.arange(8), peak])


def test_codes_by_hand():
    x = torch.tensor([7.0, -3.5, 2.5, 0.0] + [0.0] * 4)  # one block of 8 elements: scale 7 / 7 = 1
    codes, scales = quantize(x, 4, 8)
    assert scales.tolist() == [1.0]
    # 7, -3.5 -> -4 and 2.5 -> 2 (half to even), 0: offset by 8, two to a byte, the first in the low nibble
    assert codes.tolist() == [(7 + 8) | ((-4 + 8) << 4), (2 + 8) | (8 << 4), 8 | (8 << 4), 8 | (8 << 4)]
    codes8, scales8 = quantize(torch.tensor([127.0, -63.5, 0.5] + [0.0] * 5), 8, 8)
    assert scales8.tolist() == [1.0] and (codes8.to(torch.int16) - 128).tolist()[:3] == [127, -64, 0]
    assert qmax(8) == 127 and qmax(4) == 7
    zero_codes, zero_scales = quantize(torch.zeros(8), 8, 8)  # an all-zero block: scale 0, codes 0
    assert zero_scales.tolist() == [0.0] and torch.equal(dequantize(zero_codes, zero_scales, 8, 8), torch.zeros(8))


def test_padding_holds_world_shards_of_whole_blocks():
    assert padded_length(1, 2, 64) == 128 and padded_length(128, 2, 64) == 128 and padded_length(129, 4, 64) == 256


@pytest.mark.parametrize("bits", [8, 4])
def test_error_feedback_sends_what_rounding_alone_would_drop(bits):
    # one large element sets each round's scale; the others, 0.3 of a step, round to 0 every round
    # on their own. With error feedback their residual grows until it crosses half a step, so over
    # k rounds they are sent k * 0.3 steps, within one step; the large element is exact every round.
    step = 10.0 / qmax(bits)
    x = torch.full((64,), 0.3 * step)
    x[0] = 10.0
    codec = QuantizedErrorFeedback([x], bits, world=1, block=64)
    sent = torch.zeros(64)
    for _ in range(40):
        out = torch.zeros(64)
        codec.launch([x], [out], group=None, stats=_Stats()).wait()
        sent += out
    assert sent[0] == pytest.approx(400.0)
    assert torch.all((sent[1:] - 40 * 0.3 * step).abs() <= step + 1e-5)
    without, _ = quantize(x, bits, 64)
    assert torch.equal(dequantize(without, _, bits, 64)[1:], torch.zeros(63))  # rounding alone: nothing


class _Stats:
    def add(self, *args: object, **kwargs: object) -> None:
        pass
