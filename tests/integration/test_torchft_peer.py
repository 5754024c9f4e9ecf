"""torchft's LocalSGD and DiLoCo under a real Trainer (gloo, forked ranks, a real lighthouse and managers).

torchft's algorithms are checked against this library's own ``localsgd`` and ``diloco``, whose
math is proven against single-process references elsewhere: with the same seed, data split and
period, every replica's parameters after every step must agree to round-off. A test that fails
when torchft's hook never synchronises (replicas drift apart) or synchronises at other steps.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.demos.boring_classes import BoringModel

pytest.importorskip("torchft")

from lightning_hier import DiLoCoStrategy, LocalSGDStrategy, TorchftStrategy
from lightning_hier.testing import run_workers
from tests.helpers import ParamRecorder, digits, digits_classifier, trainer

PERIOD = 3


def _fit(strategy: Any, steps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    module = digits_classifier(hidden=(16,), lr=0.1, momentum=0.9)
    rec = ParamRecorder()
    t = trainer(strategy=strategy, callbacks=[rec], max_steps=steps)
    t.fit(module, datamodule=digits(batch_size=32))
    final = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    return {"steps": rec.steps, "params": rec.params, "final": final, "comm": t.strategy.comm_stats.state_dict()}


def _assert_same_trajectory(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> None:
    for mine, other in zip(ours, theirs, strict=True):
        assert mine["steps"] == other["steps"]
        for a, b in zip(mine["params"], other["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(mine["final"], other["final"], rtol=1e-5, atol=1e-6)


def _replicas_agree(ranks: list[dict[str, Any]]) -> list[bool]:
    return [torch.equal(a, b) for a, b in zip(ranks[0]["params"], ranks[1]["params"], strict=True)]


def test_torchft_local_sgd_averages_every_period_like_localsgd_and_once_more_at_the_end():
    steps = 3 * PERIOD + 1  # the last step is past a synchronisation: averaged at the end of fit
    ft = run_workers(_fit, TorchftStrategy("local_sgd", sync_every=PERIOD, timeout=60), steps, timeout=180)
    ref = run_workers(_fit, LocalSGDStrategy(tau=PERIOD, timeout=60), steps, timeout=180)
    # the end-of-fit averaging runs right after the last optimizer step, before its batch ends
    assert _replicas_agree(ft) == [step % PERIOD == 0 or step == steps for step in range(1, steps + 1)]
    _assert_same_trajectory(ft, ref)
    torch.testing.assert_close(ft[0]["final"], ft[1]["final"], rtol=0, atol=0)
    # 4 synchronisations (3 in the loop, 1 at the end), each a float32 all-reduce of every tensor (4)
    words = ft[0]["final"].numel()
    assert ft[0]["comm"]["bytes"] == 4 * words * 4 and ft[0]["comm"]["calls"] == 4 * 4


def test_torchft_diloco_takes_the_outer_nesterov_step_of_diloco():
    steps = 3 * PERIOD
    args = {"outer_lr": 0.7, "outer_momentum": 0.9, "timeout": 60}
    ft = run_workers(_fit, TorchftStrategy("diloco", sync_every=PERIOD, **args), steps, timeout=180)
    ref = run_workers(_fit, DiLoCoStrategy(window=PERIOD, **args), steps, timeout=180)
    assert _replicas_agree(ft) == [step % PERIOD == 0 for step in range(1, steps + 1)]
    _assert_same_trajectory(ft, ref)
    # and it is not Local SGD: the outer momentum moves the global model past the replicas' mean
    plain = run_workers(_fit, LocalSGDStrategy(tau=PERIOD, timeout=60), steps, timeout=180)
    assert not torch.allclose(ft[0]["params"][2 * PERIOD - 1], plain[0]["params"][2 * PERIOD - 1], atol=1e-4)


def test_registry_names_build_torchft_strategies():
    import lightning.pytorch as pl

    for name, algorithm in (("torchft_local_sgd", "local_sgd"), ("torchft_diloco", "diloco")):
        for suffix, method in (("", "popen"), ("_spawn", "spawn"), ("_fork", "fork")):
            t = pl.Trainer(strategy=name + suffix, accelerator="cpu", devices=2, logger=False)
            assert type(t.strategy) is TorchftStrategy
            assert (t.strategy.sync.algorithm, t.strategy._start_method) == (algorithm, method)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"algorithm": "streaming"}, r"`algorithm` must be one of .*'local_sgd', 'diloco'.*got 'streaming'"),
        ({"sync_every": 0}, r"`sync_every` must be .*>= 1.*got 0"),
        ({"algorithm": "diloco", "outer_momentum": 1.0}, r"`outer_momentum` must be .*got 1\.0"),
        ({"fault_tolerance": True, "start_method": "fork"}, r"fault_tolerance.*torchft's own fault tolerance"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TorchftStrategy(**kwargs)


QUIET_FIT = """
import lightning.pytorch as pl
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning_hier import TorchftStrategy

trainer = pl.Trainer(strategy=TorchftStrategy(sync_every=2, start_method="fork"), accelerator="cpu", devices=2,
                     max_steps=6, logger=False, enable_progress_bar=False, enable_checkpointing=False)
trainer.fit(BoringModel())
"""


@pytest.mark.parametrize(("rust_log", "shown"), [(None, False), ("info", True)])
def test_torchfts_servers_log_only_warnings_unless_rust_log_says_otherwise(rust_log, shown):
    env = {k: v for k, v in os.environ.items() if k != "RUST_LOG"}
    if rust_log is not None:
        env["RUST_LOG"] = rust_log
    done = subprocess.run([sys.executable, "-c", QUIET_FIT], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("[INFO] [torchft::lighthouse]" in done.stderr) == shown  # a quorum per synchronisation at INFO


class FailOnRank1(Callback):
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_rank == 1 and trainer.global_step == 5:
            raise RuntimeError("injected failure on rank 1")


@pytest.mark.parametrize("algorithm", ["local_sgd", "diloco"])
def test_a_failed_rank_ends_the_run_without_waiting_out_torchfts_quorum(algorithm):
    """Rank 0 waits in the quorum of step 8 when rank 1 fails: it must not stay for the quorum's timeout."""
    strategy = TorchftStrategy(algorithm, sync_every=4, start_method="fork", timeout=120)
    start = time.monotonic()
    with pytest.raises(Exception, match="injected failure on rank 1"):
        trainer(strategy=strategy, max_steps=40, callbacks=[FailOnRank1()]).fit(BoringModel())
    assert time.monotonic() - start < 60, "a rank waited out torchft's quorum timeout (120 s)"
