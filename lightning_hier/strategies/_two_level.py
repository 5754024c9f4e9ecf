"""The two-level arguments of the data-parallel families, defined once (``inter_node_every``, ``intra_node``).

:class:`TwoLevelOptions` validates the arguments at construction, checks them against the
layout before any process starts (Lightning has set ``num_nodes`` when it configures the
launcher) and again on every rank at set-up, and, with ``intra_node='step'``, averages the
gradients (and, with ``sync_buffers``, the float buffers) over ``data_intra`` after every
backward: DDP inside the node. The rule itself is in :mod:`lightning_hier.algorithms.two_level`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from lightning_hier import _validate as v
from lightning_hier.algorithms.averaging import float_buffers
from lightning_hier.algorithms.two_level import INTRA_NODE, LevelBytes, TwoLevel, average_gradients_, two_level_problem
from lightning_hier.comm import all_reduce_mean_
from lightning_hier.comm.collectives import Group
from lightning_hier.strategies._base import HierStrategy

if TYPE_CHECKING:
    from torch.optim import Optimizer


class TwoLevelOptions(HierStrategy):
    """Mixin of the strategies that take ``inter_node_every`` and ``intra_node`` (see the module docstring).

    Subclasses call :meth:`_configure_two_level` in ``__init__`` and build their algorithm over
    :meth:`_periodic_group` (``data``, or ``data_inter`` with ``intra_node='step'``) with
    :meth:`_levels` (the :class:`TwoLevel` of ``intra_node='window'``, else ``None``).
    """

    inter_node_every: int | None = None
    intra_node: str = "window"
    sync_buffers: bool = True
    _not_with_two_level: dict[str, tuple[Any, str]]

    def _configure_two_level(
        self,
        inter_node_every: int | None,
        intra_node: str,
        not_with: dict[str, tuple[Any, str]] | None = None,
        unsupported: str | None = None,
    ) -> None:
        """Validate and keep the arguments.

        Args:
            inter_node_every: ``m`` or ``None``.
            intra_node: ``'window'`` or ``'step'``.
            not_with: Arguments two-level synchronisation rejects: ``name -> (value, reason)``,
                rejected when the strategy's argument ``name`` equals ``value``.
            unsupported: Why this strategy offers no two-level rule at all (``None``: it does).
        """
        owner = type(self).__name__
        if inter_node_every is not None:
            inter_node_every = v.check_int(owner, "inter_node_every", inter_node_every, minimum=1)
        self.inter_node_every = inter_node_every
        self.intra_node = v.check_choice(owner, "intra_node", intra_node, INTRA_NODE)
        if inter_node_every is None and intra_node != "window":
            raise ValueError(
                f"{owner}: argument `intra_node` must be 'window' without `inter_node_every`, got {intra_node!r}: "
                "'step' (DDP inside the node) is a two-level option."
            )
        self._intra_bytes = LevelBytes(self.comm_stats)
        if inter_node_every is not None and unsupported:
            raise ValueError(f"{owner}: argument `inter_node_every`={inter_node_every} is not offered: {unsupported}.")
        if inter_node_every is not None:
            for name, (value, reason) in (not_with or {}).items():
                if getattr(self, name) == value:
                    raise ValueError(
                        f"{owner}: argument `inter_node_every`={inter_node_every} cannot be combined with "
                        f"{name}={value!r}: {reason}."
                    )

    def _problem_message(self, problem: str) -> str:
        return (
            f"{type(self).__name__}: argument `inter_node_every`={self.inter_node_every!r} "
            f"(intra_node={self.intra_node!r}) cannot run: {problem}."
        )

    def _check_two_level(self) -> None:
        problem = two_level_problem(
            self.inter_node_every, self.intra_node, self.num_nodes, self.topology.two_level_problem()
        )
        if problem:
            raise ValueError(self._problem_message(problem))

    @override
    def _configure_launcher(self) -> None:
        self._check_two_level()  # Lightning has set num_nodes: fail before any rank starts
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._check_two_level()  # a layout chosen at run time: every rank raises alike

    # ------------------------------------------------------------------ what the algorithm is built over
    @property
    def two_level(self) -> bool:
        """Whether two-level synchronisation is on."""
        return self.inter_node_every is not None

    def _periodic_group(self) -> Group:
        """The group of the family's periodic rule: ``data``, or ``data_inter`` when DDP runs inside the node."""
        return self.groups.data_inter if self.two_level and self.intra_node == "step" else self.groups.data

    def _period_factor(self) -> int:
        """``m`` with ``intra_node='step'`` (the rule runs across nodes every ``m`` windows), else 1."""
        return self.inter_node_every if self.two_level and self.intra_node == "step" and self.inter_node_every else 1

    def _levels(self) -> TwoLevel | None:
        """The two-level groups and period of ``intra_node='window'``, else ``None``."""
        if not self.two_level or self.intra_node != "window" or self.inter_node_every is None:
            return None
        return TwoLevel(self.groups.data_intra, self.groups.data_inter, self.inter_node_every)

    def _level_metrics(self, algorithm_bytes: LevelBytes | None) -> dict[str, float]:
        """``comm/bytes_intra`` and ``comm/bytes_inter``; empty on the flat rule."""
        if not self.two_level:
            return {}
        if algorithm_bytes is not None:  # intra_node='window': the algorithm counts both levels
            return algorithm_bytes.metrics()
        # intra_node='step': the node's gradients are intra, the periodic rule's collectives inter
        intra = self._intra_bytes.intra
        return {"comm/bytes_intra": float(intra), "comm/bytes_inter": float(self.comm_stats.bytes - intra)}

    # ------------------------------------------------------------------ DDP inside the node
    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if not self.two_level or self.intra_node != "step":
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_and_average() -> Any:
            output = closure()  # forward and backward of the step's last micro-batch
            self._average_in_node()
            return output

        return super().optimizer_step(optimizer, closure_and_average, model, **kwargs)

    def _average_in_node(self) -> None:
        module = self.lightning_module
        assert module is not None
        group = self.groups.data_intra
        with self._intra_bytes.counting("intra"):
            average_gradients_([p for p in module.parameters() if p.requires_grad], group, self.comm_stats)
            buffers = float_buffers(module) if self.sync_buffers else []
            if buffers:  # forward updated BatchNorm statistics: keep the node's replicas equal
                all_reduce_mean_(buffers, group, self.comm_stats)


TWO_LEVEL_ARGS = """        inter_node_every: ``None`` (default): one flat data-parallel group. An integer ``m >= 1``:
            two-level synchronisation on a multi-node job (``num_nodes > 1``): inside the node every
            {unit}, across nodes every ``m``-th one (see :mod:`lightning_hier.algorithms.two_level`).
        intra_node: With ``inter_node_every``: ``'window'`` (default; the {unit} rule inside the
            node) or ``'step'`` (DDP inside the node: gradients averaged over the node's replicas
            after every backward; the periodic rule then runs only across nodes, every ``m`` {unit}s)."""
