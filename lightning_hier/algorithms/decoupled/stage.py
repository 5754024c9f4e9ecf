"""One pipeline stage: its forward and its (possibly delayed) backward at a chosen weight version.

The stage's parameters are moved into persistent flat buckets (:class:`FlatTensors`) once. A
forward runs the stage with ``torch.func.functional_call`` on a *weight version*: one leaf tensor
per parameter, viewing either the live buckets or a copy of them (a single memcpy). The leaves are
separate autograd leaves, not views of one flat leaf: autograd would turn each view's gradient
into a zero-filled bucket-sized tensor, costing ``O(parameters x bucket)`` per backward.

Weight versions for a backward that happens after later updates (option ``weights``):

- ``'stash'``: a copy of the weights taken at forward time; the backward computes the gradient at
  the weights the batch was forwarded with (the setting of the convergence theory, the default).
- ``'legacy'``: the stored graph is kept but reads the *current* weights wherever autograd saved a
  weight (saved activations stay those of forward time), as the FDG reference code behaves. It is
  an alias of the live storage with its own version counter, so in-place optimizer updates are not
  flagged by autograd.
- ``'recompute'``: only the input is stored; at backward time the forward is re-run with the
  current weights (as Features Replay does), with the forward's RNG state (same dropout masks) and
  without touching buffers a second time (BatchNorm statistics are updated once, at forward time).

A delayed forward runs on private copies of the buffers, copied back into the module afterwards:
autograd saves BatchNorm's running statistics, which the next forward updates in place, so a
graph kept in a FIFO must not share them.

A stage whose gradient comes back before its next update (staleness 0: the last stage, every
stage of the ``sync`` schedule) needs no copy: all three options then coincide.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.func import functional_call

from lightning_hier.comm import FlatTensors

WEIGHTS = ("stash", "recompute", "legacy")


@dataclass
class InFlight:
    """A batch forwarded by this stage and waiting for its gradient."""

    batch: int
    inputs: Tensor
    output: Tensor | None
    leaves: list[Tensor] | None
    rng: tuple[Tensor, Tensor | None] | None = None


def _alias(view: Tensor) -> Tensor:
    """A leaf sharing ``view``'s memory, with a version counter of its own.

    In-place optimizer updates of the live parameters then go unnoticed by autograd: what the
    ``legacy`` option wants (and harmless when the backward comes before any update).
    """
    with torch.no_grad():
        alias = torch.empty(0, dtype=view.dtype, device=view.device)
        alias.set_(view.untyped_storage(), view.storage_offset(), view.shape, view.stride())
    return alias.requires_grad_()


def _capture_rng(device: torch.device) -> tuple[Tensor, Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextmanager
def _replay_rng(state: tuple[Tensor, Tensor | None], device: torch.device) -> Iterator[None]:
    """Run with the RNG at ``state`` and leave the global RNG as it was before."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


