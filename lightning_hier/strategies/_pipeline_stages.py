"""The part of the decoupled strategy that keeps a model cut into pipeline stages whole to the outside.

Each rank of :class:`~lightning_hier.strategies.decoupled.DecoupledStrategy` holds one stage of
the LightningModule's network during fit. This base class makes that invisible to everything
but the training step: validation runs the staged forward (every stage gets the last stage's
output), the end of fit puts the whole model back on every rank, and checkpoints hold the whole
ordinary model (a resumed run keeps only its stage's entries).

- **Checkpoints.** Every rank's stage, optimizer, RNG and counters are gathered into the file (the
  base class); its ``state_dict`` is the whole ordinary model assembled from the stages, which
  loads into the unsharded LightningModule.
- **After fit** every rank holds the whole model again (each stage broadcast by its owner), so
  ``trainer.validate/test/predict`` and the weights returned by spawn/fork are ordinary; outside
  fit the strategy runs plain data parallelism over all ranks (no pipeline).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from typing_extensions import override

from lightning_hier.algorithms.decoupled import DecoupledPipeline, IterationReport
from lightning_hier.strategies import _pipeline_model as pm
from lightning_hier.strategies._base import HierStrategy
from lightning_hier.strategies._inter_node import InterNodeLevel

log = logging.getLogger(__name__)


class PipelineStagesStrategy(HierStrategy):
    """A :class:`HierStrategy` whose ranks each hold one stage of the module (``self._cut``) during fit."""

    pipeline: DecoupledPipeline | None = None
    _cut: pm.CutModel | None = None
    _split: tuple[int, ...] | None = None  # the cut in use (kept after fit: optimizer states follow it)
    _missing_on_load: list[str]
    _example_input: Any = None
    inter_level: InterNodeLevel  # the cross-node level (off unless inter_node_every is set)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        if self._fitting():
            return super().distributed_sampler_kwargs
        # outside fit the whole model is on every rank: plain data parallelism over the world
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def _fitting(self) -> bool:
        module = self.lightning_module
        return module is not None and module._trainer is not None and module.trainer.state.fn == TrainerFn.FITTING

    def _drain(self) -> list[IterationReport]:
        """Apply every batch still in flight (the subclass runs the pipeline)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ evaluation and the end of fit
    @contextmanager
    @override
    def _consensus(self) -> Iterator[None]:
        with self.inter_level.consensus():  # the mean of the nodes' stages, when they drift apart
            if self._cut is None or self.pipeline is None or len(self.pipeline.ranks) == 1:
                yield  # one stage holds the whole network: its ordinary forward is the staged one
                return
            module = self.lightning_module
            assert module is not None
            container = self._cut.container
            target = container if isinstance(container, nn.Sequential) else module
            with pm.forward_replaced(target, self.pipeline.forward_eval):
                yield

    @override
    def _finalize_algorithm(self) -> None:
        if self._cut is None or self.pipeline is None:
            return
        if self.pipeline.in_flight:  # fit stopped mid-epoch
            self._drain()
        self.inter_level.finalize()  # every node's stage takes the consensus before the stages are joined
        self.inter_level.algorithm = None  # its buckets are this fit's stage
        pm.reassemble(self._cut, self.root_device, self.pipeline.ranks, self.groups.pipe)
        self.lightning_module.example_input_array = self._example_input  # type: ignore[union-attr]
        self._cut, self.pipeline = None, None

    # ------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The whole ordinary model, assembled from the stages of replica 0 (a collective)."""
        if self._cut is None or self.pipeline is None:
            return super().lightning_module_state_dict()
        with self.inter_level.consensus():  # a collective across nodes: every rank enters it
            if self.topology.coords(self.global_rank).data != 0:
                return {}  # only rank 0's copy is written
            state = pm.gather_state_dict(self._cut, self.pipeline.ranks, self.groups.pipe)
        return state if state is not None else {}

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        if self._restored is None:
            return super().load_model_state_dict(checkpoint, strict)
        # resuming: this rank's saved state holds its own stage only; the cut in setup() drops the rest
        module = self.lightning_module
        assert module is not None
        missing, unexpected = module.load_state_dict(self._restored["model"], strict=False)
        if unexpected:
            raise ValueError(f"DecoupledStrategy: the checkpoint has entries this model lacks: {unexpected[:5]}.")
        self._missing_on_load = list(missing)

    @override
    def _algorithm_state(self) -> dict[str, Any]:
        split = {"split": list(self._split)} if self._split is not None else {}
        if self.pipeline is None:
            return split  # after fit: the whole model, but the optimizer still holds this stage only
        if self.pipeline.in_flight:
            log.warning(
                "DecoupledStrategy: checkpoint taken with batches in flight (mid-epoch); they are not saved, so a "
                "run resumed from it skips their updates. Epoch-end checkpoints are exact."
            )
        return {**split, "pipeline": self.pipeline.state_dict(), **self.inter_level.state_dict()}

    @override
    def _load_algorithm_state(self, state: dict[str, Any]) -> None:
        if self.pipeline is not None and "pipeline" in state:
            self.pipeline.load_state_dict(state["pipeline"])
        self.inter_level.load_state_dict(state)
