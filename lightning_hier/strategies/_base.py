"""The shared base of every lightning-hier strategy.

:class:`HierStrategy` is a ``ParallelStrategy`` (not DDP: the model is never wrapped, so no
per-step gradient all-reduce happens unless an algorithm asks for one). It owns the plumbing
every algorithm needs, so a concrete strategy adds only its algorithm object and the one or two
hooks where it acts:

- process-group setup with a finite ``timeout``, launcher choice (``start_method``), ranks and
  ``num_nodes``, and the :class:`~lightning_hier.topology.Topology` that builds every group once;
- broadcasting rank 0's initial weights, barrier / broadcast / reduce;
- failure handling: a failing rank reports to the store, peers name it, a watchdog ends ranks
  left hanging or orphaned, launched ranks are ended, signals are forwarded (see
  :mod:`lightning_hier.strategies._failure`);
- checkpoints that hold every rank's model, optimizer, RNG and algorithm state, checked on
  resume (the :class:`~lightning_hier.strategies._checkpointing.CheckpointingStrategy` layer);
- the *consensus* model (global / center / average): validated during fit, saved as the
  checkpoint's ``state_dict`` and left in every rank's module at the end of fit;
- registration of ``name``, ``name_spawn`` and ``name_fork``.

Hooks for subclasses: :meth:`_layout`, :meth:`_setup_algorithm`, :meth:`_finalize_algorithm`,
:meth:`_consensus`, :meth:`_algorithm_state`, :meth:`_load_algorithm_state`,
:meth:`_sync_initial_state`.
"""

from __future__ import annotations

import logging
import os
from contextlib import ExitStack
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_hier import _validate as v
from lightning_hier.comm import CommStats, broadcast_, broadcast_object
from lightning_hier.comm.rendezvous import init_default_group
from lightning_hier.rng import restore_rng
from lightning_hier.strategies import _data_position, _finish
from lightning_hier.strategies._checkpointing import CheckpointingStrategy
from lightning_hier.strategies._data_position import DataPosition
from lightning_hier.strategies._failure import FailureHandling
from lightning_hier.strategies._finish import FinishOnce
from lightning_hier.strategies._finite import FiniteChecks, warn_if_not_finite
from lightning_hier.strategies._registry import register_family
from lightning_hier.topology import ProcessGroups, Topology

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.optim import Optimizer

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 300.0
DEFAULT_INIT_TIMEOUT_S = 600.0
START_METHODS = ("popen", "spawn", "fork")
BACKENDS = (None, "gloo", "nccl", "mpi")


