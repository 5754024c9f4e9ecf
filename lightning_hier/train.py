"""Hydra entry point: ``python -m lightning_hier.train [group=option ...] [key=value ...]``.

With no arguments it trains an MLP on the embedded 8x8 digits with 2 CPU processes and prints a
short summary. Examples::

    python -m lightning_hier.train strategy=localsgd strategy.tau=4 trainer.max_epochs=5
    python -m lightning_hier.train -m strategy=ddp,localsgd          # a sweep: one job per strategy
    python -m lightning_hier.train experiment=cifar10_resnet20 data.root=/data/cifar10

Config groups (``conf/``): ``strategy`` (registry names, plus Lightning's ``ddp`` baseline),
``model``, ``data``, ``trainer``, ``logger`` (``csv``, ``tensorboard``, ``none``; several as
``logger=[csv,tensorboard]``), ``callbacks`` (``default``, ``none``, or a list of single
callbacks) and ``experiment`` (presets that set several groups).

Every run writes its summary into its output directory (``summary.json``, ``summary.txt`` and
``train.log``); a multirun ends with a table of its jobs, printed and saved in the sweep
directory (:mod:`lightning_hier.summary`). Only this module, ``conf/`` and ``recipes/`` know
Hydra; everything else is plain Python.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import hydra
import lightning.pytorch as pl
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback as HydraCallback
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from omegaconf import DictConfig, OmegaConf
from typing_extensions import override

import lightning_hier  # noqa: F401  registers the strategy names in every process
from lightning_hier.models import Classifier
from lightning_hier.models.inputs import check_input, input_spec, unwrap
from lightning_hier.summary import Summary, write_sweep_table

log = logging.getLogger("lightning_hier.train")  # not "__main__" under python -m


def conf_dir() -> Path:
    """The packaged ``lightning_hier/conf`` (installed), else the repository's top-level ``conf/``."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "train.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"lightning_hier: no conf/train.yaml next to {here} or in its parent.")


def resolve_start_method(value: str, multirun: bool) -> str:
    """``'auto'``: popen for a single run (also right under torchrun/SLURM), fork in a sweep.

    A sweep cannot use popen: Lightning's popen launcher re-runs the command line, i.e. the
    whole sweep, in every child process.
    """
    if value != "auto":
        return value
    return "fork" if multirun else "popen"


def _metric(trainer: pl.Trainer, key: str) -> float | None:
    value = trainer.callback_metrics.get(key)
    return None if value is None else float(value)


def build_strategy(cfg: DictConfig, multirun: bool = False) -> Any:
    """Instantiate ``cfg.strategy``, resolving ``start_method: auto``."""
    strategy_cfg = OmegaConf.to_container(cfg.strategy, resolve=True)
    assert isinstance(strategy_cfg, dict)
    if "start_method" in strategy_cfg:
        strategy_cfg["start_method"] = resolve_start_method(str(strategy_cfg["start_method"]), multirun)
    return instantiate(strategy_cfg)


def _choice(cfg: DictConfig, group: str, fallback: str) -> str:
    """The option picked for a config group (``model=small_cnn``), for messages."""
    if HydraConfig.initialized():
        picked = HydraConfig.get().runtime.choices.get(group)
        if picked:
            return str(picked)
    return fallback


def build_datamodule(cfg: DictConfig) -> Any:
    """Instantiate ``cfg.data``; an open ``input_shape: null`` becomes the shape the model asks for.

    That is how ``data=synthetic`` fits every model: flat features for ``mlp``, ``(3, 32, 32)``
    images for the convolutional networks.
    """
    data = cfg.data
    if "input_shape" in data and data.input_shape is None:
        spec = input_spec(instantiate(cfg.model))
        if spec is not None:
            data = OmegaConf.merge(data, {"input_shape": list(spec.example)})
    return instantiate(data)


def build_module(cfg: DictConfig, datamodule: Any) -> Classifier:
    """The network of ``cfg.model`` sized for ``datamodule``, wrapped in a :class:`Classifier`.

    The network is checked on one batch of the data's shape first (:func:`check_input`): a model
    that does not fit its data fails here with a message that names both, before any rank starts.
    """
    factory = instantiate(cfg.model)
    model_name = _choice(cfg, "model", unwrap(factory).__name__)
    data_name = _choice(cfg, "data", str(getattr(datamodule, "name", type(datamodule).__name__)))
    net = check_input(factory, datamodule.input_shape, datamodule.num_classes, model_name, data_name)
    optim: dict[str, Any] = OmegaConf.to_container(cfg.optim, resolve=True)  # type: ignore[assignment]
    return Classifier(net, datamodule.num_classes, **optim)


