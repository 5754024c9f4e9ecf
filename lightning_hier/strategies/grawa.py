"""Lightning adapter of GRAWA, gradient-based weighted averaging (``grawa``, ``mgrawa``, ``lgrawa``).

Dimlioglu and Choromanska, "GRAWA: Gradient-based Weighted Averaging for Distributed Training of
Deep Learning Models", AISTATS 2024, arXiv 2403.04206. The math is in
:mod:`lightning_hier.algorithms.grawa`; the round mechanism, schedule, consensus model and
checkpoints are the averaging family's rule (:class:`~lightning_hier.sync.AveragingSync`), with a
probe that re-runs the module's ``training_step`` (:class:`~lightning_hier.strategies._probe.TrainingStepProbe`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from typing_extensions import override

from lightning_hier import _validate as v
from lightning_hier.algorithms.claim_sampler import SAMPLERS
from lightning_hier.algorithms.grawa import DEFAULT_BETA
from lightning_hier.strategies._probe import PROBES, TrainingStepProbe
from lightning_hier.strategies.adapter import HierStrategy
from lightning_hier.sync.averaging import ROUNDS, AveragingSync
from lightning_hier.sync.levels import TWO_LEVEL_ARGS, Levels
from lightning_hier.sync.shared_queue import SharedQueue

if TYPE_CHECKING:
    from lightning.fabric.strategies import _StrategyRegistry


class GrawaStrategy(HierStrategy):
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
        **kwargs: See :class:`~lightning_hier.strategies.HierStrategy`.

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
        owner = type(self).__name__
        probe = v.check_choice(owner, "probe", probe, PROBES)
        probe_seed = v.check_int(owner, "probe_seed", probe_seed, minimum=0)
        rounds = v.check_choice(owner, "rounds", rounds, ROUNDS)
        if v.check_choice(owner, "sampler", sampler, SAMPLERS) == "shared" and rounds != "async":
            raise ValueError(
                f"{owner}: argument `sampler`='shared' needs rounds='async': with the shared queue the ranks take "
                "different numbers of steps, and lock-step rounds are collectives every rank must reach at the same "
                f"step; got rounds={rounds!r}. Use rounds='async' or sampler='split'."
            )
        sync = AveragingSync.grawa(
            variant,
            tau,
            lam,
            rho,
            beta,
            eps,
            p,
            norm,
            rounds,
            sync_buffers=sync_buffers,
            bucket_size_mb=bucket_size_mb,
            levels=Levels(owner, inter_node_every, intra_node),
            norms=TrainingStepProbe(probe, probe_seed, owner),
            owner=owner,
        )
        super().__init__(sync=sync, allocation=SharedQueue(sync, owner) if sampler == "shared" else None, **kwargs)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        cls._register_family(strategy_registry, "grawa")
        cls._register_family(strategy_registry, "mgrawa", variant="model")
        cls._register_family(strategy_registry, "lgrawa", variant="layer")


GrawaStrategy.__doc__ = (GrawaStrategy.__doc__ or "").replace("    {two_level}", TWO_LEVEL_ARGS.format(unit="round"))