class HierStrategy(FinishOnce, FiniteChecks, FailureHandling, CheckpointingStrategy):
    """Base class of the lightning-hier strategies (see the module docstring).

    Args:
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
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin:
            Set by the Trainer; as in Lightning's own strategies.
    """

    strategy_name: ClassVar[str] = ""
    """Registry name; ``name``, ``name_spawn`` and ``name_fork`` are registered on import."""

    def __init__(
        self,
        timeout: float | timedelta = DEFAULT_TIMEOUT_S,
        init_timeout: float | timedelta = DEFAULT_INIT_TIMEOUT_S,
        start_method: str = "popen",
        process_group_backend: str | None = None,
        check_finite: bool = False,
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
        self._timeout: timedelta = _check_timeout(owner, "timeout", timeout)
        self._init_timeout = _check_timeout(owner, "init_timeout", init_timeout)
        self._start_method = v.check_choice(owner, "start_method", start_method, START_METHODS)
        self._process_group_backend = v.check_choice(owner, "process_group_backend", process_group_backend, BACKENDS)
        self.check_finite = v.check_bool(owner, "check_finite", check_finite)
        self._num_nodes = 1
        self._groups: ProcessGroups | None = None
        self._restored: dict[str, Any] | None = None
        self._eval_stack: ExitStack | None = None
        self.comm_stats = CommStats()
        self.data_position = DataPosition()
        self.last_metrics: dict[str, float] = {}

    # ------------------------------------------------------------------ layout and ranks
    def _layout(self) -> dict[str, int]:
        """Inner grid sizes (``pipe``, ``model``) of this strategy; data parallel by default."""
        return {}

    def _resolve_layout(self) -> None:
        """Decide a layout chosen at run time (each rank, default group up, before groups are built)."""

    @property
    @override
    def topology(self) -> Topology:
        """The validated rank layout (pure arithmetic; available before processes start)."""
        return Topology(world_size=self.num_nodes * self.num_processes, num_nodes=self.num_nodes, **self._layout())

    @property
    def groups(self) -> ProcessGroups:
        """This rank's process groups (after ``setup_environment``)."""
        if self._groups is None:
            raise RuntimeError(f"{type(self).__name__}: process groups are built in setup_environment().")
        return self._groups

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
        # shard data by the data-parallel coordinate only: ranks of one replica see the same data
        topo = self.topology
        return {"num_replicas": topo.data, "rank": topo.coords(self.global_rank).data}

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
        _ = self.topology  # validate the layout in the main process, before any rank starts
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = self._reporting_launcher(self._start_method)

    # ------------------------------------------------------------------ process groups
    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.set_world_ranks()
        assert self.cluster_environment is not None
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
        self._start_failure_board()

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

    # ------------------------------------------------------------------ set-up of the model
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
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
            self._setup_algorithm(trainer)
            if self._restored is not None:
                self._apply_restored_state()
            _finish.install(trainer)
            _data_position.install_callback(trainer)

    def _apply_restored_state(self) -> None:
        """Apply this rank's saved algorithm state and accounting (the RNG waits for ``on_train_start``)."""
        assert self._restored is not None
        self._load_algorithm_state(self._restored.get("algorithm", {}))
        self.comm_stats.load_state_dict(self._restored["comm"])
        self.data_position.restore(self._restored.get("data"))  # absent in format 1: Lightning's behaviour

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def _sync_initial_state(self) -> None:
        """Make every rank start from rank 0's weights (DDP does this in its constructor)."""
        assert self.lightning_module is not None
        tensors = list(self.lightning_module.parameters()) + list(self.lightning_module.buffers())
        with torch.no_grad():
            broadcast_([t.data for t in tensors], src=0, group=dist.group.WORLD)

    def _setup_algorithm(self, trainer: pl.Trainer) -> None:
        """Build the algorithm object (called at the end of ``setup`` when fitting)."""

    @override
    def _finalize_algorithm(self) -> None:
        """Leave the consensus model in every rank's module (called right after the fit's last step)."""

    def _load_algorithm_state(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`_algorithm_state`, applied at the end of ``setup`` on resume."""

    def _require_single_optimizer(self) -> Optimizer:
        if len(self.optimizers) != 1:
            raise NotImplementedError(
                f"{type(self).__name__} supports exactly one optimizer; configure_optimizers returned "
                f"{len(self.optimizers)}. Combine the parameter groups into one optimizer."
            )
        return self.optimizers[0]

    def _log(self, metrics: dict[str, float], logger: bool = True) -> None:
        """Record per-round metrics; logged through the LightningModule when logging is allowed.

        Args:
            metrics: Scalar metrics.
            logger: Also hand them to the Trainer's loggers at Lightning's cadence
                (``log_every_n_steps``); False keeps them in ``callback_metrics`` and the progress
                bar only (for a strategy that writes them to the loggers itself, e.g. every round).
        """
        self.last_metrics.update(metrics)
        module = self.lightning_module
        if module is not None and module._current_fx_name in ("optimizer_step", "training_step"):
            module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1, logger=logger)

    # ------------------------------------------------------------------ lifecycle hooks
    @override
    def on_validation_start(self) -> None:
        self._eval_stack = ExitStack()
        self._eval_stack.enter_context(self._consensus())

    @override
    def on_validation_end(self) -> None:
        if self._eval_stack is not None:
            self._eval_stack.close()
            self._eval_stack = None

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self._restored is not None:
            restore_rng(self._restored["rng"])  # the last moment before training draws from it
        self._restored = None  # everything is restored by now (optimizer states come after setup)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        module = self.lightning_module
        if module is not None and module._trainer is not None:
            self.data_position.batch_started(module.trainer.current_epoch, batch_idx)

    @property
    def _training_stage(self) -> bool:
        """Whether the trainer is fitting (its training loop), not validating, testing or predicting."""
        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        return trainer is not None and trainer.state.stage == RunningStage.TRAINING

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Make the training DataLoader resumable mid-epoch, with its own generator for iterator seeds.

        Without a generator, every ``iter(loader)`` draws a seed from the global RNG, and whether
        Lightning builds a throwaway iterator after a resume depends on where in the loop the
        checkpoint was taken; the global stream (dropout, augmentation) would then shift by one
        draw. The generator is seeded without drawing from the global RNG. The sampler resumes
        at the checkpoint's batch (:mod:`lightning_hier.strategies._data_position`).
        """
        if self._training_stage and isinstance(dataloader, DataLoader):
            if dataloader.generator is None:
                seed = (torch.initial_seed() + 1_000_003 * self.global_rank) % 2**63
                dataloader.generator = torch.Generator().manual_seed(seed)
            self.data_position.install(dataloader)
        return dataloader

    @override
    def on_train_end(self) -> None:
        super().on_train_end()  # finishes (FinishOnce), as a no-op when FinishFit already did
        warn_if_not_finite(self.lightning_module, type(self).__name__, self.global_rank)

    @override
    def teardown(self) -> None:
        self._stop_failure_board()
        # keep the process group alive (as DDP does): trainer.save_checkpoint() after fit needs it
        super().teardown()

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


MIN_TIMEOUT_S = 0.001  # gloo counts milliseconds: a shorter timeout would round to 0 (no bound at all)
MAX_TIMEOUT_S = 7 * 24 * 3600.0


def _check_timeout(owner: str, name: str, value: float | timedelta) -> timedelta:
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    return timedelta(seconds=v.check_float(owner, name, seconds, low=MIN_TIMEOUT_S, high=MAX_TIMEOUT_S))