def build_loggers(cfg: DictConfig, output_dir: str) -> list[Logger]:
    """The loggers of the ``logger`` group; a ``save_dir`` left null is the run's output directory."""
    group = cfg.get("logger")
    loggers: list[Logger] = []
    for logger_cfg in (group or {}).values():
        if logger_cfg is None or "_target_" not in logger_cfg:
            continue  # ``logger.csv=null`` removes one logger of a list
        kwargs = {"save_dir": output_dir} if logger_cfg.get("save_dir") is None else {}
        loggers.append(instantiate(logger_cfg, **kwargs))
    return loggers


def build_callbacks(cfg: DictConfig) -> list[Callback]:
    """The callbacks of the ``callbacks`` group.

    ``trainer.enable_checkpointing=false`` wins over the group: its ``ModelCheckpoint`` is left
    out (Lightning would refuse the combination).
    """
    group = cfg.get("callbacks")
    callbacks = [instantiate(c) for c in (group or {}).values() if c is not None and "_target_" in c]
    if not cfg.trainer.get("enable_checkpointing", True):
        callbacks = [c for c in callbacks if not isinstance(c, ModelCheckpoint)]
    return callbacks


def build_trainer(cfg: DictConfig, strategy: Any, output_dir: str, **overrides: Any) -> pl.Trainer:
    """The Trainer of ``cfg.trainer`` writing logs and checkpoints under ``output_dir``.

    Loggers and callbacks come from the ``logger`` and ``callbacks`` groups, unless the trainer
    config sets them itself (``+trainer.logger=false``) or ``overrides`` does.
    """
    kwargs: dict[str, Any] = {"strategy": strategy, "default_root_dir": output_dir}
    if "logger" not in cfg.trainer and "logger" not in overrides:
        kwargs["logger"] = build_loggers(cfg, output_dir) or False
    if "callbacks" not in cfg.trainer and "callbacks" not in overrides:
        kwargs["callbacks"] = build_callbacks(cfg)
    kwargs.update(overrides)
    return instantiate(cfg.trainer, **kwargs)


def run(cfg: DictConfig, output_dir: str, multirun: bool = False) -> Summary:
    """Build data, model, strategy and trainer from ``cfg``, fit, and summarise."""
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule = build_datamodule(cfg)
    module = build_module(cfg, datamodule)
    trainer = build_trainer(cfg, build_strategy(cfg, multirun), output_dir)
    start = time.perf_counter()
    trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
    if cfg.get("test_after_fit"):
        trainer.test(module, datamodule=datamodule)
    hydra_cfg = HydraConfig.get() if HydraConfig.initialized() else None
    choices = hydra_cfg.runtime.choices if hydra_cfg is not None else {}
    return Summary(
        strategy=str(choices.get("strategy", cfg.strategy.get("_target_", "?").rsplit(".", 1)[-1])),
        world_size=trainer.world_size,
        num_nodes=trainer.num_nodes,
        epochs=int(_metric(trainer, "progress/epochs") or trainer.current_epoch),
        val_acc=_metric(trainer, "val/acc"),
        samples_per_s=_metric(trainer, "throughput/samples_per_s"),
        seconds=time.perf_counter() - start,
        output_dir=output_dir,
        overrides=list(hydra_cfg.overrides.task) if hydra_cfg is not None else [],
    )


class SweepSummary(HydraCallback):
    """Hydra callback (``hydra.callbacks`` in ``conf/train.yaml``): the table of a finished multirun.

    Prints the table of every job (:func:`lightning_hier.summary.sweep_table`) and saves it as
    ``summary.md`` and ``summary.csv`` in the sweep directory.
    """

    @override
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        table = write_sweep_table(sweep_dir)
        if table is not None:
            print(f"\nlightning-hier sweep summary ({sweep_dir / 'summary.md'})\n{table.markdown()}", flush=True)


@hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="train")
def main(cfg: DictConfig) -> Any:
    """Hydra entry point; returns the final validation accuracy (for sweepers)."""
    hc = HydraConfig.get()
    summary = run(cfg, hc.runtime.output_dir, multirun=hc.mode == RunMode.MULTIRUN)
    if rank_zero_only.rank == 0:  # type: ignore[attr-defined]  # popen children re-run main(); only rank 0 reports
        summary.write(hc.runtime.output_dir)
        # Hydra's job logging sends this to the console and to <output dir>/train.log
        log.info("run summary\n%s", summary.format())
    return summary.val_acc


if __name__ == "__main__":
    main()
