"""Lightning adapter of the integrated model x batch x domain grid.

:class:`Grid2DStrategy` (registered as ``grid2d``, ``grid2d_spawn``, ``grid2d_fork``): Gholami,
Azad, Jin, Keutzer, Buluc, "Integrated Model, Batch and Domain Parallelism in Training Neural
Networks", SPAA 2018, arXiv 1712.04432. The layers live in :mod:`lightning_hier.layers`, the cost
model and grid chooser in :mod:`lightning_hier.planner`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from typing_extensions import override

from lightning_hier import _validate as v
from lightning_hier.algorithms.averaging import float_buffers
from lightning_hier.comm import broadcast_object, broadcast_unless_equal_
from lightning_hier.layers import (
    GridCommStats,
    GridContext,
    full_state_dict,
    is_grid_model,
    load_full_state_dict,
    to_grid,
    trace_shapes,
)
from lightning_hier.planner import Link, Links, best_grid, format_table, measure_links, model_layers, plan_grids
from lightning_hier.rng import capture_rng, restore_rng
from lightning_hier.strategies import _checkpoint as ckpt
from lightning_hier.strategies._grid_inputs import check_grid, input_shape, lookup, network_path
from lightning_hier.strategies._grid_sync import GridSync
from lightning_hier.strategies._inter_node import InterNodeLevel
from lightning_hier.strategies._launchers import _ReportingLauncher
from lightning_hier.strategies._user_model import (
    describe,
    find_network,
    first_input,
    first_training_batch,
    require_automatic_optimization,
)
from lightning_hier.strategies.adapter import HierStrategy, single_optimizer

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.utilities.types import _PATH

log = logging.getLogger(__name__)


class Grid2DStrategy(HierStrategy):
    """Integrated model x batch x domain parallelism on a Pr x Pc grid of ranks (rank = c * Pr + r).

    At set-up every rank takes rank 0's model and converts it in place
    (:func:`lightning_hier.layers.to_grid`): Linear layers are sharded by output features over the
    MODEL group (size Pr), convolutions, BatchNorm and pooling run on slabs of image rows with halo
    exchanges, and the slabs are gathered before the first Flatten / global pooling. Data is
    sharded over the BATCH group (size Pc) only: every rank of a MODEL group sees the same batch,
    so the DataLoader's ``batch_size`` is the batch of one MODEL group and the global batch is
    ``batch_size * Pc``. After backward, gradients are reduced by parameter kind (sharded and
    replicated: mean over BATCH; slab-partial: sum over MODEL, then mean over BATCH). Layers that
    must stay whole are left unconverted (replicated, exact outside the convolutional part): tied
    parameters (an embedding tied to the output Linear), weights their parent reads directly
    (``nn.MultiheadAttention.out_proj``, any Linear/Conv2d the traced forward never calls); see
    :mod:`lightning_hier.layers.replicated`. ``nn.TransformerEncoderLayer`` keeps its attention whole
    and shards its MLP.

    Args:
        grid: ``(Pr, Pc)`` with ``Pr * Pc`` = number of processes, or ``'auto'``: every candidate
            is costed by :func:`lightning_hier.planner.best_grid` for this model, input shape and
            DataLoader batch size, choosing the least communication time per sample. Both are
            found with ``lightning_getattr`` (``batch_size`` and ``input_shape`` on the module, its
            hparams or the datamodule, or ``example_input_array``) when the processes start;
            otherwise in ``setup`` from the first training batch (its input: the batch itself, its
            first element or first dict value), after which the grid's groups are built. The model
            is traced through its ``forward``, or, for a module without one, through its network
            (found like :class:`~lightning_hier.strategies.DecoupledStrategy`'s blocks).
        alpha: Seconds per message for ``'auto'``; ``None`` measures it on the live groups (then
            the choice may differ between runs: give both for a reproducible layout).
        beta: Seconds per word for ``'auto'``; ``None`` measures it.
        max_model: Largest Pr ``'auto'`` may choose (``None``: any); with a given ``grid`` it may not be below its Pr.
        inter_node_every: ``None`` (default): one grid over every rank. ``m >= 1``: two levels (a
            multi-node job): the grid's MODEL dimension and its per-step BATCH gradient
            reduction stay inside each node (the node's ``Pc / num_nodes`` batch blocks), and the
            node replicas meet every ``m`` optimizer steps across nodes by the ``inter_node`` rule.
            ``Pr`` must divide the ranks of a node (``'auto'`` then plans the node's grid).
        inter_node: The cross-node rule: ``'localsgd'`` (mean of the node replicas every ``m``
            steps) or ``'hpsgd'`` (HPSGD with window ``m``: the change's all-reduce overlaps the next
            window). See :mod:`lightning_hier.strategies._inter_node`.
        **kwargs: See :class:`~lightning_hier.strategies.HierStrategy` (``timeout``,
            ``start_method``, ...).

    Requirements and limits (checked with a clear error): one optimizer, element-wise (SGD, Adam,
    ...: layer-wise norms as in LARS would see only a shard); no gradient clipping by norm (value
    clipping is fine). After ``fit`` the module stays in grid form; the checkpoint's
    ``state_dict`` and the weights returned to the main process by the spawn/fork launchers are
    the ordinary network's (gathered). BatchNorm running statistics (per batch block) are
    averaged over BATCH for validation, saving and at the end of fit.

    Example:
        >>> import lightning.pytorch as pl
        >>> import lightning_hier  # registers the names
        >>> trainer = pl.Trainer(strategy=Grid2DStrategy(grid=(2, 2)), accelerator="cpu", devices=4)  # doctest: +SKIP
    """

    strategy_name = "grid2d"

    def __init__(
        self,
        grid: Sequence[int] | str = "auto",
        alpha: float | None = None,
        beta: float | None = None,
        max_model: int | None = None,
        inter_node_every: int | None = None,
        inter_node: str = "localsgd",
        **kwargs: Any,
    ) -> None:
        owner = type(self).__name__
        self.inter_level = InterNodeLevel(owner, inter_node_every, inter_node)
        super().__init__(sync=GridSync(self.inter_level), **kwargs)
        self._grid = check_grid(owner, grid)
        self.alpha = None if alpha is None else v.check_float(owner, "alpha", alpha, low=0.0)
        self.beta = None if beta is None else v.check_float(owner, "beta", beta, low=0.0)
        if (alpha is None) != (beta is None):
            raise ValueError(
                f"{owner}: give both `alpha` and `beta`, or neither (measure), got {alpha!r} and {beta!r}."
            )
        self.max_model = None if max_model is None else v.check_int(owner, "max_model", max_model, minimum=1)
        if self._grid is not None and self.max_model is not None and self._grid[0] > self.max_model:
            raise ValueError(
                f"{owner}: argument `max_model`={self.max_model} is below Pr={self._grid[0]} of grid={grid!r}; "
                "max_model bounds what grid='auto' may choose: leave it None with a given grid, or give grid='auto'."
            )
        self.grid_stats = GridCommStats()
        self.comm_stats = self.grid_stats
        self.grid_context: GridContext | None = None
        self._first_input: Tensor | None = None

    # ------------------------------------------------------------------ layout
    @property
    def grid(self) -> tuple[int, int] | None:
        """``(Pr, Pc)``; ``None`` while ``'auto'`` is undecided (before the processes start)."""
        return self._grid

    @override
    def _layout(self) -> dict[str, int]:
        if self._grid is None:
            return {}  # 'auto': decided in each rank once the model is known
        pr, pc = self._grid
        world = self.num_nodes * self.num_processes
        if world and pr * pc != world:
            raise ValueError(
                f"{type(self).__name__}: grid=({pr}, {pc}) has {pr * pc} ranks, but the Trainer runs {world} "
                f"processes (devices x num_nodes); give a grid with Pr * Pc = {world}, or grid='auto'."
            )
        return {"model": pr}

    @property
    def node_local(self) -> bool:
        """Whether the grid is each node's (two levels: ``inter_node_every`` is set)."""
        return self.inter_level.enabled

    @override
    def _resolve_layout(self) -> None:
        module = self.lightning_module
        assert module is not None
        # the real limit first, before the network is traced
        require_automatic_optimization(type(self).__name__, module, "the grid reduces each shard's gradients itself")
        if self._grid is not None:
            return
        if self.world_size == 1:
            self._grid = (1, 1)
            return
        module = self.lightning_module
        batch, shape = lookup(module, "batch_size"), input_shape(module)
        if batch is not None and shape is not None:
            self._choose_grid(int(batch), shape)
        # else: setup() decides from the first training batch (a DataModule is set up only then);
        # until then the groups are those of the pure batch grid (1, W), which need no new groups

    def _choose_grid(self, batch: int, shape: tuple[int, ...], source: str = "") -> None:
        module = self.lightning_module
        assert module is not None
        links: Link | Callable[[int, int], Links]
        if self.alpha is None or self.beta is None:
            links = measure_links(self.num_nodes)
        else:
            links = Link(self.alpha, self.beta)
        network = network_path(module)
        if network is None:
            try:
                find_network(module)
            except ValueError as err:
                raise ValueError(
                    f"{type(self).__name__}(grid='auto') costs the network on its input, but {type(module).__name__} "
                    f"defines no forward and {err}; define forward, or give grid=(Pr, Pc)."
                ) from None
        try:
            layers = model_layers(module.get_submodule(network or ""), shape)
        except Exception as err:
            what = f"{type(module).__name__}.{network}" if network else type(module).__name__
            raise ValueError(
                f"{type(self).__name__}(grid='auto') traces {what} on one zero sample of shape {list(shape)}{source}, "
                f"and its forward failed ({type(err).__name__}: {err}); give grid=(Pr, Pc)."
            ) from err
        kwargs: dict[str, Any] = {"links": links, "batch_scope": "replica", "max_model": self.max_model}
        # two levels: the grid is a node's, so plan over the ranks of one node (Pr then divides them)
        planned = self.world_size // self.num_nodes if self.node_local else self.world_size
        plan = best_grid(layers, batch, planned, **kwargs)
        pr = int(broadcast_object(plan.pr, 0, dist.group.WORLD))  # measured links may differ per rank
        self._grid = (pr, self.world_size // pr)
        if self.global_rank == 0:
            table = format_table(plan_grids(layers, batch, planned, **kwargs))
            rank_zero_info(f"grid2d: grid='auto' chose Pr x Pc = {pr} x {self.world_size // pr}\n{table}")

    def _grid_from_first_batch(self, trainer: pl.Trainer) -> None:
        """Decide grid='auto' from the first training batch, then build the grid's groups."""
        module = self.lightning_module
        assert module is not None
        if trainer.state.fn != TrainerFn.FITTING:
            self._grid = (1, self.world_size)  # nothing to cost outside fit: pure batch parallelism
            return
        batch = first_training_batch(module, trainer, self.root_device)
        x = first_input(batch)
        if x is None or x.dim() < 1:
            raise ValueError(
                f"{type(self).__name__}(grid='auto') needs the DataLoader batch size and the input shape. Not set "
                "(`batch_size` and `input_shape` on the LightningModule, its hparams or datamodule, or "
                f"`example_input_array`), and the first training batch is {describe(batch)}, with no input tensor "
                "first. Set them, or give grid=(Pr, Pc)."
            )
        self._first_input = x[:1]
        batch_size = lookup(module, "batch_size")
        shape = input_shape(module) or tuple(x.shape[1:])
        self._choose_grid(int(batch_size or x.shape[0]), shape, " (from the first training batch)")
        if self._grid != (1, self.world_size):
            self._groups = self.topology.build(self.global_rank, timeout=self._init_timeout)
            self._set_collective_timeout()
        if self._grid != (1, self.world_size) or self.node_local:
            self._build_context()

    def _build_context(self) -> None:
        self.inter_level.check(self.topology)  # on every rank alike, once the grid is known
        self.grid_context = GridContext.from_groups(self.groups, self.grid_stats, self._timeout, self.node_local)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self._grid is not None or not self.node_local:  # 'auto' undecided: checked once it is
            self._build_context()
        else:
            self.grid_context = GridContext.from_groups(self.groups, self.grid_stats, self._timeout)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if self._grid is None:
            self._grid_from_first_batch(trainer)
        grid = self.sync
        assert isinstance(grid, GridSync) and self.lightning_module is not None
        grid.start(self.lightning_module, self.grid_context, self.grid_stats)
        super().setup(trainer)

    # ------------------------------------------------------------------ model set-up
    def _example(self, module: Any, network: str | None) -> Tensor | None:
        """A one-sample input of the traced network (to check every layer at conversion), if known."""
        if network is None:
            return None
        shape = input_shape(module)
        if shape is not None:
            ref = next(iter(module.parameters()), None)
            example = torch.zeros(1, *shape, dtype=ref.dtype if ref is not None else None)
        elif self._first_input is not None:
            example = self._first_input
        else:
            return None
        try:
            trace_shapes(module.get_submodule(network), example)
        except Exception as err:  # e.g. training_step reshapes the input first: the layers check at run time
            what = f"{type(module).__name__}.{network}" if network else type(module).__name__
            log.warning(
                "grid2d: cannot trace %s on an input of shape %s (%s); layers check at run time.",
                what,
                list(example.shape),
                err,
            )
            return None
        return example

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the per-rank states are of the grid model, which exists only after setup

    @override
    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        module = self.lightning_module
        assert module is not None and self.grid_context is not None
        if not is_grid_model(module):
            with torch.no_grad():  # every rank shards the same (rank 0's) network
                tensors = [t.data for t in [*module.parameters(), *module.buffers()]]
                self.start_broadcast = broadcast_unless_equal_(tensors, 0, dist.group.WORLD)
            network = network_path(module)
            to_grid(module, self.grid_context, self._example(module, network), network or "")
        return model

    @override
    def _sync_initial_state(self) -> None:
        # weights were broadcast before sharding; the RNG must agree inside each MODEL group so that
        # dropout masks and augmentation match on ranks that compute the same activations
        g = self.grid_context
        if g is not None and g.model_group is not None:
            restore_rng(broadcast_object(capture_rng(), g.model_ranks[0], g.model_group))

    @override
    def _bind_sync(self, trainer: pl.Trainer) -> None:
        single_optimizer(self)
        if trainer.gradient_clip_val and trainer.gradient_clip_algorithm != "value":
            raise NotImplementedError(
                f"{type(self).__name__}: gradient clipping by norm would use each rank's shard norm; use "
                "gradient_clip_algorithm='value', or no clipping."
            )
        super()._bind_sync(trainer)  # the grid's reducer
        module = self.lightning_module
        assert module is not None
        self.inter_level.build(module.parameters(), self.groups, float_buffers(module), self.comm_stats)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The ordinary network's state (sharded weights gathered): loads into the unsharded model."""
        assert self.lightning_module is not None
        with self.sync.consensus():
            return ckpt.detach_state(full_state_dict(self.lightning_module))

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        if self._restored is not None:  # runs after setup here (restore_checkpoint_after_setup)
            self._apply_restored_state()
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        if self._restored is not None:
            super().load_model_state_dict(checkpoint, strict)
        else:  # an ordinary state dict (validate / test / predict from a checkpoint)
            assert self.lightning_module is not None
            load_full_state_dict(self.lightning_module, checkpoint["state_dict"], strict)

    @override
    def _check_layout(self) -> None:
        super()._check_layout()
        self.inter_level.check(self.topology)  # before any rank starts (grid='auto': only num_nodes is known)

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if isinstance(self._launcher, _ReportingLauncher):
            self._launcher = self.guard.launcher(self, self._start_method, _GridLauncher, self.check_fit_arguments)


class _GridLauncher(_ReportingLauncher):
    """Spawn/fork launcher that hands the *ordinary* (gathered) weights back to the main process."""

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> Any:
        full = self._strategy.lightning_module_state_dict()  # a collective: on every rank
        output = super()._collect_rank_zero_results(trainer, results)
        if output is not None and output.weights_path is not None:
            self._strategy.checkpoint_io.save_checkpoint(full, output.weights_path)
        return output
