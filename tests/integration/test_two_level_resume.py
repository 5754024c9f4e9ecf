"""The grid and pipeline compositions across nodes (issue 20) resume bit-identically and validate the consensus.

A checkpoint taken mid-period holds the cross-node rule's state (Local SGD's counters; HPSGD's
global model and the window in flight), so a run resumed from it repeats the uninterrupted run
step by step on every rank.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_hier import DecoupledStrategy, Grid2DStrategy
from lightning_hier.testing import run_workers
from tests.helpers import ParamRecorder, assert_resumed_run_matches, digits, digits_classifier, flat_params, trainer

NODES, DEVICES, EVERY = 2, 2, 4  # digits: 6 steps per epoch on 4 replicas of batch 64; rounds straddle epochs


class _Validated(Callback):
    """This rank's parameters as validation sees them (the consensus model's shard or stage)."""

    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, *args) -> None:
        if batch_idx == 0:
            self.params.append(flat_params(pl_module))


def _strategy(kind: str, rule: str) -> Grid2DStrategy | DecoupledStrategy:
    if kind == "grid2d":
        return Grid2DStrategy(grid=(2, 2), inter_node_every=EVERY, inter_node=rule, timeout=30)
    return DecoupledStrategy(stages=2, split=[2], inter_node_every=EVERY, inter_node=rule, timeout=30)


def _fit(kind: str, rule: str, ckpt_dir: str, resume: str | None) -> dict:
    torch.manual_seed(0)
    recorder, validated = ParamRecorder(), _Validated()
    module = digits_classifier(hidden=(32, 32), momentum=0.9)
    callbacks = [recorder, validated, ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, filename="{epoch}")]
    t = trainer(
        strategy=_strategy(kind, rule),
        devices=DEVICES,
        num_nodes=NODES,
        max_epochs=3,
        callbacks=callbacks,
        enable_checkpointing=True,
    )
    t.fit(module, datamodule=digits(batch_size=64), ckpt_path=resume)
    return {"steps": recorder.steps, "params": recorder.params, "validated": validated.params}


@pytest.mark.parametrize(("kind", "rule"), [("grid2d", "hpsgd"), ("grid2d", "localsgd"), ("decoupled", "hpsgd")])
def test_resume_mid_period_continues_bit_identically(tmp_path, kind, rule):
    full = run_workers(_fit, kind, rule, str(tmp_path / "a"), None, devices=DEVICES, num_nodes=NODES)
    ckpt = tmp_path / "a" / "epoch=0.ckpt"
    step = int(torch.load(ckpt, weights_only=False)["global_step"])
    assert step % EVERY, "the checkpoint should fall inside a cross-node period"
    resumed = run_workers(_fit, kind, rule, str(tmp_path / "b"), str(ckpt), devices=DEVICES, num_nodes=NODES)
    assert_resumed_run_matches(full, resumed, after_step=step)
    # validation (at epoch ends, mid-period) sees the consensus: the same shard / stage on both nodes
    for rank in range(DEVICES):
        mine, other_node = full[rank]["validated"], full[rank + DEVICES]["validated"]
        assert len(mine) == 3 and all(torch.equal(a, b) for a, b in zip(mine, other_node, strict=True))
