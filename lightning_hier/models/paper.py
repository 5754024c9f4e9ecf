"""The networks Gholami et al. (SPAA 2018, arXiv 1712.04432) analyse: AlexNet and VGG-16.

Both are ordered ``nn.Sequential`` blocks (features, then ``AdaptiveAvgPool2d`` + ``Flatten``, then
the classifier), as torchvision lays them out, so :func:`lightning_hier.layers.to_grid` converts
them whole: the convolutions and pools run on slabs of rows, the adaptive pooling is the conv ->
FC transition and the fully connected layers are sharded. ``width`` scales every channel count
and hidden size (e.g. 1/8 for a CPU run); ``width=1`` is the paper's network.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

VGG16_CHANNELS: tuple[int | str, ...] = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M")
VGG16_CHANNELS += (512, 512, 512, "M")


def _scaled(n: int, width: float) -> int:
    return max(1, round(n * width))


def _classifier(d_in: int, hidden: int, num_classes: int, dropout: float) -> list[nn.Module]:
    return [
        nn.Dropout(dropout), nn.Linear(d_in, hidden), nn.ReLU(),
        nn.Dropout(dropout), nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, num_classes),
    ]  # fmt: skip


def alexnet(
    input_shape: Sequence[int] = (3, 227, 227),
    num_classes: int = 1000,
    width: float = 1.0,
    dropout: float = 0.5,
    conv1_padding: int | None = None,
) -> nn.Sequential:
    """AlexNet, one tower (Krizhevsky et al. 2012): 96-256-384-384-256 channels, fc6-fc8 of 4096.

    conv1 is 11x11 with stride 4 and the three max-pools 3x3 with stride 2 (overlapping). Its
    padding defaults to 0 on 227-row inputs (Caffe, the paper's 55 x 55 conv1 output) and to 2
    otherwise (torchvision on 224). Local response normalisation is left out, as torchvision does.
    """
    c_in, h = input_shape[0], input_shape[1]
    pad = conv1_padding if conv1_padding is not None else (0 if h == 227 else 2)
    c = [_scaled(n, width) for n in (96, 256, 384, 384, 256)]
    features: list[nn.Module] = [
        nn.Conv2d(c_in, c[0], 11, stride=4, padding=pad), nn.ReLU(), nn.MaxPool2d(3, 2),
        nn.Conv2d(c[0], c[1], 5, padding=2), nn.ReLU(), nn.MaxPool2d(3, 2),
        nn.Conv2d(c[1], c[2], 3, padding=1), nn.ReLU(),
        nn.Conv2d(c[2], c[3], 3, padding=1), nn.ReLU(),
        nn.Conv2d(c[3], c[4], 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2),
    ]  # fmt: skip
    head = [nn.AdaptiveAvgPool2d((6, 6)), nn.Flatten()]
    return nn.Sequential(*features, *head, *_classifier(c[4] * 36, _scaled(4096, width), num_classes, dropout))


def vgg16(
    input_shape: Sequence[int] = (3, 224, 224), num_classes: int = 1000, width: float = 1.0, dropout: float = 0.5
) -> nn.Sequential:
    """VGG-16 (configuration D of Simonyan and Zisserman 2015): 13 3x3 convolutions, 5 max-pools 2x2, fc6-fc8."""
    layers: list[nn.Module] = []
    c = input_shape[0]
    for spec in VGG16_CHANNELS:
        if spec == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            out = _scaled(int(spec), width)
            layers += [nn.Conv2d(c, out, 3, padding=1), nn.ReLU()]
            c = out
    head = [nn.AdaptiveAvgPool2d((7, 7)), nn.Flatten()]
    return nn.Sequential(*layers, *head, *_classifier(c * 49, _scaled(4096, width), num_classes, dropout))
