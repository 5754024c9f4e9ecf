"""LightningCLI (the ``cli`` extra): a strategy and its arguments from flags and from the documented YAML."""

import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("jsonargparse")
pytest.importorskip("docstring_parser")  # jsonargparse[signatures]: LightningCLI refuses to start without it

from lightning_hier import HPSGDStrategy, LocalSGDStrategy
from lightning_hier.cli import NetworkClassifier, main
from lightning_hier.data import DigitsDataModule, SyntheticDataModule

QUIET = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", "--trainer.logger=false"]
PAGE = Path(__file__).resolve().parents[2] / "docs" / "guide" / "lightning-cli.md"


def _documented_yaml() -> str:
    """The documented LightningCLI config (the fenced block that starts with ``# hpsgd.yaml``)."""
    match = re.search(r"```yaml\n# hpsgd\.yaml\n(.*?)```", PAGE.read_text(), re.DOTALL)
    assert match, "docs/guide/lightning-cli.md lost its LightningCLI example"
    return match.group(1)


def test_the_documented_yaml_sets_the_strategy_class_and_arguments_and_fits(tmp_path):
    path = tmp_path / "hpsgd.yaml"
    path.write_text(_documented_yaml())
    args = ["fit", "--config", str(path), "--trainer.max_epochs=1", f"--trainer.default_root_dir={tmp_path}"]
    cli = main([*args, *QUIET])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, HPSGDStrategy) and strategy.sync.window == 4
    assert isinstance(cli.datamodule, DigitsDataModule) and cli.datamodule.batch_size == 32
    metrics = cli.trainer.callback_metrics  # returned by the fork launcher (the loop counters are not)
    assert float(metrics["hpsgd/window"]) == 4 and float(metrics["val/acc"]) > 0.5


def test_short_class_name_with_flags_and_a_registered_name(tmp_path):
    flags = ["--trainer.strategy=HPSGDStrategy", "--trainer.strategy.window=3", "--trainer.strategy.merge=paper"]
    cli = main([*flags, f"--trainer.default_root_dir={tmp_path}", *QUIET], run=False)
    assert isinstance(cli.trainer.strategy, HPSGDStrategy)
    assert (cli.trainer.strategy.sync.window, cli.trainer.strategy.sync.merge) == (3, "paper")
    assert isinstance(cli.model, NetworkClassifier)  # default data: digits, its shape linked into the model

    named = main(["--trainer.strategy=localsgd_fork", f"--trainer.default_root_dir={tmp_path}", *QUIET], run=False)
    assert isinstance(named.trainer.strategy, LocalSGDStrategy)


def test_model_shape_follows_the_datamodule(tmp_path):
    args = ["--data=SyntheticDataModule", "--data.input_shape=[3,8,8]", "--data.num_classes=4"]
    args.append("--model.network=small_cnn")
    cli = main([*args, f"--trainer.default_root_dir={tmp_path}", *QUIET], run=False)
    assert isinstance(cli.datamodule, SyntheticDataModule)
    assert cli.model.net(torch.zeros(2, 3, 8, 8)).shape == (2, 4)
