"""A spawned rank ends cleanly after a fit whose last collective is a user's, in ``on_train_end``.

Spawned children used to leave through the interpreter's finalization with the process groups'
gloo worker threads still running. The worker that completed the last collective (here the
``all_gather`` of :class:`~tests.user_models.SameWeightsOnEveryRank`) wakes the main thread,
then drops the finished work; dropping it takes the GIL (it releases tensors Python also holds),
and a thread that takes the GIL after finalization began dies through ``pthread_exit``, which
``std::terminate`` s the process: "terminate called without an active exception", SIGABRT,
although the fit succeeded. It takes a loaded machine (the worker gets the CPU late): reported in
2 of 38 spawn fits, seen in none of about 270 plain fits on a quieter one.

:class:`StarveGlooWorkers` makes that scheduling the rule instead of the exception: each rank
runs on one CPU and its gloo worker threads are ``SCHED_IDLE``, so they run only while the rank's
other threads are blocked. Without the fix 36 of 57 such fits (these three strategies) died of
SIGABRT, so the 6 fits here miss a regression with probability about 0.37^6, 0.3 %.
"""

from __future__ import annotations

import os
import sys

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback

import lightning_hier  # noqa: F401  (registers the strategy names)
from tests.helpers import trainer
from tests.user_models import SameWeightsOnEveryRank, UserModule

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not sys.platform.startswith("linux") or not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling classes"
    ),
]

GLOO_WORKER = "pt_gloo_runloop"  # the name torch gives ProcessGroupGloo's worker threads


class StarveGlooWorkers(Callback):
    """Pin each rank to one CPU and give its gloo worker threads the CPU only when nothing else of it runs.

    Applied again when training starts: groups built in the strategy's ``setup`` (the parameter
    server's service group) have their own workers.
    """

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        _starve_gloo_workers(trainer.global_rank)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _starve_gloo_workers(trainer.global_rank)


def _starve_gloo_workers(rank: int) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    cpu = cpus[rank % len(cpus)]
    for task in os.listdir("/proc/self/task"):
        tid = int(task)
        try:
            os.sched_setaffinity(tid, {cpu})
            with open(f"/proc/self/task/{tid}/comm") as comm:
                if comm.read().strip() == GLOO_WORKER:
                    os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except OSError:  # the thread ended meanwhile
            pass


@pytest.mark.parametrize("attempt", range(2))
@pytest.mark.parametrize("name", ["softsync_spawn", "ddp_powersgd_spawn", "localsgd_spawn"])
def test_spawned_ranks_end_cleanly_after_a_collective_in_on_train_end(name, attempt):
    torch.manual_seed(attempt)
    t = trainer(
        strategy=name,
        max_epochs=1,
        limit_train_batches=4,
        limit_val_batches=0,
        callbacks=[StarveGlooWorkers(), SameWeightsOnEveryRank()],
    )
    t.fit(UserModule())  # a rank killed by SIGABRT raises ProcessExitedException here
    assert t.state.finished
