"""Run a periodic rule on Lightning's own ``ddp`` strategy: an existing DDP project changes one line.

::

    trainer = pl.Trainer(strategy="ddp", callbacks=[OnDDP(HPSGDSync(window=8))])
    trainer = pl.Trainer(strategy="ddp", callbacks=[OnDDP(AveragingSync.localsgd(tau=8))])
    trainer = pl.Trainer(strategy="ddp", callbacks=[OnDDP(AveragingSync.grawa(variant="layer", tau=16))])

:class:`OnDDP` turns DDP's per-step gradient all-reduce off, as torch's PostLocalSGD hook does after
its warm-up (a communication hook that hands each bucket back unreduced), and drives the rule from
the optimizers' step hooks: the same :class:`~lightning_hier.sync.HPSGDSync` or
:class:`~lightning_hier.sync.AveragingSync` object a registered strategy (``hpsgd``, ``localsgd``,
``grawa``) holds, with the same result (tested to 1e-6). Validation during fit, the checkpoints'
``state_dict`` and the model after fit hold the rule's consensus model, equal on every rank.

What the strategy form adds: every rank's own state in its checkpoints (here, as with any callback
on DDP, a resume starts every rank from the saved consensus model, and the rule anew), two-level
synchronisation, GRAWA's probe on a fresh batch (here its rounds weigh each step's own gradients)
and asynchronous rounds. The rules that need their own sampler or launcher (DBS's shares, the
parameter servers, the decoupled pipeline, the grid) run as strategies only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_hier.callbacks.fit_end import ends_after_this_batch
from lightning_hier.comm import CommStats
from lightning_hier.comm.ddp_hooks import local_gradients
from lightning_hier.sync import AveragingSync, HPSGDSync, Sync
from lightning_hier.sync.base import Binding
from lightning_hier.topology import Topology

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.utils.hooks import RemovableHandle


class OnDDP(Callback):
    """A periodic rule on Lightning's ``ddp``, in place of its per-step gradient all-reduce (module docstring).

    Args:
        sync: :class:`~lightning_hier.sync.HPSGDSync`, or a flat :class:`~lightning_hier.sync.AveragingSync`
            with lock-step rounds (Local SGD, EASGD, LSGD, GRAWA with each step's gradients).

    Raises:
        ValueError: Another rule, two levels, asynchronous rounds or a GRAWA probe (at construction);
            another strategy than Lightning's DDP (when the fit is set up).
    """

    def __init__(self, sync: Sync) -> None:
        owner = type(self).__name__
        if not isinstance(sync, HPSGDSync | AveragingSync):
            raise ValueError(
                f"{owner}: argument `sync` must be an HPSGDSync or an AveragingSync, got {type(sync).__name__}: "
                "DBS's shares, the parameter servers, the pipeline and the grid need their own strategy."
            )
        if sync.levels.enabled or (isinstance(sync, AveragingSync) and sync.rounds == "async"):
            raise ValueError(
                f"{owner}: two-level synchronisation and asynchronous rounds need the strategy's own groups and "
                "server; use the registered strategy (hpsgd, localsgd, grawa) instead."
            )
        if isinstance(sync, AveragingSync) and sync.norms is not None:
            raise ValueError(
                f"{owner}: GRAWA's probe re-runs training_step inside the strategy; on DDP the rounds weigh each "
                "step's own gradients: build it without `norms` (AveragingSync.grawa(...))."
            )
        self.sync = sync
        self.stats = CommStats()
        self._handles: list[RemovableHandle] = []
        self._finished = False
        self._in_consensus: Any = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if not isinstance(strategy, DDPStrategy) or getattr(strategy, "_ddp_comm_hook", None) is not None:
            raise ValueError(
                f"{type(self).__name__} runs on Lightning's own DDP strategy (strategy='ddp', 'ddp_spawn', ...) "
                f"without a communication hook, but the Trainer uses {type(strategy).__name__}."
            )

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        ddp = trainer.strategy.model
        assert isinstance(ddp, DistributedDataParallel), "Lightning's DDP wraps the model before on_fit_start"
        ddp.register_comm_hook(None, local_gradients)  # no gradient all-reduce: the rule synchronises
        strategy = trainer.strategy
        timeout = getattr(strategy, "_timeout", None) or dist.default_pg_timeout
        groups = Topology(world_size=trainer.world_size, num_nodes=trainer.num_nodes).build(trainer.global_rank)
        callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning, not declared
        binding = Binding(pl_module, trainer.optimizers, groups, self.stats, timeout, callbacks=callbacks)
        self.sync.bind(binding)
        self._handles = [opt.register_step_post_hook(self._after_step) for opt in trainer.optimizers]
        self._finished = False

    def _after_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        self.sync.after_step(optimizer)
        self._finished = False

    def _finish(self) -> None:
        if not self._finished:
            with torch.inference_mode(False):
                self.sync.finalize()
            self._finished = True

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if ends_after_this_batch(trainer):  # the last step of fit: user hooks and checkpoints see the consensus
            self._finish()

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or not self._handles:
            return
        self._in_consensus = self.sync.consensus()
        self._in_consensus.__enter__()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._in_consensus is not None:
            self._in_consensus.__exit__(None, None, None)
            self._in_consensus = None

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if not self._handles or self._in_consensus is not None:
            return  # not training, or inside validation: the module holds the consensus already
        with self.sync.consensus():  # a collective: every rank saves
            checkpoint["state_dict"] = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish()  # a stop nobody predicted (early stopping): a no-op when already finished
        for handle in self._handles:
            handle.remove()
        self._handles = []
