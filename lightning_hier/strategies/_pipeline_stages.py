"""The part of the decoupled strategy that keeps a model cut into pipeline stages whole to the outside.

Each rank of :class:`~lightning_hier.strategies.decoupled.DecoupledStrategy` holds one stage of
the LightningModule's network during fit. :class:`PipelineStages`, the strategy's ``sync`` object,
makes that invisible to everything but the training step: validation runs the staged forward
(every stage gets the last stage's output), the end of fit puts the whole model back on every rank,
and checkpoints hold the whole ordinary model (a resumed run keeps only its stage's entries).

- **Checkpoints.** Every rank's stage, optimizer, RNG and counters are gathered into the file (the
  base class); its ``state_dict`` is the whole ordinary model assembled from the stages, which
  loads into the unsharded LightningModule.
- **After fit** every rank holds the whole model again (each stage broadcast by its owner), so
  ``trainer.validate/test/predict`` and the weights returned by spawn/fork are ordinary; outside
  fit the strategy runs plain data parallelism over all ranks (no pipeline).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn
from typing_extensions import override

from lightning_hier.algorithms.decoupled import DecoupledPipeline, IterationReport
from lightning_hier.strategies import _pipeline_model as pm
from lightning_hier.strategies._inter_node import InterNodeLevel
from lightning_hier.sync.base import Sync

log = logging.getLogger(__name__)


class PipelineStages(Sync):
    """The pipeline's part of the adapter: the staged consensus, the end of fit, and the stages' state.

    :class:`~lightning_hier.strategies.decoupled.DecoupledStrategy` builds the pipeline when a fit
    is set up and hands it over with :meth:`start`; until then (and after fit) every hook is a
    no-op but for the cross-node level.

    Args:
        inter_level: The cross-node level (off unless ``inter_node_every`` is set).
    """

    lock_step = False  # the pipeline's own messages keep the stages together, not a per-step broadcast

    def __init__(self, inter_level: InterNodeLevel) -> None:
        self.owner = inter_level.owner
        self.inter_level = inter_level
        self.cut: pm.CutModel | None = None
        self.pipeline: DecoupledPipeline | None = None
        self.split: tuple[int, ...] | None = None  # the cut in use (kept after fit: optimizer states follow it)
        self._drain: Callable[[], list[IterationReport]] | None = None
        self._host: Any = None  # the strategy: its module, device and pipe group when the stages are joined
        self._example_input: Any = None

    def start(
        self,
        cut: pm.CutModel,
        pipeline: DecoupledPipeline,
        drain: Callable[[], list[IterationReport]],
        host: Any,
        example_input: Any,
    ) -> None:
        """A fit's pipeline: its cut, the pipeline, how to drain it, and the strategy that runs it."""
        self.cut, self.pipeline, self.split = cut, pipeline, cut.split
        self._drain, self._host, self._example_input = drain, host, example_input

    @contextmanager
    @override
    def consensus(self) -> Iterator[None]:
        with self.inter_level.consensus():  # the mean of the nodes' stages, when they drift apart
            if self.cut is None or self.pipeline is None or len(self.pipeline.ranks) == 1:
                yield  # one stage holds the whole network: its ordinary forward is the staged one
                return
            container = self.cut.container
            target = container if isinstance(container, nn.Sequential) else self._host.lightning_module
            with pm.forward_replaced(target, self.pipeline.forward_eval):
                yield

    @override
    def finalize(self) -> dict[str, float]:
        if self.cut is None or self.pipeline is None:
            return {}
        if self.pipeline.in_flight and self._drain is not None:  # fit stopped mid-epoch
            self._drain()
        self.inter_level.finalize()  # every node's stage takes the consensus before the stages are joined
        self.inter_level.algorithm = None  # its buckets are this fit's stage
        host = self._host
        pm.reassemble(self.cut, host.root_device, self.pipeline.ranks, host.groups.pipe)
        host.lightning_module.example_input_array = self._example_input
        self.cut, self.pipeline = None, None
        return {}

    def whole_state_dict(self, data_coordinate: int) -> dict[str, Any] | None:
        """The whole ordinary model, assembled from the stages of replica 0 (a collective); ``None`` after fit."""
        if self.cut is None or self.pipeline is None:
            return None
        with self.inter_level.consensus():  # a collective across nodes: every rank enters it
            if data_coordinate != 0:
                return {}  # only rank 0's copy is written
            state = pm.gather_state_dict(self.cut, self.pipeline.ranks, self._host.groups.pipe)
        return state if state is not None else {}

    @override
    def state_dict(self) -> dict[str, Any]:
        split = {"split": list(self.split)} if self.split is not None else {}
        if self.pipeline is None:
            return split  # after fit: the whole model, but the optimizer still holds this stage only
        if self.pipeline.in_flight:
            log.warning(
                "DecoupledStrategy: checkpoint taken with batches in flight (mid-epoch); they are not saved, so a "
                "run resumed from it skips their updates. Epoch-end checkpoints are exact."
            )
        return {**split, "pipeline": self.pipeline.state_dict(), **self.inter_level.state_dict()}

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.pipeline is not None and "pipeline" in state:
            self.pipeline.load_state_dict(state["pipeline"])
        self.inter_level.load_state_dict(state)
