"""Everyday Trainer features under every registered strategy: the support table of the docs holds.

The table (``docs/guide/strategies/index.md``, between its markers) has a row per strategy and a
column per feature. A ``yes`` cell must train as under Lightning's DDP (and every rank ends with the
same model); a ``no (note)`` cell must be refused at set-up with the message its note below the
table quotes, before anything else can fail. Each strategy's supported features run one after another in the same two
forked processes (one launch per strategy); each refusal in its own launch.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

import lightning_hier  # noqa: F401  (registers the names)
from lightning_hier import DDPCommHookStrategy, TorchftStrategy
from lightning_hier.testing import WorkerFailed, run_workers
from tests.helpers import trainer
from tests.user_models import SameWeightsOnEveryRank, UserGAN

TABLE = Path(__file__).resolve().parents[2] / "docs" / "guide" / "strategies" / "index.md"
START, END = "<!-- features:table:start -->", "<!-- features:table:end -->"
TIMEOUT_S = 20  # a rank that hangs fails the cell quickly


class FeatureModule(pl.LightningModule):
    """A classifier with a BatchNorm layer, metrics and ``sync_dist`` logs, a predict step and a step-wise schedule."""

    def __init__(self, schedule: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
        self.accuracy = MulticlassAccuracy(num_classes=4)
        self.schedule = schedule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.accuracy(logits, y)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", self.accuracy, on_epoch=True)

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0]).argmax(1)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, nesterov=True)
        if not self.schedule:
            return optimizer
        total = self.trainer.estimated_stepping_batches  # a schedule sized to the fit: the loader's length
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=int(total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def _loader(self, shuffle: bool) -> DataLoader:
        x = torch.randn(128, 16, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x[:, :4].argmax(1)), batch_size=8, shuffle=shuffle, drop_last=True)

    def train_dataloader(self) -> DataLoader:
        return self._loader(True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(False)


class ManualModule(FeatureModule):
    """One optimizer, stepped by the module (``automatic_optimization=False``)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        opt.zero_grad()  # type: ignore[union-attr]
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        opt.step()  # type: ignore[union-attr]
        return loss


def _fit(
    strategy: Any, module: pl.LightningModule, tmp: str, ckpt_path: str | None = None, **kwargs: Any
) -> pl.Trainer:
    # the peers keep their own buffers: DDP broadcasts rank 0's at each forward (so not the last forward's),
    # torchft synchronises parameters only
    same = SameWeightsOnEveryRank(buffers=not isinstance(strategy, DDPCommHookStrategy | TorchftStrategy))
    callbacks = [*kwargs.pop("callbacks", []), same]
    options = {"max_epochs": 2, "limit_val_batches": 4, "default_root_dir": tmp, "callbacks": callbacks}
    t = trainer(strategy=strategy, **{**options, **kwargs})
    t.fit(module, ckpt_path=ckpt_path)
    return t


def _resume(strategy: Callable[[], Any], tmp: str) -> None:
    checkpoint = ModelCheckpoint(dirpath=tmp, filename="last", save_top_k=-1)
    _fit(strategy(), FeatureModule(), tmp, max_epochs=1, callbacks=[checkpoint], enable_checkpointing=True)
    _fit(strategy(), FeatureModule(), tmp, max_epochs=2, ckpt_path=f"{tmp}/last.ckpt")


def _predict(strategy: Callable[[], Any], tmp: str) -> None:
    module = FeatureModule()
    t = _fit(strategy(), module, tmp)
    predictions = t.predict(module)
    assert predictions is not None and len(predictions) > 0


