"""HPSGD: a replica/global-model pair whose window all-reduce overlaps the next window's compute.

Hierarchical Parallel SGD (Zhou, Ye, Zhang and Lv, arXiv 2009.02701, 2020; the authors' code,
github.com/Soptq/Hierarchical_Local_SGD, first called it HLSGD), in its delta form, which works
with any inner optimizer:

- every rank trains a *replica* ``x`` (the live parameters) with any inner optimizer and no
  per-step gradient all-reduce;
- a window of ``H`` optimizer steps closes with ``delta = x - V`` (``V``: the replica when the
  window opened); the SUM all-reduce of ``delta`` runs in the background while the next window
  computes;
- when that next window closes, the reduction is waited for and the *global model* advances by
  the average change of the previous window, ``S <- S + fly / W`` (one window stale), and the
  replica restarts from it (``x <- S``, ``V <- S``).

With ``H = 1`` and plain SGD this is 1-stale synchronous SGD. Two deliberate differences from
the authors' code: the end of training drains (waits for and merges the in-flight window, then
merges the steps since the last launch) instead of dropping one window and double-counting
another at every epoch end; and mode ``'poll'`` makes every rank agree on readiness (a MIN
all-reduce of the local flag on a control group), so all ranks launch the same collectives in
the same order.

Memory: the parameters become views of persistent flat buckets (:class:`FlatTensors`), and the
state is three bucket lists of the same layout: ``S``, the in-flight ``fly`` and a scratch list
that holds ``V`` during the first window only (afterwards ``V`` equals ``S``). A merge makes
four passes over the parameters (``delta``, its norm, ``S += fly / W``, ``x <- S``) and, after
the first window, allocates no parameter-sized memory.

Pure torch: usable from a plain training loop::

    hp = HPSGD(model.parameters(), group=None, window=4)   # group=None: one worker
    for x, y in data:
        loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
        hp.step()
    hp.finalize()                                          # every rank now holds S
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from lightning_hier.comm import CommStats, FlatTensors, all_reduce_sum_, all_reduce_sum_async, group_size, wait_all
from lightning_hier.comm.collectives import Group, payload_bytes

MODES = ("fixed", "poll")


@dataclass(frozen=True)
class Merge:
    """What one merge did: the per-window metrics.

    Attributes:
        window: Optimizer steps in the window just closed.
        blocked_s: Seconds blocked in communication since the previous launch (waiting for that
            window's reduction, plus the readiness agreement in mode ``'poll'``); ~0 when hidden.
        bytes: Payload bytes of the reduction launched for the window just closed.
        distance: Consensus distance ``||x - S||`` of this rank's replica from the global model
            it trained against, just before the merge.
        merges: Windows merged into the global model so far.
    """

    window: int
    blocked_s: float
    bytes: int
    distance: float
    merges: int


class HPSGD:
    """The HPSGD state machine (see the module docstring).

    Args:
        params: The replica's parameters; they become views of persistent flat buckets (their
            identity is kept, so optimizer state stays valid).
        group: Data-parallel group (``None``: a single worker).
        window: ``H``, optimizer steps per window (mode ``'poll'``: the minimum window).
        mode: ``'fixed'`` merges every ``window`` steps (deterministic, reproducible);
            ``'poll'`` merges at the first step (after ``window``) at which the reduction has
            completed on *every* rank, decided by a MIN all-reduce of the local flag on
            ``control_group`` (adaptive, not reproducible run to run).
        buffers: Extra tensors averaged at each merge with the same one-window staleness as the
            parameters (e.g. BatchNorm statistics from :func:`float_buffers`); empty: local.
        bucket_bytes: Bucket size bound of the flat buffers (``None``: one per dtype).
        stats: Communication accounting to update.
        control_group: Group for the ``'poll'`` agreement; a separate group with the ranks of
            ``group`` keeps the tiny flag from queuing behind the bulk reduction. Default:
            ``group`` itself.
        optimizer: The inner optimizer, required for ``reset_optimizer_state``.
        reset_optimizer_state: Clear the inner optimizer's state (momentum, Adam moments) at
            every merge; by default it is kept across windows.

    Raises:
        ValueError: On a bad ``window``, ``mode``, or ``reset_optimizer_state`` without an
            optimizer.
    """

    def __init__(
        self,
        params: Iterable[Tensor],
        group: Group,
        window: int = 2,
        mode: str = "fixed",
        buffers: Iterable[Tensor] = (),
        bucket_bytes: int | None = None,
        stats: CommStats | None = None,
        control_group: Group = None,
        optimizer: Optimizer | None = None,
        reset_optimizer_state: bool = False,
    ) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"HPSGD: argument `window` must be an integer >= 1, got {window!r}.")
        if mode not in MODES:
            raise ValueError(f"HPSGD: argument `mode` must be one of {MODES}, got {mode!r}.")
        if reset_optimizer_state and optimizer is None:
            raise ValueError("HPSGD: `reset_optimizer_state=True` needs the inner `optimizer`.")
        self.group, self.window, self.mode = group, window, mode
        self.control_group = control_group if control_group is not None else group
        self.world = group_size(group)
        self.stats = stats if stats is not None else CommStats()
        self.optimizer, self.reset_optimizer_state = optimizer, reset_optimizer_state
        self.flat = FlatTensors(list(params), bucket_bytes)
        extra = list(buffers)
        self.flat_buffers = FlatTensors(extra, bucket_bytes) if extra else None
        self.global_model: list[Tensor] = self.flat.clone()  # S
        self.in_flight: list[Tensor] = self.flat.zeros_like()  # fly
        self._scratch: list[Tensor] = self.flat.zeros_like()  # V in the first window, else scratch
        self.global_buffers: list[Tensor] = self.flat_buffers.clone() if self.flat_buffers else []
        self._buffers_in_flight: list[Tensor] = self.flat_buffers.zeros_like() if self.flat_buffers else []
        self._works: list[dist.Work] = []
        self._replica: tuple[list[Tensor], list[Tensor]] | None = None  # saved while in consensus()
        self.launched = False
        self.first_window = False
        self.since_launch = 0
        self.steps = 0
        self.merges = 0
        self._blocked_mark = 0.0

    # ------------------------------------------------------------------ the recurrence
    @property
    def replica(self) -> list[Tensor]:
        """``x``: the flat buckets the parameters are views of."""
        return self.flat.buckets

    def _buffers(self) -> list[Tensor]:
        return self.flat_buffers.buckets if self.flat_buffers is not None else []

    def step(self) -> Merge | None:
        """Call after every optimizer step; returns the merge's metrics when a window closed."""
        self.steps += 1
        self.since_launch += 1
        if not self.launched:
            self._first_launch()
            return None
        if not self._ready():
            return None
        return self._merge()

    @torch.no_grad()
    def _first_launch(self) -> None:
        # nothing to merge yet: ship the first step's change and keep training the replica
        for x, s, fly in zip(self.replica, self.global_model, self.in_flight, strict=True):
            torch.sub(x, s, out=fly)  # V = S before the first step
        torch._foreach_copy_(self._scratch, self.replica)  # V <- x
        if self.flat_buffers is not None:
            torch._foreach_copy_(self._buffers_in_flight, self._buffers())
        self.launched, self.first_window = True, True
        self._launch()

    def _ready(self) -> bool:
        if self.since_launch < self.window:
            return False
        if self.mode == "fixed":
            return True
        return self._all_ranks_completed()

    def _all_ranks_completed(self) -> bool:
        # a rank-local is_completed() differs between ranks; the MIN makes the decision common
        done = all(w.is_completed() for w in self._works)
        if self.control_group is None:
            return done
        flag = torch.tensor([int(done)], dtype=torch.int32, device=self.replica[0].device)
        with self.stats.blocked():
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.control_group)
        self.stats.add(payload_bytes([flag]))
        return bool(flag.item())

    @torch.no_grad()
    def _merge(self) -> Merge:
        window = self.since_launch
        distance = self._close_window()
        torch._foreach_copy_(self.replica, self.global_model)  # the replica restarts from S
        if self.flat_buffers is not None:
            torch._foreach_copy_(self._buffers_in_flight, self._buffers())
            torch._foreach_copy_(self._buffers(), self.global_buffers)
        # the scratch list now holds this window's delta: it becomes the next in-flight buffer
        self.in_flight, self._scratch = self._scratch, self.in_flight
        blocked = self.stats.blocked_s - self._blocked_mark
        self.merges += 1
        self._launch()
        if self.reset_optimizer_state and self.optimizer is not None:
            self.optimizer.state.clear()
        return Merge(window, blocked, payload_bytes(self._payload()), distance, self.merges)

    def _close_window(self) -> float:
        """Wait, put this window's delta in the scratch list and apply the previous one to S.

        Returns the consensus distance ``||x - S||`` (S before the update).
        """
        self._wait()
        x, s = self.replica, self.global_model
        if self.first_window:
            distance = _norm([xb - sb for xb, sb in zip(x, s, strict=True)])  # once per fit
            start = self._scratch
        else:
            start = s  # V == S after the first merge
        for xb, vb, out in zip(x, start, self._scratch, strict=True):
            torch.sub(xb, vb, out=out)  # delta = x - V
        if not self.first_window:
            distance = _norm(self._scratch)
        torch._foreach_add_(s, self.in_flight, alpha=1.0 / self.world)
        if self.flat_buffers is not None:
            torch._foreach_copy_(self.global_buffers, self._buffers_in_flight)
            torch._foreach_div_(self.global_buffers, float(self.world))
        self.first_window = False
        return distance

    def _payload(self) -> list[Tensor]:
        return self.in_flight + self._buffers_in_flight

    def _launch(self) -> None:
        self._works = all_reduce_sum_async(self._payload(), self.group, self.stats)
        self.since_launch = 0
        self._blocked_mark = self.stats.blocked_s

    def _wait(self) -> None:
        # the only place an in-flight buffer becomes readable
        wait_all(self._works, self.stats)
        self._works = []

    @torch.no_grad()
    def finalize(self) -> None:
        """End of training: merge the in-flight window and the steps since it, so no update is lost.

        Afterwards every rank's replica (and, with ``buffers``, its buffers) holds the global
        model, and the next :meth:`step` starts a new pipeline.
        """
        if not self.launched:
            return
        self._close_window()
        if self.since_launch:  # the partial window: a blocking reduction, once per fit
            if self.flat_buffers is not None:
                torch._foreach_copy_(self._buffers_in_flight, self._buffers())
            all_reduce_sum_(self._scratch + self._buffers_in_flight, self.group, self.stats)
            torch._foreach_add_(self.global_model, self._scratch, alpha=1.0 / self.world)
            if self.flat_buffers is not None:
                torch._foreach_div_(self._buffers_in_flight, float(self.world))
                torch._foreach_copy_(self.global_buffers, self._buffers_in_flight)
            self.merges += 1
        self.merges += 1
        torch._foreach_copy_(self.replica, self.global_model)
        if self.flat_buffers is not None:
            torch._foreach_copy_(self._buffers(), self.global_buffers)
        self.launched, self.since_launch = False, 0

    # ------------------------------------------------------------------ views of the global model
    def global_tensors(self) -> list[Tensor]:
        """Per-parameter views of the global model ``S``, in the order of ``params``."""
        return self.flat.split(self.global_model)

    @contextmanager
    def consensus(self) -> Iterator[None]:
        """Hold the global model (and global buffers) in the replica while inside, then restore it."""
        if self._replica is not None:  # nested: already holding S
            yield
            return
        with torch.no_grad():
            self._replica = ([b.clone() for b in self.replica], [b.clone() for b in self._buffers()])
            torch._foreach_copy_(self.replica, self.global_model)
            if self.flat_buffers is not None:
                torch._foreach_copy_(self._buffers(), self.global_buffers)
        try:
            yield
        finally:
            with torch.no_grad():
                params, bufs = self._replica
                torch._foreach_copy_(self.replica, params)
                if bufs:
                    torch._foreach_copy_(self._buffers(), bufs)
            self._replica = None

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Counters and per-tensor copies of ``S``, the (waited) in-flight sum and ``V`` when distinct.

        Waits for the in-flight reduction first (a stored buffer must be a finished sum); in mode
        ``'fixed'`` this changes no result. Per-tensor lists keep checkpoints independent of the
        bucket size. Inside :meth:`consensus`, the replica being held aside is stored as well.
        """
        self._wait()
        state: dict[str, Any] = {
            "steps": self.steps,
            "merges": self.merges,
            "since_launch": self.since_launch,
            "launched": self.launched,
            "first_window": self.first_window,
            "global_model": self.global_tensors(),
        }
        if self.launched:
            state["in_flight"] = self.flat.split(self.in_flight)
        if self.first_window:
            state["window_start"] = self.flat.split(self._scratch)
        if self.flat_buffers is not None:
            state["global_buffers"] = self.flat_buffers.split(self.global_buffers)
            state["buffers_in_flight"] = self.flat_buffers.split(self._buffers_in_flight)
        if self._replica is not None:
            state["replica"] = self.flat.split(self._replica[0])
            if self.flat_buffers is not None:
                state["replica_buffers"] = self.flat_buffers.split(self._replica[1])
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict` (the parameters' own values are restored separately)."""
        self._wait()
        self.steps, self.merges = int(state["steps"]), int(state["merges"])
        self.since_launch = int(state["since_launch"])
        self.launched, self.first_window = bool(state["launched"]), bool(state["first_window"])
        _load(self.flat, self.global_model, state["global_model"], "global_model")
        if self.launched:
            _load(self.flat, self.in_flight, state["in_flight"], "in_flight")
        if self.first_window:
            _load(self.flat, self._scratch, state["window_start"], "window_start")
        if "replica" in state:
            _load(self.flat, self.replica, state["replica"], "replica")
        if self.flat_buffers is None:
            if "global_buffers" in state:
                raise ValueError("HPSGD: the checkpoint averaged buffers (sync_buffers) but this run does not.")
            return
        if "global_buffers" not in state:
            raise ValueError("HPSGD: this run averages buffers (sync_buffers) but the checkpoint did not.")
        _load(self.flat_buffers, self.global_buffers, state["global_buffers"], "global_buffers")
        _load(self.flat_buffers, self._buffers_in_flight, state["buffers_in_flight"], "buffers_in_flight")
        if "replica_buffers" in state:
            _load(self.flat_buffers, self._buffers(), state["replica_buffers"], "replica_buffers")


def _norm(tensors: Sequence[Tensor]) -> float:
    return float(torch.stack(torch._foreach_norm(list(tensors))).norm()) if tensors else 0.0


def _load(flat: FlatTensors, dst: list[Tensor], src: Sequence[Tensor], name: str) -> None:
    views = flat.split(dst)
    if len(src) != len(views) or any(a.shape != b.shape for a, b in zip(src, views, strict=True)):
        raise ValueError(f"HPSGD: checkpoint entry `{name}` does not match this model's parameters.")
    torch._foreach_copy_(views, [t.to(v.device, v.dtype) for t, v in zip(src, views, strict=True)])
