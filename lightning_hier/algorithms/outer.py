"""Outer optimizers: how an averaged model change moves the global model.

Periodic-averaging methods produce, every round or window, an average change of the replicas
``u = mean_w (x_w - x_start)``. Adding it (``S <- S + u``) is plain model averaging. DiLoCo
(Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models", 2023)
and FedOpt (Reddi et al., "Adaptive Federated Optimization", ICLR 2021) instead treat
``g = -u`` as an *outer gradient* and step an outer optimizer on it; DiLoCo's choice, SGD with
Nesterov momentum (outer lr 0.7, momentum 0.9), is :class:`OuterNesterov`.

Written exactly as ``torch.optim.SGD(lr=lr, momentum=mu, nesterov=True, dampening=0)`` applied
to ``g = -u``::

    M <- mu * M + u                 (M = u at the first step, as torch's buffer starts at g)
    S <- S + lr * (u + mu * M)      (mu = 0:  S <- S + lr * u)

With ``lr = 1`` and ``mu = 0`` this is plain addition, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


class OuterNesterov:
    """Nesterov-momentum SGD on averaged model changes, over flat buckets.

    Args:
        lr: Outer learning rate (``1.0``: the change is added as it is).
        momentum: Outer Nesterov momentum ``mu`` in ``[0, 1)`` (``0``: no momentum buffer is kept).

    Raises:
        ValueError: On an ``lr`` that is not positive or a ``momentum`` outside ``[0, 1)``.
    """

    def __init__(self, lr: float = 1.0, momentum: float = 0.0) -> None:
        if not lr > 0 or lr != lr or lr == float("inf"):
            raise ValueError(f"OuterNesterov: argument `lr` must be a finite number > 0, got {lr!r}.")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"OuterNesterov: argument `momentum` must be in [0, 1), got {momentum!r}.")
        self.lr, self.momentum = float(lr), float(momentum)
        self.buffer: list[Tensor] = []  # M, allocated at the first step when momentum > 0

    @property
    def is_identity(self) -> bool:
        """Whether a step is plain addition of the change."""
        return self.lr == 1.0 and self.momentum == 0.0

    @torch.no_grad()
    def step_(self, model: Sequence[Tensor], change: Sequence[Tensor], scale: float = 1.0) -> None:
        """Advance ``model`` in place by the outer step for the change ``u = scale * change``.

        ``change`` may have a lower precision than ``model`` (a compressed payload); the
        arithmetic happens in ``model``'s dtype.
        """
        model, change = list(model), list(change)
        if self.momentum == 0.0:
            torch._foreach_add_(model, change, alpha=self.lr * scale)
            return
        if not self.buffer:
            self.buffer = [torch.zeros_like(t) for t in model]
        torch._foreach_mul_(self.buffer, self.momentum)
        torch._foreach_add_(self.buffer, change, alpha=scale)
        torch._foreach_add_(model, change, alpha=self.lr * scale)
        torch._foreach_add_(model, self.buffer, alpha=self.lr * self.momentum)

    def copy(self) -> OuterNesterov:
        """An independent copy (the momentum buffer cloned), to look ahead without changing this one."""
        twin = OuterNesterov(self.lr, self.momentum)
        twin.buffer = [t.clone() for t in self.buffer]
        return twin
