"""Every registered strategy, by name at default arguments, on modules this project did not write.

A user sets ``strategy="..."`` in an existing project: Lightning's own ``BoringModel`` (one
``nn.Linear`` in ``self.layer``, dict outputs, bare-tensor batches), a module with its network
in ``self.model`` and no ``forward``, and a classifier with ``(x, y)`` batches and Nesterov SGD
must train under every name with the fork launcher, and every rank must hold the same whole model
when user ``on_train_end`` hooks run (a collective inside such a hook must work too). The
parameter-server strategies, which copy the user's optimizer onto the server, also train with AdamW.
"""

from __future__ import annotations

import importlib.util

import lightning.pytorch as pl
import pytest
import torch

import lightning_hier  # noqa: F401  (registers the strategy names)
from lightning_hier import GrawaStrategy
from tests.helpers import flat_params, trainer
from tests.user_models import BoringModel, SameWeightsOnEveryRank, UserClassifier, UserModule

# every name a user can pass; the `_fork` variant of each is what runs here
NAMES = (
    "localsgd",
    "easgd",
    "lsgd",
    "grawa",
    "mgrawa",
    "lgrawa",
    "hpsgd",
    "diloco",
    "dbs",
    "decoupled",
    "grid2d",
    "asgd",
    "softsync",
    "dbs_async",
    "dbs_hpsgd",
    "dbs_localsgd",
    "ddp_post_local_sgd",
    "ddp_powersgd",
    "ddp_fp16",
    "torchft_local_sgd",
    "torchft_diloco",
)
NEEDS_TORCHFT = pytest.mark.skipif(
    importlib.util.find_spec("torchft") is None,
    reason="torchft is not installed (pip install 'lightning-hier[torchft]')",
)
PARAMS = [pytest.param(n, marks=NEEDS_TORCHFT) if n.startswith("torchft_") else n for n in NAMES]
MODULES = {"BoringModel": BoringModel, "UserModule": UserModule, "UserClassifier": UserClassifier}


def test_every_registered_name_is_covered():
    from lightning.pytorch.strategies import StrategyRegistry

    ours = {n.removesuffix("_fork") for n in StrategyRegistry.available_strategies() if n.endswith("_fork")}
    assert ours - {"ddp"} == set(NAMES)


@pytest.mark.parametrize("module", list(MODULES))
@pytest.mark.parametrize("name", PARAMS)
def test_strategy_trains_a_users_module_at_default_arguments(name, module):
    torch.manual_seed(0)
    model: pl.LightningModule = MODULES[module]()
    before = flat_params(model)
    # raises inside the fit when the ranks differ
    t = trainer(strategy=f"{name}_fork", max_epochs=2, limit_val_batches=0, callbacks=[SameWeightsOnEveryRank()])
    t.fit(model)
    after = flat_params(model)  # rank 0's finished model, returned by the fork launcher
    assert after.shape == before.shape and torch.isfinite(after).all() and not torch.equal(after, before)


@pytest.mark.parametrize("module", list(MODULES))
@pytest.mark.parametrize("variant", ["model", "layer"])
def test_async_grawa_trains_a_users_module_at_default_arguments(variant, module):
    """``mgrawa`` / ``lgrawa`` with ``rounds='async'`` (an argument, not a name) on the same modules."""
    torch.manual_seed(0)
    model: pl.LightningModule = MODULES[module]()
    before = flat_params(model)
    strategy = GrawaStrategy(variant=variant, rounds="async", start_method="fork")
    t = trainer(strategy=strategy, max_epochs=2, limit_val_batches=0, callbacks=[SameWeightsOnEveryRank()])
    t.fit(model)
    after = flat_params(model)
    assert after.shape == before.shape and torch.isfinite(after).all() and not torch.equal(after, before)


class _AdamWModule(UserModule):
    """The user's module with AdamW, whose ``defaults`` hold a key its constructor does not take."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01)


@pytest.mark.parametrize("name", ["asgd", "softsync", "dbs_async"])
def test_parameter_server_strategies_train_a_users_module_with_adamw(name):
    """The server holds a copy of the user's optimizer: AdamW's must build (it failed before)."""
    torch.manual_seed(0)
    model = _AdamWModule()
    before = flat_params(model)
    t = trainer(strategy=f"{name}_fork", max_epochs=1, limit_val_batches=0, callbacks=[SameWeightsOnEveryRank()])
    t.fit(model)
    after = flat_params(model)
    assert torch.isfinite(after).all() and not torch.equal(after, before)
