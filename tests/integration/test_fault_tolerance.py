"""Fault-tolerant Local SGD under a real Trainer: ``kill -9`` of a replica, the others go on, a restart rejoins.

Three forked replicas over gloo; replica 1 kills itself (SIGKILL) after a chosen number of steps.
The final model must equal the single-process reference of the membership sequence the run
logged (:mod:`tests.fault_tolerance_reference`) to 1e-6, and every replica must end equal.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_hier.strategies import (
    DiLoCoStrategy,
    FaultTolerance,
    GrawaStrategy,
    HPSGDStrategy,
    LocalSGDStrategy,
)
from tests.fault_tolerance_reference import simulate, simulate_hpsgd
from tests.helpers import flat_params, trainer

ROOT = Path(__file__).resolve().parents[2]
REPLICAS, SAMPLES, FEATURES, CLASSES, BATCH, TAU, EPOCHS = 3, 240, 6, 3, 8, 4, 2
STEPS_PER_EPOCH = SAMPLES // REPLICAS // BATCH  # 10


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    return TensorDataset(x, (x[:, :CLASSES].argmax(1)))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, CLASSES))


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)


class _Net(pl.LightningModule):
    """A user's module (its network under ``body``) that kills its own replica after ``kill_after`` steps."""

    def __init__(self, kill_replica: int, kill_after: int, in_round: bool = False, step_s: float = 0.0) -> None:
        super().__init__()
        self.body = _model()
        self.kill_replica, self.kill_after, self.in_round = kill_replica, kill_after, in_round
        self.step_s = step_s  # a slower step: a restart that takes seconds comes back during training

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        fault = self.trainer.strategy.fault_tolerance
        doomed = self.global_rank == self.kill_replica and fault is not None and fault.incarnation == 0
        if doomed and self.in_round and self.trainer.global_step == self.kill_after - 1:
            # step kill_after ends with a round: the replica arrives, is counted in, and dies in its collective
            algorithm = self.trainer.strategy.sync.algorithm
            round_of = "_act" if hasattr(algorithm, "_act") else "sync"  # DiLoCo's, the others'
            setattr(algorithm, round_of, lambda *_: os.kill(os.getpid(), signal.SIGKILL))
        elif doomed and not self.in_round and self.trainer.global_step == self.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(self.step_s)
        x, y = batch
        loss = nn.functional.cross_entropy(self.body(x), y)
        self.log("loss", loss, sync_dist=True)  # Lightning's collective: this replica's own value
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return _optimizer(self.body)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.body(x), y), sync_dist=True)


class _Record(Callback):
    """Each replica's final parameters and membership events, one file per replica."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # after the strategy's own end of training (its last admission); a replica admitted there
        # restores a finished loop, whose training hooks (on_train_end) do not run
        torch.save(flat_params(pl_module), self.out / f"replica{trainer.global_rank}.pt")
        fault = trainer.strategy.fault_tolerance
        events = fault.membership.events if fault.membership is not None else []
        (self.out / f"events{trainer.global_rank}.json").write_text(json.dumps(events))


def _fit(
    tmp_path: Path,
    kill_after: int,
    max_restarts: int,
    in_round: bool = False,
    cls: type = LocalSGDStrategy,
    kill_replica: int = 1,
    validation: dict[str, Any] | None = None,
    replica: dict[str, Any] | None = None,
    step_s: float = 0.0,
    init_timeout: float = 600.0,
    callbacks: tuple[Callback, ...] = (),
    **kwargs: Any,
) -> _Net:
    """A fit of every replica with the fork launcher, or (``replica``: its identity and coordinator) of one."""
    validation = validation or {}
    module = _Net(kill_replica=kill_replica, kill_after=kill_after, in_round=in_round, step_s=step_s)
    fault = FaultTolerance(max_restarts=max_restarts, dead_after_s=1.0, **(replica or {}))
    period = kwargs or {"tau": TAU}
    start_method, devices = ("popen", 1) if fault.external else ("fork", REPLICAS)
    strategy = cls(**period, start_method=start_method, timeout=60, init_timeout=init_timeout, fault_tolerance=fault)
    callbacks = (_Record(tmp_path), *callbacks)
    t = trainer(strategy=strategy, devices=devices, max_epochs=EPOCHS, callbacks=list(callbacks), **validation)
    t.fit(module, DataLoader(_data(), batch_size=BATCH), DataLoader(_data(), batch_size=BATCH) if validation else None)
    return module


def _slow_restarts(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Every restarted replica waits ``seconds`` before it connects (the forked replicas inherit the patch)."""
    connect = FaultTolerance.connect

    def slow_restart(self: FaultTolerance, *args: Any) -> None:
        if self.incarnation > 0:
            time.sleep(seconds)
        connect(self, *args)

    monkeypatch.setattr(FaultTolerance, "connect", slow_restart)


