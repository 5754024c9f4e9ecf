"""GRAWA: gradient-based weighted averaging (MGRAWA per model, LGRAWA per layer).

Dimlioglu and Choromanska, "GRAWA: Gradient-based Weighted Averaging for Distributed Training of
Deep Learning Models", AISTATS 2024, arXiv 2403.04206 (code: github.com/tolgadimli/GRAWA).
Workers in flat regions of the loss (small gradient norms) get more weight in the center. Every
round, on every rank::

    n  = gradient-norm probe: n_l = ||g_l||_2 per parameter tensor l
         MGRAWA: n = sum_l n_l (norm='sum', the authors' code) or sqrt(sum_l n_l^2) (norm='l2')
    m  = beta m + (1 - beta) n ;  r += 1 ;  nh = m / (1 - beta^r)     # EMA, bias-corrected
    s  = 1 / (nh + eps)^p
    w  = s / sum_workers(s)                                            # weights sum to 1 per tensor
    c  = sum_workers(w x)                                              # the center

then the shared mechanism pulls ``x <- x + lam (c - x)`` (:mod:`lightning_hier.algorithms.averaging`).
Per-tensor weights become per-element weights through the flat buckets' segment lengths, so the
center is one weighted all-reduce of the P parameters.

Numerics: scores are computed in float64 as ``exp(min(-p log(nh + eps), 600))``, so a zero
gradient norm gives a large finite score (never inf or NaN), and equal norms give exactly equal
weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

from lightning_hier.algorithms.centers import CenterPolicy, RoundContext
from lightning_hier.comm import FlatTensors, all_reduce_sum_

VARIANTS = ("model", "layer")
NORMS = ("sum", "l2")
DEFAULT_BETA = 0.9**8
"""EMA rate of the gradient norms (inherited by the authors from EASGD; about 0.43)."""
_MAX_LOG_SCORE = 600.0  # exp(600) ~ 1e260: far from float64 overflow even summed over many ranks


def grad_norms(params: Sequence[Tensor]) -> Tensor:
    """``||grad||_2`` of every tensor (0 where ``.grad`` is None), float64, on the first tensor's device."""
    device = params[0].device if params else torch.device("cpu")
    out = torch.zeros(len(params), dtype=torch.float64, device=device)
    present = [i for i, p in enumerate(params) if p.grad is not None]
    if present:
        norms = torch._foreach_norm([params[i].grad for i in present])  # type: ignore[misc]
        out[present] = torch.stack([n.to(device, torch.float64) for n in norms])
    return out


@contextmanager
def preserved(params: Sequence[Tensor], buffers: Iterable[Tensor]) -> Iterator[None]:
    """Run a side computation without disturbing the gradients or the buffers (BatchNorm statistics).

    Inside, every ``.grad`` starts as None; on exit the original gradient tensors and the buffers'
    values are put back.
    """
    saved_grads = [p.grad for p in params]
    kept = list(buffers)
    saved_buffers = [b.detach().clone() for b in kept]
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        for p, g in zip(params, saved_grads, strict=True):
            p.grad = g
        with torch.no_grad():
            for b, saved in zip(kept, saved_buffers, strict=True):
                b.copy_(saved)


def probe_grad_norms(params: Sequence[Tensor], loss_fn: Callable[[], Tensor], buffers: Iterable[Tensor]) -> Tensor:
    """The gradient-norm probe: per-tensor norms of the gradient of ``loss_fn()`` at the current weights.

    One forward/backward that leaves the training state untouched (see :func:`preserved`).

    Args:
        params: The parameters whose gradient norms are measured (in this order).
        loss_fn: Computes the probe loss (e.g. the training loss of one batch).
        buffers: Saved and restored around the probe (e.g. ``module.buffers()``).
    """
    # a final round may run under no_grad (the strategy leaves inference mode before finalizing)
    with preserved(params, buffers), torch.enable_grad():
        loss_fn().backward()
        return grad_norms(params)


class NormEMA:
    """Exponential moving average with bias correction (Adam's), of a vector of norms.

    Args:
        beta: Decay in [0, 1); 0 keeps only the latest value.
        size: Length of the vector (1 for MGRAWA, the number of tensors for LGRAWA).
    """

    def __init__(self, beta: float, size: int) -> None:
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"NormEMA: `beta` must be in [0, 1), got {beta}.")
        self.beta = beta
        self.m = torch.zeros(size, dtype=torch.float64)
        self.r = 0

    def update(self, n: Tensor) -> Tensor:
        """Fold in ``n``; return the bias-corrected estimate ``m / (1 - beta^r)``."""
        self.m = self.m.to(n.device) * self.beta + (1.0 - self.beta) * n.to(torch.float64)
        self.r += 1
        return self.m / (1.0 - self.beta**self.r)

    def state_dict(self) -> dict[str, Any]:
        return {"m": self.m.clone(), "r": self.r}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.m, self.r = state["m"].to(torch.float64), int(state["r"])


def grawa_scores(norm_hat: Tensor, eps: float, p: float) -> Tensor:
    """Unnormalised weights ``1 / (nh + eps)^p`` in float64, finite for a zero norm (see module docstring)."""
    log_score = -p * torch.log(norm_hat.to(torch.float64) + eps)
    return torch.exp(log_score.clamp(max=_MAX_LOG_SCORE))


def normalise_weights(scores: Tensor) -> Tensor:
    """``[W, L]`` scores of every rank -> weights that sum to 1 over the ranks, per column."""
    return scores / scores.sum(dim=0, keepdim=True)


Expansion = list[tuple[Tensor, Tensor]]
"""Per bucket, the parameter-tensor index of each segment and the segment lengths (LGRAWA)."""


