"""DiLoCo, and Streaming DiLoCo's fragments: an outer optimizer on the replicas' averaged change.

DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
arXiv 2311.08105, 2023): every replica trains alone with its inner optimizer for ``H`` steps; then
the *outer gradient* ``g = S - mean_w x_w`` (the global model ``S`` minus the replicas' mean) moves
``S`` by an outer optimizer, SGD with Nesterov momentum (lr 0.7, momentum 0.9), and every replica
restarts from the new ``S``::

    every H steps:  u <- mean_w (x_w - S)                 (one all-reduce of the changes)
                    S <- OuterNesterov(S, u)              (lr * (u + mu * M), M <- mu M + u)
                    x_w <- S

Streaming DiLoCo (Douillard et al., arXiv 2501.18512, 2025) cuts the model into ``F`` fragments
(contiguous groups of parameter tensors, of about equal size) that synchronise at staggered steps,
fragment ``f`` at the steps ``t`` with ``t mod H = round((f + 1) H / F) mod H``, so the link
carries ``1 / F`` of the model at a time; the reduction of a fragment may run in the background for
``delay`` steps (``fragment_sync_delay`` in torchft) while the replicas train on, and when it is
applied the fragment's replica keeps a share ``alpha`` of its own newest values
(``fragment_update_alpha``)::

    at t:           u_f <- mean_w (x_w,f - S_f)           (launched)
    at t + delay:   S_f <- OuterNesterov_f(S_f, u_f);  x_f <- alpha x_f + (1 - alpha) S_f

``F = 1, delay = 0, alpha = 0`` is DiLoCo. The change may be sent in bfloat16, int8 or 4 bits
with error feedback (:mod:`lightning_hier.algorithms.compression`; the quantized all-reduce keeps
a rank's bytes about two quantized payloads whatever the number of ranks), as INTELLECT-1 sent int8
and Streaming DiLoCo 4-bit outer gradients.

The consensus model (what validation during fit sees) is the global model ``S`` of each fragment's
latest applied step; at the end of training (:meth:`DiLoCo.finalize`) every fragment takes one
more outer step on the changes since its last synchronisation, and every replica becomes ``S``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from lightning_hier import _validate as v
from lightning_hier.algorithms.compression import COMPRESSIONS, Bf16ErrorFeedback, QuantizedChange, make_codec
from lightning_hier.algorithms.outer import OuterNesterov
from lightning_hier.algorithms.round_guard import RoundGuard, restore_point
from lightning_hier.comm import CommStats, FlatTensors, all_reduce_mean_, all_reduce_sum_async, group_size, wait_all
from lightning_hier.comm.collectives import Group
from lightning_hier.comm.quantized import gather_step, start_gathers

__all__ = ["DiLoCo", "Fragment", "fragment_offsets", "split_fragments"]


def split_fragments(params: Sequence[Tensor], count: int) -> list[list[Tensor]]:
    """``params`` cut into ``count`` contiguous groups of about equal size (each at least one tensor)."""
    count = max(1, min(count, len(params)))
    total = sum(p.numel() for p in params)
    groups: list[list[Tensor]] = [[] for _ in range(count)]
    seen = 0
    for index, p in enumerate(params):
        # the group this tensor's middle falls in, but never past what leaves one tensor per later group
        group = min(int((seen + p.numel() / 2) * count / total), count - 1, index)
        group = max(group, count - (len(params) - index))
        groups[group].append(p)
        seen += p.numel()
    return groups


def fragment_offsets(window: int, count: int) -> list[int]:
    """The step (mod ``window``) at which each fragment synchronises: staggered evenly, the last at 0."""
    return [round((f + 1) * window / count) % window for f in range(count)]


class Fragment:
    """One fragment's global model, outer optimizer, codec and the reduction in flight."""

    def __init__(
        self,
        params: list[Tensor],
        offset: int,
        outer: OuterNesterov,
        compression: str,
        world: int,
        bucket_bytes: int | None,
    ) -> None:
        self.flat = FlatTensors(params, bucket_bytes)
        self.offset = offset
        self.global_model: list[Tensor] = self.flat.clone()  # S
        self.outer = outer
        self.codec = make_codec(compression, self.global_model, world)
        self.change: list[Tensor] = self.flat.zeros_like()  # the sum in flight lands here (or in the codec's)
        self.works: list[Any] = []
        self.apply_at: int | None = None  # the step at which the reduction in flight is applied
        self.synced_at = 0  # the step of the latest launch

    def launch(self, step: int, delay: int, group: Group, stats: CommStats) -> None:
        """Start the SUM of this rank's change ``x - S`` (compressed if asked)."""
        change = torch._foreach_sub(self.flat.buckets, self.global_model)
        if isinstance(self.codec, QuantizedChange):
            self.works = [self.codec.launch(change, group, stats)]
            self.change = self.codec.total
        elif isinstance(self.codec, Bf16ErrorFeedback):
            self.change = self.codec.encode_(change)
            self.works = all_reduce_sum_async(self.change, group, stats)
        else:
            torch._foreach_copy_(self.change, change)
            self.works = all_reduce_sum_async(self.change, group, stats)
        self.apply_at, self.synced_at = step + delay, step

    @torch.no_grad()
    def apply(self, world: int, alpha: float, stats: CommStats) -> None:
        """Wait for the sum; ``S <- outer(S, sum / W)``; ``x <- alpha x + (1 - alpha) S``."""
        wait_all(self.works, stats)
        self.works, self.apply_at = [], None
        self.outer.step_(self.global_model, self.change, scale=1.0 / world)
        if alpha == 0.0:
            torch._foreach_copy_(self.flat.buckets, self.global_model)
        else:
            torch._foreach_mul_(self.flat.buckets, alpha)
            torch._foreach_add_(self.flat.buckets, self.global_model, alpha=1.0 - alpha)

    def state_dict(self) -> dict[str, Any]:
        split = self.flat.split
        state: dict[str, Any] = {"global_model": split(self.global_model), "synced_at": self.synced_at}
        if self.apply_at is not None:
            state["change"], state["apply_at"] = split(self.change), self.apply_at
        if self.outer.buffer:
            state["outer_momentum"] = split(self.outer.buffer)
        if self.codec is not None:
            state["residual"] = split(self.codec.residual)
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.flat.load(self.global_model, state["global_model"], "DiLoCo", "global_model")
        self.synced_at = int(state["synced_at"])
        self.apply_at = int(state["apply_at"]) if "apply_at" in state else None
        if self.apply_at is not None:
            self.flat.load(self.change, state["change"], "DiLoCo", "change")
        self.outer.buffer = self.flat.zeros_like() if "outer_momentum" in state else []
        if self.outer.buffer:
            self.flat.load(self.outer.buffer, state["outer_momentum"], "DiLoCo", "outer_momentum")
        if self.codec is not None and "residual" in state:
            self.flat.load(self.codec.residual, state["residual"], "DiLoCo", "residual")


