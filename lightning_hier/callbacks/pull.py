"""The pull-to-center callback: the *policy* of the model-averaging strategies.

The split: the strategy's rule (:class:`~lightning_hier.sync.AveragingSync` of ``localsgd``,
``easgd``, ``lsgd``, ``grawa`` / ``mgrawa`` / ``lgrawa``) owns everything that communicates — the
center, the pull, the proximal pull, the consensus model, the bytes — and, when the Trainer has
this callback, asks it after every optimizer step *how much* and *how often*:

- :meth:`PullToCenter.lam_at` the pull strength of the next round,
- :meth:`PullToCenter.rho_at` the proximal strength of this step,
- :meth:`PullToCenter.tau_at` the length of the current period,

and, after every round, :meth:`PullToCenter.on_round` decides what is logged. Without a
``PullToCenter`` in ``Trainer(callbacks=...)`` the rule keeps its constructor's constants and logs
the standard metrics of every round. Every rank must answer the same (a function of the counters it is
given), since all ranks take part in every round.

Example (a pull that strengthens over the first rounds, every per-layer weight logged)::

    class RampedPull(PullToCenter):
        def lam_at(self, round_index, default):
            return min(default, 0.1 * (round_index + 1))

    trainer = pl.Trainer(strategy="lgrawa", callbacks=[RampedPull(log_layer_weights=True)])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_hier import _validate as v
from lightning_hier.sync.averaging import AveragingSync

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_hier.algorithms.centers import RoundReport

Schedule = Callable[[int], float]


class PullToCenter(Callback):
    """Pull schedule and per-round logging of an averaging strategy (see the module docstring).

    Args:
        lam: Pull strength in (0, 1], or a function ``round_index -> strength``; ``None``: the
            strategy's (its ``lam``; EASGD: ``alpha``).
        rho: Proximal strength in [0, 1] (per step ``x += rho / tau (center - x)``), or a function
            ``step -> strength``; ``None``: the strategy's.
        tau: Period in optimizer steps (>= 1), or a function ``round_index -> period``; ``None``:
            the strategy's.
        log_layer_weights: Also log every rank's weight of every parameter tensor (LGRAWA), named
            ``grawa/layer_weight/rank{r}/{parameter name}``.
        log_every_round: Write every round's metrics to the Trainer's loggers at that round's
            step (rounds seldom fall on ``log_every_n_steps``); False leaves them to Lightning's
            logging cadence (the latest round's values at each logging step).

    Functions given here must be picklable for ``start_method='spawn'`` (use a subclass that
    overrides :meth:`lam_at`, :meth:`rho_at` or :meth:`tau_at` instead of a lambda).
    """

    def __init__(
        self,
        lam: float | Schedule | None = None,
        rho: float | Schedule | None = None,
        tau: int | Callable[[int], int] | None = None,
        log_layer_weights: bool = False,
        log_every_round: bool = True,
    ) -> None:
        owner = type(self).__name__
        if lam is not None and not callable(lam):
            v.check_float(owner, "lam", lam, 0.0, 1.0, low_inclusive=False)
        if rho is not None and not callable(rho):
            v.check_float(owner, "rho", rho, 0.0, 1.0)
        if tau is not None and not callable(tau):
            v.check_int(owner, "tau", tau, minimum=1)
        self.lam, self.rho, self.tau = lam, rho, tau
        self.log_layer_weights = v.check_bool(owner, "log_layer_weights", log_layer_weights)
        self.log_every_round = v.check_bool(owner, "log_every_round", log_every_round)
        self._fit: tuple[pl.Trainer, pl.LightningModule] | None = None

    def lam_at(self, round_index: int, default: float) -> float:
        """Pull strength of round ``round_index`` (0-based); ``default`` is the strategy's."""
        return _resolve(self.lam, round_index, default)

    def rho_at(self, step: int, default: float) -> float:
        """Proximal strength after optimizer step ``step`` (0-based); ``default`` is the strategy's."""
        return _resolve(self.rho, step, default)

    def tau_at(self, round_index: int, default: int) -> int:
        """Length of the period that ends with round ``round_index``; ``default`` is the strategy's."""
        return _resolve(self.tau, round_index, default)

    def on_round(self, trainer: pl.Trainer, pl_module: pl.LightningModule, report: RoundReport) -> dict[str, float]:
        """Metrics to log for one round (the strategy logs them at this step)."""
        metrics = report.metrics()
        if self.log_layer_weights and report.weights is not None and report.weights.shape[1] > 1:
            names = [name for name, _ in pl_module.named_parameters()]
            for r, row in enumerate(report.weights):
                metrics.update({f"grawa/layer_weight/rank{r}/{n}": float(w) for n, w in zip(names, row, strict=True)})
        return metrics

    def round_metrics(self, report: RoundReport) -> dict[str, float]:
        """The metrics of one round: :meth:`on_round` with this fit's trainer and module."""
        assert self._fit is not None, "set up by the Trainer first"
        return self.on_round(*self._fit, report)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not isinstance(getattr(trainer.strategy, "sync", None), AveragingSync):
            raise ValueError(
                f"{type(self).__name__} sets the pull of an averaging strategy (localsgd, easgd, lsgd, grawa, "
                f"mgrawa, lgrawa), but the trainer's strategy is {type(trainer.strategy).__name__}."
            )
        found = [c for c in trainer.callbacks if isinstance(c, PullToCenter)]  # type: ignore[attr-defined]
        if len(found) > 1:
            raise ValueError(f"Trainer has {len(found)} PullToCenter callbacks; an averaging strategy uses one.")
        self._fit = (trainer, pl_module)


def _resolve(value: Any, counter: int, default: Any) -> Any:
    if value is None:
        return default
    return value(counter) if callable(value) else value
