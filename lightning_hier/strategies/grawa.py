"""Lightning adapter of GRAWA, gradient-based weighted averaging (``grawa``, ``mgrawa``, ``lgrawa``).

Dimlioglu and Choromanska, "GRAWA: Gradient-based Weighted Averaging for Distributed Training of
Deep Learning Models", AISTATS 2024, arXiv 2403.04206. The math is in
:mod:`lightning_hier.algorithms.grawa`; the round mechanism, schedule, consensus model and
checkpoints are shared with the other averaging strategies
(:class:`~lightning_hier.strategies.averaging.AveragingStrategy`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from torch import Tensor
from torchmetrics import Metric
from typing_extensions import override

from lightning_hier import _validate as v
from lightning_hier.algorithms.centers import CenterPolicy
from lightning_hier.algorithms.grawa import DEFAULT_BETA, NORMS, VARIANTS, GradientWeightedCenter, probe_grad_norms
from lightning_hier.algorithms.grawa_async import AsyncGradientWeightedCenter
from lightning_hier.algorithms.ps_link import require_worker
from lightning_hier.comm import CommStats, all_reduce_mean_
from lightning_hier.comm.collectives import Group
from lightning_hier.strategies._async_rounds import AsyncRounds
from lightning_hier.strategies._finite import loss_of
from lightning_hier.strategies._probe import draw, first, fresh_batches_of, isolated_rng
from lightning_hier.strategies._shared_queue import SharedQueueStrategy
from lightning_hier.strategies._step_sync import local_sigterm_check
from lightning_hier.strategies._two_level import TWO_LEVEL_ARGS
from lightning_hier.strategies._user_model import muted_logs
from lightning_hier.strategies.averaging import AveragingStrategy

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.strategies import _StrategyRegistry

PROBES = ("fresh", "batch", "step")
ROUNDS = ("sync", "async")


class GrawaStrategy(SharedQueueStrategy, AveragingStrategy):
    """GRAWA: every ``tau`` steps, pull each replica toward a center weighted by inverse gradient norms.

    Registered as ``grawa`` (variant from the arguments), ``mgrawa`` (``variant='model'``) and
    ``lgrawa`` (``variant='layer'``), each with ``_spawn`` and ``_fork`` forms. Defaults follow the
    authors' released CIFAR script (tau 32, lam 0.5, rho 0.01).

    Args:
        variant: ``'model'`` (MGRAWA: one weight per replica) or ``'layer'`` (LGRAWA: one weight per
            replica and parameter tensor).
        tau: Period in optimizer steps (gradient accumulation does not change it).
        lam: Pull strength toward the center, in (0, 1]; ``x += lam (c - x)``.
        rho: Proximal pull toward the last center after every step (``rho / tau`` per step), in [0, 1].
        beta: EMA decay of the gradient norms, in [0, 1) (bias-corrected; default ``0.9 ** 8``).
        eps: Added to the norm before inverting, > 0 (a zero norm gives a large, finite weight).
        p: Exponent of the inverse norm, in (0, 8].
        norm: MGRAWA's model norm: ``'sum'`` of per-tensor norms (the authors' code) or ``'l2'``.
        probe: Gradients whose norms weight the replicas, measured once per round (and for the
            final round of a partial last period), each a side computation that leaves logging,
            torchmetrics states, BatchNorm statistics and the optimizer's gradients untouched:

            - ``'fresh'`` (default; the authors' code): one extra forward/backward of
              ``training_step`` at the current weights on a batch drawn from the *whole* training
              set, independently of the rank's shard: each rank draws, from its training
              DataLoader's dataset (a dict or list of DataLoaders, and datamodules, work too), a
              batch of the training batch size, collated and moved to the device as in training.
              The draws and every random number of the probe (augmentation, dropout) are seeded by
              ``(probe_seed, rank, step)``, and the training RNG stream and DataLoader are left
              where they were; so nothing extra is checkpointed and a resume draws the same
              batches. Needs a map-style dataset. Cost per round: fetching one batch plus one
              forward/backward.
            - ``'batch'``: the same on the round's last training batch, the one the rank has just
              stepped on. Cheaper to fetch, but the norm then rewards a replica for fitting its own
              batch: on label-skewed shards it favours the worse replica (measured below).
            - ``'step'``: the gradients of the step that closed the round, free, with the same bias
              as ``'batch'``; use it when ``training_step`` has other side effects.

            Measured (2 CPU ranks, 3 seeds, validation accuracy at equal epochs, mean): with
            label-skewed shards (each rank 80% of its five classes), MNIST 8k/2k MLP, 2 epochs,
            tau 16: MGRAWA 0.928 fresh / 0.891 batch / 0.891 step, LGRAWA 0.930 / 0.890 / 0.890;
            digits MLP, 4 epochs, tau 8: 0.969 / 0.971 / 0.972 and 0.968 / 0.971 / 0.972. With
            i.i.d. shards all three agree within 0.005 on both.
        probe_seed: Base seed of the fresh probe batches (``probe='fresh'``), >= 0.
        rounds: ``'sync'`` (default): every rank takes part in every round (lock-step collectives).
            ``'async'``: the authors' asynchronous rounds: after its own ``tau`` steps a rank sends
            its replica and its score to a parameter server (a thread on rank 0, which also trains),
            gets back the center of every rank's latest replica (weighted by the latest scores) and
            pulls toward it, without waiting for the others; see
            :mod:`lightning_hier.algorithms.grawa_async`. Ranks still meet at validation, checkpoints
            and the end of fit (the consensus model is the server's center). A rank silent for
            longer than ``timeout`` (no round) fails the run naming it: keep ``tau`` steps well
            under ``timeout``. Resuming restores the server's table from rank 0's state, but an
            asynchronous run is not bit-identical on resume (the arrival order is the machine's).
        sampler: Where each rank's training batches come from. ``'split'`` (default): Lightning's
            ``DistributedSampler``, so every rank takes the same number of steps per epoch and a
            fast rank waits for a slow one at the epoch's end even with asynchronous rounds.
            ``'shared'`` (needs ``rounds='async'``): every rank claims its next batch from a queue
            on the server, so a fast rank trains more of the epoch's samples (and reports more
            rounds) than a slow one, and every sample is trained once per epoch across the ranks;
            the Trainer options this rules out (per-step validation, ``max_steps``, step-based
            checkpoints or time limits) are rejected at set-up, and a schedule sized by
            ``trainer.estimated_stepping_batches`` cannot be built (the epoch has no length). As
            :class:`~lightning_hier.strategies.param_server.AsgdStrategy`'s ``sampler``.
        sync_buffers: Average floating-point buffers (BatchNorm statistics) uniformly at every round.
        bucket_size_mb: Size bound of the flat buffers reduced in one call (MiB, >= 0.001).
    {two_level}
        **kwargs: See :class:`~lightning_hier.strategies._base.HierStrategy`.

    Two levels (``inter_node_every=m``; :class:`~lightning_hier.algorithms.two_level.LevelRounds`):
    with ``intra_node='window'`` a round that is not an ``m``-th one pulls toward the *node's*
    center (the node's replicas weighted by their inverse gradient norms, over ``data_intra``),
    and every ``m``-th round is a flat round over the whole data group. The node rounds and the
    whole-job rounds keep separate norm EMAs. With ``intra_node='step'`` (DDP inside the node)
    the rounds run every ``m * tau`` steps over ``data_inter``, and the probed gradient norms are
    first averaged over the node's ranks (each rank probes its own batch), so a node's replicas
    get one weight and stay equal. ``rounds='async'`` is flat only.

    The consensus model (validation during fit, checkpoints' ``state_dict``) is the center: the
    replicas weighted with the latest round's weights. At the end of fit, a partial last period
    (or a fit shorter than ``tau``) gets a final round: a new probe of the trained replicas, its
    weights, and every rank's model becomes their center. Not offered: evaluating the uniform
    average with BatchNorm statistics recomputed over the training set (the authors' code also
    does this; it costs a pass over the data).

    Example:
        >>> import lightning.pytorch as pl
        >>> from lightning_hier import GrawaStrategy
        >>> strategy = GrawaStrategy(variant="layer", tau=16, lam=0.5, start_method="fork")
        >>> trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2)  # doctest: +SKIP
    """

    strategy_name = "grawa"

    def __init__(
        self,
        variant: str = "model",
        tau: int = 32,
        lam: float = 0.5,
        rho: float = 0.01,
        beta: float = DEFAULT_BETA,
        eps: float = 1e-8,
        p: float = 1.0,
        norm: str = "sum",
        probe: str = "fresh",
        probe_seed: int = 0,
        rounds: str = "sync",
        sampler: str = "split",
        sync_buffers: bool = True,
        bucket_size_mb: float = 25.0,
        inter_node_every: int | None = None,
        intra_node: str = "window",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        owner = type(self).__name__
        self.variant = v.check_choice(owner, "variant", variant, VARIANTS)
        self.beta = v.check_float(owner, "beta", beta, 0.0, 1.0, high_inclusive=False)
        self.eps = v.check_float(owner, "eps", eps, low=0.0, low_inclusive=False)
        self.p = v.check_float(owner, "p", p, 0.0, 8.0, low_inclusive=False)
        self.norm = v.check_choice(owner, "norm", norm, NORMS)
        self.probe = v.check_choice(owner, "probe", probe, PROBES)
        self.probe_seed = v.check_int(owner, "probe_seed", probe_seed, minimum=0)
        self.rounds = v.check_choice(owner, "rounds", rounds, ROUNDS)
        if self._check_sampler(sampler) == "shared" and self.rounds != "async":
            raise ValueError(
                f"{owner}: argument `sampler`='shared' needs rounds='async': with the shared queue the ranks take "
                "different numbers of steps, and lock-step rounds are collectives every rank must reach at the same "
                f"step; got rounds={self.rounds!r}. Use rounds='async' or sampler='split'."
            )
        self._async: AsyncRounds | None = None
        self._fresh: Any = None  # the FreshBatches of every training DataLoader (probe='fresh')
        self._configure(
            tau,
            lam,
            rho,
            sync_buffers,
            bucket_size_mb,
            inter_node_every=inter_node_every,
            intra_node=intra_node,
            not_with={"rounds": ("async", "asynchronous rounds talk to one parameter server; use rounds='sync'")},
        )

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        cls._register_family(strategy_registry, "grawa")
        cls._register_family(strategy_registry, "mgrawa", variant="model")
        cls._register_family(strategy_registry, "lgrawa", variant="layer")

    @override
    def _policy(self) -> CenterPolicy:
        kind = AsyncGradientWeightedCenter if self.rounds == "async" else GradientWeightedCenter
        return kind(self.variant, self.beta, self.eps, self.p, self.norm)

    @override
    def _setup_algorithm(self, trainer: pl.Trainer) -> None:
        super()._setup_algorithm(trainer)
        if self.rounds == "async" and self.algorithm is not None:
            local_sigterm_check(trainer)  # else Lightning's per-step broadcast keeps the workers in lock-step
            self._check_shared(trainer)  # every rank raises the same error, before any claim
            policy = self.algorithm.policy
            assert isinstance(policy, AsyncGradientWeightedCenter)
            claims = self._claim_queue if self.sampler == "shared" else None
            self._async = AsyncRounds.start(self.topology, self.algorithm.flat, self.variant, self._timeout, claims)
            policy.connect(require_worker(self._async).call, self.barrier)

    @override
    def _claim(self, epoch: int, n: int, num_samples: int) -> tuple[int, int]:
        link = self._async  # looked up at each claim: the loader may be built before set-up (an LR schedule)
        if link is None:
            raise self._fetched_before_setup()
        with self.comm_stats.blocked():
            return link.claim(epoch, n, num_samples)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self._async is not None:
            self._async.resume()  # paused at the last consensus (validation, checkpoint)

    @contextmanager
    @override
    def _consensus(self) -> Iterator[None]:
        if self._async is not None:
            self._async.resume()  # a second consensus at the same point (validation, then a checkpoint) asks again
        with super()._consensus():
            if self._async is not None:
                self._async.pause()  # every rank has read the server's center: no rank reports until training goes on
            yield

    @override
    def _finalize_algorithm(self) -> None:
        super()._finalize_algorithm()  # the final reports and the server's center
        if self._async is not None:
            self._async.pause()
            self.last_metrics.update(self._async.metrics())

    @override
    def on_train_end(self) -> None:
        super().on_train_end()  # the final round (finish_training) comes first
        if self._async is not None:
            # kept after it stops: a checkpoint saved after fit still holds the server's table
            self._async.pause()

    @override
    def _algorithm_state(self) -> dict[str, Any]:
        state = super()._algorithm_state()
        if self._async is not None and self._async.server is not None:
            state["server"] = self._async.server.state_dict()  # rank 0 keeps every rank's latest replica
        return state

    @override
    def _load_algorithm_state(self, state: dict[str, Any]) -> None:
        super()._load_algorithm_state(state)
        if self._async is not None and "server" in state:
            self._async.load_server_state(state["server"])

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        module = self.lightning_module
        if self.probe == "fresh" and module is not None:
            # the training DataLoaders exist from here on (Lightning set them up before this hook)
            loaders = module.trainer.train_dataloader
            self._fresh = fresh_batches_of(loaders, self.probe_seed, self.global_rank, type(self).__name__)

    @override
    def _norms(self) -> Callable[[], Tensor] | None:
        if self.probe == "step" or self.algorithm is None:
            return None
        params, module = self.algorithm.flat.tensors, self.lightning_module
        assert module is not None
        loss = self._fresh_probe_loss if self.probe == "fresh" else self._batch_probe_loss
        if self.two_level and self.intra_node == "step":  # one weight per node: its ranks' mean norms
            group, stats = self.groups.data_intra, self.comm_stats
            return lambda: _node_mean(probe_grad_norms(params, loss, module.buffers()), group, stats)
        return lambda: probe_grad_norms(params, loss, module.buffers())

    def _batch_probe_loss(self) -> Tensor:
        """The training loss of the round's last batch at the current weights (probe='batch')."""
        if self._step_args is None:
            raise RuntimeError("GrawaStrategy(probe='batch'): no training batch seen yet.")
        args, kwargs = self._step_args
        return self._training_loss(args, kwargs)

    def _fresh_probe_loss(self) -> Tensor:
        """The training loss of a batch drawn from the whole training set (probe='fresh').

        The batch and every random draw of the probe (augmentation, dropout) come from the seed of
        ``(probe_seed, rank, optimizer steps so far)``; the training RNG streams are put back after.
        """
        if self._fresh is None or self.algorithm is None:
            raise RuntimeError("GrawaStrategy(probe='fresh'): the training DataLoaders are not set up yet.")
        step = self.algorithm.schedule.steps
        with isolated_rng(first(self._fresh).seed_for(step)):
            batch = self.batch_to_device(draw(self._fresh, step))  # the module's transfer hooks, as in training
            rest: tuple[Any, ...] = (0,)  # batch_idx: that of the latest training batch when there is one
            kwargs: dict[str, Any] = {}
            if self._step_args is not None:
                (_, *others), kwargs = self._step_args
                rest = tuple(others)
            return self._training_loss((batch, *rest), kwargs)

    def _training_loss(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
        """``training_step(*args, **kwargs)``'s loss, as a side computation (nothing logged, metrics kept)."""
        module = self.lightning_module
        assert module is not None
        with _side_effect_free(module), self.precision_plugin.train_step_context():
            loss = loss_of(module.training_step(*args, **kwargs))
        if loss is None:
            raise RuntimeError(
                f"GrawaStrategy(probe={self.probe!r}): training_step returned no loss tensor; use probe='step'."
            )
        return loss


def _node_mean(norms: Tensor, group: Group, stats: CommStats) -> Tensor:
    """The mean of the node's probed norms (``intra_node='step'``: a node's replicas are one)."""
    all_reduce_mean_([norms], group, stats)
    return norms


@contextmanager
def _side_effect_free(module: pl.LightningModule) -> Iterator[None]:
    """Re-run a LightningModule hook as a side computation: nothing logged, torchmetrics states kept."""
    metrics = [m for m in module.modules() if isinstance(m, Metric)]
    saved = [(m._copy_state_dict(), m._update_count, m._computed, m._forward_cache) for m in metrics]
    try:
        with muted_logs(module):
            yield
    finally:
        for metric, (state, count, computed, cache) in zip(metrics, saved, strict=True):
            for name, value in state.items():
                setattr(metric, name, value)
            metric._update_count, metric._computed, metric._forward_cache = count, computed, cache


GrawaStrategy.__doc__ = (GrawaStrategy.__doc__ or "").replace("    {two_level}", TWO_LEVEL_ARGS.format(unit="round"))