class DiLoCo:
    """DiLoCo's outer loop, optionally streamed by fragments (see the module docstring).

    Args:
        params: The replica's parameters; they become views of persistent flat buckets.
        group: Data-parallel group (``None``: a single worker).
        window: ``H``, inner steps between two synchronisations of a fragment.
        outer_lr: Outer learning rate (DiLoCo: 0.7).
        outer_momentum: Outer Nesterov momentum (DiLoCo: 0.9).
        fragments: ``F``, how many staggered fragments (1: DiLoCo).
        delay: Steps a fragment's reduction runs in the background before it is applied (0: at once).
        alpha: Share of a fragment's own newest values kept when the global step is applied.
        compression: ``'none'``, ``'bf16'``, ``'int8'`` or ``'int4'``.
        buffers: Extra tensors averaged uniformly (blocking) whenever the last fragment synchronises.
        bucket_bytes: Bucket size bound of the flat buffers.
        stats: Communication accounting.
    """

    def __init__(
        self,
        params: Iterable[Tensor],
        group: Group,
        window: int = 64,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        fragments: int = 1,
        delay: int = 0,
        alpha: float = 0.0,
        compression: str = "none",
        buffers: Iterable[Tensor] = (),
        bucket_bytes: int | None = None,
        stats: CommStats | None = None,
    ) -> None:
        self.window = v.check_int("DiLoCo", "window", window, minimum=1)
        self.delay = v.check_int("DiLoCo", "delay", delay, minimum=0, maximum=window - 1)
        self.alpha = v.check_float("DiLoCo", "alpha", alpha, 0.0, 1.0, high_inclusive=False)
        if compression not in COMPRESSIONS:
            raise ValueError(f"DiLoCo: argument `compression` must be one of {COMPRESSIONS}, got {compression!r}.")
        self.group, self.world = group, group_size(group)
        self.stats = stats if stats is not None else CommStats()
        tensors = list(params)
        groups = split_fragments(tensors, fragments)
        offsets = fragment_offsets(window, len(groups))
        self.fragments = [
            Fragment(g, o, OuterNesterov(outer_lr, outer_momentum), compression, self.world, bucket_bytes)
            for g, o in zip(groups, offsets, strict=True)
        ]
        extra = list(buffers)
        self.flat_buffers = FlatTensors(extra, bucket_bytes) if extra else None
        self.steps = 0
        self.syncs = 0
        self._finished_at: int | None = None  # the step of the latest finalize (a second one is a no-op)
        self.guard: RoundGuard | None = None
        """Runs the synchronisations under a changing membership (``None``: a fixed group; DiLoCo only)."""

    def step(self) -> int:
        """Call after every optimizer step; returns how many fragments were synchronised or applied."""
        self.steps += 1
        if self.guard is None:
            return self._act()
        if self.steps % self.window != 0:  # fault tolerant (one fragment, no delay): it acts at window ends
            return 0
        return self.guard.run(self, self._act, admit=True)  # each window's synchronisation is a round

    def _act(self) -> int:
        """Send, apply (and average the buffers) whatever is due at this step; how many fragments acted."""
        acted = 0
        for fragment in self.fragments:
            if (
                fragment.apply_at is not None
                and self.steps == fragment.synced_at + gather_step(self.delay) < fragment.apply_at
            ):
                start_gathers(fragment.works)  # a quantized reduction's second half, behind the steps until the apply
            if fragment.apply_at == self.steps:
                fragment.apply(self.world, self.alpha, self.stats)
                acted += 1
            if self.steps % self.window == fragment.offset and fragment.apply_at is None:
                fragment.launch(self.steps, self.delay, self.group, self.stats)
                self.syncs += 1
                if self.delay == 0:
                    fragment.apply(self.world, self.alpha, self.stats)
                acted += 1
        if self.flat_buffers is not None and self.steps % self.window == 0:
            all_reduce_mean_(self.flat_buffers.buckets, self.group, self.stats)
        return acted

    def undo_point(self) -> Callable[[], None]:
        """How to undo a synchronisation that failed half-way (a fault-tolerant run): everything as now."""
        flats = [f.flat for f in self.fragments] + ([self.flat_buffers] if self.flat_buffers is not None else [])
        restore = restore_point(flats, self)

        def undo() -> None:
            for fragment in self.fragments:
                fragment.works = []  # the failed reduction's: never waited for again
            restore()

        return undo

    def regroup(self, group: Group) -> None:
        """Synchronise over ``group`` from now on: the live replicas of a fault-tolerant run (every member calls it)."""
        self.group, self.world = group, group_size(group)

    @torch.no_grad()
    def finalize(self) -> None:
        """End of training: apply what is in flight, one more outer step on what changed since, ``x <- S``."""
        if self._finished_at == self.steps:
            return
        if self.guard is not None:
            self.guard.run(self, self._finalize, admit=False)
        else:
            self._finalize()

    @torch.no_grad()
    def _finalize(self) -> None:
        self._finished_at = self.steps
        for fragment in self.fragments:
            if fragment.apply_at is not None:
                fragment.apply(self.world, self.alpha, self.stats)
            if fragment.synced_at < self.steps:  # steps since the last synchronisation: a final one
                fragment.launch(self.steps, 0, self.group, self.stats)
                fragment.apply(self.world, 0.0, self.stats)
            torch._foreach_copy_(fragment.flat.buckets, fragment.global_model)
        if self.flat_buffers is not None:
            all_reduce_mean_(self.flat_buffers.buckets, self.group, self.stats)

    @contextmanager
    def consensus(self) -> Iterator[None]:
        """Hold every fragment's global model ``S`` in the replica while inside, then restore the replica."""
        saved = [f.flat.clone() for f in self.fragments]
        for fragment in self.fragments:
            fragment.flat.copy_(fragment.global_model)
        try:
            yield
        finally:
            for fragment, replica in zip(self.fragments, saved, strict=True):
                fragment.flat.copy_(replica)

    def state_dict(self) -> dict[str, Any]:
        for fragment in self.fragments:
            wait_all(fragment.works, self.stats)  # a stored sum must be finished
            fragment.works = []
        return {"steps": self.steps, "syncs": self.syncs, "fragments": [f.state_dict() for f in self.fragments]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        fragments = state["fragments"]
        if len(fragments) != len(self.fragments):
            raise ValueError(
                f"DiLoCo: the checkpoint has {len(fragments)} fragment(s), this run has {len(self.fragments)}; "
                "resume with the same `fragments`."
            )
        self.steps, self.syncs = int(state["steps"]), int(state["syncs"])
        for fragment, saved in zip(self.fragments, fragments, strict=True):
            fragment.load_state_dict(saved)
