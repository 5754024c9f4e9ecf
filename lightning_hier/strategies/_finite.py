"""The opt-in non-finite guard (``check_finite=True``) shared by every strategy of this package.

A NaN or inf on one rank does not stay there: the next all-reduce (of gradients, of a window's
change, of replicas toward a center) carries it into every rank's model, and a fit ends "fine"
with a useless consensus model. With the guard on, each rank checks, at the three points where
its own numbers are complete and not yet communicated,

1. the loss returned by ``training_step`` (before backward: DDP's hooks reduce during backward),
2. the gradients after backward (before DBS's and grid2d's reductions and the optimizer step),
3. the parameters after the optimizer step (before an algorithm's round),

and raises :class:`NonFiniteError` naming the rank, the step and what was not finite. The raise
goes through the strategy's usual failure handling, so the peers name this rank and stop
within seconds instead of training on.

The checks cost one reduction per tensor per step, so they are off by default. Without them a
non-finite model at the end of fit still gets one warning (see :func:`warn_if_not_finite`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from collections.abc import Callable

    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ParallelStrategy as Strategy

log = logging.getLogger(__name__)


class NonFiniteError(FloatingPointError):
    """A rank's loss, gradient or parameter was NaN or infinite (raised with ``check_finite=True``).

    Attributes:
        rank: The global rank that found it.
        step: The optimizer step (``trainer.global_step``) being computed.
        what: ``'loss'``, ``'gradients'`` or ``'parameters'``.
    """

    def __init__(self, message: str, rank: int, step: int, what: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.step = step
        self.what = what


def loss_of(output: Any) -> Tensor | None:
    """The loss in a ``training_step`` output (a tensor, or a mapping with ``'loss'``)."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, Mapping) and isinstance(output.get("loss"), Tensor):
        return output["loss"]
    return None


def all_finite(tensors: Iterable[Tensor | None]) -> bool:
    """Whether every element of every tensor is finite (one host sync for all of them)."""
    # the max of |x| is inf for an inf and NaN for a NaN (max propagates NaN), and unlike a
    # norm it cannot overflow on large finite values
    peaks = [t.detach().abs().amax() for t in tensors if t is not None and t.numel() > 0]
    return not peaks or bool(torch.stack([p.float() for p in peaks]).isfinite().all())


def _where(trainer: pl.Trainer | None) -> tuple[int, str]:
    if trainer is None:
        return -1, "outside a fit"
    step = trainer.global_step
    batch = trainer.fit_loop.epoch_loop.batch_idx
    return step, f"at global step {step} (epoch {trainer.current_epoch}, batch {batch})"


class FiniteGuard:
    """The ``check_finite`` guard of one strategy (see the module docstring); does nothing when off.

    Args:
        enabled: The strategy's ``check_finite`` argument.
        owner: The strategy's class name, for the error message.
    """

    def __init__(self, enabled: bool, owner: str) -> None:
        self.enabled = enabled
        self.owner = owner

    def check_loss(self, strategy: Strategy, loss: Tensor | float | None) -> None:
        """Raise :class:`NonFiniteError` if ``loss`` is NaN or infinite (``None``: nothing to check)."""
        if not self.enabled or loss is None:
            return
        value = loss.detach() if isinstance(loss, Tensor) else torch.tensor(loss)
        if not all_finite([value]):
            self.raise_non_finite(strategy, "loss", f": {value.float().mean().item()}")

    def check_gradients(self, strategy: Strategy) -> None:
        """After backward: this rank's gradients, before any reduction carries them to the others."""
        if self.enabled:
            self._check_module(strategy, "gradients", lambda p: p.grad)

    def check_parameters(self, strategy: Strategy) -> None:
        """After the optimizer step: this rank's parameters, before an algorithm's round."""
        if self.enabled:
            self._check_module(strategy, "parameters", lambda p: p)

    def _check_module(self, strategy: Strategy, what: str, pick: Callable[[torch.nn.Parameter], Tensor | None]) -> None:
        module = strategy.lightning_module
        if module is None:
            return
        named = list(module.named_parameters())
        if all_finite(pick(p) for _, p in named):
            return
        bad = [name for name, p in named if not all_finite([pick(p)])]
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        self.raise_non_finite(strategy, what, f" (in {shown})")

    def raise_non_finite(self, strategy: Strategy, what: str, detail: str) -> None:
        """Raise :class:`NonFiniteError` for ``what`` on this rank, naming the step."""
        module = strategy.lightning_module
        trainer = module._trainer if module is not None else None
        step, where = _where(trainer)
        rank = strategy.global_rank
        raise NonFiniteError(
            f"{self.owner}: rank {rank} has non-finite {what} {where}{detail}; stopped before it "
            "reaches the other ranks (check_finite=True). Lower the learning rate, clip gradients "
            "(Trainer(gradient_clip_val=...)) or check this rank's data.",
            rank=rank,
            step=step,
            what=what,
        )


def warn_if_not_finite(module: torch.nn.Module | None, owner: str, rank: int) -> bool:
    """Log a warning if ``module``'s parameters are not all finite; whether they were."""
    if module is None or all_finite(module.parameters()):
        return True
    log.warning(
        "%s: the model on rank %d has non-finite parameters at the end of fit. Set check_finite=True "
        "on the strategy to stop at the first NaN/inf and learn which rank and step produced it.",
        owner,
        rank,
    )
    return False
