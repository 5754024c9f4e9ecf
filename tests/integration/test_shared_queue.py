"""``sampler='shared'`` under a real Trainer: one rank slowed, every sample trained once, fast ranks take more steps."""

import os
import re
import time
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

from lightning_hier import AsgdStrategy, AsyncDBSStrategy, GrawaStrategy, SoftsyncStrategy
from lightning_hier.models import Classifier, mlp
from lightning_hier.testing import run_workers
from tests.helpers import trainer

N, BATCH, EPOCHS, WORLD = 240, 4, 2, 3
SLOW_RANK, SLEEP_S = 2, 0.25


class Indexed(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Random 8x8 inputs that record which indices this rank loaded (num_workers=0: in the training process)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(N, 1, 8, 8, generator=g), torch.randint(0, 10, (N,), generator=g)
        self.seen: list[int] = []

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.seen.append(int(i))
        return self.x[i], self.y[i]


class SlowRank(Callback):
    """Rank ``SLOW_RANK`` sleeps before every batch; every rank counts its steps per epoch and its batch sizes."""

    def __init__(self, sleep_s: float = SLEEP_S) -> None:
        self.sleep_s = sleep_s
        self.steps: dict[int, int] = {}
        self.sizes: list[int] = []

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_rank == SLOW_RANK:
            time.sleep(self.sleep_s)
        self.steps[trainer.current_epoch] = self.steps.get(trainer.current_epoch, 0) + 1
        self.sizes.append(len(batch[1]))


TAU = 3


def _strategy(name: str) -> AsgdStrategy | SoftsyncStrategy | GrawaStrategy:
    if name == "asgd":
        return AsgdStrategy(sampler="shared", timeout=30)
    if name == "softsync":
        return SoftsyncStrategy(n=3, sampler="shared", timeout=30)
    variant = "layer" if name == "lgrawa_async" else "model"
    # probe='batch': a fresh probe would fetch samples of the dataset too, and `seen` counts the training ones
    return GrawaStrategy(variant=variant, rounds="async", sampler="shared", tau=TAU, probe="batch", timeout=30)


def _reports(rank_out: dict[str, Any]) -> int:
    """GRAWA's reports of a rank in a fit: one every TAU of its steps, one more for a partial last period."""
    steps = sum(rank_out["steps"].values())
    return steps // TAU + (steps % TAU > 0)


def _server_stats(strategy: AsgdStrategy | SoftsyncStrategy | GrawaStrategy) -> dict[str, float]:
    if isinstance(strategy, GrawaStrategy):
        return dict(strategy.last_metrics)  # the server's, kept at the end of fit
    assert strategy.sync.ps is not None
    return strategy.sync.ps.stats()


def _fit(name: str) -> dict[str, Any]:
    torch.manual_seed(0)
    module = Classifier(mlp((1, 8, 8), 10, hidden=(16,)), 10, lr=0.05)
    strategy = _strategy(name)
    data = Indexed()
    slow = SlowRank()
    t = trainer(strategy=strategy, devices=int(os.environ["WORLD_SIZE"]), max_epochs=EPOCHS, callbacks=[slow])
    # validation at each epoch's end pauses the server; the next epoch's first claims restart it
    t.fit(module, DataLoader(data, batch_size=BATCH, shuffle=True), DataLoader(Indexed(), batch_size=16))
    out = {"seen": data.seen, "steps": slow.steps, "stats": _server_stats(strategy)}
    return out | {"params": torch.cat([p.detach().reshape(-1) for p in module.parameters()])}


@pytest.mark.parametrize("name", ["asgd", "softsync", "mgrawa_async", "lgrawa_async"])
def test_shared_queue_trains_each_sample_once_and_fast_ranks_take_more_steps(name):
    out = run_workers(_fit, name, devices=WORLD, timeout=120)
    seen = sorted(i for r in out for i in r["seen"])
    assert seen == sorted(list(range(N)) * EPOCHS)  # every sample once per epoch, across the ranks
    for epoch in range(EPOCHS):
        steps = [r["steps"][epoch] for r in out]
        assert sum(steps) == N // BATCH
        # the slow rank sleeps 0.25 s a step, the others take milliseconds: with a split each would take
        # N / (BATCH * WORLD) = 20 steps; here the slow rank gets fewer and a fast one more. (How the rest
        # divides between the fast ranks is timing: rank 0 claims in-process, rank 1 over gloo.)
        assert steps[SLOW_RANK] < N // (BATCH * WORLD) < max(steps[0], steps[1]), steps
    stats = out[0]["stats"]
    if "grawa" not in name:
        assert stats["ps/applied"] == EPOCHS * N // BATCH, stats
        return
    # GRAWA's server: a report every TAU of a rank's own steps, and one more for a partial last period
    assert stats["ps/applied"] == sum(_reports(r) for r in out), stats
    for r in out:  # the end of fit holds the server's center on every rank
        assert torch.equal(r["params"], out[0]["params"])


def _fit_dbs(rebalance_every: int, sleep_s: float, n: int | None = None) -> dict[str, Any]:
    torch.manual_seed(0)
    module = Classifier(mlp((1, 8, 8), 10, hidden=(16,)), 10, lr=0.05)
    strategy = AsyncDBSStrategy(
        sampler="shared", initial_sizes=[6, 4, 2], rebalance_every=rebalance_every, warmup_steps=1, timeout=30, n=n
    )
    data, slow = Indexed(), SlowRank(sleep_s)
    t = trainer(strategy=strategy, devices=WORLD, max_epochs=EPOCHS, callbacks=[slow])
    t.fit(module, DataLoader(data, batch_size=BATCH, shuffle=True))
    server = strategy.sync.ps.server if strategy.sync.ps is not None else None
    shares = server.core.claims.shares if server is not None and server.core.claims is not None else None
    assert strategy.sync.ps is not None
    rebalances = shares.rebalances if shares is not None else None
    return {"seen": data.seen, "sizes": slow.sizes, "rebalances": rebalances, "stats": strategy.sync.ps.stats()}


def test_dbs_async_shared_claims_are_sized_by_the_server():
    fixed = run_workers(_fit_dbs, 10**6, 0.05, devices=WORLD, timeout=120)  # never measured: the initial split
    assert sorted(i for r in fixed for i in r["seen"]) == sorted(list(range(N)) * EPOCHS)
    for size, r in zip([6, 4, 2], fixed, strict=True):
        # every claim is the server's size for the rank; only an epoch's last claim may be cut short
        assert r["sizes"] and max(r["sizes"]) == size and sum(b != size for b in r["sizes"]) <= EPOCHS, r["sizes"]
    assert fixed[0]["stats"]["ps/updates"] == fixed[0]["stats"]["ps/applied"]  # ASGD's server: one push, one update
    # every rank reports its speed every 2 of its steps (no sleep: every rank takes enough steps to measure);
    # the 2-softsync server (n=2 of 3 workers) applies pushes in pairs, the last of a pause alone
    moving = run_workers(_fit_dbs, 2, 0.0, 2, devices=WORLD, timeout=120)
    assert sorted(i for r in moving for i in r["seen"]) == sorted(list(range(N)) * EPOCHS)
    assert moving[0]["rebalances"] > 0  # the server re-split B from the reported speeds, with no all-gather
    assert any(set(r["sizes"]) - {b} for b, r in zip([6, 4, 2], moving, strict=True))
    stats = moving[0]["stats"]
    assert stats["ps/applied"] / 2 <= stats["ps/updates"] <= stats["ps/applied"] / 2 + EPOCHS, stats


def _fit_resumable(name: str, ckpt_dir: str, epochs: int, resume: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    module = Classifier(mlp((1, 8, 8), 10, hidden=(16,)), 10, lr=0.05)
    strategy = _strategy(name)
    ckpt = ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, every_n_epochs=1, filename="{epoch}")
    data, steps = Indexed(), SlowRank(sleep_s=0.0)
    t = trainer(strategy=strategy, devices=WORLD, max_epochs=epochs, callbacks=[ckpt, steps], enable_checkpointing=True)
    path = os.path.join(ckpt_dir, "epoch=0.ckpt") if resume else None
    t.fit(module, DataLoader(data, batch_size=BATCH, shuffle=True), ckpt_path=path)
    return {"seen": data.seen, "stats": _server_stats(strategy), "steps": steps.steps}


@pytest.mark.parametrize("name", ["asgd", "mgrawa_async"])
def test_shared_queue_resumes_after_an_epoch_end_checkpoint_with_the_next_epoch(name, tmp_path):
    first = run_workers(_fit_resumable, name, str(tmp_path), 1, False, devices=WORLD, timeout=120)
    resumed = run_workers(_fit_resumable, name, str(tmp_path), 3, True, devices=WORLD, timeout=120)
    # epochs 1 and 2, each sample once per epoch: not the used-up epoch 0 again (an empty epoch) nor half of one
    assert sorted(i for r in resumed for i in r["seen"]) == sorted(list(range(N)) * 2)
    # the server's counters go on from the checkpoint
    if name == "asgd":
        assert resumed[0]["stats"]["ps/applied"] == 3 * N // BATCH
        return
    # a report per TAU steps of each rank and a final one for a partial period, in each fit
    reports = sum(_reports(r) for r in first + resumed)
    assert resumed[0]["stats"]["ps/applied"] == reports, (reports, resumed[0]["stats"])


class HangRank1(Callback):
    """Rank 1 stops at its third batch as if hung: it sends no further claim or push."""

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if trainer.global_rank == 1 and idx == 2:
            time.sleep(3600)


def _fit_hung() -> None:
    torch.manual_seed(0)
    module = Classifier(mlp((1, 8, 8), 10, hidden=(16,)), 10, lr=0.05)
    t = trainer(strategy=AsgdStrategy(sampler="shared", timeout=4), devices=WORLD, callbacks=[HangRank1()])
    t.fit(module, DataLoader(Indexed(), batch_size=BATCH))


def test_shared_queue_a_hung_rank_fails_the_fit_within_the_timeout_and_is_named():
    from lightning_hier.testing import WorkerFailed

    start = time.monotonic()
    with pytest.raises(WorkerFailed) as info:
        run_workers(_fit_hung, devices=WORLD, timeout=60)
    elapsed = time.monotonic() - start
    # rank 0 (the server) names the silent worker; no rank waits forever on a claim or a reply.
    # Two detectors race: the serving thread's silence check ("rank(s) [1] did not answer within")
    # and a receive that timed out ("receiving from rank 1 did not answer"); either names rank 1.
    # (Whether rank 2's own report of the failure arrives in time to be left out of the list is a race.)
    named = re.search(r"rank\(s\) \[1\] did not answer within|receiving from rank 1 did not answer", str(info.value))
    assert info.value.rank == 0 and named, info.value
    assert elapsed < 40, f"took {elapsed:.1f} s"


def _fit_rejected(option: dict[str, Any], name: str) -> None:
    torch.manual_seed(0)
    module = Classifier(mlp((1, 8, 8), 10, hidden=(16,)), 10, lr=0.05)
    t = trainer(strategy=_strategy(name), devices=2, **option)
    t.fit(module, DataLoader(Indexed(), batch_size=BATCH))


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"val_check_interval": 5}, "val_check_interval"),
        ({"limit_train_batches": 0.5}, "limit_train_batches"),
        (
            {"callbacks": [ModelCheckpoint(every_n_train_steps=3)], "enable_checkpointing": True},
            "every_n_train_steps=3",
        ),
        ({"max_time": {"minutes": 5}}, "interval='step'"),
        ({"max_steps": 10}, "max_steps"),
    ],
)
def test_shared_queue_rejects_per_step_trainer_options(option, message):
    from lightning_hier.testing import WorkerFailed

    with pytest.raises(WorkerFailed, match=f"AsgdStrategy: with sampler='shared'.*{message}"):
        run_workers(_fit_rejected, option, "asgd", devices=2, timeout=60)


