"""The grid fully connected layer (Gholami et al., SPAA 2018, arXiv 1712.04432, section 3.1).

Rank (r, c) holds rows r of the weight (a shard of the output features) and of the bias,
replicated over c, and the samples of batch block c::

    forward:   y_local = x_c @ W_r^T + b_r ;  all-gather over MODEL along features -> y_c
    backward:  dx_c = all_reduce_MODEL(dy_c[:, rows r] @ W_r)      (skipped when x needs no grad)
               dW_r = dy_c[:, rows r]^T @ x_c ; mean over BATCH (by the gradient reducer)

This is Megatron's ``ColumnParallelLinear(gather_output=True)`` plus data parallelism on BATCH.
When ``out_features`` is not divisible by Pr the shards differ by one row (``torch.tensor_split``
sizes); the all-gather then pads the short shards (gloo gathers equal sizes only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import override

from lightning_hier.layers.collectives import copy_to_model, even_shard_sizes, gather_along, shard_range
from lightning_hier.layers.context import GridContext, ParamKind


class GridLinear(nn.Module):
    """``nn.Linear`` whose output features are sharded over MODEL.

    Its ``state_dict`` holds this rank's shard under the keys of ``nn.Linear``; use
    :meth:`to_linear` (a collective) or :func:`lightning_hier.layers.full_state_dict` for the
    whole layer.

    Args:
        in_features: Input features (every rank sees all of them).
        out_features: Output features of the whole layer (``>= Pr``).
        bias: Whether the layer has a bias.
        grid: This rank's grid context.
        device, dtype: Of the parameters.
    """

    param_kind = ParamKind.SHARDED

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        grid: GridContext,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if out_features < grid.pr:
            raise ValueError(
                f"GridLinear: out_features={out_features} cannot be sharded over Pr={grid.pr} MODEL ranks "
                f"(every rank needs at least one row); keep this layer replicated."
            )
        self.in_features, self.out_features, self.grid = in_features, out_features, grid
        self.sizes = even_shard_sizes(out_features, grid.pr)
        rows = self.sizes[grid.r]
        self.weight = nn.Parameter(torch.empty(rows, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(rows, device=device, dtype=dtype)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, grid: GridContext) -> GridLinear:
        """The shard of ``linear`` (identical on every rank) that belongs to this rank."""
        w = linear.weight
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, grid, w.device, w.dtype)
        new.load_state_dict({k: new.shard(v) for k, v in linear.state_dict().items()})
        return new

    def shard(self, full: Tensor) -> Tensor:
        """This rank's rows of a whole-layer weight or bias."""
        start, stop = shard_range(self.out_features, self.grid.pr, self.grid.r)
        return full[start:stop]

    @override
    def forward(self, x: Tensor) -> Tensor:
        if x.dim() == 0 or x.shape[-1] != self.in_features:  # F.linear would name the shard's shape
            raise ValueError(
                f"GridLinear (nn.Linear({self.in_features}, {self.out_features}) sharded over Pr={self.grid.pr}) got "
                f"an input of shape {list(x.shape)}: it needs {self.in_features} features in the last dimension."
            )
        x = copy_to_model(x, self.grid, "fc_dx")
        return gather_along(F.linear(x, self.weight, self.bias), -1, self.sizes, self.grid, "fc_gather")

    @torch.no_grad()
    def full_parameters(self) -> dict[str, Tensor]:
        """The whole weight and bias, gathered over MODEL (a collective on the MODEL group)."""
        out = {"weight": self._gather_rows(self.weight)}
        if self.bias is not None:
            out["bias"] = self._gather_rows(self.bias)
        return out

    def to_linear(self) -> nn.Linear:
        """An ordinary ``nn.Linear`` with the gathered weights (a collective on the MODEL group)."""
        w = self.weight
        linear = nn.Linear(self.in_features, self.out_features, self.bias is not None, w.device, w.dtype)
        linear.load_state_dict(self.full_parameters())
        return linear

    def _gather_rows(self, t: Tensor) -> Tensor:
        return gather_along(t.detach(), 0, self.sizes, self.grid, "state").clone()

    @override
    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"rows={self.sizes[self.grid.r]} (shard {self.grid.r} of {self.grid.pr}), bias={self.bias is not None}"
        )
