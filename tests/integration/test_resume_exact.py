"""Resume is bit-identical from mid-epoch checkpoints and with ``max_steps``, for every strategy family.

Digits with a batch of 64 per replica: 11 steps per epoch. Each case fits 24 steps with a checkpoint
every 16 steps, then resumes from step 16 (batch 5 of epoch 1) in fresh workers; every rank's
parameters after every later step must equal the uninterrupted run's (``torch.equal``). Before the
strategies recorded the data position, the resumed run restarted epoch 1 from its first batch, and
after a ``max_steps`` resume Lightning's sampler epoch was one ahead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_hier import (
    DBSHPSGDStrategy,
    DBSLocalSGDStrategy,
    DBSStrategy,
    DecoupledStrategy,
    DiLoCoStrategy,
    EasgdStrategy,
    GrawaStrategy,
    Grid2DStrategy,
    HPSGDStrategy,
    LocalSGDStrategy,
    LsgdStrategy,
)
from lightning_hier.callbacks import Straggler
from lightning_hier.testing import run_workers
from tests.helpers import ParamRecorder, assert_resumed_run_matches, digits, digits_classifier, trainer

FAMILIES: dict[str, tuple[Callable[[], Any], int]] = {  # strategy, devices
    "localsgd": (lambda: LocalSGDStrategy(tau=5, timeout=30), 2),
    "easgd": (lambda: EasgdStrategy(tau=5, rho=0.05, timeout=30), 2),
    "lsgd": (lambda: LsgdStrategy(tau=5, timeout=30), 2),
    "grawa": (lambda: GrawaStrategy(variant="layer", tau=5, rho=0.1, probe="batch", timeout=30), 2),
    "hpsgd": (lambda: HPSGDStrategy(window=4, timeout=30), 2),  # step 16 ends a window: one in flight
    # launches at steps 1, 7, 13, each merged 2 steps later: at the step-16 checkpoint nothing is in flight
    "hpsgd-delay": (lambda: HPSGDStrategy(window=6, delay=2, compression="int8", timeout=30), 2),
    # 3 fragments sent at steps 2, 4, 0 mod 6, each landing 2 steps later: at the step-16 checkpoint one is in flight
    "diloco": (
        lambda: DiLoCoStrategy(
            window=6, fragments=3, fragment_sync_delay=2, fragment_update_alpha=0.5, compression="int4", timeout=30
        ),
        2,
    ),
    "grid2d": (lambda: Grid2DStrategy(grid=(2, 2), timeout=30), 4),
    # one replica of 2 stages (22 steps per epoch); 'sync' has no batch in flight between steps
    "decoupled-sync": (lambda: DecoupledStrategy(stages=2, schedule="sync", timeout=30), 2),
}


def _fit(name: str, ckpt_dir: str, resume: str | None, every: int | None, limits: dict[str, int]) -> dict:
    make, _ = FAMILIES[name]
    torch.manual_seed(0)
    rec = ParamRecorder()
    module = digits_classifier(hidden=(32, 32), dropout=0.2)  # dropout and augmentation consume the RNG
    # every: a checkpoint every n steps (mid-epoch); None: at every epoch's end
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, filename="{step}", every_n_train_steps=every)
    t = trainer(
        strategy=make(), devices=FAMILIES[name][1], callbacks=[rec, checkpoint], enable_checkpointing=True, **limits
    )
    t.fit(module, datamodule=digits(batch_size=64, augment=True), ckpt_path=resume)
    return {"steps": rec.steps, "params": rec.params}


def _full_and_resumed(fit: Callable[..., dict], tmp_path, step: int, *args: Any, devices: int = 2) -> tuple[list, list]:
    full = run_workers(fit, *args[:1], str(tmp_path / "a"), None, *args[1:], devices=devices)
    resume = str(tmp_path / "a" / f"step={step}.ckpt")
    resumed = run_workers(fit, *args[:1], str(tmp_path / "b"), resume, *args[1:], devices=devices)
    return full, resumed


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_mid_epoch_checkpoint_resumes_bit_identically(name, tmp_path):
    limits = {"max_steps": 24, "max_epochs": -1}  # into epoch 2 after the resume (its first step is 23)
    full, resumed = _full_and_resumed(_fit, tmp_path, 16, name, 16, limits, devices=FAMILIES[name][1])
    assert_resumed_run_matches(full, resumed, after_step=16)
    assert resumed[0]["steps"] == list(range(17, 25))


def test_a_resumed_run_resumes_again_bit_identically_within_the_same_epoch(tmp_path):
    # the second checkpoint is written by a run that itself resumed mid-epoch (at step 13, batch 2
    # of epoch 1): its data position must count the epoch's batches, not those since the resume
    limits = {"max_steps": 24, "max_epochs": -1}
    full = run_workers(_fit, "localsgd", str(tmp_path / "a"), None, 13, limits, devices=2)
    once = run_workers(_fit, "localsgd", str(tmp_path / "b"), str(tmp_path / "a" / "step=13.ckpt"), 3, limits)
    twice = run_workers(_fit, "localsgd", str(tmp_path / "c"), str(tmp_path / "b" / "step=18.ckpt"), None, limits)
    assert_resumed_run_matches(full, once, after_step=13)
    assert_resumed_run_matches(full, twice, after_step=18)


def test_a_chain_of_resumes_from_an_epoch_end_then_twice_mid_epoch_stays_bit_identical(tmp_path):
    # b resumes from epoch 0's last batch; Lightning 2.6.6 then leaves the epochs b trains uncounted,
    # so c, resumed from b's mid-epoch checkpoint, counted the epoch's batches from 0 again: its
    # batch_idx (and the data position of the checkpoint it writes, from which d resumed too early in
    # the epoch) and its validation at the epoch's end (skipped: the RNG then differs)
    limits = {"max_epochs": 3}  # with max_steps Lightning keeps counting from the epoch's start
    a = run_workers(_fit, "localsgd", str(tmp_path / "a"), None, 11, limits, devices=2)  # epoch 0's last batch
    b = run_workers(_fit, "localsgd", str(tmp_path / "b"), str(tmp_path / "a" / "step=11.ckpt"), 4, limits)
    c = run_workers(_fit, "localsgd", str(tmp_path / "c"), str(tmp_path / "b" / "step=12.ckpt"), 5, limits)
    d = run_workers(_fit, "localsgd", str(tmp_path / "d"), str(tmp_path / "c" / "step=15.ckpt"), None, limits)
    for resumed, step in ((b, 11), (c, 12), (d, 15)):
        assert_resumed_run_matches(a, resumed, after_step=step)


def test_an_epoch_end_checkpoint_resumes_bit_identically_with_max_steps(tmp_path):
    # Lightning hands set_epoch current_epoch + 1 after such a resume: the strategy corrects it
    full, resumed = _full_and_resumed(_fit, tmp_path, 22, "localsgd", None, {"max_steps": 36, "max_epochs": -1})
    assert_resumed_run_matches(full, resumed, after_step=22)
    assert resumed[0]["steps"] == list(range(23, 37))  # epochs 2 and 3


# DBS shares inside HPSGD / Local SGD: the window around the checkpoint at step 16 (HPSGD: launches at
# 11 and 21; Local SGD: rounds at 10 and 20) mixes the split before and after the rebalance at step
# 13, so its sample weights are exact after the resume only if the window's counts were saved
DBS_SHARES: dict[str, Callable[..., Any]] = {
    "dbs": DBSStrategy,
    "dbs_hpsgd": lambda **kw: DBSHPSGDStrategy(window=10, **kw),
    "dbs_localsgd": lambda **kw: DBSLocalSGDStrategy(tau=10, **kw),
}


def _fit_dbs(name: str, ckpt_dir: str, resume: str | None) -> dict:
    torch.manual_seed(0)
    rec = ParamRecorder()
    module = digits_classifier(dropout=0.2)
    # rebalances (from measured speeds) after steps 13, 23, ...: the checkpoint at step 16 is mid-epoch,
    # after a rebalance in the same epoch
    strategy = DBS_SHARES[name](rebalance_every=10, warmup_steps=3, timeout=30)
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, filename="{step}", every_n_train_steps=16)
    callbacks = [Straggler(ranks=1, factor=3.0), rec, checkpoint]
    t = trainer(strategy=strategy, callbacks=callbacks, enable_checkpointing=True, max_steps=23, max_epochs=-1)
    t.fit(module, datamodule=digits(batch_size=64, augment=True), ckpt_path=resume)
    return {"steps": rec.steps, "params": rec.params}


@pytest.mark.parametrize("name", list(DBS_SHARES))
def test_dbs_resumes_mid_epoch_with_the_split_of_each_batch(name, tmp_path):
    full, resumed = _full_and_resumed(_fit_dbs, tmp_path, 16, name)
    saved = torch.load(tmp_path / "a" / "step=16.ckpt", weights_only=True)["lightning_hier"]["ranks"][0]
    shares = saved["allocation"]  # DBS's shares: the strategy's allocation object
    (first, equal), (start, measured) = shares["segments"]  # epoch 1's splits
    assert (first, equal, start) == (0, [64, 64], 2) and measured != equal  # rebalanced from its batch 2
    assert saved["data"] == {"epoch": 1, "batches": 5}
    # until the next rebalance (after step 23, from new timings) the resumed run is the same run
    assert_resumed_run_matches(full, resumed, after_step=16)


def _fit_decoupled(ckpt_dir: str, resume: str | None) -> dict:
    torch.manual_seed(0)
    rec = ParamRecorder()
    module = digits_classifier(hidden=(32, 32), dropout=0.2)
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, filename="{step}")
    strategy = DecoupledStrategy(stages=2, timeout=30)
    t = trainer(strategy=strategy, callbacks=[rec, checkpoint], enable_checkpointing=True, max_steps=30, max_epochs=-1)
    t.fit(module, datamodule=digits(batch_size=64, augment=True), ckpt_path=resume)
    return {"steps": rec.steps, "params": rec.params}


def test_decoupled_resumes_bit_identically_from_an_epoch_end_with_max_steps(tmp_path):
    # one replica of 2 stages: 22 steps per epoch. With 'fdg' (the default) or 'ddg', mid-epoch
    # checkpoints hold no batches in flight (the pipeline's autograd state cannot be saved): only
    # epoch ends, where the pipeline is drained, are exact
    full, resumed = _full_and_resumed(_fit_decoupled, tmp_path, 22)
    assert_resumed_run_matches(full, resumed, after_step=22)
