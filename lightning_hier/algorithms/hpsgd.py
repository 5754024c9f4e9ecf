"""HPSGD: a replica/global-model pair whose window all-reduce overlaps the next window's compute.

Hierarchical Parallel SGD (Zhou, Ye, Zhang and Lv, arXiv 2009.02701, 2020; the authors' code,
github.com/Soptq/Hierarchical_Local_SGD, first called it HLSGD), in its delta form, which works
with any inner optimizer. Every rank trains a *replica* ``x`` (the live parameters) with its own
optimizer and no per-step gradient all-reduce. A window of ``H`` optimizer steps closes with
this rank's change ``d = x - V`` (``V``: the replica when the window opened); its SUM
all-reduce runs in the background while the next window computes. When that next window
closes, the reduction is waited for (``F = sum_w d_w`` of the previous window) and::

    S <- S + F / W                         # the global model: the previous window's average change
    merge='paper':  x <- S;      V <- S    # the replica restarts from the global model
    merge='eager':  x <- S + d;  V <- x    # ... and keeps its own freshest window on top of it
    launch all_reduce(d)                   # this window's change, behind the next window

``S`` is identical on every rank and one window stale. With ``merge='paper'`` each rank also
drops its newest window (it comes back, averaged, one window later), so every gradient moves a
model up to ``H`` steps older than the one it was computed on, and momentum optimizers lose most
of their stable step size to that delay (``recipes/hpsgd/README.md``). ``merge='eager'`` follows
Kale, Douillard and Donchev ("Eager Updates For Overlapped Communication and Computation in
DiLoCo", arXiv 2502.12996, 2025): while the newest average is in flight, the rank's own newest
change stands in for it, so ``x = S_{k-1} + mean_w d_w^{k-1} + d_own^k`` holds every change the
rank knows of and its trajectory is never rolled back. (Kale et al. weight the own fresh change
``1/W`` beside the others' stale ones; adding it whole measured better here with momentum.)

Options on the same overlapped window and flat buckets:

- an *outer optimizer* (``outer_lr``, ``outer_momentum``): the global update ``S <- S + F / W``
  becomes a Nesterov-momentum SGD step on the outer gradient ``-F / W``, as in DiLoCo
  (:class:`~lightning_hier.algorithms.outer.OuterNesterov`); ``outer_lr=1, outer_momentum=0``
  is the addition above, bit for bit;
- ``compression='bf16'``: the window's change is sent in bfloat16 with error feedback (half the
  bytes; :class:`~lightning_hier.algorithms.compression.Bf16ErrorFeedback`), and ``S`` stays
  float32.

The first window is the first step alone (launch at step 1, merges at steps ``1 + H``,
``1 + 2H``, ...). Two deliberate differences from the authors' code: the end of training drains
(waits for and merges the in-flight window, then merges the steps since the last launch with a
blocking reduction) instead of dropping one window and double-counting another at every epoch
end; and mode ``'poll'`` makes every rank agree on readiness (a MIN all-reduce of the local flag
on a control group), so all ranks launch the same collectives in the same order.

Memory: the parameters become views of persistent flat buckets (:class:`FlatTensors`); the state
is ``S``, the in-flight payload and a scratch list of the same layout, plus ``V`` with
``merge='eager'``, the outer momentum with ``outer_momentum > 0`` and a bfloat16 payload and
float32 residual with ``compression='bf16'``.

Pure torch: usable from a plain training loop::

    hp = HPSGD(model.parameters(), group=None, window=4)   # group=None: one worker
    for x, y in data:
        loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
        hp.step()
    hp.finalize()                                          # every rank now holds S
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from lightning_hier import _validate as v
from lightning_hier.algorithms.compression import COMPRESSIONS, Bf16ErrorFeedback, QuantizedChange, make_codec
from lightning_hier.algorithms.hpsgd_state import HPSGDCheckpoint
from lightning_hier.algorithms.outer import OuterNesterov
from lightning_hier.algorithms.round_guard import RoundGuard
from lightning_hier.comm import (
    CommStats,
    FlatTensors,
    PhaseClock,
    all_reduce_sum_,
    all_reduce_sum_async,
    group_size,
    wait_all,
)
from lightning_hier.comm.collectives import Group, payload_bytes
from lightning_hier.comm.quantized import QuantizedWork, gather_step, start_gathers

MODES = ("fixed", "poll")
MERGES = ("eager", "paper")
AUTO = "auto"
"""``delay='auto'``: the delay is chosen from the second window's reduction, timed (:func:`auto_delay`)."""
AUTO_WAIT = 0.25
"""``delay='auto'``: the wait per merge it accepts, in steps (a quarter step: under 7 % at window 4)."""


