"""The opt-in non-finite guard: a NaN/inf on one rank stops the run, named, before it spreads."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_hier import HPSGDStrategy, NonFiniteError
from lightning_hier.strategies import DDPCommHookStrategy
from lightning_hier.strategies._finite import all_finite, warn_if_not_finite
from lightning_hier.testing import WorkerFailed, run_workers
from tests.helpers import trainer

BAD_RANK, BAD_BATCH = 1, 3


class Poisoned(BoringModel):
    """BoringModel whose rank 1 produces a non-finite loss, gradient or parameter at batch 3."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def _now(self, batch_idx: int) -> bool:
        return self.global_rank == BAD_RANK and batch_idx == BAD_BATCH

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        if self.where == "loss" and self._now(batch_idx):
            out["loss"] = out["loss"] * float("nan")
        if self.where == "gradients" and self._now(batch_idx):
            out["loss"].register_hook(lambda g: g * float("inf"))  # a finite loss, infinite gradients
        return out

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.where == "parameters" and self._now(self.trainer.fit_loop.epoch_loop.batch_idx):
            self.layer.bias.grad.fill_(float("inf"))  # past the gradient check: only the step sees it


def _fit(name: str, where: str, check: bool) -> bool:
    from lightning.pytorch.strategies import StrategyRegistry

    entry = StrategyRegistry[name]
    strategy = entry["strategy"](**{**entry["init_params"], "check_finite": check, "timeout": 30})
    model = Poisoned(where)
    trainer(strategy=strategy, max_epochs=1, limit_train_batches=8, limit_val_batches=0).fit(model)
    return all_finite(model.parameters())


@pytest.mark.parametrize(
    "name",
    [
        "hpsgd",
        "dbs",
        "localsgd",
        "easgd",
        "lsgd",
        "mgrawa",
        "grid2d",
        "dbs_hpsgd",
        "dbs_localsgd",
        "ddp_powersgd",
        "ddp_post_local_sgd",
    ],
)
def test_a_nan_loss_on_one_rank_stops_the_run_naming_it(name):
    with pytest.raises(WorkerFailed, match=rf"rank {BAD_RANK} has non-finite loss at global step {BAD_BATCH} ") as err:
        run_workers(_fit, name, "loss", True, devices=2, timeout=90)
    assert err.value.rank == BAD_RANK
    assert "NonFiniteError" in err.value.details


@pytest.mark.parametrize(("name", "where"), [("dbs", "gradients"), ("grid2d", "gradients"), ("hpsgd", "parameters")])
def test_non_finite_gradients_or_parameters_are_caught_before_they_are_reduced(name, where):
    # DBS and grid2d reduce gradients inside the closure, right after backward: the check runs first
    with pytest.raises(WorkerFailed, match=rf"rank {BAD_RANK} has non-finite {where} .*\(in layer\.") as err:
        run_workers(_fit, name, where, True, devices=2, timeout=90)
    assert err.value.rank == BAD_RANK


def test_without_the_guard_the_nan_reaches_every_rank_and_the_end_of_fit_warns(caplog):
    # the default: no per-step cost; the fit ends, and the non-finite consensus is reported once
    assert run_workers(_fit, "hpsgd", "loss", False, devices=2, timeout=90) == [False, False]
    caplog.set_level(logging.WARNING)
    broken = torch.nn.Linear(2, 2)
    torch.nn.init.constant_(broken.weight, float("nan"))
    assert not warn_if_not_finite(broken, "HPSGDStrategy", 0)
    assert warn_if_not_finite(torch.nn.Linear(2, 2), "HPSGDStrategy", 0)
    assert "rank 0 has non-finite parameters at the end of fit" in caplog.text


def test_all_finite_tells_nan_and_inf_from_large_finite_values():
    assert all_finite([torch.full((3,), 3e38), torch.zeros(0), None])
    assert not all_finite([torch.ones(2), torch.tensor([1.0, float("inf")])])
    assert not all_finite([torch.tensor([float("nan")], dtype=torch.bfloat16)])


@pytest.mark.parametrize("cls", [HPSGDStrategy, lambda **kw: DDPCommHookStrategy("fp16", **kw)])
def test_check_finite_must_be_a_bool(cls):
    with pytest.raises(ValueError, match=r"argument `check_finite` must be True or False, got 'yes'"):
        cls(check_finite="yes")


def test_the_error_names_rank_step_and_what():
    err = NonFiniteError("msg", rank=3, step=7, what="loss")
    assert (err.rank, err.step, err.what) == (3, 7, "loss")
    assert isinstance(err, FloatingPointError)


def _fit_decoupled_poisoned() -> None:
    from lightning_hier import DecoupledStrategy
    from tests.helpers import digits, digits_classifier

    module = digits_classifier(hidden=(32, 32))
    calls = {"n": 0}

    def poison(_: Any, __: Any, output: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        return output * float("nan") if calls["n"] == BAD_BATCH else output

    module.net[-1].register_forward_hook(poison)  # the last block lives on stage 1 = rank 1
    strategy = DecoupledStrategy(stages=2, module_attr="net", check_finite=True, timeout=30)
    trainer(strategy=strategy, max_epochs=1, limit_train_batches=8, limit_val_batches=0).fit(
        module, datamodule=digits(batch_size=16)
    )


def test_decoupled_checks_a_stages_gradients_before_they_travel():
    with pytest.raises(WorkerFailed, match=rf"rank {BAD_RANK} has non-finite gradients .*\(pipeline stage 1\)") as err:
        run_workers(_fit_decoupled_poisoned, devices=2, timeout=90)
    assert err.value.rank == BAD_RANK
