"""Reference networks, each an ``nn.Sequential`` of blocks so a pipeline strategy can cut it.

- :func:`mlp`: Flatten -> [Linear, ReLU(, Dropout)] x n -> Linear.
- :func:`small_cnn`: [Conv3x3, BatchNorm, ReLU, MaxPool] x n -> [Flatten, Linear, ReLU] -> Linear.
- :func:`cifar_resnet` / :func:`resnet20` / :func:`resnet56`: the CIFAR ResNets of He et al.,
  "Deep Residual Learning for Image Recognition", CVPR 2016, section 4.2 (3 stages of n basic
  blocks with 16/32/64 channels, identity shortcuts with zero-padding, option A).
"""

from __future__ import annotations

from collections.abc import Sequence
from math import prod

import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import override


def mlp(
    input_shape: Sequence[int], num_classes: int, hidden: Sequence[int] = (256, 256), dropout: float = 0.0
) -> nn.Sequential:
    """Multi-layer perceptron; block ``i`` is one hidden layer (the first also flattens)."""
    blocks: list[nn.Module] = []
    width = prod(input_shape)
    for i, h in enumerate(hidden):
        layers: list[nn.Module] = [nn.Flatten()] if i == 0 else []
        layers += [nn.Linear(width, h), nn.ReLU()]
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
        blocks.append(nn.Sequential(*layers))
        width = h
    head: list[nn.Module] = [] if hidden else [nn.Flatten()]
    blocks.append(nn.Sequential(*head, nn.Linear(width, num_classes)))
    return nn.Sequential(*blocks)


def small_cnn(
    input_shape: Sequence[int],
    num_classes: int,
    channels: Sequence[int] = (32, 64),
    hidden: int = 128,
    layer_blocks: bool = False,
) -> nn.Sequential:
    """A small convolutional network; each conv block halves the spatial size.

    Args:
        input_shape: ``(channels, height, width)`` of one input.
        num_classes: Outputs of the last layer.
        channels: Output channels of each conv block.
        hidden: Width of the hidden linear layer.
        layer_blocks: Every layer its own block (Conv, BatchNorm, ReLU, MaxPool, ..., Linear) rather
            than one block per conv stage: the same function and parameters, but a pipeline can cut
            between any two layers (the first conv stage alone is about two thirds of the compute
            at 32x32, so its boundary is the only cut a 4-block network offers near the middle).
    """
    c, h, w = input_shape
    blocks: list[nn.Sequential] = []
    for out in channels:
        blocks.append(
            nn.Sequential(nn.Conv2d(c, out, 3, padding=1, bias=False), nn.BatchNorm2d(out), nn.ReLU(), nn.MaxPool2d(2))
        )
        c, h, w = out, h // 2, w // 2
    if h < 1 or w < 1:
        raise ValueError(f"small_cnn: input {tuple(input_shape)} is too small for {len(channels)} pooling blocks.")
    blocks.append(nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, hidden), nn.ReLU()))
    blocks.append(nn.Sequential(nn.Linear(hidden, num_classes)))
    if layer_blocks:
        return nn.Sequential(*(layer for block in blocks for layer in block))
    return nn.Sequential(*blocks)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a shortcut; downsampling shortcuts subsample and zero-pad (option A)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.stride = stride
        self.pad = out_channels - in_channels

    @override
    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x[:, :, :: self.stride, :: self.stride] if self.stride > 1 else x
        if self.pad:
            shortcut = F.pad(shortcut, (0, 0, 0, 0, self.pad // 2, self.pad - self.pad // 2))
        return F.relu(out + shortcut)


def cifar_resnet(input_shape: Sequence[int], num_classes: int, depth: int = 20) -> nn.Sequential:
    """CIFAR ResNet of ``depth = 6 n + 2`` layers: stem, 3n basic blocks, pooled linear head."""
    if (depth - 2) % 6:
        raise ValueError(f"cifar_resnet: depth must be 6n + 2 (20, 32, 44, 56, 110), got {depth}.")
    n = (depth - 2) // 6
    blocks: list[nn.Module] = [
        nn.Sequential(nn.Conv2d(input_shape[0], 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
    ]
    channels = 16
    for stage, width in enumerate((16, 32, 64)):
        for i in range(n):
            stride = 2 if stage > 0 and i == 0 else 1
            blocks.append(BasicBlock(channels, width, stride))
            channels = width
    blocks.append(nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes)))
    net = nn.Sequential(*blocks)
    for m in net.modules():
        if isinstance(m, nn.Conv2d | nn.Linear):
            nn.init.kaiming_normal_(m.weight)
    return net


def resnet20(input_shape: Sequence[int], num_classes: int) -> nn.Sequential:
    """ResNet-20 (0.27 M parameters)."""
    return cifar_resnet(input_shape, num_classes, 20)


def resnet56(input_shape: Sequence[int], num_classes: int) -> nn.Sequential:
    """ResNet-56 (0.85 M parameters)."""
    return cifar_resnet(input_shape, num_classes, 56)
