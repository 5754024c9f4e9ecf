"""What input each reference network takes, and a check that a network fits its data.

The training entry builds a network for the data's ``input_shape``; a mismatch (an image network on
flat features, an image too small for the pooling) used to surface as an unpacking or convolution
error from deep inside the network. :func:`check_input` fails first, naming the model, what it
needs, the data and what it gives. :data:`NETWORK_INPUTS` also tells the training entry which shape
synthetic data should have for a network (``data=synthetic`` with ``input_shape: null``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_hier.models.networks import cifar_resnet, mlp, resnet20, resnet56, small_cnn
from lightning_hier.models.paper import alexnet, vgg16


@dataclass(frozen=True)
class InputSpec:
    """The input a network accepts (per sample, without the batch dimension).

    Args:
        needs: What it accepts, in words (for messages).
        example: A shape it accepts; synthetic data uses it when its shape is left open.
        dims: The number of dimensions it requires (``None``: any).
    """

    needs: str
    example: tuple[int, ...]
    dims: int | None = None


_IMAGE = InputSpec("image input (C, H, W)", (3, 32, 32), dims=3)

NETWORK_INPUTS: dict[Callable[..., nn.Module], InputSpec] = {
    mlp: InputSpec("any input shape (each sample is flattened)", (32,)),
    small_cnn: _IMAGE,
    cifar_resnet: _IMAGE,
    resnet20: _IMAGE,
    resnet56: _IMAGE,
    alexnet: InputSpec("image input (C, H, W), e.g. (3, 227, 227)", (3, 227, 227), dims=3),
    vgg16: InputSpec("image input (C, H, W), e.g. (3, 224, 224)", (3, 224, 224), dims=3),
}
"""Input of the reference networks, by factory function."""


def unwrap(factory: Callable[..., Any]) -> Callable[..., Any]:
    """The function under any ``functools.partial`` layers (what a Hydra ``_partial_`` config gives)."""
    while isinstance(factory, functools.partial):
        factory = factory.func
    return factory


def input_spec(factory: Callable[..., Any]) -> InputSpec | None:
    """The :class:`InputSpec` of a network factory (a ``functools.partial`` of one too), if known."""
    return NETWORK_INPUTS.get(unwrap(factory))


def check_input(
    factory: Callable[..., nn.Module],
    input_shape: Sequence[int],
    num_classes: int,
    model_name: str,
    data_name: str,
) -> nn.Module:
    """Build ``factory(input_shape=..., num_classes=...)`` and check it on one batch of zeros.

    The network is run once in eval mode without gradients (no BatchNorm statistics change) on a
    batch of two samples, and its output must be ``(2, num_classes)`` logits.

    Args:
        factory: Builds the network from ``input_shape`` and ``num_classes`` (keyword arguments).
        input_shape: The data's shape of one sample.
        num_classes: The data's number of classes.
        model_name: The model's name in messages (e.g. the config choice ``small_cnn``).
        data_name: The data's name in messages (e.g. ``synthetic``).

    Returns:
        The network, in training mode.

    Raises:
        ValueError: The network does not take this input or gives no ``(batch, num_classes)`` output;
            the message says what the model needs and what the data gives.
    """
    shape = tuple(int(s) for s in input_shape)
    spec = input_spec(factory)
    needs = spec.needs if spec is not None else "an input it can take"
    hint = _hint(spec, data_name)
    mismatch = f"model={model_name} needs {needs}; data={data_name} gives {shape}"
    if spec is not None and spec.dims is not None and len(shape) != spec.dims:
        raise ValueError(f"{mismatch}.{hint}")
    try:  # what a constructor raises for a shape it cannot take (other errors are not about shapes)
        net = factory(input_shape=shape, num_classes=num_classes)
    except (ValueError, IndexError) as err:
        raise ValueError(f"{mismatch}, for which it cannot be built: {type(err).__name__}: {err}{hint}") from err
    was_training = net.training
    net.eval()  # no BatchNorm statistics change, no dropout
    try:
        with torch.no_grad():
            out = net(torch.zeros(2, *shape))
    except (RuntimeError, ValueError, IndexError) as err:  # what torch raises on a bad shape
        raise ValueError(f"{mismatch}, on which it fails: {type(err).__name__}: {err}{hint}") from err
    net.train(was_training)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, num_classes):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(
            f"model={model_name} on data={data_name} (input {shape}) gives output {got} for a batch of 2; "
            f"classification needs logits of shape (2, {num_classes}) (num_classes from data={data_name})."
        )
    return net


def _hint(spec: InputSpec | None, data_name: str) -> str:
    if spec is None or spec.dims is None:
        return ""
    example = list(spec.example)
    if data_name == "synthetic":
        return (
            f" Set data.input_shape={example} (or leave it null: synthetic data then takes the shape the "
            "model asks for)."
        )
    return f" Use data with such input (data=digits, mnist, cifar10, or synthetic with data.input_shape={example})."
