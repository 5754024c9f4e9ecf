"""A rule on Lightning's own ``ddp`` (``OnDDP``) equals its strategy form; what it does not take, it refuses.

On 2 gloo ranks, with the same model, shards, optimizer and seed, ``Trainer(strategy="ddp",
callbacks=[OnDDP(rule)])`` ends with the same parameters on every rank as the registered strategy
holding that rule (to 1e-6): DDP's per-step gradient all-reduce is off, the rule runs on the
optimizer's steps, and every rank holds the consensus when the fit ends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from lightning_hier import GrawaStrategy, HPSGDStrategy, LocalSGDStrategy
from lightning_hier.callbacks import OnDDP
from lightning_hier.sync import AveragingSync, HPSGDSync, Levels, ShareWeightedGradients, SpeedShares
from lightning_hier.testing import WorkerFailed, run_workers
from tests.helpers import flat_params, trainer
from tests.integration.test_plain_loop import EPOCHS, _Sharded
from tests.user_models import SameWeightsOnEveryRank

CASES: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
    "hpsgd": (lambda: HPSGDStrategy(window=3, timeout=30), lambda: HPSGDSync(window=3)),
    "localsgd": (lambda: LocalSGDStrategy(tau=4, timeout=30), lambda: AveragingSync.localsgd(tau=4)),
    "lgrawa": (
        lambda: GrawaStrategy(variant="layer", tau=4, probe="step", timeout=30),
        lambda: AveragingSync.grawa(variant="layer", tau=4),
    ),
}


def _fit(strategy: Any, callbacks: list[Any]) -> torch.Tensor:
    torch.manual_seed(0)
    model = _Sharded()
    callbacks = [*callbacks, SameWeightsOnEveryRank()]
    t = trainer(strategy=strategy, max_epochs=EPOCHS, use_distributed_sampler=False, callbacks=callbacks)
    t.fit(model)
    return flat_params(model)


def _strategy_form(name: str) -> torch.Tensor:
    return _fit(CASES[name][0](), [])


def _on_ddp(name: str) -> torch.Tensor:
    return _fit("ddp", [OnDDP(CASES[name][1]())])


@pytest.mark.parametrize("name", list(CASES))
def test_a_rule_on_lightnings_ddp_equals_its_strategy(name):
    strategy = run_workers(_strategy_form, name, devices=2)
    on_ddp = run_workers(_on_ddp, name, devices=2)
    for rank in range(2):
        torch.testing.assert_close(on_ddp[rank], strategy[rank], atol=1e-6, rtol=0)


def test_plain_ddp_differs_so_the_hook_is_off():
    ddp = run_workers(_fit, "ddp", [], devices=2)
    on_ddp = run_workers(_on_ddp, "localsgd", devices=2)
    assert not torch.allclose(ddp[0], on_ddp[0], atol=1e-4)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: ShareWeightedGradients(SpeedShares()), "need their own strategy"),
        (lambda: HPSGDSync(levels=Levels("X", inter_node_every=2)), "two-level synchronisation"),
        (lambda: AveragingSync.grawa(rounds="async"), "asynchronous rounds"),
    ],
)
def test_rules_that_need_their_own_strategy_are_refused_at_construction(make, message):
    with pytest.raises(ValueError, match=message):
        OnDDP(make())


def test_another_strategy_than_ddp_is_refused_when_the_fit_is_set_up():
    with pytest.raises(WorkerFailed, match="OnDDP runs on Lightning's own DDP strategy"):
        run_workers(_fit, HPSGDStrategy(timeout=30), [OnDDP(HPSGDSync())], devices=2)
