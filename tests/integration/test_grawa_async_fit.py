"""Asynchronous GRAWA (``rounds='async'``) under a real Trainer: 3 forked ranks, consensus, server accounting."""

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

from lightning_hier import GrawaStrategy
from lightning_hier.models import Classifier, mlp
from lightning_hier.testing import run_workers
from tests.helpers import flat_params, trainer

W, N, BATCH, EPOCHS, TAU = 3, 40, 8, 2, 3  # 5 steps per epoch: 3 rounds and a final report per rank


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + rank)
    return torch.randn(N, 1, 8, 8, generator=g), torch.randint(0, 10, (N,), generator=g) % (3 + rank)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"])  # before the Trainer joins


class _ValidationWeights(Callback):
    """Records the weights the rank validates (the consensus model) at every validation."""

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if batch_idx == 0:  # after the strategy's on_validation_start, which enters the consensus
            self.seen.append(flat_params(pl_module))


def _fit(variant: str, path: str) -> dict:
    torch.manual_seed(0)
    module = Classifier(mlp((1, 8, 8), 10, hidden=(16,)), 10, lr=0.05, momentum=0.9, nesterov=False)
    x, y = _data(_rank())
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)
    strategy = GrawaStrategy(variant=variant, rounds="async", tau=TAU, probe="batch", timeout=30)
    recorder = _ValidationWeights()
    t = trainer(strategy=strategy, devices=W, max_epochs=EPOCHS, use_distributed_sampler=False, callbacks=[recorder])
    t.fit(module, loader, loader)
    t.save_checkpoint(path)
    return {"params": flat_params(module), "validated": recorder.seen, "metrics": dict(strategy.last_metrics)}


@pytest.mark.parametrize("variant", ["model", "layer"])
def test_async_rounds_fit_with_one_consensus_everywhere(variant, tmp_path: Path):
    path = str(tmp_path / "async.ckpt")
    out = run_workers(_fit, variant, path, devices=W, timeout=120)
    final = out[0]["params"]
    assert torch.isfinite(final).all()
    for rank in range(W):  # validation and the end of fit hold the server's center on every rank
        assert torch.equal(out[rank]["params"], final)
        assert len(out[rank]["validated"]) == EPOCHS
        for epoch in range(EPOCHS):
            assert torch.equal(out[rank]["validated"][epoch], out[0]["validated"][epoch])
    assert not torch.equal(out[0]["validated"][0], out[0]["validated"][1])
    saved = torch.load(path, weights_only=False)["state_dict"]
    assert torch.equal(torch.cat([t.reshape(-1) for t in saved.values()]), final)
    metrics = out[0]["metrics"]
    # every report applied exactly once: 3 rounds (steps 3, 6, 9) and a final report (step 10) per rank
    assert metrics["ps/applied"] == 4 * W and metrics["ps/updates"] == 4 * W
    assert 0 <= metrics["ps/staleness_mean"] <= metrics["ps/staleness_max"] <= 4 * W - 1
    assert "grawa/weight/rank2" in metrics


def _resume(path: str) -> dict:
    torch.manual_seed(0)
    module = Classifier(mlp((1, 8, 8), 10, hidden=(16,)), 10, lr=0.05, momentum=0.9, nesterov=False)
    x, y = _data(_rank())
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)
    strategy = GrawaStrategy(rounds="async", tau=TAU, probe="batch", timeout=30)
    t = trainer(strategy=strategy, devices=W, max_epochs=EPOCHS + 1, use_distributed_sampler=False)
    t.fit(module, loader, ckpt_path=path)
    return {"params": flat_params(module), "metrics": dict(strategy.last_metrics)}


def test_async_rounds_resume_with_the_servers_table(tmp_path: Path):
    path = str(tmp_path / "async.ckpt")
    run_workers(_fit, "model", path, devices=W, timeout=120)
    ranks = torch.load(path, weights_only=False)["lightning_hier"]["ranks"]
    server = ranks[0]["algorithm"]["server"]  # rank 0 saved the server: every rank's latest replica
    assert len(server["handler"]["replicas"]) == W and bool(server["handler"]["reported"].all())
    assert all("server" not in r["algorithm"] for r in ranks[1:])
    out = run_workers(_resume, path, devices=W, timeout=120)
    for rank in range(W):
        assert torch.equal(out[rank]["params"], out[0]["params"])
    # the restored server counts on: 12 reports before, then a round (step 3) and a final report per rank
    assert out[0]["metrics"]["ps/applied"] == 4 * W + 2 * W