def test_grawa_shared_queue_rejects_per_step_trainer_options():
    from lightning_hier.testing import WorkerFailed

    with pytest.raises(WorkerFailed, match=r"GrawaStrategy: with sampler='shared'.*max_steps"):
        run_workers(_fit_rejected, {"max_steps": 10}, "mgrawa_async", devices=2, timeout=60)


def test_shared_queue_rejects_dedicated_server_synchronous_softsync_and_lock_step_grawa():
    with pytest.raises(ValueError, match=r"GrawaStrategy: argument `sampler`='shared' needs rounds='async'"):
        GrawaStrategy(sampler="shared")
    with pytest.raises(ValueError, match=r"GrawaStrategy.*sampler"):
        GrawaStrategy(rounds="async", sampler="queue")
    with pytest.raises(ValueError, match=r"sampler.*'shared'.*dedicated"):
        AsgdStrategy(sampler="shared", server="dedicated")
    for cls in (SoftsyncStrategy, AsyncDBSStrategy):
        with pytest.raises(ValueError, match=f"{cls.__name__}: argument `n`=1"):
            cls(n=1, sampler="shared")
    with pytest.raises(ValueError, match="sampler"):
        AsgdStrategy(sampler="queue")


def _fit_scheduled(scheduler: str) -> dict[str, Any]:
    torch.manual_seed(0)
    module = Classifier(mlp((1, 8, 8), 10, hidden=(16,)), 10, lr=0.05, scheduler=scheduler, warmup_steps=5)
    steps = SlowRank(sleep_s=0.0)
    t = trainer(strategy=_strategy("mgrawa_async"), devices=2, max_epochs=1, callbacks=[steps])
    t.fit(module, DataLoader(Indexed(), batch_size=BATCH))
    return {"lr": t.optimizers[0].param_groups[0]["lr"], "steps": steps.steps[0]}


def test_shared_queue_runs_a_warm_up_and_rejects_a_cosine_it_cannot_size():
    from lightning_hier.testing import WorkerFailed

    # the epoch has no length: a warm-up works (the full rate after it), a cosine over the fit cannot be sized
    for r in run_workers(_fit_scheduled, "none", devices=2, timeout=60):  # the rate after each rank's own steps
        assert r["lr"] == pytest.approx(0.05 * min(1.0, (r["steps"] + 1) / 5)), r
    with pytest.raises(WorkerFailed, match=r"GrawaStrategy: a training batch was fetched before set-up.*OneCycleLR"):
        run_workers(_fit_scheduled, "cosine", devices=2, timeout=60)
