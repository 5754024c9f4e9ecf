"""Issue 12: the last merge / round of fit happens before any user hook, validation or checkpoint sees the model.

Every strategy whose ranks hold different replicas during fit must leave the model that ``fit()``
returns, equal on every rank, in the module by the time the last epoch's validation, the
``on_train_end`` / ``on_fit_end`` hooks of callbacks and of the LightningModule, the last
``ModelCheckpoint`` and a ``trainer.save_checkpoint`` after fit run. The periods below do not
divide the number of steps, so there is always a partial window (round) left to finish.
"""

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_hier import (
    DBSHPSGDStrategy,
    DBSLocalSGDStrategy,
    DiLoCoStrategy,
    EasgdStrategy,
    GrawaStrategy,
    HPSGDStrategy,
    LocalSGDStrategy,
    LsgdStrategy,
)
from lightning_hier.models import Classifier, mlp
from lightning_hier.strategies import HierStrategy, _finish
from lightning_hier.testing import run_workers
from tests.helpers import digits, digits_classifier, flat_params, trainer

# 11 steps per epoch (digits, batch 64, 2 ranks): every period leaves a partial window at the end
STRATEGIES: dict[str, Callable[[], HierStrategy]] = {
    "hpsgd": lambda: HPSGDStrategy(window=3, timeout=30),
    "diloco": lambda: DiLoCoStrategy(window=3, fragments=2, fragment_sync_delay=1, timeout=30),
    "localsgd": lambda: LocalSGDStrategy(tau=5, timeout=30),
    "easgd": lambda: EasgdStrategy(tau=5, timeout=30),
    "lsgd": lambda: LsgdStrategy(tau=5, timeout=30),
    "mgrawa": lambda: GrawaStrategy(variant="model", tau=5, timeout=30),
    "dbs_hpsgd": lambda: DBSHPSGDStrategy(window=3, initial_sizes=[96, 32], timeout=30),
    "dbs_localsgd": lambda: DBSLocalSGDStrategy(tau=5, initial_sizes=[96, 32], timeout=30),
}


def _checksum_on_every_rank(module: torch.nn.Module) -> list[float]:
    """What a user hook would do: all-gather a parameter checksum (a collective inside the hook)."""
    local = flat_params(module).double().sum().reshape(1)
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return [float(t) for t in gathered]


class HookedClassifier(Classifier):
    """Records its parameters in its own ``on_train_end`` and ``on_fit_end``."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(mlp((1, 8, 8), 10, hidden=(32,)), 10, lr=0.1)
        self.seen: dict[str, Any] = {}

    def on_train_end(self) -> None:
        self.seen["module.on_train_end"] = flat_params(self)
        self.seen["module.on_train_end checksums"] = _checksum_on_every_rank(self)

    def on_fit_end(self) -> None:
        self.seen["module.on_fit_end"] = flat_params(self)


class HookRecorder(Callback):
    """Records what the last validation during fit and a user callback's ``on_train_end`` see."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, batch_idx: int, *args: object
    ) -> None:
        if trainer.state.fn == "fit" and batch_idx == 0:  # the strategy's consensus is in place by now
            self.seen["last validation"] = flat_params(pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seen["callback.on_train_end"] = flat_params(pl_module)
        self.seen["callback.on_train_end checksums"] = _checksum_on_every_rank(pl_module)


def _fit_and_record_hooks(name: str) -> dict[str, Any]:
    module, recorder = HookedClassifier(), HookRecorder()
    t = trainer(strategy=STRATEGIES[name](), max_epochs=1, callbacks=[recorder])
    t.fit(module, datamodule=digits(batch_size=64))
    return {**recorder.seen, **module.seen, "final": flat_params(module)}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_train_end_and_fit_end_hooks_see_the_returned_model_on_every_rank(name):
    r0, r1 = run_workers(_fit_and_record_hooks, name, devices=2)
    assert torch.equal(r0["final"], r1["final"])
    checksum = float(r0["final"].double().sum())
    for hook in ("last validation", "callback.on_train_end", "module.on_train_end", "module.on_fit_end"):
        for rank, seen in enumerate((r0, r1)):
            assert torch.equal(seen[hook], seen["final"]), f"{hook} on rank {rank} differs from fit()'s model"
    for hook in ("callback.on_train_end checksums", "module.on_train_end checksums"):
        for rank, seen in enumerate((r0, r1)):
            assert seen[hook] == [checksum, checksum], f"{hook} gathered on rank {rank}"


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _fit_with_last_checkpoint(name: str, ckpt_dir: str, limits: dict[str, int]) -> dict[str, torch.Tensor]:
    module = digits_classifier()
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, save_last=True)
    t = trainer(strategy=STRATEGIES[name](), callbacks=[checkpoint], enable_checkpointing=True, **limits)
    t.fit(module, datamodule=digits(batch_size=64))
    return _state(module)


