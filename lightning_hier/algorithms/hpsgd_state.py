"""What one HPSGD rank saves in a checkpoint and restores from it, apart from the recurrence.

:class:`HPSGDCheckpoint` is the ``state_dict`` / ``load_state_dict`` half of
:class:`~lightning_hier.algorithms.hpsgd.HPSGD` (Zhou et al., arXiv 2009.02701). Tensors are
stored per parameter (not per bucket), so a checkpoint does not depend on the bucket size.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_hier.algorithms.compression import Bf16ErrorFeedback, QuantizedChange
from lightning_hier.algorithms.outer import OuterNesterov
from lightning_hier.comm import FlatTensors


class _Parts(Protocol):
    """The members of HPSGD that its checkpoint reads and writes."""

    merge: str
    steps: int
    merges: int
    since_launch: int
    launched: bool
    pending: bool
    first_window: bool
    delay: int
    delay_chosen: bool
    in_flight_world: int
    world: int
    flat: FlatTensors
    flat_buffers: FlatTensors | None
    global_model: list[Tensor]
    in_flight: list[Tensor]
    global_buffers: list[Tensor]
    _buffers_in_flight: list[Tensor]
    codec: Bf16ErrorFeedback | QuantizedChange | None
    outer: OuterNesterov
    _replica: tuple[list[Tensor], list[Tensor]] | None

    def _start(self) -> list[Tensor]: ...

    def _buffers(self) -> list[Tensor]: ...

    def _wait(self) -> None: ...

    def _load_buffers(self, state: dict[str, Any]) -> None: ...

    def global_tensors(self) -> list[Tensor]: ...

    @property
    def replica(self) -> list[Tensor]: ...


class HPSGDCheckpoint:
    """``state_dict`` / ``load_state_dict`` of :class:`~lightning_hier.algorithms.hpsgd.HPSGD`."""

    def state_dict(self: _Parts) -> dict[str, Any]:
        """This rank's state: counters, ``S``, in-flight sum, ``V``, outer momentum, residual.

        ``V`` is stored only where it differs from ``S``. Waits for the in-flight reduction first
        (a stored buffer must be a finished sum); in mode ``'fixed'`` this changes no result.
        Per-tensor lists keep checkpoints independent of the bucket size. Inside
        :meth:`consensus`, the replica being held aside is stored as well.
        """
        self._wait()
        split = self.flat.split
        state: dict[str, Any] = {
            "merge": self.merge,
            "steps": self.steps,
            "merges": self.merges,
            "since_launch": self.since_launch,
            "launched": self.launched,
            "pending": self.pending,
            "first_window": self.first_window,
            "global_model": self.global_tensors(),
            "delay": self.delay,
            "delay_chosen": self.delay_chosen,
        }
        if self.launched:
            state["in_flight"] = split(self.in_flight)
            state["in_flight_world"] = self.in_flight_world
        if self._start() is not self.global_model:
            state["window_start"] = split(self._start())
        if self.outer.buffer:
            state["outer_momentum"] = split(self.outer.buffer)
        if self.codec is not None:
            state["residual"] = split(self.codec.residual)
        if self.flat_buffers is not None:
            state["global_buffers"] = self.flat_buffers.split(self.global_buffers)
            state["buffers_in_flight"] = self.flat_buffers.split(self._buffers_in_flight)
        if self._replica is not None:
            state["replica"] = split(self._replica[0])
            if self.flat_buffers is not None:
                state["replica_buffers"] = self.flat_buffers.split(self._replica[1])
        return state

    @torch.no_grad()
    def load_state_dict(self: _Parts, state: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict` (the parameters' own values are restored separately).

        Raises:
            ValueError: When the checkpoint was written with another ``merge`` rule, another
                buffer policy, or for another model.
        """
        self._wait()
        if "two_level" in state:
            raise ValueError(
                f"HPSGD: the checkpoint was written with inter_node_every={state['two_level']['every']}, "
                "this run is flat (inter_node_every=None)."
            )
        merge = state.get("merge", "paper")  # checkpoints older than the merge option: the paper's rule
        if merge != self.merge:
            raise ValueError(
                f"HPSGD: the checkpoint was written with merge={merge!r}, this run uses merge={self.merge!r}."
            )
        self.steps, self.merges = int(state["steps"]), int(state["merges"])
        self.since_launch = int(state["since_launch"])
        self.launched, self.first_window = bool(state["launched"]), bool(state["first_window"])
        self.pending = bool(state.get("pending", self.launched))  # without `delay`, launched means pending
        if not self.delay_chosen and state.get("delay_chosen"):  # delay='auto', chosen before the checkpoint
            self.delay, self.delay_chosen = int(state["delay"]), True
        self.flat.load(self.global_model, state["global_model"], "HPSGD", "global_model")
        if self.launched:
            self.flat.load(self.in_flight, state["in_flight"], "HPSGD", "in_flight")
            self.in_flight_world = int(state.get("in_flight_world", self.world))  # a joiner: the sender's
        if self._start() is not self.global_model:
            self.flat.load(self._start(), state.get("window_start", self.global_tensors()), "HPSGD", "window_start")
        self.outer.buffer = self.flat.zeros_like() if "outer_momentum" in state else []
        if self.outer.buffer:
            self.flat.load(self.outer.buffer, state["outer_momentum"], "HPSGD", "outer_momentum")
        if self.codec is not None:  # a checkpoint without compression: nothing left out yet
            torch._foreach_zero_(self.codec.residual)
            self.flat.load(
                self.codec.residual, state.get("residual", self.flat.split(self.codec.residual)), "HPSGD", "residual"
            )
        if "replica" in state:
            self.flat.load(self.replica, state["replica"], "HPSGD", "replica")
        self._load_buffers(state)

    def _load_buffers(self: _Parts, state: dict[str, Any]) -> None:
        if self.flat_buffers is None:
            if "global_buffers" in state:
                raise ValueError("HPSGD: the checkpoint averaged buffers (sync_buffers) but this run does not.")
            return
        if "global_buffers" not in state:
            raise ValueError("HPSGD: this run averages buffers (sync_buffers) but the checkpoint did not.")
        self.flat_buffers.load(self.global_buffers, state["global_buffers"], "HPSGD", "global_buffers")
        self.flat_buffers.load(self._buffers_in_flight, state["buffers_in_flight"], "HPSGD", "buffers_in_flight")
        if "replica_buffers" in state:
            self.flat_buffers.load(self._buffers(), state["replica_buffers"], "HPSGD", "replica_buffers")
