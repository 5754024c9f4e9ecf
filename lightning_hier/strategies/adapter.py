"""The one Lightning adapter of every lightning-hier strategy: it holds the pieces as objects and calls them.

:class:`HierStrategy` is a ``ParallelStrategy`` (not DDP: the model is never wrapped, so no
per-step gradient all-reduce happens unless its rule asks for one). Like Lightning's own
``Strategy``, which holds its launcher, precision plugin and ``checkpoint_io`` and calls them, it
holds:

==================  ==========================================================================
``sync``            how the replicas agree (:class:`~lightning_hier.sync.Sync`): HPSGD's windows,
                    averaging rounds, DBS's weighted gradients, a parameter server
``allocation``      how each rank gets its training batches (:class:`~lightning_hier.sync.Allocation`):
                    Lightning's sampler split, DBS's speed-proportional shares, a shared queue
``guard``           failure handling: reports, the watchdog, ending launched ranks (:class:`FailureGuard`)
``finite``          the opt-in non-finite guard (:class:`FiniteGuard`)
``data_position``   where training is in its data, for exact resume (:class:`DataPosition`)
``fault_tolerance`` the opt-in fault-tolerant mode: live membership, restarts, rejoining
                    through a peer (:class:`~lightning_hier.strategies.FaultTolerance`)
``comm_stats``      bytes sent and time blocked in collectives
==================  ==========================================================================

and it owns what every rule needs: the process groups (one :class:`~lightning_hier.topology.Topology`
builds them once, with a finite ``timeout``), the launcher (``start_method``), broadcasting rank 0's
initial weights, the consensus model (validated during fit, saved as the checkpoint's
``state_dict``, left in every module at the end of fit) and checkpoints that hold every rank's
state, one entry per object. Each Lightning hook below says which object acts, in which order.

The registered strategies (``hpsgd``, ``localsgd``, ``dbs``, ...) are thin constructors that build
their objects and pass them here; ``decoupled`` and ``grid2d`` are subclasses (as Lightning's FSDP
sits beside DDP). Any other combination of objects is a strategy too::

    HierStrategy(sync=HPSGDSync(window=8), allocation=SpeedShares(rebalance_every=10))
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.fabric.utilities.optimizer import _optimizer_to_device, _optimizers_to_device
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_hier import _validate as v
from lightning_hier.callbacks.dbs import DBSCallback
from lightning_hier.comm import CommStats, broadcast_object, broadcast_unless_equal_
from lightning_hier.comm.rendezvous import init_default_group
from lightning_hier.rng import capture_rng, restore_rng
from lightning_hier.strategies import _checkpoint as ckpt
from lightning_hier.strategies import _checkpointing, _data_position, _finish
from lightning_hier.strategies._checkpoint_file import read_checkpoint
from lightning_hier.strategies._data_position import DataPosition
from lightning_hier.strategies._elastic_launcher import ElasticLauncher
from lightning_hier.strategies._failure import END_GRACE_S, FailureGuard
from lightning_hier.strategies._fault_tolerance import LIVE_CHECKPOINT, FaultTolerance
from lightning_hier.strategies._finite import FiniteGuard, loss_of, warn_if_not_finite
from lightning_hier.strategies._launchers import _CheckedScriptLauncher
from lightning_hier.strategies._registry import register_family
from lightning_hier.strategies._replica_launcher import ReplicaEnvironment, ReplicaLauncher
from lightning_hier.strategies._shared_queue import check_shared_trainer
from lightning_hier.strategies._step_sync import local_sigterm_check
from lightning_hier.sync import Allocation, Binding, SpeedShares, Sync
from lightning_hier.sync.compose import check_composition
from lightning_hier.topology import ProcessGroups, Topology

if TYPE_CHECKING:
    from collections.abc import Callable

    import lightning.pytorch as pl
    from lightning.fabric.utilities.types import _PATH
    from torch.optim import Optimizer

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 300.0
DEFAULT_INIT_TIMEOUT_S = 600.0
START_METHODS = ("popen", "spawn", "fork")
BACKENDS = (None, "gloo", "nccl", "mpi")
MIN_TIMEOUT_S = 0.001  # gloo counts milliseconds: a shorter timeout would round to 0 (no bound at all)
MAX_TIMEOUT_S = 7 * 24 * 3600.0


class HierStrategy(ParallelStrategy):
    """The Lightning adapter that every lightning-hier strategy is (see the module docstring).

    Args:
        sync: How the replicas agree (``None``: they do not; each rank trains alone).
        allocation: How the training batches are split (``None``: Lightning's ``DistributedSampler``
            over the data-parallel ranks).
        timeout: Seconds (or a ``timedelta``) a collective may wait before the run fails. Finite
            by design: a hung rank fails the job after this long instead of blocking it forever.
        init_timeout: Seconds the start-up rendezvous (the process group and its sub-groups) may
            wait for every rank to arrive. Ranks start at different times (imports, nodes
            scheduled seconds apart), so this is longer than ``timeout``; once the groups exist,
            every collective uses ``timeout`` (as torchtitan separates init and train timeouts).
        start_method: ``'popen'`` re-runs the script per rank (the default; also what torchrun
            and SLURM use), ``'spawn'`` or ``'fork'`` start ranks with multiprocessing (needed
            inside notebooks, tests and Hydra multiruns).
        process_group_backend: ``'gloo'``, ``'nccl'``, ``'mpi'`` or ``None`` (NCCL on CUDA, gloo
            otherwise).
        check_finite: Check every step that this rank's loss, gradients and parameters are finite
            before they reach the other ranks, and stop the run with a
            :class:`~lightning_hier.strategies._finite.NonFiniteError` naming the rank and step.
            Off by default (one extra pass over the parameters per step).
        fault_tolerance: Keep training when a replica fails, and restart it
            (:class:`~lightning_hier.strategies.FaultTolerance`, its arguments as a mapping, or
            ``True`` for its defaults); periodic rules only (``localsgd``, the GRAWA family,
            ``hpsgd``, ``diloco``), with ``start_method`` ``'fork'`` or ``'spawn'``, or with a
            ``coordinator`` and one process per replica under torchrun.
            ``None`` (default): a failure ends the run.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin:
            Set by the Trainer; as in Lightning's own strategies.
    """

    strategy_name: ClassVar[str] = ""
    """Registry name; ``name``, ``name_spawn`` and ``name_fork`` are registered on import."""

    def __init__(
        self,
        sync: Sync | None = None,
        allocation: Allocation | None = None,
        timeout: float | timedelta = DEFAULT_TIMEOUT_S,
        init_timeout: float | timedelta = DEFAULT_INIT_TIMEOUT_S,
        start_method: str = "popen",
        process_group_backend: str | None = None,
        check_finite: bool = False,
        fault_tolerance: FaultTolerance | Mapping[str, Any] | bool | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        owner = type(self).__name__
        self.sync = sync if sync is not None else Sync()
        self.allocation = allocation if allocation is not None else Allocation()
        check_composition(self.sync, self.allocation, owner)
        self._timeout: timedelta = check_timeout(owner, "timeout", timeout)
        self._init_timeout = check_timeout(owner, "init_timeout", init_timeout)
        self._start_method = v.check_choice(owner, "start_method", start_method, START_METHODS)
        self._process_group_backend = v.check_choice(owner, "process_group_backend", process_group_backend, BACKENDS)
        self.guard = FailureGuard(self._timeout)
        self.finite = FiniteGuard(v.check_bool(owner, "check_finite", check_finite), owner)
        self.fault_tolerance = FaultTolerance.of(owner, fault_tolerance)
        if self.fault_tolerance is not None:
            self.fault_tolerance.check(owner, self.sync.fault_tolerance_problem(), self._start_method, 1)
            if self.fault_tolerance.external:
                if cluster_environment is not None:
                    raise ValueError(
                        f"{owner}: argument `fault_tolerance` with a `coordinator` sets the cluster environment "
                        f"(replica {self.fault_tolerance.replica} of {self.fault_tolerance.replicas}), "
                        f"got cluster_environment={cluster_environment!r} too."
                    )
                self.cluster_environment = ReplicaEnvironment(self.fault_tolerance)
        self.comm_stats = CommStats()
        self.data_position = DataPosition()
        self.last_metrics: dict[str, float] = {}
        """The latest value of every metric the strategy reported (also those not handed to a logger)."""
        self.start_broadcast: bool | None = None
        """Whether the fit's start sent rank 0's weights (``False``: every rank held them; ``None``: not yet)."""
        self.last_step_args: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        """The arguments of the latest ``training_step`` (a probe may re-run it on the side)."""
        self._num_nodes = 1
        self._groups: ProcessGroups | None = None
        self._binding: Binding | None = None
        self._restored: dict[str, Any] | None = None  # this rank's saved state, between load and on_train_start
        self._eval_stack: ExitStack | None = None  # the consensus entered for validation
        self._finish = _finish.Finish()
        self._step_open = False  # manual optimization: an optimizer stepped in this batch

    @property
    def check_finite(self) -> bool:
        """Whether the non-finite guard is on."""
        return self.finite.enabled

    # ------------------------------------------------------------------ layout and ranks
    def _layout(self) -> dict[str, int]:
        """Inner grid sizes (``pipe``, ``model``) of this strategy; data parallel by default."""
        return {}

    def _resolve_layout(self) -> None:
        """Decide a layout chosen at run time (each rank, default group up, before groups are built)."""

    @property
    def topology(self) -> Topology:
        """The validated rank layout (pure arithmetic; available before processes start)."""
        fault = self.fault_tolerance
        if fault is not None and fault.replicas is not None:  # each replica a job of one process (torchrun)
            return Topology(world_size=fault.replicas, **self._layout())
        return Topology(world_size=self.num_nodes * self.num_processes, num_nodes=self.num_nodes, **self._layout())

    @property
    def groups(self) -> ProcessGroups:
        """This rank's process groups (after ``setup_environment``)."""
        if self._groups is None:
            raise RuntimeError(f"{type(self).__name__}: process groups are built in setup_environment().")
        return self._groups

    def _check_layout(self) -> None:
        """Every object checks the layout: in the main process before any rank starts, and on every rank."""
        topology = self.topology
        self.sync.check_layout(topology)
        self.allocation.check_layout(topology)

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        # Lightning injects a DistributedSampler and reduces `sync_dist` logs only when True
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # the allocation's split: by the data-parallel coordinate only (ranks of one replica see the same data)
        return self.allocation.sampler_kwargs(self.topology, self.global_rank, self._training_stage)

    @property
    def process_group_backend(self) -> str:
        if self._process_group_backend is not None:
            return self._process_group_backend
        return "nccl" if self.root_device.type == "cuda" else "gloo"

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._check_layout()  # in the main process, before any rank starts
        fault = self.fault_tolerance
        if fault is not None:
            fault.check(type(self).__name__, None, self._start_method, self.num_nodes, self.num_processes)
        if fault is not None and fault.external:
            self._launcher = ReplicaLauncher(self, check=self.check_fit_arguments)
        elif fault is not None:
            grace_s = min(END_GRACE_S, self.guard.timeout_s())
            finish_s = self._init_timeout.total_seconds()
            self._launcher = ElasticLauncher(self, self._start_method, grace_s, self.check_fit_arguments, finish_s)
        elif self._start_method == "popen":
            env = self.cluster_environment
            self._launcher = _CheckedScriptLauncher(self.check_fit_arguments, env, self.num_processes, self.num_nodes)
        else:
            self._launcher = self.guard.launcher(self, self._start_method, check=self.check_fit_arguments)

    def check_fit_arguments(self, trainer: pl.Trainer | None, args: tuple[Any, ...]) -> None:
        """In the main process, before the ranks start: a training DataLoader given to ``fit`` is checked."""
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        # Trainer.fit launches _fit_impl(model, train_dataloaders, val_dataloaders, datamodule, ...);
        # a DataModule's loader is only built in the ranks (its hooks may read or download data)
        if fitting and len(args) > 1 and isinstance(args[1], DataLoader):
            self.allocation.check_training_loader(args[1])

    # ------------------------------------------------------------------ process groups
    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        if self.fault_tolerance is not None:
            if self._groups is None:  # no failure board: its watchdog would end the survivors of a failure
                self.fault_tolerance.connect(self, self._init_timeout)
            return
        if not dist.is_initialized():
            os.environ["MASTER_ADDR"] = self.cluster_environment.main_address
            os.environ["MASTER_PORT"] = str(self.cluster_environment.main_port)
            init_default_group(  # its store listens on MASTER_ADDR only, not on every interface
                self.process_group_backend,
                rank=self.global_rank,
                world_size=self.world_size,
                address=self.cluster_environment.main_address,
                port=self.cluster_environment.main_port,
                timeout=self._init_timeout,
                multi_node=self.num_nodes > 1,
            )
        if self._groups is None:
            self._resolve_layout()
            self._groups = self.topology.build(self.global_rank, timeout=self._init_timeout)
            self._set_collective_timeout()
        self.guard.start(self)
        self._check_layout()  # a layout chosen at run time: every rank raises alike

    def _set_collective_timeout(self) -> None:
        """Switch every group from the start-up ``init_timeout`` to the per-collective ``timeout``."""
        groups = self.groups
        every = (
            dist.group.WORLD,
            groups.data,
            groups.pipe,
            groups.model,
            groups.node,
            groups.data_intra,
            groups.data_inter,
        )
        unique = {id(g): g for g in every if g}
        for group in unique.values():
            dist.distributed_c10d._set_pg_timeout(self._timeout, group)

    # ------------------------------------------------------------------ set-up of the model and the objects
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.model = self._setup_model(self.model)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if self._restored is None:
            self._sync_initial_state()
        if fitting:
            self.data_position = DataPosition()  # a new fit (the loader may be built by the optimizers' set-up)
            self._binding = self._bind_allocation(trainer)
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
            self._bind_sync(trainer)
            if self._restored is not None:
                self._apply_restored_state()
            _finish.install(trainer)
            _data_position.install_callback(trainer)

    def _bind_allocation(self, trainer: pl.Trainer) -> Binding:
        """Bind the allocation first: a schedule sized to the fit builds the training loader with the optimizers."""
        module = self.lightning_module
        assert module is not None
        binding = Binding(
            module=module,
            optimizers=[],
            groups=self.groups,
            stats=self.comm_stats,
            timeout=self._timeout,
            accumulation=trainer.accumulate_grad_batches,
            seed=global_seed(),
            callbacks=list(trainer.callbacks),  # type: ignore[attr-defined]  # set by Lightning, not declared
            host=self,
        )
        self.allocation.bind(binding)
        if isinstance(self.allocation, SpeedShares):
            # first, so checkpoints saved at the end of a batch already hold that step's rebalance
            _ensure_callback(trainer, DBSCallback)
        return binding

    def _bind_sync(self, trainer: pl.Trainer) -> None:
        """Bind the rule to the module's optimizers (every rank raises alike on what it cannot run)."""
        binding = self._binding
        assert binding is not None
        binding.optimizers = list(self.optimizers)
        if not self.sync.lock_step or self.fault_tolerance is not None:
            # Lightning's per-step SIGTERM-flag broadcast would hold the ranks together every step (an
            # asynchronous worker in lock-step; an overlapped window waiting behind it); the rule's own
            # collectives keep them together, and a signalled rank still stops (see _step_sync)
            local_sigterm_check(trainer)
        if not self.allocation.equal_steps:
            check_shared_trainer(type(self).__name__, trainer)  # before any claim
        self.sync.bind(binding)
        if self.fault_tolerance is not None:
            self.fault_tolerance.attach(self)
            self.fault_tolerance.install(trainer)

    def _apply_restored_state(self) -> None:
        """Apply this rank's saved state of every object (the RNG waits for ``on_train_start``)."""
        assert self._restored is not None
        self.sync.load_state_dict(self._restored.get("algorithm", {}))
        self.allocation.load_state_dict(self._restored.get("allocation", {}))
        self.comm_stats.load_state_dict(self._restored["comm"])
        self.data_position.restore(self._restored.get("data"))  # absent in format 1: Lightning's behaviour

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def _sync_initial_state(self) -> None:
        """Make every rank start from rank 0's weights (DDP does this in its constructor).

        Ranks that already hold rank 0's weights (built from one seed) send only a digest: on a slow
        link the float32 broadcast would cost more than many compressed rounds.
        """
        assert self.lightning_module is not None
        tensors = list(self.lightning_module.parameters()) + list(self.lightning_module.buffers())
        if self.fault_tolerance is not None:
            self.fault_tolerance.broadcast_initial([t.data for t in tensors])
            self.start_broadcast = True
            return
        with torch.no_grad():
            self.start_broadcast = broadcast_unless_equal_([t.data for t in tensors], src=0, group=dist.group.WORLD)

    # ------------------------------------------------------------------ one training step
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self.last_step_args = (args, kwargs)
        step = super().training_step
        return self.sync.training_step(lambda: self._observe(step(*args, **kwargs)))

    def _observe(self, output: Any) -> Any:
        loss = loss_of(output)
        self.finite.check_loss(self, loss)  # before backward: DDP-like rules reduce during it
        self.sync.observe(loss)  # LSGD elects its leader from the running loss
        return output

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        scale = self.allocation.loss_scale()  # DBS: a micro-batch of another share in a mixed step
        if scale != 1.0:  # keep the common case bit-identical: no multiplication by 1
            closure_loss = closure_loss * scale
        output = super().backward(closure_loss, optimizer, *args, **kwargs)
        self.finite.check_gradients(self)  # this rank's gradients, before any reduction
        return output

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        sync = self.sync

        def closure_then_reduce() -> Any:
            output = closure()  # forward and backward of the step's last micro-batch
            sync.reduce_gradients(optimizer)  # DBS's weights, DDP inside a node: before clipping and the step
            return output

        sync.before_step(optimizer)  # DBS x HPSGD / Local SGD: the window's sample weight
        step = super().optimizer_step
        output = sync.run_step(optimizer, lambda: step(optimizer, closure_then_reduce, model, **kwargs))
        self.finite.check_parameters(self)  # this rank's parameters, before a round sends them
        self._log(sync.after_step(optimizer))  # a window's merge, an averaging round, the server's metrics
        if self._automatic_optimization():
            self.allocation.step_ended()  # DBS: the step's time and samples
        else:
            self._step_open = True  # several optimizers may step in this batch: it ends when the next starts
        return output

    def _automatic_optimization(self) -> bool:
        module = self.lightning_module
        return module is None or module.automatic_optimization

    # ------------------------------------------------------------------ the loop around the steps
    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._finish.rearm()
        self._step_open = False
        if self._restored is not None:
            restore_rng(self._restored["rng"])  # the last moment before training draws from it
        self._restored = None  # everything is restored by now (optimizer states come after setup)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self._finish.rearm()  # training goes on: the replicas may differ again
        module = self.lightning_module
        if module is not None and module._trainer is not None:
            _data_position.count_epoch_under_way(module.trainer)
            self.data_position.batch_started(module.trainer.current_epoch, batch_idx)
        if self._step_open:  # manual optimization: the previous batch's steps are over
            self.allocation.step_ended()
            self._step_open = False
        self.allocation.batch_started(batch, batch_idx)  # DBS: this micro-batch's share, and its time
        self.sync.batch_started(batch)  # a server: (re)started after a pause

    def finish_training(self) -> None:
        """Leave the finished (consensus) model in every rank's module, once per end of training; a collective.

        :class:`~lightning_hier.strategies._finish.FinishFit` calls it right after the fit's last
        optimizer step, not in the strategy's ``on_train_end``, which Lightning runs after every
        user ``on_train_end``: the last epoch's validation and checkpoints, user ``on_train_end`` /
        ``on_fit_end`` hooks (collectives in them included) and ``fit()``'s result all see the same
        finished model on every rank.
        """
        self._finish(self._finalize)

    def _finalize(self) -> None:
        self.last_metrics.update(self.sync.finalize())

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        self.finish_training()  # a no-op unless a stop came that FinishFit did not predict
        module = self.lightning_module
        if self.fault_tolerance is not None and module is not None and module._trainer is not None:
            self.fault_tolerance.finish(module.trainer)
        self.sync.pause()
        warn_if_not_finite(self.lightning_module, type(self).__name__, self.global_rank)

    @override
    def on_validation_start(self) -> None:
        self._eval_stack = ExitStack()
        self._eval_stack.enter_context(self.sync.consensus())

    @override
    def on_validation_end(self) -> None:
        if self._eval_stack is not None:
            self._eval_stack.close()
            self._eval_stack = None

    @property
    def _training_stage(self) -> bool:
        """Whether the trainer is fitting (its training loop), not validating, testing or predicting."""
        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        return trainer is not None and trainer.state.stage == RunningStage.TRAINING

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """The training loader: the allocation's batches, resumable mid-epoch, with its own generator.

        Without a generator, every ``iter(loader)`` draws a seed from the global RNG, and whether
        Lightning builds a throwaway iterator after a resume depends on where in the loop the
        checkpoint was taken; the global stream (dropout, augmentation) would then shift by one
        draw. The generator is seeded without drawing from the global RNG. The sampler resumes
        at the checkpoint's batch (:mod:`lightning_hier.strategies._data_position`).
        """
        if not self._training_stage:
            return dataloader
        loader = self.allocation.training_loader(dataloader, seed=global_seed())
        if isinstance(loader, DataLoader):
            if loader.generator is None:
                seed = (torch.initial_seed() + 1_000_003 * self.global_rank) % 2**63
                loader.generator = torch.Generator().manual_seed(seed)
            self.data_position.install(loader)
        return loader

    def _log(self, metrics: dict[str, float]) -> None:
        """Record what an object reported; hand it to Lightning as its ``reporting`` says."""
        if not metrics:
            return
        self.last_metrics.update(metrics)
        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        if module is None or trainer is None:
            return
        reporting = self.sync.reporting
        if reporting == "sparse":
            # a log_dict costs about a millisecond of the training thread: at Lightning's cadence only
            every = max(1, int(getattr(trainer, "log_every_n_steps", 1)))  # set by Lightning, not declared
            if (trainer.global_step + 1) % every != 0:
                return
        if module._current_fx_name in ("optimizer_step", "training_step"):
            module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1, logger=reporting != "each")
        if reporting == "each" and trainer.is_global_zero:  # rare reports: each one at its own step
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    @override
    def teardown(self) -> None:
        self.guard.stop()
        # keep the process group alive (as DDP does): trainer.save_checkpoint() after fit needs it
        super().teardown()

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        self.guard.on_exception(exception, self.launcher)
        self.sync.abort()  # after the report: the rule's own servers and threads go (no collective: peers may be gone)

    # ------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The consensus model: what ``trainer.save_checkpoint`` stores as ``state_dict``."""
        assert self.lightning_module is not None
        if self.fault_tolerance is not None and self.fault_tolerance.donating:
            return ckpt.detach_state(self.lightning_module.state_dict())  # right after a round: the consensus
        with self.sync.consensus():
            return ckpt.detach_state(self.lightning_module.state_dict())

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Gather every rank's state into the checkpoint; rank 0 writes it atomically.

        A collective: every rank must call it (``trainer.save_checkpoint`` does). Calling it on
        rank 0 only (``if trainer.is_global_zero: trainer.save_checkpoint(...)``) deadlocks.
        """
        filepath = self.broadcast(filepath)
        states = None
        if "optimizer_states" in checkpoint and self.fault_tolerance is None:  # not weights_only
            with self._replicas_in_place():
                states = _checkpointing.gather_rank_states(self._rank_state(checkpoint))
        if not self.is_global_zero:
            return
        checkpoint[ckpt.STATE_KEY] = ckpt.strategy_section(
            self.strategy_name or type(self).__name__,
            self.topology.describe(),
            checkpoint.get("state_dict", {}),
            *(states if states is not None else (None, None)),
        )
        _checkpointing.write(checkpoint, filepath, storage_options, self.checkpoint_io)

    def _rank_state(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """This rank's state, one entry per object."""
        assert self.lightning_module is not None
        module = self.lightning_module
        batches = module.trainer.num_training_batches if module._trainer is not None else float("inf")
        return {
            "model": ckpt.detach_state(module.state_dict()),
            "optimizer_states": checkpoint.get("optimizer_states", []),
            "rng": capture_rng(),
            "algorithm": ckpt.detach_state(self.sync.state_dict()),
            "allocation": ckpt.detach_state(self.allocation.state_dict()),
            "comm": self.comm_stats.state_dict(),
            "data": self.data_position.state_dict(batches),
        }

    @contextmanager
    def _replicas_in_place(self) -> Iterator[None]:
        """Put the replicas back while inside validation's consensus (a checkpoint saved there).

        Each rank must store its own replica, not the consensus it is validating; the consensus is
        entered again afterwards (a collective for some rules: every rank saves together).
        """
        if self._eval_stack is None:
            yield
            return
        self._eval_stack.close()
        try:
            yield
        finally:
            self._eval_stack = ExitStack()
            self._eval_stack.enter_context(self.sync.consensus())

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        path = str(checkpoint_path)
        if path == LIVE_CHECKPOINT and self.fault_tolerance is not None:  # a restarted replica: a peer's state
            checkpoint, self._restored = self.fault_tolerance.live_checkpoint()
            return checkpoint
        load = super().load_checkpoint
        checkpoint = read_checkpoint(path, lambda: load(path, weights_only))
        module = self.lightning_module
        fitting = module is not None and module._trainer is not None and module.trainer.state.fn == TrainerFn.FITTING
        if not fitting:  # validate / test / predict: the consensus state_dict is what is used
            ckpt.check_state_dict(checkpoint, path)
            return checkpoint
        name = self.strategy_name or type(self).__name__
        restored = ckpt.select_rank_state(checkpoint, path, name, self.topology.describe(), self.global_rank)
        mine = ckpt.rank_state_damaged(checkpoint, self.global_rank)
        damaged = _checkpointing.agree_on_damaged(mine, self.global_rank, self.world_size, self.root_device)
        if damaged:  # every rank raises the same error, so none waits for a damaged peer
            raise ckpt.damaged_ranks_error(path, name, damaged)
        self._restored = restored
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        assert self.lightning_module is not None
        state = self._restored["model"] if self._restored is not None else checkpoint["state_dict"]
        self.lightning_module.load_state_dict(state, strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        states = self._restored["optimizer_states"] if self._restored is not None else checkpoint["optimizer_states"]
        for optimizer, state in zip(self.optimizers, states, strict=True):
            optimizer.load_state_dict(state)
            _optimizer_to_device(optimizer, self.root_device)

    # ------------------------------------------------------------------ collectives
    @override
    def barrier(self, name: str | None = None) -> None:
        if dist.is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        return broadcast_object(obj, src, dist.group.WORLD)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ------------------------------------------------------------------ registration
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        if cls.strategy_name:
            cls._register_family(strategy_registry, cls.strategy_name)

    @classmethod
    def _register_family(cls, registry: _StrategyRegistry, name: str, **init_params: Any) -> None:
        """Register ``name`` (popen), ``name_spawn`` and ``name_fork`` with fixed arguments."""
        doc = (cls.__doc__ or cls.__name__).strip().splitlines()[0]
        register_family(registry, cls, name, doc, **init_params)


def check_timeout(owner: str, name: str, value: float | timedelta) -> timedelta:
    """A timeout in seconds (or a ``timedelta``) within ``[MIN_TIMEOUT_S, MAX_TIMEOUT_S]``."""
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    return timedelta(seconds=v.check_float(owner, name, seconds, low=MIN_TIMEOUT_S, high=MAX_TIMEOUT_S))


def global_seed() -> int:
    """The seed Lightning gives its ``DistributedSampler``: the same on every rank (``seed_everything`` sets it)."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


def single_optimizer(strategy: HierStrategy) -> Optimizer:
    """The strategy's one optimizer; a clear error for several (the pipeline and the grid take one)."""
    if len(strategy.optimizers) != 1:
        raise NotImplementedError(
            f"{type(strategy).__name__} supports exactly one optimizer; configure_optimizers returned "
            f"{len(strategy.optimizers)}. Combine the parameter groups into one optimizer."
        )
    return strategy.optimizers[0]


def _ensure_callback(trainer: pl.Trainer, kind: type[Any]) -> None:
    """Put a default ``kind()`` first in ``trainer.callbacks`` unless the Trainer has one."""
    callbacks: list[Any] = trainer.callbacks  # type: ignore[attr-defined]
    if not any(isinstance(c, kind) for c in callbacks):
        callbacks.insert(0, kind())
