"""Two-level synchronisation under a real Trainer: 2 simulated nodes x 2 forked ranks on one host."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_hier import GrawaStrategy, HPSGDStrategy, LocalSGDStrategy
from lightning_hier.testing import run_workers
from tests.helpers import ParamRecorder, assert_resumed_run_matches, digits, digits_classifier, flat_params, trainer

FAMILIES = {
    "hpsgd": (HPSGDStrategy, {"window": 2}),
    "localsgd": (LocalSGDStrategy, {"tau": 2}),
    "mgrawa": (GrawaStrategy, {"tau": 2, "variant": "model"}),
    "lgrawa": (GrawaStrategy, {"tau": 2, "variant": "layer"}),
}


def _fit(family: str, m: int, intra_node: str) -> tuple[dict[str, float], torch.Tensor, list[int]]:
    cls, kwargs = FAMILIES[family]
    strategy = cls(inter_node_every=m, intra_node=intra_node, timeout=30, **kwargs)
    t = trainer(strategy=strategy, devices=2, num_nodes=2, max_epochs=1)
    module = digits_classifier()
    t.fit(module, datamodule=digits(batch_size=32))
    ranks = torch.distributed.get_process_group_ranks(strategy.groups.data_intra)
    metrics = {k: float(v) for k, v in t.callback_metrics.items() if "rank" not in k}
    return metrics, flat_params(module), ranks


@pytest.mark.parametrize(
    ("family", "m", "intra_node"),
    [
        ("hpsgd", 2, "window"),
        ("hpsgd", 1, "step"),
        ("localsgd", 2, "window"),
        ("mgrawa", 2, "window"),
        ("lgrawa", 2, "step"),
    ],
)
def test_each_family_trains_on_two_levels_under_a_trainer(family, m, intra_node):
    out = run_workers(_fit, family, m, intra_node, devices=2, num_nodes=2, timeout=120)
    metrics, params, _ = out[0]
    assert [o[2] for o in out] == [[0, 1], [0, 1], [2, 3], [2, 3]]  # the node groups the rule used
    assert all(torch.equal(o[1], params) for o in out), "every rank holds the consensus model after fit"
    assert metrics["val/acc"] > 0.5  # 10 classes: it learned
    assert metrics["comm/bytes_intra"] > 0 and metrics["comm/bytes_inter"] > 0
    # inside the node every window / step, across nodes every m-th: more bytes stay in the node
    assert metrics["comm/bytes_intra"] >= metrics["comm/bytes_inter"]


@pytest.mark.parametrize("cls", [HPSGDStrategy, LocalSGDStrategy, GrawaStrategy])
def test_two_levels_on_one_node_are_rejected_before_any_process_starts(cls):
    with pytest.raises(ValueError, match=rf"{cls.__name__}: argument `inter_node_every`=2 .* needs num_nodes > 1"):
        pl.Trainer(strategy=cls(inter_node_every=2), accelerator="cpu", devices=2, num_nodes=1, logger=False)


def _fit_to(family: str, ckpt_dir: str, resume: str | None) -> dict:
    """Digits, batch 64 per replica on 4 replicas: 6 steps per epoch; 14 steps, a checkpoint every 9."""
    cls, kwargs = FAMILIES[family]
    torch.manual_seed(0)
    rec = ParamRecorder()
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, filename="{step}", every_n_train_steps=9)
    strategy = cls(inter_node_every=2, timeout=30, **kwargs)
    t = trainer(
        strategy=strategy,
        devices=2,
        num_nodes=2,
        callbacks=[rec, checkpoint],
        enable_checkpointing=True,
        max_steps=14,
        max_epochs=-1,
    )
    t.fit(digits_classifier(), datamodule=digits(batch_size=64), ckpt_path=resume)
    return {"steps": rec.steps, "params": rec.params}


@pytest.mark.parametrize("family", ["hpsgd", "localsgd"])
def test_a_two_level_checkpoint_resumes_bit_identically(family, tmp_path):
    # hpsgd, window 2: merges at steps 3, 5, 7, 9; the cross-node sum sent at step 9 is in flight at the checkpoint
    full = run_workers(_fit_to, family, str(tmp_path / "a"), None, devices=2, num_nodes=2, timeout=120)
    resume = str(tmp_path / "a" / "step=9.ckpt")
    resumed = run_workers(_fit_to, family, str(tmp_path / "b"), resume, devices=2, num_nodes=2, timeout=120)
    assert_resumed_run_matches(full, resumed, after_step=9)
    assert resumed[0]["steps"] == list(range(10, 15))