# Trainer limits and the global step they stop at (11 batches per epoch)
LIMITS: dict[str, tuple[dict[str, int], int]] = {
    "max_epochs": ({"max_epochs": 2}, 22),
    "max_steps": ({"max_epochs": -1, "max_steps": 16}, 16),  # mid-epoch 2
    # accumulating 2 batches: steps after batches 2, 4, ..., 10 and after 11 (Lightning steps on an
    # epoch's last batch whatever the accumulation), so 6 steps per epoch; step 7 is batch 2 of epoch 2
    "max_epochs_accumulating": ({"max_epochs": 2, "accumulate_grad_batches": 2}, 12),
    "max_steps_accumulating": ({"max_epochs": -1, "max_steps": 7, "accumulate_grad_batches": 2}, 7),
}


CHECKPOINT_CASES = [("hpsgd", stop) for stop in LIMITS] + [("easgd", "max_epochs"), ("easgd", "max_steps")]


@pytest.mark.parametrize(("name", "stop"), CHECKPOINT_CASES, ids=[f"{n}-{s}" for n, s in CHECKPOINT_CASES])
def test_last_checkpoint_holds_the_returned_model(name, stop, tmp_path):
    limits, last_step = LIMITS[stop]
    final, other = run_workers(_fit_with_last_checkpoint, name, str(tmp_path), limits, devices=2)
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert saved["global_step"] == last_step
    assert saved["state_dict"].keys() == final.keys()
    for key, value in final.items():
        assert torch.equal(other[key], value), f"ranks differ after fit in {key}"
        assert torch.equal(saved["state_dict"][key], value), f"last.ckpt differs from fit()'s model in {key}"
    for rank, state in enumerate(saved["lightning_hier"]["ranks"]):
        for key, value in final.items():
            assert torch.equal(state["model"][key], value), f"rank {rank}'s saved replica differs in {key}"


class StopAtStep(Callback):
    """Requests a stop in ``on_train_batch_end``, after the strategy's own callback has looked."""

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step == 7:
            trainer.should_stop = True


@pytest.mark.parametrize("validate", [True, False], ids=["saved_in_validation", "saved_at_epoch_end"])
def test_a_stop_requested_by_a_later_callback_still_checkpoints_the_returned_model(validate, tmp_path):
    def fit() -> dict[str, Any]:
        module, recorder = digits_classifier(), HookRecorder()
        checkpoint = ModelCheckpoint(dirpath=str(tmp_path), save_last=True)
        callbacks = [StopAtStep(), recorder, checkpoint]
        limits = {} if validate else {"limit_val_batches": 0}
        t = trainer(strategy=STRATEGIES["hpsgd"](), callbacks=callbacks, enable_checkpointing=True, **limits)
        t.fit(module, datamodule=digits(batch_size=64))
        return {
            "final": _state(module),
            "params": flat_params(module),
            "validated": recorder.seen.get("last validation"),
        }

    out = run_workers(fit, devices=2)
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 7
    final = out[0]["final"]
    for key, value in final.items():
        assert torch.equal(out[1]["final"][key], value) and torch.equal(saved["state_dict"][key], value), key
    if validate:
        assert torch.equal(out[0]["validated"], out[0]["params"])


def _fit_then_save(name: str, path: str) -> dict[str, torch.Tensor]:
    module = digits_classifier()
    t = trainer(strategy=STRATEGIES[name](), max_epochs=1)
    t.fit(module, datamodule=digits(batch_size=64))
    t.save_checkpoint(path)  # every rank: a collective
    return _state(module)


@pytest.mark.parametrize("name", ["hpsgd", "lsgd"])
def test_save_checkpoint_after_fit_holds_the_returned_model(name, tmp_path):
    path = tmp_path / "after_fit.ckpt"
    final, _ = run_workers(_fit_then_save, name, str(path), devices=2)
    saved = torch.load(path, weights_only=True)
    for key, value in final.items():
        assert torch.equal(saved["state_dict"][key], value), key
        for rank, state in enumerate(saved["lightning_hier"]["ranks"]):
            assert torch.equal(state["model"][key], value), f"rank {rank}: {key}"


def _fit_finishing_after_every_batch(name: str | None) -> torch.Tensor:
    """``name``: finish after every batch, as if every guess of the last step were wrong; None: Local SGD, tau 1."""
    torch.manual_seed(0)
    module = digits_classifier()
    strategy = STRATEGIES[name]() if name else LocalSGDStrategy(tau=1, timeout=30)
    predict = _finish.ends_after_this_batch
    if name:
        _finish.ends_after_this_batch = lambda trainer: True
    try:
        trainer(strategy=strategy, max_epochs=1).fit(module, datamodule=digits(batch_size=64))
    finally:
        _finish.ends_after_this_batch = predict
    return flat_params(module)


@pytest.mark.parametrize("name", ["hpsgd", "localsgd"])
def test_a_wrong_guess_of_the_last_step_only_adds_a_merge(name):
    # finishing after a step averages the replicas and training goes on from there: finishing
    # after every step is Local SGD with tau = 1 (HPSGD: S + mean(x - S), equal up to rounding)
    finished = run_workers(_fit_finishing_after_every_batch, name, devices=2)
    expected = run_workers(_fit_finishing_after_every_batch, None, devices=2)
    assert torch.equal(finished[0], finished[1])
    torch.testing.assert_close(finished[0], expected[0], atol=1e-6, rtol=0)