def auto_delay(phase_s: Sequence[float], step_s: float, window: int, wait: float = AUTO_WAIT) -> int:
    """The smallest delay in ``[1, window]`` at which a reduction is predicted to block at most ``wait`` steps.

    ``phase_s`` are the reduction's phases, run back to back: one for an all-reduce; two for a
    quantized one, its exchange and then its gather, which starts :func:`gather_step` steps after
    the launch (or when the exchange ends, if later). With delay ``D`` and step time ``t`` a rank
    waits ``max(0, a - D t)`` for one phase of ``a`` seconds, and for two (``a`` then ``b``,
    ``g = gather_step(D) t``) ``max(0, a - g) + max(0, g + b - D t)``: for a late exchange when it
    starts the gather, then for the gather at the merge. ``window`` when no delay is short enough.

    A shorter delay brings the other ranks' changes in sooner (``docs/guide/strategies/hpsgd.md``
    has the accuracies), so the smallest delay that hides the reduction is the best one.
    """
    if step_s <= 0:
        return 1 if not any(phase_s) else window
    for delay in range(1, window + 1):
        if len(phase_s) == 1:
            blocked = max(0.0, phase_s[0] - delay * step_s)
        else:
            exchange, gather = phase_s
            start = gather_step(delay) * step_s
            blocked = max(0.0, exchange - start) + max(0.0, start + gather - delay * step_s)
        if blocked <= wait * step_s:
            return delay
    return window


def check_delay(owner: str, delay: Any, window: int, merge: str, mode: str) -> int | str | None:
    """``delay`` checked: ``None``, ``'auto'`` or an integer in ``[1, window]``.

    A delay below ``window`` (or ``'auto'``, which may choose one) needs ``merge='eager'`` (the
    replica keeps its steps since the launch) and ``mode='fixed'`` (merges at counted steps).

    Raises:
        ValueError: Naming ``owner``, the argument and the bad value.
    """
    if delay is None:
        return None
    if delay != AUTO:
        number = v.as_int(delay)
        if number is None or not 1 <= number <= window:
            raise ValueError(
                f"{owner}: argument `delay` must be an integer in [1, window={window}] or 'auto', got {delay!r}."
            )
        delay = number
    if delay == AUTO or delay < window:
        why = f"(below window={window})" if delay != AUTO else f"(it may choose one below window={window})"
        for name, value, allowed in (("merge", merge, "eager"), ("mode", mode, "fixed")):
            if value != allowed:
                raise ValueError(
                    f"{owner}: argument `delay`={delay!r} {why} needs {name}={allowed!r}, got {name}={value!r}."
                )
    return delay


@dataclass(frozen=True)
class Merge:
    """What one merge did: the per-window metrics.

    Attributes:
        window: Optimizer steps in the window just closed.
        blocked_s: Seconds blocked in communication since the previous launch (waiting for that
            window's reduction, plus the readiness agreement in mode ``'poll'``); ~0 when hidden.
        bytes: Payload bytes of the reduction launched for the window just closed.
        distance: Consensus distance ``||x - S||`` of this rank's replica from the global model,
            just before the merge.
        merges: Windows merged into the global model so far.
    """

    window: int
    blocked_s: float
    bytes: int
    distance: float
    merges: int


