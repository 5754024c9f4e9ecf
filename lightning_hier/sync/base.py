"""The two objects a data-parallel step is made of: how replicas agree, and how each gets its batches.

A :class:`Sync` binds one of the algorithms of :mod:`lightning_hier.algorithms` to a model, its
optimizers and process groups; an :class:`Allocation` decides which samples each rank trains on.
Both are plain objects over torch (no Lightning), driven at fixed points of a training step::

    allocation.bind(binding); sync.bind(binding)     once: model, optimizers and groups exist
    allocation.batch_started(batch, i)               a (micro-)batch starts
    sync.reduce_gradients(optimizer)                 after backward, before the step
    sync.before_step(optimizer)
    sync.run_step(optimizer, step)                   the step itself (a parameter server replaces it)
    sync.after_step(optimizer) -> metrics            a window's merge, an averaging round
    allocation.step_ended()                          the step is done (DBS times it)
    sync.consensus() / sync.finalize()               the model to evaluate; the end of training
    state_dict() / load_state_dict()                 each object's own checkpoint state

:class:`~lightning_hier.strategies.HierStrategy` holds one of each and calls them from Lightning's
hooks. :meth:`Sync.attach` drives the same objects from any other loop (plain PyTorch, Lightning
Fabric, another trainer) through the optimizer's step hooks, as torchft's ``LocalSGD`` does.

Several optimizers (a GAN's generator and discriminator) are synchronised by the same rule, each
over its own parameters and on its own steps: a :class:`Sync` builds one algorithm per optimizer
(:meth:`Binding.parameter_sets`), and ``reduce_gradients`` / ``after_step`` act on the optimizer
being stepped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_hier.comm import CommStats
from lightning_hier.topology import ProcessGroups, Topology

DEFAULT_TIMEOUT = timedelta(seconds=300)


@dataclass
class Binding:
    """What a :class:`Sync` or :class:`Allocation` is bound to for one run of training.

    Attributes:
        module: The model (a LightningModule under Lightning).
        optimizers: Its optimizers, in the order the loop uses them.
        groups: This rank's process groups (:meth:`Topology.build`).
        stats: Communication accounting every collective adds to.
        timeout: Longest wait of a collective or a message.
        accumulation: Micro-batches per optimizer step (a new split starts at a multiple of it).
        seed: Seed shared by every rank (shuffling of re-batched loaders).
        callbacks: The loop's callbacks; a rule may take a schedule from them (averaging's
            :class:`~lightning_hier.sync.averaging.PullSchedule`).
        host: What drives the loop (the Lightning strategy, or ``None``), for the objects it
            supplied itself (such as a probe that re-runs its ``training_step``).
    """

    module: nn.Module
    optimizers: Sequence[Optimizer]
    groups: ProcessGroups
    stats: CommStats = field(default_factory=CommStats)
    timeout: timedelta = DEFAULT_TIMEOUT
    accumulation: int = 1
    seed: int = 0
    callbacks: Sequence[object] = ()
    host: Any = None
    _sets: tuple[tuple[int, ...], list[list[nn.Parameter]]] | None = field(default=None, init=False, repr=False)

    @property
    def topology(self) -> Topology:
        return self.groups.topology

    @property
    def rank(self) -> int:
        return self.groups.rank

    def parameter_sets(self) -> list[list[nn.Parameter]]:
        """The parameters each optimizer's algorithm synchronises, one list per optimizer.

        With one optimizer: every parameter of the module (frozen ones included, as they were
        before several optimizers were supported). With several: each optimizer's parameters in
        the module's order; a parameter no optimizer holds never changes and is left out.
        """
        key = tuple(id(o) for o in self.optimizers)
        if self._sets is None or self._sets[0] != key:  # computed once per set of optimizers
            self._sets = (key, self._partition())
        return self._sets[1]

    def _partition(self) -> list[list[nn.Parameter]]:
        params = list(self.module.parameters())
        if len(self.optimizers) <= 1:
            return [params]
        owner: dict[int, int] = {}
        for index, optimizer in enumerate(self.optimizers):
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if owner.setdefault(id(p), index) != index:
                        raise ValueError(
                            "lightning_hier: a parameter belongs to two optimizers; each optimizer's parameters "
                            "are synchronised by their own algorithm, so every parameter must have one optimizer."
                        )
        return [[p for p in params if owner.get(id(p)) == index] for index in range(len(self.optimizers))]

    def index_of(self, optimizer: Optimizer) -> int:
        """The position of ``optimizer`` (or the one it wraps, e.g. Lightning's ``LightningOptimizer``)."""
        inner = getattr(optimizer, "optimizer", optimizer)  # LightningOptimizer keeps the torch one here
        for index, candidate in enumerate(self.optimizers):
            if candidate is optimizer or candidate is inner:
                return index
        raise ValueError("lightning_hier: the optimizer being stepped is not one of the bound optimizers.")


class Sync:
    """How the replicas stay in agreement; the base does nothing (independent replicas).

    Subclasses override the points they act at (see the module docstring). ``lock_step`` says
    whether the ranks meet in a collective at every step; a rule that lets them run apart between
    its own collectives (HPSGD's overlapped windows, a parameter server) sets it False, and the
    Lightning adapter then takes Lightning's per-step SIGTERM broadcast out of the loop.
    """

    lock_step: bool = True
    owner: str = "Sync"
    """The name in error messages (the strategy class that holds it)."""
    reporting: str = "lightning"
    """How the metrics of :meth:`after_step` reach a logger: ``'lightning'`` (at the loop's logging
    cadence), ``'each'`` (every report written at its own step: rare reports, such as rounds) or
    ``'sparse'`` (a report every step that is only worth handing over at the logging cadence)."""

    def check_layout(self, topology: Topology) -> None:
        """Raise a ``ValueError`` when this rule cannot run on ``topology`` (before any rank starts, and at set-up)."""

    def fault_tolerance_problem(self) -> str | None:
        """Why this rule cannot keep training when a replica fails (``None``: it can; see :meth:`regroup`)."""
        return "its replicas meet at every step or hold state that no round carries, so a lost replica stops the run"

    def regroup(self, groups: ProcessGroups, guard: Any) -> None:
        """Run over ``groups`` from now on, each round through ``guard`` (a fault-tolerant run; every member calls it).

        Args:
            groups: The process groups of the live replicas.
            guard: A :class:`~lightning_hier.algorithms.averaging.RoundGuard`.
        """
        raise NotImplementedError(f"{self.owner}: {self.fault_tolerance_problem()}.")

    def bind(self, binding: Binding) -> None:
        """Build the algorithm(s) over ``binding`` (a collective when it builds groups)."""

    def settle(self) -> None:
        """Finish every collective in flight (a fault-tolerant run, before a replica joins); a collective."""

    def batch_started(self, batch: Any) -> None:
        """A training (micro-)batch starts."""

    def training_step(self, run: Callable[[], Any]) -> Any:
        """Run the loop's training step (``run``); a rule may run it differently."""
        return run()

    def observe(self, loss: Tensor | None) -> None:
        """The loss of the step just computed (LSGD elects its leader from it)."""

    def reduce_gradients(self, optimizer: Optimizer) -> None:
        """After backward of the step's last micro-batch, before ``optimizer`` steps."""

    def before_step(self, optimizer: Optimizer) -> None:
        """Right before ``optimizer``'s step (gradients final)."""

    def run_step(self, optimizer: Optimizer, step: Callable[[], Any]) -> Any:
        """Take ``optimizer``'s step (``step``); a rule may take it elsewhere."""
        return step()

    def after_step(self, optimizer: Optimizer) -> dict[str, float]:
        """After ``optimizer``'s step: the rule's per-step work; returns metrics to log (often none)."""
        return {}

    def consensus(self) -> Any:
        """A context in which the model holds the consensus (validation, saving); the replica after."""
        return nullcontext()

    def finalize(self) -> dict[str, float]:
        """Leave the consensus model in the replica for good (end of training; idempotent, may go on).

        Returns:
            Final metrics to keep (not logged), often none.
        """
        return {}

    def pause(self) -> None:
        """Training stops for a while (the end of training): background work goes quiet."""

    def abort(self) -> None:
        """The run failed on this rank: release what the rule holds without a collective (peers may be gone)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict` (called after :meth:`bind`)."""

    # ------------------------------------------------------------------ any training loop
    @contextmanager
    def attach(
        self,
        module: nn.Module,
        optimizers: Optimizer | Sequence[Optimizer],
        groups: ProcessGroups | None = None,
        allocation: Allocation | None = None,
        stats: CommStats | None = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
    ) -> Iterator[Binding]:
        """Drive this rule from a plain training loop through the optimizers' step hooks.

        Inside the ``with`` block, every ``optimizer.step()`` first reduces the gradients and
        prepares the step (:meth:`reduce_gradients`, :meth:`before_step`), and afterwards runs the
        rule (:meth:`after_step`: a merge, a round). On exit the replicas take the consensus
        (:meth:`finalize`) and the hooks are removed. One batch per optimizer step (no gradient
        accumulation inside the block).

        Args:
            module: The model; its parameters may become views of flat buckets.
            optimizers: Its optimizer, or several (each synchronised on its own steps).
            groups: Process groups (``None``: the data-parallel groups of every rank in the
                default group, built here; a collective).
            allocation: The batch allocation that goes with the rule (DBS's shares), bound first.
            stats: Communication accounting (a new one if ``None``).
            timeout: Longest wait of the rule's collectives and messages.

        Yields:
            The :class:`Binding` (its ``stats`` count the bytes sent).

        Example:
            >>> sync = AveragingSync.localsgd(tau=8)  # doctest: +SKIP
            >>> with sync.attach(model, optimizer):  # doctest: +SKIP
            ...     for x, y in loader:
            ...         loss_fn(model(x), y).backward()
            ...         optimizer.step()
            ...         optimizer.zero_grad()
        """
        opts = [optimizers] if isinstance(optimizers, Optimizer) else list(optimizers)
        if groups is None:
            groups = Topology(world_size=dist.get_world_size()).build(dist.get_rank(), timeout=timeout)
        binding = Binding(module, opts, groups, stats if stats is not None else CommStats(), timeout, host=None)
        if allocation is not None:
            allocation.bind(binding)
        self.bind(binding)
        handles = []
        for opt in opts:
            handles.append(opt.register_step_pre_hook(self._pre_step_hook(allocation)))
            handles.append(opt.register_step_post_hook(self._post_step_hook(allocation)))
        try:
            yield binding
            self.finalize()
        finally:
            for handle in handles:
                handle.remove()

    def _pre_step_hook(self, allocation: Allocation | None) -> Callable[..., None]:
        def hook(optimizer: Optimizer, *_: Any) -> None:
            if allocation is not None:
                allocation.step_starting()
            self.reduce_gradients(optimizer)
            self.before_step(optimizer)

        return hook

    def _post_step_hook(self, allocation: Allocation | None) -> Callable[..., None]:
        def hook(optimizer: Optimizer, *_: Any) -> None:
            self.after_step(optimizer)
            if allocation is not None:
                allocation.step_ended()

        return hook


class Allocation:
    """How the training batches are made; the base leaves them to the sampler (each rank its shard).

    Under Lightning the base is Lightning's ``DistributedSampler`` split by the data-parallel
    coordinate: :meth:`sampler_kwargs`.
    """

    owner: str = "Allocation"
    equal_steps: bool = True
    """Every rank takes the same number of steps per epoch (False: a shared queue of samples)."""

    def check_layout(self, topology: Topology) -> None:
        """Raise a ``ValueError`` when the allocation cannot run on ``topology`` (before any rank starts)."""

    def check_training_loader(self, loader: Any) -> None:
        """Raise a ``ValueError`` for a training loader this allocation cannot split (before any rank starts)."""

    def bind(self, binding: Binding) -> None:
        """Prepare for a run of training (idempotent: a loader may be built first)."""

    def sampler_kwargs(self, topology: Topology, rank: int, training: bool) -> dict[str, int]:
        """``num_replicas`` and ``rank`` of a ``DistributedSampler`` for this rank (every stage)."""
        return {"num_replicas": topology.data, "rank": topology.coords(rank).data}

    def training_loader(self, loader: Any, seed: int = 0) -> Any:
        """The training loader this allocation draws from (``loader`` itself by default).

        Args:
            loader: The loop's training loader.
            seed: The seed every rank shares, for a re-batched loader's shuffling.
        """
        return loader

    def batch_started(self, batch: Any, batch_idx: int) -> None:
        """A training (micro-)batch starts."""

    def step_starting(self) -> None:
        """A plain loop's optimizer step starts (its batch was the step's only one)."""

    def loss_scale(self) -> float:
        """Factor on the current micro-batch's loss before backward (1.0 but in mixed steps)."""
        return 1.0

    def step_ended(self) -> None:
        """The optimizer step (every optimizer's, under manual optimization) is done."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict`."""


def regroup_all(
    binding: Binding | None, groups: ProcessGroups, group: Any, algorithms: Sequence[Any], guard: Any
) -> None:
    """What :meth:`Sync.regroup` does for a rule of one algorithm per optimizer over one group.

    Every algorithm runs over ``group`` (the live replicas' data group, of ``groups``) and its
    collectives through ``guard`` (a :class:`~lightning_hier.algorithms.round_guard.RoundGuard`).
    """
    assert binding is not None, "bind() first"
    binding.groups = groups
    for algorithm in algorithms:
        algorithm.regroup(group)
        algorithm.guard = guard


SAMPLE_WEIGHTS_PROBLEM = "DBS's sample weights follow every rank's share"
"""Why a rule with DBS's sample weights cannot keep training when a replica fails."""


# ---------------------------------------------------------------------------------- one algorithm per optimizer
PER_OPTIMIZER = "per_optimizer"
"""State key of a rule with several optimizers (one algorithm state each); one optimizer's state is unwrapped."""


def join_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The checkpoint state of one algorithm per optimizer: the single state itself, or all of them."""
    return dict(states[0]) if len(states) == 1 else {PER_OPTIMIZER: list(states)}


def split_state(state: dict[str, Any], count: int, owner: str) -> list[dict[str, Any]]:
    """Inverse of :func:`join_states` for ``count`` optimizers.

    Raises:
        ValueError: The state was saved with another number of optimizers.
    """
    states = state.get(PER_OPTIMIZER, [state])
    if len(states) != count:
        raise ValueError(
            f"{owner}: the checkpoint holds the state of {len(states)} optimizer(s), this run has {count}; "
            "resume with the same configure_optimizers."
        )
    return list(states)


@contextmanager
def all_consensus(contexts: Sequence[Callable[[], Any]]) -> Iterator[None]:
    """Enter every algorithm's consensus (in order; left in reverse)."""
    with ExitStack() as stack:
        for enter in contexts:
            stack.enter_context(enter())
        yield
