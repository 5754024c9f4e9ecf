"""``python -m lightning_hier.planner``: print the candidate grids of a network, one table per P."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from torch import nn

from lightning_hier.models.networks import mlp, resnet20, resnet56, small_cnn
from lightning_hier.models.paper import alexnet, vgg16
from lightning_hier.planner.cost import Layer, Link
from lightning_hier.planner.networks import alexnet_layers, vgg16_layers
from lightning_hier.planner.plan import format_table, plan_grids

OUR_MODELS: dict[str, Callable[..., nn.Module]] = {
    "mlp": mlp,
    "small_cnn": small_cnn,
    "resnet20": resnet20,
    "resnet56": resnet56,
    "alexnet-net": alexnet,  # the nn.Module (with its pools), traced on --input-shape
    "vgg16-net": vgg16,
}
REFERENCE_MODELS = ("alexnet", "alexnet-fc", "vgg16")


def _layers(args: argparse.Namespace) -> list[Layer]:
    if args.model == "alexnet":
        return alexnet_layers()
    if args.model == "alexnet-fc":
        return alexnet_layers(fc_only=True)
    if args.model == "vgg16":
        return vgg16_layers()
    from lightning_hier.planner.networks import model_layers

    net = OUR_MODELS[args.model](tuple(args.input_shape), args.classes)
    return model_layers(net, args.input_shape)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and print the tables; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m lightning_hier.planner", description=__doc__)
    parser.add_argument("--model", choices=[*REFERENCE_MODELS, *OUR_MODELS], default="alexnet-fc")
    parser.add_argument("--input-shape", type=int, nargs="+", default=[3, 32, 32], help="without the batch")
    parser.add_argument("--classes", type=int, default=10, help="output classes of our own models")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--batch-scope", choices=["global", "replica"], default="global")
    parser.add_argument("--world-size", type=int, nargs="+", default=[8])
    parser.add_argument("--alpha", type=float, default=2e-6, help="seconds per message")
    parser.add_argument("--beta", type=float, default=4e-10, help="seconds per word")
    parser.add_argument("--max-model", type=int, default=None, help="largest Pr (the reference uses 8 for whole nets)")
    parser.add_argument("--memory-limit-mib", type=float, default=None)
    args = parser.parse_args(argv)
    layers = _layers(args)
    for p in args.world_size:
        plans = plan_grids(
            layers,
            args.batch_size,
            p,
            links=Link(args.alpha, args.beta),
            batch_scope=args.batch_scope,
            max_model=args.max_model,
            memory_limit_bytes=None if args.memory_limit_mib is None else args.memory_limit_mib * 2**20,
            first_input_grad=args.model == "alexnet-fc",
        )
        title = (
            f"{args.model}: P={p}, batch {args.batch_size} ({args.batch_scope}), "
            f"alpha={args.alpha:g} s, beta={args.beta:g} s/word"
        )
        print(format_table(plans, title) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
