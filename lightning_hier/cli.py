r"""LightningCLI entry point: ``python -m lightning_hier.cli fit [--config FILE] [--section.key=value ...]``.

The Hydra entry point (:mod:`lightning_hier.train`) is the main one; this module is for projects
that already use Lightning's own command line. It needs ``jsonargparse[signatures]``
(``pip install "lightning-hier[cli]"``). Importing :mod:`lightning_hier` registers the strategy
names, so both of Lightning's forms work::

    # a registered name (its default arguments)
    python -m lightning_hier.cli fit --trainer.strategy=localsgd_fork --trainer.devices=2
    # a class and its arguments (the short class name is enough once lightning_hier is imported)
    python -m lightning_hier.cli fit --trainer.strategy=HPSGDStrategy --trainer.strategy.window=4 \
        --trainer.strategy.start_method=fork --trainer.devices=2 --trainer.max_epochs=3

or the same from a YAML file (``--config hpsgd.yaml``)::

    trainer:
      accelerator: cpu
      devices: 2
      max_epochs: 3
      strategy:
        class_path: lightning_hier.HPSGDStrategy
        init_args: {window: 4, merge: eager, start_method: fork}
    model:
      network: mlp
      lr: 0.05
    data:
      class_path: lightning_hier.data.DigitsDataModule
      init_args: {batch_size: 32}

A registered name takes no arguments (``--trainer.strategy=hpsgd --trainer.strategy.window=4``
is rejected by jsonargparse): give the class to set them. The datamodule defaults to
:class:`~lightning_hier.data.DigitsDataModule`; the model's input shape and number of classes
are taken from the datamodule.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning.pytorch.cli import _JSONARGPARSE_SIGNATURES_AVAILABLE, LightningArgumentParser, LightningCLI
from typing_extensions import override

import lightning_hier  # noqa: F401  registers the strategy names (also in popen children)
from lightning_hier import _validate as v
from lightning_hier.data import ArrayDataModule
from lightning_hier.models import NETWORKS, Classifier


class NetworkClassifier(Classifier):
    """:class:`~lightning_hier.models.Classifier` around one of the reference networks, chosen by name.

    Args:
        network: ``'mlp'``, ``'small_cnn'``, ``'resnet20'`` or ``'resnet56'``.
        input_shape: Shape of one sample (linked from the datamodule by the CLI).
        num_classes: Number of classes (linked from the datamodule by the CLI).
        optimizer, lr, momentum, nesterov, weight_decay, scheduler, warmup_steps, label_smoothing:
            As in :class:`~lightning_hier.models.Classifier` (written out: LightningCLI reads this
            signature), with Nesterov momentum and weight decay on by default.
    """

    def __init__(
        self,
        network: str = "mlp",
        input_shape: Sequence[int] = (1, 8, 8),
        num_classes: int = 10,
        optimizer: str = "sgd",
        lr: float = 0.1,
        momentum: float = 0.9,
        nesterov: bool = True,
        weight_decay: float = 0.0001,
        scheduler: str = "none",
        warmup_steps: int = 0,
        label_smoothing: float = 0.0,
    ) -> None:
        v.check_choice(type(self).__name__, "network", network, sorted(NETWORKS))
        super().__init__(
            NETWORKS[network](input_shape=tuple(input_shape), num_classes=num_classes),
            num_classes,
            optimizer=optimizer,
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            scheduler=scheduler,
            warmup_steps=warmup_steps,
            label_smoothing=label_smoothing,
        )


class HierCLI(LightningCLI):
    """``LightningCLI`` with the model's input shape and classes linked from the datamodule."""

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.set_defaults({"data": {"class_path": "lightning_hier.data.DigitsDataModule"}})
        parser.link_arguments("data.input_shape", "model.input_shape", apply_on="instantiate")
        parser.link_arguments("data.num_classes", "model.num_classes", apply_on="instantiate")


def main(args: list[str] | None = None, run: bool = True) -> HierCLI:
    """Run the command line (``args`` instead of ``sys.argv[1:]`` when given).

    With ``run=False`` the arguments carry no subcommand and the CLI only builds the model,
    datamodule and trainer (``cli.trainer.fit(cli.model, datamodule=cli.datamodule)`` then fits).
    """
    if not _JSONARGPARSE_SIGNATURES_AVAILABLE:
        raise ModuleNotFoundError(
            f"lightning_hier.cli needs {_JSONARGPARSE_SIGNATURES_AVAILABLE}: pip install 'lightning-hier[cli]'"
        )
    kwargs: dict[str, Any] = {"args": args} if args is not None else {}
    return HierCLI(
        NetworkClassifier,
        ArrayDataModule,
        subclass_mode_data=True,
        trainer_defaults={"accelerator": "cpu", "devices": 2},
        save_config_kwargs={"overwrite": True},
        run=run,
        **kwargs,
    )


if __name__ == "__main__":
    main()

__all__ = ["HierCLI", "NetworkClassifier", "main"]