FEATURES: dict[str, Callable[[Callable[[], Any], str], Any]] = {
    "accumulate": lambda s, tmp: _fit(s(), FeatureModule(), tmp, accumulate_grad_batches=2),
    "clip norm": lambda s, tmp: _fit(s(), FeatureModule(), tmp, gradient_clip_val=1.0),
    "clip value": lambda s, tmp: _fit(
        s(), FeatureModule(), tmp, gradient_clip_val=0.5, gradient_clip_algorithm="value"
    ),
    "LR schedule": lambda s, tmp: _fit(s(), FeatureModule(schedule=True), tmp),
    "manual": lambda s, tmp: _fit(s(), ManualModule(), tmp),
    "GAN": lambda s, tmp: _fit(s(), UserGAN(), tmp, limit_val_batches=0),
    "bf16-mixed": lambda s, tmp: _fit(s(), FeatureModule(), tmp, precision="bf16-mixed"),
    "mid-epoch val": lambda s, tmp: _fit(s(), FeatureModule(), tmp, val_check_interval=0.5),
    "early stop": lambda s, tmp: _fit(
        s(), FeatureModule(), tmp, max_epochs=5, callbacks=[EarlyStopping("val_loss", patience=0)]
    ),
    "max_steps": lambda s, tmp: _fit(s(), FeatureModule(), tmp, max_steps=5, max_epochs=-1),
    "max_time": lambda s, tmp: _fit(s(), FeatureModule(), tmp, max_time={"minutes": 5}),
    "resume": _resume,
    "predict": _predict,
}

NAMES = sorted(
    name
    for name, entry in StrategyRegistry.items()
    if entry["strategy"].__module__.startswith("lightning_hier.") and not name.endswith(("_spawn", "_fork"))
)


def _strategy(name: str) -> Callable[[], Any]:
    entry = StrategyRegistry[name]
    return lambda: entry["strategy"](**{**entry["init_params"], "timeout": TIMEOUT_S})


def run_cell(name: str, feature: str, tmp: str) -> None:
    """One cell, on every rank."""
    torch.manual_seed(0)
    FEATURES[feature](_strategy(name), tmp)


def run_row(name: str, features: list[str], tmp: str) -> None:
    """Every supported feature of one strategy, one fit after another in the same processes."""
    for index, feature in enumerate(features):
        run_cell(name, feature, f"{tmp}/{index}")


# ---------------------------------------------------------------------------------- the table
def table() -> tuple[dict[str, dict[str, str]], dict[str, str]]:
    """``{strategy: {feature: cell}}`` and ``{footnote: message}`` of the docs' table."""
    text = TABLE.read_text()
    body = text[text.index(START) + len(START) : text.index(END)].strip().splitlines()
    header = [c.strip().strip("`") for c in body[0].strip().strip("|").split("|")]
    rows: dict[str, dict[str, str]] = {}
    for line in body[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0].strip("`")] = dict(zip(header[1:], cells[1:], strict=True))
    notes = dict(re.findall(r"^- \*\*(\w+)\*\*: .*?``(.+?)``", text[text.index(END) :], re.MULTILINE | re.DOTALL))
    return rows, notes


def test_the_table_has_every_strategy_and_feature():
    rows, notes = table()
    assert sorted(rows) == NAMES
    for name, cells in rows.items():
        assert list(cells) == list(FEATURES), name
        for cell in cells.values():
            assert cell == "yes" or re.fullmatch(r"no \(\w+\)", cell), f"{name}: {cell!r}"
            if cell != "yes":
                assert cell[4:-1] in notes, f"{name}: note {cell} has no message"


def _cells(supported: bool) -> list[Any]:
    rows, notes = table()
    if supported:
        return [pytest.param(n, [f for f, c in rows[n].items() if c == "yes"], id=n) for n in sorted(rows)]
    return [
        pytest.param(n, f, notes[c[4:-1]], id=f"{n}-{f}")
        for n in sorted(rows)
        for f, c in rows[n].items()
        if c != "yes"
    ]


@pytest.mark.parametrize(("name", "features"), _cells(supported=True))
def test_the_supported_features_train_as_under_ddp(name, features, tmp_path):
    run_workers(run_row, name, features, str(tmp_path), devices=2, timeout=240)


@pytest.mark.parametrize(("name", "feature", "message"), _cells(supported=False))
def test_an_unsupported_feature_is_refused_first_with_its_reason(name, feature, message, tmp_path):
    with pytest.raises(WorkerFailed, match=re.escape(message)):
        run_workers(run_cell, name, feature, str(tmp_path), devices=2, timeout=120)