class StageRunner:
    """Forward and backward of one stage's module.

    Args:
        module: The stage (its parameters are re-pointed into flat buckets, identity kept).
        weights: ``'stash'``, ``'recompute'`` or ``'legacy'`` (see the module docstring).
    """

    def __init__(self, module: nn.Module, weights: str = "stash") -> None:
        if weights not in WEIGHTS:
            raise ValueError(f"StageRunner: `weights` must be one of {', '.join(map(repr, WEIGHTS))}, got {weights!r}.")
        self.module = module
        self.weights = weights
        named = list(module.named_parameters())
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.flat = FlatTensors(self.params)
        self.buffer_names = [n for n, _ in module.named_buffers()]
        self.buffers = [b for _, b in module.named_buffers()]

    def adopt(self, flat: FlatTensors) -> None:
        """Use ``flat`` as the live buckets: another algorithm re-pointed the parameters into its own.

        A cross-node rule (Local SGD, HPSGD) moves the stage's parameters into flat buckets of its
        own; forwards must then read those, or they would see the stale first buckets.

        Raises:
            ValueError: If ``flat`` does not hold exactly this stage's parameters, aliased, in order.
        """
        if [id(t) for t in flat.tensors] != [id(p) for p in self.params] or not flat.is_aliased():
            raise ValueError("StageRunner.adopt: the buckets must hold this stage's parameters, in order, as views.")
        self.flat = flat

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the stage computes in (that of its first parameter; float32 without parameters)."""
        return self.params[0].dtype if self.params else torch.float32

    @property
    def device(self) -> torch.device:
        return self.flat.buckets[0].device if self.flat.buckets else torch.device("cpu")

    def _leaves(self, buckets: list[Tensor]) -> list[Tensor]:
        """One autograd leaf per parameter, viewing its slice of ``buckets``."""
        return [_alias(view) for view in self.flat.split(buckets)]

    def _call(self, leaves: list[Tensor], inputs: Tensor, buffers: list[Tensor] | None = None) -> Tensor:
        tensors = dict(zip(self.names, leaves, strict=True))
        if buffers is not None:
            tensors.update(zip(self.buffer_names, buffers, strict=True))
        return functional_call(self.module, tensors, (inputs,))

    def _call_private(self, leaves: list[Tensor], inputs: Tensor) -> tuple[Tensor, list[Tensor]]:
        """Forward on copies of the buffers (the graph keeps them); returns the output and the copies."""
        copies = [b.detach().clone() for b in self.buffers]
        return self._call(leaves, inputs, copies), copies

    def _live(self) -> list[Tensor]:
        return self._leaves(self.flat.buckets)

    def forward_now(self, inputs: Tensor) -> tuple[Tensor, list[Tensor]]:
        """Forward for a backward that comes before the next update: no copy of the weights."""
        leaves = self._live()
        return self._call(leaves, inputs), leaves

    def forward_delayed(self, inputs: Tensor, batch: int) -> tuple[Tensor, InFlight]:
        """Forward whose backward comes after later updates: the output and what waits in the FIFO."""
        if self.weights == "recompute":
            rng = _capture_rng(inputs.device)
            with torch.no_grad():
                output = self.module(inputs)
            return output, InFlight(batch, inputs, None, None, rng)
        leaves = self._leaves(self.flat.clone()) if self.weights == "stash" else self._live()
        output, buffers = self._call_private(leaves, inputs)
        with torch.no_grad():  # the statistics update of this forward, made once
            for live, updated in zip(self.buffers, buffers, strict=True):
                live.copy_(updated)
        return output, InFlight(batch, inputs, output, leaves)

    def backward_delayed(self, entry: InFlight, grad_output: Tensor) -> list[Tensor]:
        """Backward of a FIFO entry with the gradient of its output; returns the weight leaves (holding ``.grad``)."""
        if entry.leaves is None:  # recompute: rebuild the graph at the current weights
            assert entry.rng is not None
            with _replay_rng(entry.rng, entry.inputs.device), torch.enable_grad():
                leaves = self._live()
                output, _ = self._call_private(leaves, entry.inputs)  # statistics were updated at forward time
        else:
            assert entry.output is not None
            leaves, output = entry.leaves, entry.output
        torch.autograd.backward(output, grad_tensors=grad_output)
        return leaves

    @staticmethod
    def grads(leaves: list[Tensor]) -> list[Tensor]:
        """The gradient of each parameter (zeros where a parameter got none)."""
        return [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves]

    def flatten(self, grads: list[Tensor]) -> list[Tensor]:
        """Per-parameter tensors packed into the bucket layout (for one collective per bucket)."""
        return [
            torch.cat([grads[i].reshape(-1) for i in self.flat.segment_indices(b)])
            for b in range(len(self.flat.buckets))
        ]

    def set_grads(self, grads: list[Tensor]) -> None:
        """Make ``grads`` (one per parameter) the parameters' ``.grad``."""
        for p, g in zip(self.params, grads, strict=True):
            p.grad = g

    def clear_grads(self) -> None:
        for p in self.params:
            p.grad = None