class HPSGD(HPSGDCheckpoint):
    """The HPSGD state machine (see the module docstring for the exact rules).

    Args:
        params: The replica's parameters; they become views of persistent flat buckets (their
            identity is kept, so optimizer state stays valid).
        group: Data-parallel group (``None``: a single worker).
        window: ``H``, optimizer steps per window (mode ``'poll'``: the minimum window).
        mode: ``'fixed'`` merges every ``window`` steps (deterministic, reproducible);
            ``'poll'`` merges at the first step (after ``window``) at which the reduction has
            completed on *every* rank, decided by a MIN all-reduce of the local flag on
            ``control_group`` (adaptive, not reproducible run to run).
        merge: ``'eager'`` (the replica restarts from ``S`` plus its own newest window change)
            or ``'paper'`` (the replica restarts from ``S``, as in Zhou et al.).
        outer_lr: Outer learning rate of the global update (``1.0``: the average change is added).
        outer_momentum: Outer Nesterov momentum in ``[0, 1)`` (``0.0``: none).
        compression: ``'none'`` (float32 payload) or ``'bf16'`` (bfloat16 with error feedback).
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
        delay: Steps from a window's launch to its merge, in ``[1, window]`` (``None``: ``window``);
            below ``window`` the launches stay every ``window`` steps and the merge comes sooner.
            ``'auto'``: ``window`` for the first two windows, then :func:`auto_delay`'s choice
            from the second one's reduction, timed on every rank (agreed on ``control_group``).

    Raises:
        ValueError: On a bad ``window``, ``mode``, ``merge``, ``compression``, outer argument, or
            ``reset_optimizer_state`` without an optimizer.
    """

    def __init__(
        self,
        params: Iterable[Tensor],
        group: Group,
        window: int = 2,
        mode: str = "fixed",
        merge: str = "eager",
        outer_lr: float = 1.0,
        outer_momentum: float = 0.0,
        compression: str = "none",
        buffers: Iterable[Tensor] = (),
        bucket_bytes: int | None = None,
        stats: CommStats | None = None,
        control_group: Group = None,
        optimizer: Optimizer | None = None,
        reset_optimizer_state: bool = False,
        delay: int | str | None = None,
    ) -> None:
        window = v.check_int("HPSGD", "window", window, minimum=1)
        for name, value, allowed in (
            ("mode", mode, MODES),
            ("merge", merge, MERGES),
            ("compression", compression, COMPRESSIONS),
        ):
            if value not in allowed:
                raise ValueError(f"HPSGD: argument `{name}` must be one of {allowed}, got {value!r}.")
        if reset_optimizer_state and optimizer is None:
            raise ValueError("HPSGD: `reset_optimizer_state=True` needs the inner `optimizer`.")
        delay = check_delay("HPSGD", delay, window, merge, mode)
        self.group, self.window, self.mode, self.merge = group, window, mode, merge
        self.delay = window if delay is None or delay == AUTO else int(delay)
        self.delay_chosen = delay != AUTO
        """Whether :attr:`delay` is final (``delay='auto'``: from the second window's merge on, once timed)."""
        self.control_group = control_group if control_group is not None else group
        self.world = group_size(group)
        self.in_flight_world = self.world  # how many replicas' changes the in-flight sum holds
        self.stats = stats if stats is not None else CommStats()
        self.optimizer, self.reset_optimizer_state = optimizer, reset_optimizer_state
        self.outer = OuterNesterov(outer_lr, outer_momentum)
        self.flat = FlatTensors(list(params), bucket_bytes)
        extra = list(buffers)
        self.flat_buffers = FlatTensors(extra, bucket_bytes) if extra else None
        self.global_model: list[Tensor] = self.flat.clone()  # S
        self._delta: list[Tensor] = self.flat.zeros_like()  # d; also V in the paper rule's first window
        self._own_start: list[Tensor] | None = self.flat.clone() if merge == "eager" else None  # V
        self.codec = make_codec(compression, self.global_model, self.world)
        self.in_flight: list[Tensor] = (  # fly: where the summed change lands
            self.codec.payload
            if isinstance(self.codec, Bf16ErrorFeedback)
            else self.codec.total
            if self.codec is not None
            else self.flat.zeros_like()
        )
        self.global_buffers: list[Tensor] = self.flat_buffers.clone() if self.flat_buffers else []
        self._buffers_in_flight: list[Tensor] = self.flat_buffers.zeros_like() if self.flat_buffers else []
        self._works: list[dist.Work] = []
        self._timing: list[PhaseClock] | None = None  # delay='auto': the in-flight reduction's, until chosen
        self._launched_at = 0.0  # delay='auto': perf_counter() at the timed reduction's launch
        self._replica: tuple[list[Tensor], list[Tensor]] | None = None  # saved while in consensus()
        self.launched = False
        self.pending = False  # a launched window not merged yet (with delay == window: always, once launched)
        self.first_window = False
        self.since_launch = 0
        self.steps = 0
        self.merges = 0
        self._blocked_mark = 0.0
        # this rank's factor on the change it sends (DBS shares: W n_r / N, lightning_hier.algorithms.dbs_compose)
        self.change_weight = 1.0
        self.guard: RoundGuard | None = None
        """Settles the in-flight reduction under a changing membership (``None``: a fixed group)."""
        self._sent: list[Tensor] | None = None  # with a guard: this rank's payload as sent, to sum again
        self._send_group: Group = None  # the group the in-flight reduction runs over
        self._settling = False  # with a guard: a launched reduction not yet settled

    # ------------------------------------------------------------------ the recurrence
    @property
    def replica(self) -> list[Tensor]:
        """``x``: the flat buckets the parameters are views of."""
        return self.flat.buckets

    def _buffers(self) -> list[Tensor]:
        return self.flat_buffers.buckets if self.flat_buffers is not None else []

    def _start(self) -> list[Tensor]:
        """``V``, the replica when the current window opened."""
        if self._own_start is not None:
            return self._own_start
        # paper rule: V is the first step's end inside the first window, S ever after
        return self._delta if self.first_window else self.global_model

    def step(self) -> Merge | None:
        """Call after every optimizer step; returns the merge's metrics when a window closed."""
        self.steps += 1
        self.since_launch += 1
        if not self.launched:
            self._first_launch()
            return None
        for clock in self._timing or ():  # NCCL's: read at step boundaries
            clock.poll()
        if self.pending and self.since_launch == gather_step(self.delay):
            start_gathers(self._works)  # a quantized reduction's second half, behind the steps until the merge
        if self.delay < self.window:  # merge `delay` steps after a launch, launch every `window` steps
            if self.pending and self.since_launch == self.delay:
                return self._merge_early()
            if self.since_launch == self.window:
                self._launch()
            return None
        if not self._ready():
            return None
        return self._merge()

    def _choose_delay(self, compute_s: float) -> None:
        """``delay='auto'``: from the window just waited for, the delay of every later window.

        Each rank times its reduction from its launch to the completion of its collectives (a
        :class:`~lightning_hier.comm.PhaseClock`, per phase for a quantized one) and its steps'
        compute over the window (``compute_s``), and proposes :func:`auto_delay`'s choice. The
        ranks take the smallest proposal (a MIN all-reduce on ``control_group``): a rank that
        launched early also timed its wait for the others, which no delay hides; the one that
        launched last timed the transfer alone. Without the timings (the window was launched
        before a resume) the choice waits for the next window.
        """
        if self.world == 1:  # nothing to wait for
            self.delay, self.delay_chosen = 1, True
            return
        step_s = compute_s / max(1, self.since_launch)
        proposal = 0 if self._timing is None else auto_delay([c.elapsed() for c in self._timing], step_s, self.window)
        self._timing = None
        chosen = self._agree_min(proposal)  # 0: a rank has no timing
        if chosen > 0:
            self.delay, self.delay_chosen = chosen, True

    def _agree_min(self, value: int) -> int:
        if self.control_group is None:
            return value
        tensor = torch.tensor([value], dtype=torch.int32, device=self.replica[0].device)
        with self.stats.blocked():
            dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.control_group)
        self.stats.add(payload_bytes([tensor]))
        return int(tensor.item())

    @torch.no_grad()
    def _first_launch(self) -> None:
        # nothing to merge yet: ship the first step's change (V = S before it), keep the replica
        for x, s, d in zip(self.replica, self.global_model, self._delta, strict=True):
            torch.sub(x, s, out=d)
        self._stage_buffers()
        self.launched, self.first_window = True, True
        self._send()
        torch._foreach_copy_(self._start(), self.replica)  # V <- x

    @torch.no_grad()
    def _merge_early(self) -> Merge:
        """``delay`` steps after a launch: ``S <- S + F / W``; ``x <- S + (x - V)``; ``V <- S``.

        ``x - V`` is this rank's change since the launch, not yet sent; with ``V = S`` the next
        launch sends exactly that change plus the steps until then.
        """
        self._wait(admit=True)
        distance = _norm(torch._foreach_sub(self.replica, self.global_model))
        self._apply_in_flight()
        assert self._own_start is not None  # delay < window needs merge='eager'
        torch._foreach_sub_(self.replica, self._own_start)
        torch._foreach_add_(self.replica, self.global_model)
        torch._foreach_copy_(self._own_start, self.global_model)
        if self.flat_buffers is not None:
            torch._foreach_copy_(self._buffers(), self.global_buffers)
        self.first_window = False
        self.merges += 1
        if self.reset_optimizer_state and self.optimizer is not None:
            self.optimizer.state.clear()
        blocked = self.stats.blocked_s - self._blocked_mark
        return Merge(self.window, blocked, self._sent_bytes(), distance, self.merges)

    @torch.no_grad()
    def _launch(self) -> None:
        """``window`` steps after the previous launch (its change already merged): send ``x - V``; ``V <- x``."""
        self._take_change()
        self._stage_buffers()
        self._send()
        torch._foreach_copy_(self._start(), self.replica)

    def _ready(self) -> bool:
        if self.since_launch < self.window:
            return False
        if self.mode == "fixed":
            return True
        return self._all_ranks_completed()

    def _all_ranks_completed(self) -> bool:
        return self._all_agree(all(w.is_completed() for w in self._works))

    def _all_agree(self, done: bool) -> bool:
        # a rank-local is_completed() differs between ranks; the MIN makes the decision common
        return bool(self._agree_min(int(done)))

    @torch.no_grad()
    def _merge(self) -> Merge:
        window = self.since_launch
        choose = not self.delay_chosen and self.merges >= 1  # the first reduction may also set up connections
        blocked_so_far = self.stats.blocked_s - self._blocked_mark
        compute_s = time.perf_counter() - self._launched_at - blocked_so_far if choose else 0.0  # wall less blocked
        distance = self._close_window(admit=True)
        if choose:
            self._choose_delay(compute_s)
        self._restart()
        blocked = self.stats.blocked_s - self._blocked_mark
        self.merges += 1
        self._send()
        if self.reset_optimizer_state and self.optimizer is not None:
            self.optimizer.state.clear()
        return Merge(window, blocked, self._sent_bytes(), distance, self.merges)

    def _close_window(self, admit: bool = False) -> float:
        """Wait; put this window's change ``x - V`` in ``d``; apply the previous window's to ``S``.

        Also stages this window's buffers for sending. Returns the consensus distance
        ``||x - S||`` (``S`` before the update). ``admit``: a restarted replica may join here.
        """
        self._wait(admit)
        start = self._take_change()
        # in the paper rule's steady state V == S, so x - S is d itself: no extra pass
        distance = _norm(
            self._delta if start is self.global_model else torch._foreach_sub(self.replica, self.global_model)
        )
        self._apply_in_flight()
        self._stage_buffers()
        self.first_window = False
        return distance

    def _take_change(self) -> list[Tensor]:
        """``d <- x - V`` (no temporary); returns ``V``."""
        start = self._start()
        for xb, vb, d in zip(self.replica, start, self._delta, strict=True):
            torch.sub(xb, vb, out=d)
        return start

    def _apply_in_flight(self) -> None:
        """``S <- outer(S, F / W)``; the global buffers become the in-flight buffers' mean.

        A no-op when nothing is pending (with ``delay < window``, between a merge and the next launch).
        """
        if not self.pending:
            return
        self.pending = False
        self.outer.step_(self.global_model, self.in_flight, scale=1.0 / self.in_flight_world)
        if self.flat_buffers is not None:
            torch._foreach_copy_(self.global_buffers, self._buffers_in_flight)
            torch._foreach_div_(self.global_buffers, float(self.in_flight_world))

    def _stage_buffers(self) -> None:
        if self.flat_buffers is not None:  # the buffers' values go with this window's change
            torch._foreach_copy_(self._buffers_in_flight, self._buffers())

    def _restart(self) -> None:
        """Open the next window: ``x <- S`` (paper) or ``x <- S + d``, ``V <- x`` (eager)."""
        torch._foreach_copy_(self.replica, self.global_model)
        if self._own_start is not None:
            torch._foreach_add_(self.replica, self._delta)
            torch._foreach_copy_(self._own_start, self.replica)
        if self.flat_buffers is not None:
            torch._foreach_copy_(self._buffers(), self.global_buffers)

    def _send(self) -> None:
        """Launch the background SUM of ``d`` (compressed if asked) and the staged buffers.

        Both are first scaled by :attr:`change_weight` when it is not 1 (so the merged change is a
        weighted mean, ``sum_w c_w d_w / W``); the replica has already restarted from ``d`` unscaled.
        """
        if self.change_weight != 1.0:
            torch._foreach_mul_(self._delta + self._buffers_in_flight, self.change_weight)
        clock = PhaseClock() if not self.delay_chosen else None  # delay='auto': this reduction is timed
        if isinstance(self.codec, QuantizedChange):  # its own all-reduce; the buffers' goes beside it
            works: list[Any] = [self.codec.launch(self._delta, self.group, self.stats)] if self.group else []
            self._works = works + all_reduce_sum_async(self._buffers_in_flight, self.group, self.stats)
        else:
            if self.codec is not None:
                self.in_flight = self.codec.encode_(self._delta)
            else:  # d becomes the in-flight buffer; the waited one is the next scratch
                self.in_flight, self._delta = self._delta, self.in_flight
            if self.guard is not None:  # kept to sum again among the survivors if a replica dies meanwhile
                self._sent = [t.clone() for t in self._payload()]
                self._send_group, self._settling = self.group, True
            self._works = all_reduce_sum_async(self._payload(), self.group, self.stats)
        if clock is not None:
            quantized = next((w for w in self._works if isinstance(w, QuantizedWork)), None)
            self._timing = quantized.phases if quantized is not None else [clock.track(self._works, self.group)]
            self._launched_at = clock.start
        self.in_flight_world = self.world
        self.since_launch = 0
        self.pending = True
        self._blocked_mark = self.stats.blocked_s

    def _payload(self) -> list[Tensor]:
        return self.in_flight + self._buffers_in_flight

    def _sent_bytes(self) -> int:
        """Bytes of the payload sent for a window (the quantized size for int8 / int4)."""
        change = self.codec.payload_bytes if isinstance(self.codec, QuantizedChange) else payload_bytes(self.in_flight)
        return change + payload_bytes(self._buffers_in_flight)

    def _wait(self, admit: bool = False) -> None:
        # the only place an in-flight buffer becomes readable
        if self.guard is not None and self._settling:
            self.guard.run(self, self._settle, admit)
            return
        wait_all(self._works, self.stats)
        self._works = []

    # ------------------------------------------------------------------ a changing membership
    def settle(self) -> None:
        """Wait for the window in flight (its sum is then final here; a collective)."""
        self._wait()

    def regroup(self, group: Group) -> None:
        """Send over ``group`` from now on (the live replicas of a fault-tolerant run; every member calls it)."""
        self.group = self.control_group = group
        self.world = group_size(group)

    def _settle(self) -> None:
        """Finish the in-flight reduction; if the group changed since the launch, sum the survivors' changes again.

        The rule for a replica lost while its window was in flight: its change is dropped, and the
        survivors' changes of that window are summed among them (blocking) and averaged over
        their number, so the window still counts for every replica that finished it.
        """
        if self._send_group is self.group:
            wait_all(self._works, self.stats)
        else:
            assert self._sent is not None
            torch._foreach_copy_(self._payload(), self._sent)
            all_reduce_sum_(self._payload(), self.group, self.stats)
            self.in_flight_world = self.world
        self._works, self._settling = [], False

    def undo_point(self) -> Callable[[], None]:
        """How to undo a failed :meth:`_settle` (the guard calls it first): the payload as sent, to sum again."""

        def undo() -> None:
            if self._sent is not None:
                torch._foreach_copy_(self._payload(), self._sent)
            self._works, self._settling, self._send_group = [], True, None  # summed again, over the next group

        return undo

    @torch.no_grad()
    def finalize(self) -> None:
        """End of training: merge the in-flight window and the steps since it, so no update is lost.

        Afterwards every rank's replica (and, with ``buffers``, its buffers) holds the global
        model, and the next :meth:`step` starts a new pipeline. Calling it again is a no-op.
        """
        if not self.launched:
            return
        partial, pending = self.since_launch > 0, self.pending
        self._close_window()
        self.merges += int(pending)
        if partial:  # the steps since the last launch: a blocking reduction, once per fit
            self._send()
            self._wait()
            self._apply_in_flight()
            self.merges += 1
        torch._foreach_copy_(self.replica, self.global_model)
        if self._own_start is not None:
            torch._foreach_copy_(self._own_start, self.global_model)
        if self.flat_buffers is not None:
            torch._foreach_copy_(self._buffers(), self.global_buffers)
        self.launched, self.since_launch = False, 0

    # ------------------------------------------------------------------ views of the global model
    def global_tensors(self) -> list[Tensor]:
        """Per-parameter views of the global model ``S``, in the order of ``params``."""
        return self.flat.split(self.global_model)

    def _current_model(self) -> tuple[list[Tensor], list[Tensor]]:
        """``S`` and the buffers advanced by the window in flight, without changing any state."""
        if not self.pending:
            return self.global_model, self.global_buffers
        self._wait()
        model = [s.clone() for s in self.global_model]
        self.outer.copy().step_(model, self.in_flight, scale=1.0 / self.in_flight_world)  # the next merge's
        return model, [b / self.in_flight_world for b in self._buffers_in_flight]

    @contextmanager
    def consensus(self) -> Iterator[None]:
        """Hold the consensus model in the replica while inside, then restore the replica.

        The consensus model is the newest global model every rank agrees on: ``S`` advanced by
        the window in flight (waited for; no extra communication), i.e. the global model of the
        next merge. It lags the replicas by the steps since the last launch (fewer than
        ``window``); :meth:`finalize` merges those too. At the end of fit the two coincide.
        """
        if self._replica is not None:  # nested: already holding it
            yield
            return
        with torch.no_grad():
            self._replica = ([b.clone() for b in self.replica], [b.clone() for b in self._buffers()])
            model, buffers = self._current_model()
            torch._foreach_copy_(self.replica, model)
            if self.flat_buffers is not None:
                torch._foreach_copy_(self._buffers(), buffers)
        try:
            yield
        finally:
            with torch.no_grad():
                params, bufs = self._replica
                torch._foreach_copy_(self.replica, params)
                if bufs:
                    torch._foreach_copy_(self._buffers(), bufs)
            self._replica = None


def _norm(tensors: Sequence[Tensor]) -> float:
    return float(torch.stack(torch._foreach_norm(list(tensors))).norm()) if tensors else 0.0
