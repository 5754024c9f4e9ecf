"""Reference networks (ordered blocks) and the generic classification LightningModule."""

from collections.abc import Callable

from torch import nn

from lightning_hier.models.classifier import Classifier
from lightning_hier.models.networks import BasicBlock, cifar_resnet, mlp, resnet20, resnet56, small_cnn
from lightning_hier.models.paper import alexnet, vgg16

# each takes (input_shape, num_classes, **its own options)
NETWORKS: dict[str, Callable[..., nn.Module]] = {
    "mlp": mlp,
    "small_cnn": small_cnn,
    "resnet20": resnet20,
    "resnet56": resnet56,
    "alexnet": alexnet,
    "vgg16": vgg16,
}

__all__ = [
    "NETWORKS",
    "BasicBlock",
    "Classifier",
    "alexnet",
    "cifar_resnet",
    "mlp",
    "resnet20",
    "resnet56",
    "small_cnn",
    "vgg16",
]
