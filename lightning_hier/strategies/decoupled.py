"""Lightning adapter of the decoupled pipeline: :class:`DecoupledStrategy`.

Registered as ``decoupled``, ``decoupled_spawn`` and ``decoupled_fork``. The algorithm (Pham and
Ahn, arXiv 2509.05679, on FDG / DDG) lives in :mod:`lightning_hier.algorithms.decoupled`.

How it sits in Lightning (decisions, in the order a fit meets them):

- **Layout.** ``W = N x K`` ranks, ``rank(d, k) = d * K + k`` (:class:`~lightning_hier.topology.Topology`
  with ``pipe=K``); a given ``K`` that does not divide the world size fails when the Trainer is
  built. ``stages='auto'`` (the default) takes the largest divisor of the world size that is at most
  the number of blocks: as deep a pipeline as the world and the model allow, the rest of the world
  as data parallelism; a one-block network (``BoringModel``) gets ``K = 1``, plain data parallelism
  through the same engine. The training sampler shards by the data-parallel coordinate ``d`` only:
  the stages of a replica read the same batches (stage 0 uses them; labels travel with the
  activations, and the last stage keeps its own copy of the batch for the loss).
- **The model.** The blocks are the ``nn.Sequential`` (or ``nn.ModuleList``) at ``module_attr``;
  any other module there is one block. Without ``module_attr`` the strategy looks breadth first
  (the module's direct children, then theirs, ...) for the first level holding an ``nn.Sequential``
  / ``nn.ModuleList`` with parameters, which must hold exactly one (``net`` of
  :class:`~lightning_hier.models.Classifier`, ``model`` of a module built as ``self.model = nn.Sequential(...)``);
  with no such container, a module whose parameters all sit in one child has that child as its one
  block; otherwise an error lists the candidates. Every rank starts from rank 0's whole model
  (broadcast before the cut), then keeps only its stage: the other blocks go to the meta device
  behind placeholders. ``configure_optimizers`` therefore sees this stage's parameters only.
- **Input and balance.** Stage 0 feeds each batch's input to the first block: the batch itself (a
  tensor), its first element (tuple/list) or first value (dict). At set-up rank 0 runs the blocks on
  one sample (``example_input_array``, else the first training batch's input): a block that cannot
  take its input fails here with the block and the shapes named. ``split`` gives the cut points; by
  default rank 0 times each block's forward + backward on that sample and balances the stages.
- **One training step = one lock-step iteration.** The strategy's ``training_step`` runs the
  iteration (forwards, delayed backward, data-parallel gradient all-reduce, optimizer step through
  the precision plugin: gradient clipping and ``on_before_optimizer_step`` apply) and returns the
  loss as a detached tensor; its ``backward`` and ``optimizer_step`` do nothing more, so Lightning
  sees a loss on every rank and there is no second backward. The loss is
  ``module.pipeline_loss(output, target)`` if the module defines it (batches ``(inputs, targets)``);
  otherwise the last stage runs the user's own ``training_step(batch, batch_idx)`` with the network
  (the blocks' ``nn.Sequential``, the single block, or ``forward`` for an ``nn.ModuleList``) replaced
  by the pipeline's output for that batch, so the user's loss is exact; it must call the network
  once on the batch's input, and its ``self.log`` calls are dropped (see
  :mod:`lightning_hier.strategies._pipeline_loss`). Logged: ``train/loss`` (epoch mean over all
  batches and replicas; each rank reports the losses of the batches it applied, which travel back
  with the gradients).
- **Epoch ends drain the pipeline** (``2K - 2`` extra iterations for ``fdg``, ``K - 1`` for
  ``ddg``, none for ``sync``) inside the epoch's last step, so every batch is applied exactly once,
  validation and checkpoints at epoch ends see a model with nothing in flight, and resuming from
  them is exact. A checkpoint taken mid-epoch does not hold batches in flight (a warning says so).
  BatchNorm statistics are averaged over the replicas at each drain (they do not affect training).
- **Validation during fit** is a plain staged forward with no state change: ``module(x)`` routes
  the blocks through the stages, and the last stage's output reaches every stage of the replica, so
  the user's ``validation_step`` runs unchanged on every rank and torchmetrics/``sync_dist``
  reduce over the whole world (each replica counted K times: means are unchanged).
- **Checkpoints, the end of fit, outside fit**: the strategy's ``sync`` object,
  :class:`~lightning_hier.strategies._pipeline_stages.PipelineStages`.

Supported: precision ``32-true``, ``64-true``, ``16-true``, ``bf16-true``; one optimizer stepped once
per call (not LBFGS); automatic optimization; ``accumulate_grad_batches=1``. ``gradient_clip_algorithm
='norm'`` clips each stage's gradient by its own norm. ``on_before_backward``/``on_after_backward``
are not called.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from typing_extensions import override

from lightning_hier import _validate as v
from lightning_hier.algorithms.averaging import float_buffers
from lightning_hier.algorithms.decoupled import (
    SCHEDULES,
    WEIGHTS,
    DecoupledPipeline,
    IterationReport,
    check_stage_count,
)
from lightning_hier.comm import all_reduce_mean_, broadcast_object
from lightning_hier.strategies import _pipeline_model as pm
from lightning_hier.strategies._finite import all_finite
from lightning_hier.strategies._inter_node import InterNodeLevel, data_levels
from lightning_hier.strategies._pipeline_loss import TrainingStepLoss
from lightning_hier.strategies._pipeline_stages import PipelineStages
from lightning_hier.strategies._user_model import require_automatic_optimization
from lightning_hier.strategies.adapter import HierStrategy, single_optimizer

if TYPE_CHECKING:
    from collections.abc import Callable

    import lightning.pytorch as pl
    from torch.optim import Optimizer

log = logging.getLogger(__name__)

SUPPORTED_PRECISION = (Precision, DoublePrecision, HalfPrecision)


class DecoupledStrategy(HierStrategy):
    """Data parallelism x fully decoupled backpropagation: N pipelines of K stages with delayed gradients.

    Args:
        stages: Number of pipeline stages ``K``; the world size must be a multiple (``N = W / K``).
            ``'auto'``: ``len(split) + 1`` when ``split`` is given, else the largest divisor of the
            world size (with ``inter_node_every``: of the ranks of one node) that is at most the number
            of blocks (chosen when the processes start and logged; ``num_stages`` holds it).
        split: ``K - 1`` block indices where stages ``1 .. K-1`` start; ``None`` balances the
            stages by measured per-block time.
        schedule: ``'fdg'`` (fully decoupled, staleness ``2(K-1-k)``), ``'ddg'`` (locked forward,
            ``K-1-k``) or ``'sync'`` (no staleness: plain backpropagation, pipelined).
        order: ``'forward_first'`` (the default: forward, then the delayed backward and update) or
            ``'backward_first'`` (FDG's order, ``fdg`` only: the forward sees the same iteration's
            update, staleness ``2(K-1-k) - 1`` before the last stage). See
            :mod:`lightning_hier.algorithms.decoupled.schedule` for why forward first is the default.
        weights: Weights of a delayed backward: ``'stash'`` (forward-time copy), ``'recompute'``
            (re-run the forward with current weights) or ``'legacy'`` (stored graph, current weights).
        beta: Gradient shrinking in ``(0, 1]``: stage ``k``'s gradients are scaled by ``beta ** (K-1-k)``.
        wire_dtype: ``'bf16'``: activations and activation gradients cross the cuts in bfloat16
            (half the bytes of float32; each stage still computes in its own dtype); ``None``: as
            they are.
        link_gbps: Bandwidth of the links between stages in Gbit/s. When given (and ``split`` is
            not), the balanced cut charges every stage, besides its blocks' measured time, the
            transfer time of the activation crossing each cut it borders (as it travels, so
            ``wire_dtype`` counts); ``None`` balances compute only.
        module_attr: Dotted path of the ``nn.Sequential`` / ``nn.ModuleList`` of blocks on the
            LightningModule (any other module there is one block); ``None`` finds it (see "The
            model" above) or fails listing the candidates.
        inter_node_every: ``None`` (default): every update's stage gradient is averaged over all
            ``N`` replicas; on a multi-node job whose pipelines fit in a node, in two steps (over the
            node's replicas, then across nodes), which equals the flat mean. ``m >= 1``: the
            gradient mean stays inside the node, and the stages of different nodes meet every ``m``
            of their updates by the ``inter_node`` rule. Needs ``num_nodes > 1`` and
            ``K`` dividing the ranks of a node.
        inter_node: The cross-node rule with ``inter_node_every``: ``'localsgd'`` or ``'hpsgd'``
            (see :mod:`lightning_hier.strategies._inter_node`).
        **kwargs: See :class:`~lightning_hier.strategies.HierStrategy` (``timeout``,
            ``start_method``, ``process_group_backend``).

    Example:
        >>> import lightning.pytorch as pl
        >>> import lightning_hier  # registers the names
        >>> trainer = pl.Trainer(strategy="decoupled_fork", accelerator="cpu", devices=2)  # doctest: +SKIP
        >>> trainer = pl.Trainer(strategy=DecoupledStrategy(stages=2, schedule="ddg"), devices=4)  # doctest: +SKIP
    """

    strategy_name = "decoupled"

    def __init__(
        self,
        stages: int | str = "auto",
        split: Sequence[int] | None = None,
        schedule: str = "fdg",
        weights: str = "stash",
        beta: float = 1.0,
        module_attr: str | None = None,
        order: str = "forward_first",
        wire_dtype: str | None = None,
        link_gbps: float | None = None,
        inter_node_every: int | None = None,
        inter_node: str = "localsgd",
        **kwargs: Any,
    ) -> None:
        owner = type(self).__name__
        self.inter_level = InterNodeLevel(owner, inter_node_every, inter_node)
        super().__init__(sync=PipelineStages(self.inter_level), **kwargs)
        self.stages: int | str = pm.check_stages_argument(owner, stages)
        # K: known now when given (or implied by `split`), else chosen per rank once the model is known
        self._num_stages: int | None = self.stages if isinstance(self.stages, int) else None
        if self._num_stages is None and isinstance(split, Sequence) and not isinstance(split, str):
            self._num_stages = len(split) + 1
        self.split = pm.check_split_argument(owner, split, self._num_stages or 1)
        self.schedule = v.check_choice(owner, "schedule", schedule, SCHEDULES)
        self.weights = v.check_choice(owner, "weights", weights, WEIGHTS)
        self.order = pm.check_order_argument(owner, order, self.schedule)
        self.wire_dtype = v.check_choice(owner, "wire_dtype", wire_dtype, tuple(pm.WIRE_DTYPES))
        self.link_gbps = (
            None if link_gbps is None else v.check_float(owner, "link_gbps", link_gbps, low=0.0, low_inclusive=False)
        )
        self.beta = v.check_float(owner, "beta", beta, low=0.0, high=1.0, low_inclusive=False)
        self.module_attr = pm.check_module_attr_argument(owner, module_attr)
        self._found_attr: str | None = None
        self._gradient_group: dist.ProcessGroup | None = None
        self._loss: TrainingStepLoss | None = None
        self.last_reports: list[IterationReport] = []
        """What every stage iteration of the latest training step did (for monitors and tests)."""
        self._missing_on_load: list[str] = []
        self._cut: pm.CutModel | None = None
        self._example_input: Any = None

    @property
    def pipeline(self) -> DecoupledPipeline | None:
        """This rank's stage of the running pipeline (``None`` outside fit)."""
        stages = self.sync
        assert isinstance(stages, PipelineStages)
        return stages.pipeline

    @property
    def num_stages(self) -> int:
        """``K``: the ``stages`` argument, or what ``'auto'`` chose (known once the processes started)."""
        if self._num_stages is None:
            raise RuntimeError("DecoupledStrategy: stages='auto' is decided when the processes start.")
        return self._num_stages

    @override
    def _layout(self) -> dict[str, int]:
        return {"pipe": self._num_stages} if self._num_stages is not None else {}

    @override
    def _resolve_layout(self) -> None:
        module = self.lightning_module
        assert module is not None
        # the real limit first, before the network is looked for
        require_automatic_optimization(type(self).__name__, module, "the pipeline steps each stage's optimizer itself")
        if self._num_stages is not None:
            return
        attr = self._blocks_attr()
        blocks = len(pm.resolve_blocks(module, attr))
        world = self.world_size
        # two levels: a pipeline must stay inside a node, so K divides the ranks of one node
        room = world // self.num_nodes if self.inter_level.enabled else world
        self._num_stages = max(k for k in range(1, min(blocks, room) + 1) if room % k == 0)
        rank_zero_info(
            f"decoupled: stages='auto' chose K={self._num_stages} stage(s) x N={world // self._num_stages} "
            f"replica(s) for the {blocks} block(s) of `{attr}` on {world} processes."
        )

    @override
    def _check_layout(self) -> None:
        super()._check_layout()
        self.inter_level.check(self.topology)  # before any rank starts (stages='auto': only num_nodes), then on each

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self._gradient_group is None and self.groups.pipe is not None:
            # the activation gradients travel on a connection of their own (DecoupledPipeline's
            # `pipe_group`): sharing one with the activations can double a boundary's transfer time
            self._gradient_group = self.topology.build_second_group("pipe", self.global_rank, self._timeout)

    def _blocks_attr(self) -> str:
        """``module_attr``, or the path of the network found by the rule of :func:`find_network`."""
        if self._found_attr is None:
            assert self.lightning_module is not None
            self._found_attr = pm.blocks_attr(self.lightning_module, self.module_attr)
        return self._found_attr

    # ------------------------------------------------------------------ precision and sampling
    @property  # type: ignore[explicit-override]  # mypy cannot mark a property that has a setter
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else Precision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is not None and type(plugin) not in SUPPORTED_PRECISION:
            raise ValueError(
                f"DecoupledStrategy: precision plugin {type(plugin).__name__} is not supported; use precision "
                "'32-true', '64-true', '16-true' or 'bf16-true'. Mixed precision would need autocast and loss "
                "scaling across stages that apply gradients of different batches."
            )
        self._precision_plugin = plugin

    # ------------------------------------------------------------------ cutting the model
    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        self._cut_model(trainer)  # the optimizers are built for this rank's stage only
        super().setup_optimizers(trainer)

    def _cut_model(self, trainer: pl.Trainer) -> None:
        module: nn.Module = self.lightning_module  # type: ignore[assignment]
        attr = self._blocks_attr()
        blocks = pm.resolve_blocks(module, attr)
        pm.check_no_outside_parameters(module, attr)
        try:
            check_stage_count(len(blocks), self.num_stages)
            split = self._choose_split(trainer, blocks, attr)
            self._cut = pm.cut(module, attr, split, self.num_stages, self.topology.coords(self.global_rank).pipe)
        except ValueError as err:  # the helpers' messages do not name the strategy
            raise ValueError(f"DecoupledStrategy: {err}") from None
        unexpected = [k for k in self._missing_on_load if k not in set(self._cut.foreign_keys())]
        if unexpected:
            raise ValueError(f"DecoupledStrategy: the checkpoint lacks this stage's entries {unexpected[:5]}.")
        # ModelSummary would run the example through this rank's partial model; restored after fit
        lightning_module = self.lightning_module
        assert lightning_module is not None
        self._example_input, lightning_module.example_input_array = lightning_module.example_input_array, None

    def _choose_split(self, trainer: pl.Trainer, blocks: pm.Container, attr: str) -> tuple[int, ...]:
        saved = self._restored.get("algorithm", {}).get("split") if self._restored is not None else None
        if saved is not None and self.split is not None and tuple(self.split) != tuple(saved):
            raise ValueError(f"split {list(self.split)} differs from the checkpoint's split {list(saved)}")
        known = tuple(saved) if saved is not None else self.split
        if known is None and self.num_stages == len(blocks):
            known = tuple(range(1, self.num_stages))  # one block per stage: nothing to balance
        # rank 0 checks the blocks on a sample input (and times them); every rank gets the same verdict
        module = self.lightning_module
        assert module is not None
        verdict = None
        if self.global_rank == 0:
            link = None if self.link_gbps is None else (8 / (self.link_gbps * 1e9), pm.WIRE_DTYPES[self.wire_dtype])
            verdict = pm.probe_blocks(
                module, trainer, self.root_device, blocks, attr, self.num_stages, known is None, link
            )
        split, error = broadcast_object(verdict, 0, torch.distributed.group.WORLD)
        if error is not None:
            raise ValueError(error)
        return known if known is not None else tuple(split)

    @override
    def _bind_sync(self, trainer: pl.Trainer) -> None:
        module = self.lightning_module
        assert module is not None and self._cut is not None
        stage = self._cut.stage()
        pm.check_fit_settings(module, trainer.accumulate_grad_batches, single_optimizer(self), stage)
        # step-wise schedulers advance every iteration, also on stages still waiting for their
        # first gradient; torch would warn that the first learning rate was skipped, which it is not
        warnings.filterwarnings(
            "ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before", category=UserWarning
        )
        # no per-step SIGTERM-flag broadcast (PipelineStages.lock_step is False): on the default group
        # it would make the start of every step a barrier of all stages (with one replica the pipe
        # group is the default group, so it also queues behind the activations on their connection)
        # and the stages would lose the slack the delayed gradients give them
        topo, coords = self.topology, self.topology.coords(self.global_rank)
        # periodic across nodes: the per-update mean stays in the node; else node, then across nodes
        levels = (self.groups.data_intra, None) if self.inter_level.enabled else data_levels(self.groups)
        pipeline = DecoupledPipeline(
            stage,
            stage_index=coords.pipe,
            stage_ranks=topo.group_ranks("pipe", self.global_rank),
            pipe_group=(self.groups.pipe, self._gradient_group),
            data_group=levels,
            schedule=self.schedule,
            order=self.order,
            weights=self.weights,
            beta=self.beta,
            loss_fn=self._loss_fn(module, coords.pipe == self.num_stages - 1),
            stats=self.comm_stats,
            check_gradients=self._check_stage_gradients if self.check_finite else None,
            wire_dtype=pm.WIRE_DTYPES[self.wire_dtype],
            timeout=self._timeout,  # gloo bounds point-to-point waits by init_timeout otherwise
        )
        runner = pipeline.runner
        inter = self.inter_level.build(runner.params, self.groups, float_buffers(runner.module), self.comm_stats)
        if inter is not None:
            runner.adopt(inter.flat)  # the rule moved the stage's parameters into its buckets
        stages = self.sync
        assert isinstance(stages, PipelineStages)
        stages.start(self._cut, pipeline, self._drain, self, self._example_input)
        super()._bind_sync(trainer)

    def _check_stage_gradients(self, grads: list[Tensor]) -> None:
        if not all_finite(grads):
            stage = self.topology.coords(self.global_rank).pipe
            self.finite.raise_non_finite(self, "gradients", f" (pipeline stage {stage})")

    def _loss_fn(self, module: pl.LightningModule, last: bool) -> Callable[[Tensor, Tensor | None], Tensor]:
        """``module.pipeline_loss`` if defined, else the module's own training_step (see :mod:`._pipeline_loss`)."""
        self._loss = None
        pipeline_loss = getattr(module, "pipeline_loss", None)
        if callable(pipeline_loss):
            return pipeline_loss
        assert self._cut is not None
        container = self._cut.module.get_submodule(self._cut.attr)
        network, name = (module, "forward") if isinstance(container, nn.ModuleList) else (container, self._cut.attr)
        self._loss = TrainingStepLoss(module, network, name, last)
        return self._loss

    # ------------------------------------------------------------------ one step = one iteration
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        batch = kwargs.get("batch", args[0] if args else None)
        batch_idx = int(kwargs.get("batch_idx", args[1] if len(args) > 1 else 0))
        pipe = self.pipeline
        if pipe is None:
            raise RuntimeError(
                "DecoupledStrategy: a training batch came after the fit was predicted to end and the stages "
                "were reassembled into the whole model; the pipeline cannot go on. This is a bug in "
                "lightning_hier.callbacks.fit_end.ends_after_this_batch: please report the Trainer's "
                "stopping arguments."
            )
        reports: list[IterationReport] = []
        with self.precision_plugin.train_step_context():
            if batch_idx == 0 and pipe.in_flight:  # the previous epoch stopped early
                reports += self._drain()
            fed = self._loss.stage_input(batch, batch_idx) if self._loss is not None else batch
            reports.append(pipe.step(fed, self._apply))
            if self._ends_epoch(batch_idx):
                reports += self._drain()
        self.last_reports = reports
        return self._report(reports)

    def _apply(self) -> None:
        # through the precision plugin: on_before_optimizer_step and gradient clipping, then the step
        module = self.lightning_module
        assert module is not None
        self.precision_plugin.optimizer_step(self.optimizers[0], model=module, closure=_no_closure)
        self.inter_level.step()  # counts this stage's updates; every inter_node_every of them, across nodes
        self.finite.check_parameters(self)

    def _drain(self) -> list[IterationReport]:
        assert self.pipeline is not None
        reports = self.pipeline.drain(self._apply)
        # BatchNorm statistics do not influence training; averaging them gives one model per stage
        buffers = float_buffers(self.pipeline.runner.module)
        if buffers:
            all_reduce_mean_(buffers, self.groups.data, self.comm_stats)
        return reports

    def _ends_epoch(self, batch_idx: int) -> bool:
        trainer = self.lightning_module.trainer  # type: ignore[union-attr]
        if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch or batch_idx + 1 >= trainer.num_training_batches:
            return True
        return 0 <= trainer.max_steps <= trainer.global_step + 1

    def _report(self, reports: list[IterationReport]) -> Tensor:
        applied = [(r.loss, r.rows) for r in reports if r.loss is not None]
        rows = sum(n for _, n in applied)
        loss = sum(value * n for value, n in applied) / rows if rows else float("nan")
        module = self.lightning_module
        assert module is not None and self.pipeline is not None
        if rows:
            module.log("train/loss", loss, on_step=False, on_epoch=True, prog_bar=True, sync_dist=True, batch_size=rows)
        self._log({"pipe/in_flight": float(reports[-1].in_flight), "pipe/updates": float(self.pipeline.updates)})
        return torch.tensor(loss, device=self.root_device)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """Nothing to do: :meth:`training_step` ran the stage's backward passes."""
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Run Lightning's closure (our training step, which steps the optimizer); no further step."""
        return closure()

    # ------------------------------------------------------------------ outside fit, and checkpoints
    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        module = self.lightning_module
        fitting = module is not None and module._trainer is not None and module.trainer.state.fn == TrainerFn.FITTING
        if fitting:
            return super().distributed_sampler_kwargs
        # outside fit the whole model is on every rank: plain data parallelism over the world
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The whole ordinary model, assembled from the stages of replica 0 (a collective)."""
        stages = self.sync
        assert isinstance(stages, PipelineStages)
        whole = stages.whole_state_dict(self.topology.coords(self.global_rank).data)
        return whole if whole is not None else super().lightning_module_state_dict()

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


def _no_closure() -> None:
    return None
