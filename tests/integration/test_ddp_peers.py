"""The DDP peers under a real Trainer on CPU (gloo): each hook is registered and does what it should.

Lightning's own ``DDPStrategy`` ignores ``ddp_comm_hook`` on CPU; every test here fails when the
hook is silently dropped (plain fp32 all-reduce every step).
"""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from lightning_hier import DDPCommHookStrategy
from lightning_hier.testing import WorkerFailed, run_workers
from tests.helpers import ParamRecorder, digits, digits_classifier, trainer


class HookName(Callback):
    """The communication hook DDP reports having registered (its logging data), at the start of fit."""

    name = ""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.name = str(trainer.strategy.model._get_ddp_logging_data().get("comm_hook", ""))  # type: ignore[union-attr]


class Gradients(Callback):
    """This rank's own gradient of the first batch (before DDP) and the gradient the optimizer gets."""

    def __init__(self) -> None:
        self.local: Tensor | None = None
        self.synced: Tensor | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        net = copy.deepcopy(pl_module.net)  # a copy outside DDP: its backward triggers no reducer
        x, y = batch
        loss = pl_module._loss(net(x), y)
        self.local = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, list(net.parameters()))])

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.synced = torch.cat([p.grad.reshape(-1).clone() for p in pl_module.parameters()])


def _fit(strategy: Any, callbacks: list[Callback], **overrides: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    module = digits_classifier(hidden=(64,), lr=0.1, momentum=0.9)
    hook = HookName()
    t = trainer(strategy=strategy, callbacks=[hook, *callbacks], **overrides)
    t.fit(module, datamodule=digits(batch_size=32))
    return {"hook": hook.name, "loss": float(t.callback_metrics["train/loss"]), "state": t.strategy._ddp_comm_state}


def _fp16_one_step() -> dict[str, Any]:
    grads = Gradients()
    out = _fit(DDPCommHookStrategy("fp16", timeout=30), [grads], max_steps=1)
    return {**out, "local": grads.local, "synced": grads.synced}


def test_fp16_hook_all_reduces_fp16_rounded_gradients_on_cpu():
    ranks = run_workers(_fp16_one_step, devices=2)
    assert [r["hook"] for r in ranks] == ["fp16_compress_hook"] * 2
    # torch's fp16 hook: each rank's bucket cast to fp16 and halved, summed in fp16, cast back
    fp16_mean = (ranks[0]["local"].half() / 2 + ranks[1]["local"].half() / 2).float()
    fp32_mean = (ranks[0]["local"] + ranks[1]["local"]) / 2
    for r in ranks:
        torch.testing.assert_close(r["synced"], fp16_mean, rtol=0, atol=0)
    assert not torch.equal(ranks[0]["synced"], fp32_mean), "fp32 gradients: the hook was ignored"
    torch.testing.assert_close(ranks[0]["synced"], fp32_mean, rtol=1e-3, atol=1e-4)  # fp16 rounding only


PERIOD = 3


def _post_local_sgd() -> dict[str, Any]:
    rec = ParamRecorder()
    strategy = DDPCommHookStrategy("post_local_sgd", model_averaging_period=PERIOD, timeout=30)
    out = _fit(strategy, [rec], max_steps=3 * PERIOD + 1)
    return {**out, "steps": rec.steps, "params": rec.params}


def test_post_local_sgd_averages_every_period_and_replicas_differ_between():
    ranks = run_workers(_post_local_sgd, devices=2)
    assert [r["hook"] for r in ranks] == ["post_localSGD_hook"] * 2
    assert ranks[0]["steps"] == list(range(1, 3 * PERIOD + 2))
    for i, step in enumerate(ranks[0]["steps"]):
        same = torch.equal(ranks[0]["params"][i], ranks[1]["params"][i])
        # torch's PeriodicModelAverager averages after its steps 0, P, 2P, ... (global steps 1, P+1, ...)
        averaged = (step - 1) % PERIOD == 0
        assert same == averaged, f"step {step}: replicas {'equal' if same else 'differ'}"
    assert not any(r["state"].post_local_gradient_allreduce for r in ranks)  # no intra-node subgroups on CPU


def _powersgd(hook: str | None) -> dict[str, Any]:
    rec = ParamRecorder()
    strategy = DDPCommHookStrategy("powersgd", powersgd_rank=2, timeout=30) if hook else "ddp"
    out = _fit(strategy, [rec], max_epochs=2)
    state = out.pop("state")
    return {**out, "params": rec.params, "stats": state.compression_stats() if hook else None}


def test_powersgd_compresses_keeps_ranks_equal_and_fits():
    ranks = run_workers(_powersgd, "powersgd", devices=2)
    plain = run_workers(_powersgd, None, devices=2)
    assert [r["hook"] for r in ranks] == ["powerSGD_hook"] * 2
    assert all(torch.isfinite(torch.tensor(r["loss"])) and r["loss"] < 1.0 for r in ranks)
    for a, b in zip(ranks[0]["params"], ranks[1]["params"], strict=True):
        assert torch.equal(a, b)  # every rank applies the same decompressed gradient
    rate, before, after = ranks[0]["stats"]
    assert after < before and rate > 2
    # the two warm-up steps are plain all-reduces, then the low-rank gradients take another path
    torch.testing.assert_close(ranks[0]["params"][1], plain[0]["params"][1])
    assert not torch.allclose(ranks[0]["params"][2], plain[0]["params"][2])


def _powersgd_small_buckets() -> None:
    _fit(DDPCommHookStrategy("powersgd", bucket_cap_mb=0.001, timeout=30), [], max_steps=1)


def test_powersgd_over_gloo_rejects_buckets_smaller_than_the_model():
    with pytest.raises(WorkerFailed, match=r"`bucket_cap_mb` must be None or >= 0\.0\d"):
        run_workers(_powersgd_small_buckets, devices=2)


def test_registry_names_build_the_peers():
    for name, hook in (("ddp_post_local_sgd", "post_local_sgd"), ("ddp_powersgd", "powersgd"), ("ddp_fp16", "fp16")):
        for suffix, method in (("", "popen"), ("_spawn", "spawn"), ("_fork", "fork")):
            t = pl.Trainer(strategy=name + suffix, accelerator="cpu", devices=2, logger=False)
            assert type(t.strategy) is DDPCommHookStrategy
            assert (t.strategy.hook, t.strategy._start_method) == (hook, method)


def test_fork_name_fits_from_the_main_process():
    module = digits_classifier()
    t = trainer(strategy="ddp_post_local_sgd_fork", max_steps=4)
    t.fit(module, datamodule=digits(batch_size=64))
    assert torch.isfinite(t.callback_metrics["train/loss"])
