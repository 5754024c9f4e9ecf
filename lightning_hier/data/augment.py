"""Batched augmentation and normalisation on the device (one kernel per batch, not per image)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


def normalize(x: Tensor, mean: Sequence[float], std: Sequence[float], dtype: torch.dtype | None = None) -> Tensor:
    """Scale ``uint8`` images to [0, 1] and standardise each channel (dimension 1).

    Args:
        x: A batch, ``uint8`` images or floating-point features.
        mean: Per-channel mean (of the scaled data).
        std: Per-channel standard deviation.
        dtype: Result dtype (the model's, e.g. float64 under ``precision="64-true"``); default:
            ``x``'s floating dtype, float32 for ``uint8``.
    """
    if dtype is None:
        dtype = x.dtype if x.is_floating_point() else torch.float32
    x = x.to(dtype).div_(255.0) if x.dtype == torch.uint8 else x.to(dtype)
    shape = (1, len(mean)) + (1,) * (x.dim() - 2)
    m = torch.tensor(mean, dtype=x.dtype, device=x.device).view(shape)
    s = torch.tensor(std, dtype=x.dtype, device=x.device).view(shape)
    return (x - m) / s


def random_crop_flip(x: Tensor, padding: int = 4, flip: bool = True) -> Tensor:
    """Random crop with zero padding and random horizontal flip of a ``[N, C, H, W]`` batch.

    Every image gets its own offset and flip; the random numbers come from the global torch
    generator of ``x``'s device, which checkpoints capture, so augmentation resumes exactly.
    """
    n, _, h, w = x.shape
    if padding > 0:
        padded = F.pad(x, (padding, padding, padding, padding))
        dy = torch.randint(0, 2 * padding + 1, (n,), device=x.device)
        dx = torch.randint(0, 2 * padding + 1, (n,), device=x.device)
        rows = (dy[:, None] + torch.arange(h, device=x.device))[:, None, :, None]  # [N,1,H,1]
        cols = (dx[:, None] + torch.arange(w, device=x.device))[:, None, None, :]  # [N,1,1,W]
        batch = torch.arange(n, device=x.device)[:, None, None, None]
        chans = torch.arange(x.shape[1], device=x.device)[None, :, None, None]
        x = padded[batch, chans, rows, cols]
    if flip:
        mask = torch.rand(n, device=x.device) < 0.5
        x = torch.where(mask[:, None, None, None], x.flip(3), x)
    return x
