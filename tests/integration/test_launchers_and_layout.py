"""Registry names, the three launchers, simulated multi-node layouts and argument checks."""

import os
import signal

import lightning.pytorch as pl
import pytest
import torch

import lightning_hier
from lightning_hier import STRATEGIES, HierStrategy, LocalSGDStrategy
from lightning_hier.testing import run_workers
from tests.helpers import digits, digits_classifier, flat_params, trainer


@pytest.mark.parametrize("cls", STRATEGIES)
@pytest.mark.parametrize(("suffix", "method"), [("", "popen"), ("_spawn", "spawn"), ("_fork", "fork")])
def test_registry_names_resolve_in_the_trainer(cls, suffix, method):
    t = pl.Trainer(strategy=cls.strategy_name + suffix, accelerator="cpu", devices=2, logger=False)
    assert type(t.strategy) is cls
    assert t.strategy._start_method == method


def test_fork_launcher_returns_the_consensus_model_to_the_main_process():
    module = digits_classifier()
    t = trainer(strategy="localsgd_fork", max_epochs=2)
    t.fit(module, datamodule=digits(batch_size=64))
    assert t.callback_metrics["train/loss"] < 2.0
    assert torch.isfinite(flat_params(module)).all()


def test_spawn_launcher_fits():
    module = digits_classifier()
    t = trainer(strategy=LocalSGDStrategy(tau=2, start_method="spawn", timeout=60), max_epochs=1)
    t.fit(module, datamodule=digits(batch_size=64))
    assert "train/loss" in t.callback_metrics


def _two_nodes() -> dict:
    t = trainer(strategy=LocalSGDStrategy(tau=2, timeout=30), devices=2, num_nodes=2, max_epochs=1)
    module = digits_classifier()
    dm = digits(batch_size=32)
    t.fit(module, datamodule=dm)
    sampler = t.train_dataloader.sampler
    groups = t.strategy.groups
    return {
        "ranks": (t.global_rank, t.local_rank, t.node_rank, t.world_size),
        "sampler": (sampler.num_replicas, sampler.rank),
        "kwargs": t.strategy.distributed_sampler_kwargs,
        "node_group": torch.distributed.get_process_group_ranks(groups.node),
        "levels": [torch.distributed.get_process_group_ranks(g) for g in (groups.data_intra, groups.data_inter)],
        "data_group_is_world": groups.data is torch.distributed.group.WORLD,
        "params": flat_params(module),
    }


def test_two_nodes_by_two_processes_layout():
    out = run_workers(_two_nodes, devices=2, num_nodes=2)
    assert [o["ranks"] for o in out] == [(0, 0, 0, 4), (1, 1, 0, 4), (2, 0, 1, 4), (3, 1, 1, 4)]
    assert [o["sampler"] for o in out] == [(4, 0), (4, 1), (4, 2), (4, 3)]
    assert [o["kwargs"] for o in out] == [{"num_replicas": 4, "rank": r} for r in range(4)]
    assert [o["node_group"] for o in out] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [o["levels"] for o in out] == [[[0, 1], [0, 2]], [[0, 1], [1, 3]], [[2, 3], [0, 2]], [[2, 3], [1, 3]]]
    assert all(o["data_group_is_world"] for o in out)
    assert all(torch.equal(o["params"], out[0]["params"]) for o in out)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tau": 0}, r"LocalSGDStrategy: argument `tau` must be an integer >= 1, got 0"),
        ({"tau": 2.5}, "`tau` must be an integer"),
        ({"timeout": 0}, r"`timeout` must be a finite number in \[0.001"),
        ({"timeout": float("inf")}, "`timeout`"),
        ({"init_timeout": -1}, r"`init_timeout` must be a finite number in \[0.001"),
        ({"start_method": "threads"}, r"`start_method` must be one of 'popen', 'spawn', 'fork', got 'threads'"),
        ({"process_group_backend": "ucc"}, "`process_group_backend`"),
        ({"bucket_size_mb": 0}, "`bucket_size_mb`"),
        ({"sync_buffers": "yes"}, "`sync_buffers` must be True or False"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LocalSGDStrategy(**kwargs)


class _ThreeStages(HierStrategy):
    strategy_name = ""

    def _layout(self) -> dict[str, int]:
        return {"pipe": 3}


def test_bad_layout_fails_when_the_trainer_is_built_before_any_process_starts():
    with pytest.raises(ValueError, match="world size 2 is not divisible by pipe x model = 3 x 1"):
        pl.Trainer(strategy=_ThreeStages(), accelerator="cpu", devices=2, logger=False)


def test_package_import_registers_names():
    from lightning.pytorch.strategies import StrategyRegistry

    lightning_hier.register_all()  # idempotent
    assert {"localsgd", "localsgd_spawn", "localsgd_fork"} <= set(StrategyRegistry)


class _SignalMainProcess(pl.Callback):
    """Rank 0 sends SIGINT to the main process (its parent, with fork) at the second step."""

    def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_rank == 0 and trainer.global_step == 1:
            os.kill(os.getppid(), signal.SIGINT)


def test_a_signal_the_main_process_ignores_is_not_forwarded():
    # a job started with `&` or nohup ignores SIGINT; the fork launcher keeps it that way
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        t = trainer(strategy="localsgd_fork", max_steps=4, callbacks=[_SignalMainProcess()])
        t.fit(digits_classifier(), datamodule=digits(batch_size=64))
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
    assert t.state.finished  # trained to max_steps; a forwarded SIGINT would have interrupted it