def segment_expansions(flat: FlatTensors) -> Expansion:
    """How per-tensor weights ``[L]`` spread over the elements of each of ``flat``'s buckets."""
    out = []
    for b, bucket in enumerate(flat.buckets):
        index = torch.tensor(flat.segment_indices(b), device=bucket.device)
        counts = torch.tensor(flat.segment_numels(b), device=bucket.device)
        out.append((index, counts))
    return out


def weigh_(buckets: Sequence[Tensor], weights: Tensor, expand: Expansion) -> None:
    """Multiply ``buckets`` in place by one replica's weights, ``[1]`` (MGRAWA) or ``[L]`` spread by ``expand``."""
    for b, bucket in enumerate(buckets):
        w = weights.to(bucket.device, bucket.dtype)
        if expand:
            index, counts = expand[b]
            w = torch.repeat_interleave(w[index], counts, output_size=bucket.numel())
        bucket.mul_(w)


class GradientWeightedCenter(CenterPolicy):
    """GRAWA's center: the replicas weighted by inverse (EMA, bias-corrected) gradient norms.

    Args:
        variant: ``'model'`` (MGRAWA, one weight per worker) or ``'layer'`` (LGRAWA, one weight per
            worker and parameter tensor).
        beta: EMA decay of the norms, in [0, 1).
        eps: Added to the norm before inverting (> 0).
        p: Exponent of the inverse norm (> 0).
        norm: MGRAWA's model norm: ``'sum'`` of per-tensor norms (the authors' code) or the global
            ``'l2'`` norm.

    Per round it all-reduces a ``[W, L + 1]`` float64 table (every rank's scores and raw norm, so
    every rank can log every rank's weight) and the P weighted parameters.
    """

    def __init__(
        self, variant: str = "model", beta: float = DEFAULT_BETA, eps: float = 1e-8, p: float = 1.0, norm: str = "sum"
    ) -> None:
        if variant not in VARIANTS or norm not in NORMS:
            raise ValueError(f"GradientWeightedCenter: variant must be in {VARIANTS} and norm in {NORMS}.")
        if eps <= 0 or p <= 0:
            raise ValueError(f"GradientWeightedCenter: `eps` and `p` must be > 0, got {eps} and {p}.")
        self.variant, self.eps, self.p, self.norm = variant, eps, p, norm
        self.beta = beta
        self.ema: NormEMA | None = None
        self.weights: Tensor | None = None  # [W, L] of the latest round; uniform before the first
        self._expand: list[tuple[Tensor, Tensor]] = []

    @override
    def default_lam(self, world: int) -> float:
        return 0.5

    def _bind(self, flat: FlatTensors, world: int) -> None:
        """Size the state for this model and group (on the first round or consensus)."""
        width = len(flat.tensors) if self.variant == "layer" else 1
        if self.ema is None:
            self.ema = NormEMA(self.beta, width)
        if self.weights is None:
            self.weights = torch.full((world, width), 1.0 / world, dtype=torch.float64)
        if not self._expand and self.variant == "layer":
            self._expand = segment_expansions(flat)

    def _model_norm(self, norms: Tensor) -> Tensor:
        return norms.sum().reshape(1) if self.norm == "sum" else norms.pow(2).sum().sqrt().reshape(1)

    def local_scores(self, ctx: RoundContext) -> tuple[Tensor, Tensor]:
        """Probe this rank's norms, fold them into its EMA; its scores ``[L]`` and its model norm ``[1]``.

        The per-rank half of a round, shared by the lock-step round (:meth:`combine`) and the
        asynchronous one (:mod:`lightning_hier.algorithms.grawa_async`).
        """
        self._bind(ctx.flat, ctx.world)
        assert self.ema is not None
        norms = ctx.norms().to(torch.float64)
        model_norm = self._model_norm(norms)
        norm_hat = self.ema.update(norms if self.variant == "layer" else model_norm)
        return grawa_scores(norm_hat, self.eps, self.p), model_norm

    def _measure(self, ctx: RoundContext) -> dict[str, Any]:
        scores, model_norm = self.local_scores(ctx)
        table = torch.zeros(ctx.world, scores.numel() + 1, dtype=torch.float64, device=ctx.flat.buckets[0].device)
        table[ctx.rank, :-1] = scores
        table[ctx.rank, -1] = model_norm[0]
        all_reduce_sum_([table], ctx.group, ctx.stats)
        self.weights = normalise_weights(table[:, :-1]).cpu()
        return {"weights": self.weights.clone(), "grad_norms": table[:, -1].cpu()}

    @override
    def combine(self, out: list[Tensor], ctx: RoundContext) -> dict[str, Any]:
        self._bind(ctx.flat, ctx.world)
        fields = self._measure(ctx) if ctx.fresh else {}
        assert self.weights is not None
        weigh_(out, self.weights[ctx.rank], self._expand)
        all_reduce_sum_(out, ctx.group, ctx.stats)
        return fields

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "variant": self.variant,
            "ema": None if self.ema is None else self.ema.state_dict(),
            "weights": None if self.weights is None else self.weights.clone(),
        }

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("variant", self.variant) != self.variant:
            raise ValueError(
                f"GRAWA: the checkpoint was written with variant={state['variant']!r}, this run uses "
                f"variant={self.variant!r}; resume with the same variant."
            )
        if state.get("ema") is not None:
            self.ema = NormEMA(self.beta, int(state["ema"]["m"].numel()))
            self.ema.load_state_dict(state["ema"])
        if state.get("weights") is not None:
            self.weights = state["weights"].to(torch.float64)
