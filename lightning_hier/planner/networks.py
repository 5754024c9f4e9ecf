"""Layer descriptions: the paper's reference networks, and any module traced on an input shape."""

from __future__ import annotations

from collections.abc import Sequence
from math import prod

import torch
from torch import nn

from lightning_hier.layers.convert import Role, classify, trace_shapes
from lightning_hier.layers.pooling import pool_window
from lightning_hier.layers.spatial import conv_padding
from lightning_hier.planner.cost import (
    BNLayer,
    ConvLayer,
    FCLayer,
    Layer,
    PoolLayer,
    ReplicatedLayer,
    Transition,
    UnsupportedLayer,
)

# docs/algorithms.md, section 5: (C_in, H_in = W_in, C_out, kernel, stride)
ALEXNET_CONVS = [
    (3, 227, 96, 11, 4),
    (96, 27, 256, 5, 1),
    (256, 13, 384, 3, 1),
    (384, 13, 384, 3, 1),
    (384, 13, 256, 3, 1),
]
ALEXNET_FCS = [(9216, 4096), (4096, 4096), (4096, 1000)]
VGG16_CONVS = [
    (c_in, h, c_out, 3, 1)
    for c_in, h, c_out in [
        (3, 224, 64), (64, 224, 64), (64, 112, 128), (128, 112, 128), (128, 56, 256), (256, 56, 256),
        (256, 56, 256), (256, 28, 512), (512, 28, 512), (512, 28, 512), (512, 14, 512), (512, 14, 512),
        (512, 14, 512),
    ]
]  # fmt: skip
VGG16_FCS = [(25088, 4096), (4096, 4096), (4096, 1000)]


def _reference(
    convs: Sequence[tuple[int, int, int, int, int]], fcs: Sequence[tuple[int, int]], prefix: str
) -> list[Layer]:
    layers: list[Layer] = [
        ConvLayer(c_in, h, h, c_out, k, stride, name=f"{prefix}conv{i + 1}")
        for i, (c_in, h, c_out, k, stride) in enumerate(convs)
    ]
    layers.append(Transition(fcs[0][0], name=f"{prefix}transition"))
    return layers + _fcs(fcs, len(convs) + 1, prefix)


def _fcs(fcs: Sequence[tuple[int, int]], first: int, prefix: str) -> list[Layer]:
    return [FCLayer(d_in, d_out, name=f"{prefix}fc{first + i}") for i, (d_in, d_out) in enumerate(fcs)]


def alexnet_layers(fc_only: bool = False) -> list[Layer]:
    """AlexNet (single tower) as in docs/algorithms.md (section 5): 5 convolutions (pooling ignored) and fc6-fc8.

    With ``fc_only`` just fc6-fc8; evaluate them with ``first_input_grad=True`` (fc6 keeps its dX
    term, as inside the whole network).
    """
    return _fcs(ALEXNET_FCS, 6, "alexnet.") if fc_only else _reference(ALEXNET_CONVS, ALEXNET_FCS, "alexnet.")


def vgg16_layers() -> list[Layer]:
    """VGG-16 on 224 x 224 inputs: 13 3x3 convolutions (pooling ignored) and fc6-fc8."""
    return _reference(VGG16_CONVS, VGG16_FCS, "vgg16.")


def model_layers(module: nn.Module, input_shape: Sequence[int]) -> list[Layer]:
    """Trace ``module`` on one zero sample of ``input_shape`` and describe its layers in call order.

    Roles come from :func:`lightning_hier.layers.classify`, the same decision the converter makes,
    so the description matches what :func:`lightning_hier.layers.to_grid` builds.
    """
    ref = next(iter(module.parameters()), None)
    example = torch.zeros(1, *input_shape, dtype=ref.dtype if ref is not None else None)
    shapes = trace_shapes(module, example)
    roles = {path: (m, role, reason) for path, m, role, reason in classify(module, set(shapes))}
    layers: list[Layer] = []
    for path, (ins, _) in shapes.items():
        m, role, reason = roles[path]
        params = sum(p.numel() for p in m.parameters())
        if isinstance(m, nn.Linear) and role is Role.LINEAR:
            layers.append(FCLayer(m.in_features, m.out_features, m.bias is not None, name=path))
        elif isinstance(m, nn.Conv2d) and role in (Role.FIRST_CONV, Role.CONV):
            layers.append(_conv(m, ins, role is Role.FIRST_CONV, path))
        elif isinstance(m, nn.BatchNorm2d) and role is Role.BATCHNORM:
            layers.append(BNLayer(ins[1], ins[2], ins[3], m.affine, name=path))
        elif isinstance(m, nn.MaxPool2d | nn.AvgPool2d) and role is Role.POOL:
            layers.append(_pool(m, ins, path))
        elif role is Role.TRANSITION:
            layers.append(Transition(prod(ins[1:]), name=path, h=ins[2] if len(ins) == 4 else 0))
        elif role is Role.UNSUPPORTED:
            layers.append(UnsupportedLayer(reason, name=path, params=params))
        elif params:
            layers.append(ReplicatedLayer(params, name=path))
    return layers


def _conv(m: nn.Conv2d, ins: torch.Size, first: bool, path: str) -> ConvLayer:
    (top, bottom), _ = conv_padding(m)
    return ConvLayer(
        c_in=ins[1],
        h=ins[2],
        w=ins[3],
        c_out=m.out_channels,
        k=m.kernel_size[0],
        stride=m.stride[0],
        padding=top,
        kw=m.kernel_size[1],
        dilation=m.dilation[0],
        groups=m.groups,
        bias=m.bias is not None,
        splits_input=first,
        name=path,
        pad_bottom=bottom,
        padding_mode=m.padding_mode,
    )


def _pool(m: nn.MaxPool2d | nn.AvgPool2d, ins: torch.Size, path: str) -> PoolLayer:
    window = pool_window(m)
    return PoolLayer(
        h=ins[2],
        stride=window.stride,
        name=path,
        kernel=window.kernel,
        padding=window.pad_top,
        dilation=window.dilation,
        c=ins[1],
        w=ins[3],
        ceil_mode=bool(m.ceil_mode),
        count_include_pad=bool(getattr(m, "count_include_pad", True)),
        return_indices=bool(getattr(m, "return_indices", False)),
    )