def _shard_batch(replica: int, epoch: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = _data()
    sampler = DistributedSampler(data, num_replicas=REPLICAS, rank=replica, shuffle=True, seed=0)  # Lightning's
    sampler.set_epoch(epoch)
    rows = list(sampler)[index * BATCH : (index + 1) * BATCH]
    return data.tensors[0][rows], data.tensors[1][rows]


def _reference(
    events: list[dict[str, object]], killed: dict[int, int], outer: tuple[float, float] | None = None
) -> list[torch.Tensor]:
    models = simulate(_model, _optimizer, _shard_batch, REPLICAS, TAU, STEPS_PER_EPOCH, EPOCHS, events, killed, outer)
    return [flat_params(m) for m in models]


@pytest.mark.parametrize(
    ("kill_after", "validation"),
    [(6, None), (9, {"num_sanity_val_steps": 2, "val_check_interval": 5})],  # consensus: validation during fit
)
def test_a_killed_replica_restarts_rejoins_and_the_model_equals_the_reference(tmp_path, kill_after, validation):
    module = _fit(tmp_path, kill_after=kill_after, max_restarts=1, validation=validation)
    events = json.loads((tmp_path / "events0.json").read_text())
    left = [e for e in events if e.get("left")]
    joined = [e for e in events if e.get("joined")]
    assert [e["left"] for e in left] == [[1]] and [e["joined"] for e in joined] == [[1]], events
    # its steps since its last round are lost (Lightning's global_step during the round of step 4k is 4k - 1)
    assert left[0]["lost_since_step"] == (kill_after // TAU) * TAU - 1
    ends = [torch.load(tmp_path / f"replica{r}.pt", weights_only=True) for r in range(REPLICAS)]
    for end in ends[1:]:
        torch.testing.assert_close(end, ends[0], rtol=0, atol=1e-6)  # the restarted replica ends equal too
    reference = _reference(events, killed={1: kill_after})
    torch.testing.assert_close(flat_params(module.body), reference[0], rtol=0, atol=1e-6)
    assert not torch.equal(reference[0], _reference([], killed={})[0])  # the failure changed the result


def test_a_replica_killed_inside_a_round_has_the_round_undone_and_run_again_without_it(tmp_path):
    module = _fit(tmp_path, kill_after=8, max_restarts=1, in_round=True)
    events = json.loads((tmp_path / "events0.json").read_text())
    assert {"point": "1.0", "undone": True} in events  # the round of step 8 failed in its all-reduce
    assert next(e for e in events if e.get("left"))["point"] == "1.1"  # and ran again without replica 1
    reference = _reference(events, killed={1: 8})
    torch.testing.assert_close(flat_params(module.body), reference[0], rtol=0, atol=1e-6)


def test_grawa_trains_on_through_a_kill_and_the_restarted_replica_ends_with_the_others(tmp_path):
    _fit(tmp_path, kill_after=6, max_restarts=1, cls=GrawaStrategy)  # weights over the live replicas
    events = json.loads((tmp_path / "events0.json").read_text())
    assert [e["left"] for e in events if e.get("left")] == [[1]]
    assert [e["joined"] for e in events if e.get("joined")] == [[1]]
    ends = [torch.load(tmp_path / f"replica{r}.pt", weights_only=True) for r in range(REPLICAS)]
    for end in ends[1:]:
        torch.testing.assert_close(end, ends[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize(("kill_after", "in_round"), [(6, False), (8, True)])
def test_diloco_trains_on_through_a_kill_rejoins_and_equals_the_reference_with_its_outer_nesterov(
    tmp_path, kill_after, in_round
):
    module = _fit(tmp_path, kill_after=kill_after, max_restarts=1, in_round=in_round, cls=DiLoCoStrategy, window=TAU)
    events = json.loads((tmp_path / "events0.json").read_text())
    assert ({"point": "1.0", "undone": True} in events) == in_round  # its outer step undone, then run again
    assert [e["left"] for e in events if e.get("left")] == [[1]]
    assert [e["joined"] for e in events if e.get("joined")] == [[1]]
    ends = [torch.load(tmp_path / f"replica{r}.pt", weights_only=True) for r in range(REPLICAS)]
    for end in ends[1:]:
        torch.testing.assert_close(end, ends[0], rtol=0, atol=1e-6)
    reference = _reference(events, killed={1: kill_after}, outer=(0.7, 0.9))  # DiLoCo's defaults
    torch.testing.assert_close(flat_params(module.body), reference[0], rtol=0, atol=1e-6)
    assert not torch.allclose(reference[0], _reference(events, killed={1: kill_after})[0])  # the outer step mattered


@pytest.mark.parametrize("kill_after", [6, 11])
def test_hpsgd_drops_the_lost_window_rejoins_and_equals_the_reference(tmp_path, kill_after):
    module = _fit(tmp_path, kill_after=kill_after, max_restarts=1, cls=HPSGDStrategy, window=TAU)
    events = json.loads((tmp_path / "events0.json").read_text())
    leaves = {e["step"] + 1: tuple(e["world"]) for e in events if e.get("left")}  # during that step's merge
    joins = {e["step"]: tuple(e["joined"]) for e in events if e.get("joined")}  # after that step
    assert list(leaves.values()) == [(0, 2)] and list(joins.values()) == [(1,)], events
    ends = [torch.load(tmp_path / f"replica{r}.pt", weights_only=True) for r in range(REPLICAS)]
    for end in ends[1:]:
        torch.testing.assert_close(end, ends[0], rtol=0, atol=1e-6)
    reference = simulate_hpsgd(
        _model, _optimizer, _shard_batch, REPLICAS, TAU, STEPS_PER_EPOCH, EPOCHS, leaves, joins, {1: kill_after}
    )
    torch.testing.assert_close(flat_params(module.body), reference, rtol=0, atol=1e-6)


def test_replica_0_killed_at_the_last_step_still_hands_back_the_finished_model(tmp_path, monkeypatch):
    _slow_restarts(monkeypatch, 2.0)  # a restarted replica slower to start (imports, data) than the others to finish
    steps = STEPS_PER_EPOCH * EPOCHS
    module = _fit(tmp_path, kill_after=steps - 1, max_restarts=1, kill_replica=0)
    events = json.loads((tmp_path / "events1.json").read_text())
    assert [e["left"] for e in events if e.get("left")] == [[0]]
    assert [e["point"] for e in events if e.get("joined")] == [f"{steps // TAU}.final/admit"]  # after the last round
    reference = _reference(events, killed={0: steps - 1})
    torch.testing.assert_close(flat_params(module.body), reference[1], rtol=0, atol=1e-6)


def test_a_replica_back_before_the_last_round_joins_after_the_validation_that_follows_it(tmp_path):
    # the round of the last step is followed by the epoch's validation, which a joiner restored at
    # that step's end would not run as the others do: it joins at the end of training instead
    steps = STEPS_PER_EPOCH * EPOCHS
    validation = {"num_sanity_val_steps": 2, "val_check_interval": 5}
    module = _fit(tmp_path, kill_after=steps - 2, max_restarts=1, validation=validation)
    events = json.loads((tmp_path / "events0.json").read_text())
    assert [e["point"].endswith(".final/admit") for e in events if e.get("joined")] == [True]
    reference = _reference(events, killed={1: steps - 2})
    torch.testing.assert_close(flat_params(module.body), reference[0], rtol=0, atol=1e-6)


def test_without_restarts_the_others_finish_without_the_dead_replica(tmp_path):
    module = _fit(tmp_path, kill_after=5, max_restarts=0)
    events = json.loads((tmp_path / "events0.json").read_text())
    assert [e["left"] for e in events if e.get("left")] == [[1]]
    assert not any(e.get("joined") for e in events)
    assert not (tmp_path / "replica1.pt").exists()
    reference = _reference(events, killed={1: 5})
    torch.testing.assert_close(flat_params(module.body), reference[0], rtol=0, atol=1e-6)


class _HangAtTheEnd(Callback):
    """Replica 2 hangs once its fit is over (user code that deadlocks there, say)."""

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank == 2:
            time.sleep(3600)


def test_a_replica_still_running_init_timeout_after_the_others_finished_is_killed_and_the_fit_returns(tmp_path, caplog):
    # without the launcher's bound it would wait for that replica for ever
    module = _fit(tmp_path, kill_after=10**6, max_restarts=1, init_timeout=8, callbacks=(_HangAtTheEnd(),))
    assert (
        "replica 2 was still running init_timeout=8 s after another replica finished, after 0 restart(s)" in caplog.text
    )
    torch.testing.assert_close(flat_params(module.body), _reference([], killed={})[0], rtol=0, atol=1e-6)


def test_under_torchrun_each_replica_its_own_job_a_killed_one_is_restarted_rejoins_and_equals_the_reference(
    tmp_path,
):
    kill_after = 2
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "lightning_hier.coordinator", "--port", "0", "--linger-s", "1"],
        stdout=subprocess.PIPE,
        text=True,
    )
    jobs: list[subprocess.Popen[str]] = []
    try:
        address = coordinator.stdout.readline().split()[-1]  # type: ignore[union-attr]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
        torchrun += ["--max-restarts=1", "--monitor-interval=0.1", "-m", "tests.integration.torchrun_replica"]
        torchrun += [f"--coordinator={address}", f"--kill-after={kill_after}", f"--out={tmp_path}"]
        jobs += [
            subprocess.Popen(
                [*torchrun, f"--replica={i}"],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for i in range(REPLICAS)
        ]
        outputs = [job.communicate(timeout=120)[0] for job in jobs]
        for i, job in enumerate(jobs):
            assert job.returncode == 0, f"replica {i}:\n{outputs[i][-4000:]}"
        assert coordinator.wait(timeout=30) == 0  # it ends once training finished
    finally:
        for process in (*jobs, coordinator):
            process.kill()
    events = json.loads((tmp_path / "events0.json").read_text())
    assert [e["left"] for e in events if e.get("left")] == [[1]], events
    assert [e["joined"] for e in events if e.get("joined")] == [[1]], events  # in training, or at its end if late
    ends = [torch.load(tmp_path / f"replica{r}.pt", weights_only=True) for r in range(REPLICAS)]
    for end in ends[1:]:
        torch.testing.assert_close(end, ends[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(ends[0], _reference(events, killed={1: kill_after})[0], rtol=0, atol=1e-6)


def test_bad_fault_tolerance_arguments_are_refused_before_any_process_starts():
    with pytest.raises(ValueError, match=r"fault_tolerance.*start_method.*'popen'"):
        LocalSGDStrategy(fault_tolerance=True)
    with pytest.raises(ValueError, match=r"HPSGDStrategy: argument `fault_tolerance` cannot be used here: mode='poll'"):
        HPSGDStrategy(start_method="fork", mode="poll", fault_tolerance=True)
    with pytest.raises(ValueError, match=r"max_restarts"):
        FaultTolerance(max_restarts=-1)
    with pytest.raises(ValueError, match=r"fault_tolerance.*'yes'"):
        LocalSGDStrategy(start_method="fork", fault_tolerance="yes")
    with pytest.raises(ValueError, match=r"`coordinator` must be 'host:port'.*'localhost'"):
        FaultTolerance(coordinator="localhost", replica=0, replicas=2)
    with pytest.raises(ValueError, match=r"`coordinator` needs .*replica=None"):
        FaultTolerance(coordinator="localhost:29600", replicas=2)
    with pytest.raises(ValueError, match=r"`replica` must be .*got 2"):
        FaultTolerance(coordinator="localhost:29600", replica=2, replicas=2)
    with pytest.raises(ValueError, match=r"`replica` and `replicas` .* needs `coordinator`"):
        FaultTolerance(replica=0, replicas=2)
    external = {"coordinator": "localhost:29600", "replica": 0, "replicas": 2}
    with pytest.raises(ValueError, match=r"needs start_method='popen', got start_method='fork'"):
        LocalSGDStrategy(start_method="fork", fault_tolerance=external)
    with pytest.raises(ValueError, match=r"one process per replica .*got devices=2"):
        trainer(strategy=LocalSGDStrategy(fault_tolerance=external), devices=2)


def test_a_replica_back_many_rounds_later_rejoins_and_the_model_equals_the_reference(tmp_path, monkeypatch):
    _slow_restarts(monkeypatch, 1.5)  # a restart as slow as a torchrun job's, against steps of 20 ms: rounds go by
    module = _fit(tmp_path, kill_after=5, max_restarts=1, step_s=0.02)
    events = json.loads((tmp_path / "events0.json").read_text())
    left = next(e for e in events if e.get("left"))
    joined = next(e for e in events if e.get("joined"))
    assert joined["step"] - left["step"] >= 3 * TAU, events  # it was away for several rounds
    reference = _reference(events, killed={1: 5})
    torch.testing.assert_close(flat_params(module.body), reference[0], rtol=0, atol=1e-6)
