"""The lock-step engine of one pipeline stage (one rank of the N x K grid).

Every rank calls :meth:`DecoupledPipeline.step` once per iteration, all ranks in lock-step. On
stage ``k`` an iteration is:

1. **input**: stage 0 takes the next batch; a later stage takes the activation (and the labels,
   which travel with it) sent in the previous iteration (``fdg``), or waits for it from stage
   ``k - 1`` within this iteration (``ddg``, ``sync``: the forward is locked);
2. **forward**: the last stage computes the loss, backpropagates at once, all-reduces the gradient
   over its data-parallel group and applies it; any other stage pushes ``(batch, input, weight
   version)`` into its FIFO and passes the activation on;
3. **delayed backward** (stages ``k < K - 1``): if the gradient of the oldest FIFO entry came (sent
   in the previous iteration; within this one for ``sync``), it is multiplied by ``beta``,
   backpropagated at the entry's weight version, all-reduced and applied; the input gradient and
   the batch's loss go on to stage ``k - 1``. With ``order='backward_first'`` (FDG's order, see
   :mod:`.schedule`) stages ``k < K - 1`` run step 3 before step 2.

**Messages.** A decoupled direction (activations for ``fdg``, gradients for ``fdg``/``ddg``)
carries at most one message per iteration, one per batch: an iteration of the pipeline's fill or
drain with no batch to pass on sends nothing, and its receiver, which knows that from the
schedule's counters (:meth:`.Schedule.sends_activation`), posts nothing. (An empty message would
still travel at the link buffer's full size, a whole transfer at the fill and at the end of every
epoch.) Its receive is posted when the previous one is taken and waited for only where the stage
needs it (the activation when the iteration starts, the gradient just before the delayed
backward), and a send is waited for only before its link's buffer is written again
(:meth:`Mailbox.send_later`): so an activation gradient leaving the last stage after its compute
travels behind the next iteration's forward on both ends. A locked direction is a blocking
send/receive within the iteration. Evaluation uses mailboxes with their own tag, so it can run
while training receives are posted.

No update happens on a stage before its first gradient arrives, so momentum and weight decay do
not move weights during the warm-up. :meth:`drain` runs the iterations without new input that
apply every batch still in flight; afterwards every FIFO is empty and the pipeline restarts its
iteration and batch counters.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_hier.algorithms.decoupled.schedule import Schedule
from lightning_hier.algorithms.decoupled.stage import InFlight, StageRunner
from lightning_hier.comm import CommStats, Inbox
from lightning_hier.comm.p2p import Mailbox, Parcel
from lightning_hier.comm.two_level import two_level_mean_

Group = dist.ProcessGroup | None
# training keeps receives posted between iterations; evaluation's messages must not match them
_TRAIN_TAG, _EVAL_TAG = 0, 1
WIRE_DTYPES = (None, torch.bfloat16)
"""What activations and their gradients may travel as (``None``: their own dtype)."""
LossFn = Callable[[Tensor, Tensor | None], Tensor]
Apply = Callable[[], None]


@dataclass(frozen=True)
class IterationReport:
    """What one stage did in one iteration (batch ids count from 0 since the pipeline was last empty)."""

    iteration: int
    forwarded: int | None
    applied: int | None
    loss: float | None
    rows: int
    in_flight: int


@dataclass
class _Done:
    """Result of the backward part of an iteration."""

    batch: int
    loss: float
    rows: int
    outgoing: Parcel | None


class DecoupledPipeline:
    """One stage of a pipeline trained with delayed gradients (see the module docstring).

    Args:
        stage: This rank's blocks (its parameters become views of flat buckets).
        stage_index: ``k``, 0-based.
        stage_ranks: Global ranks of the ``K`` stages of this rank's replica, in stage order.
        pipe_group: Process group of ``stage_ranks`` (``None`` when ``K == 1``), or a pair
            ``(activations, gradients)`` of groups over the same ranks: each direction then has a
            connection of its own (gloo opens one TCP connection per pair of ranks and group, and
            one connection carrying bulk data both ways lets the two messages take turns, up to
            twice a transfer's time; docs/lightning.md, section 10).
        data_group: The data-parallel group of this stage (``None`` without replicas), or a pair
            ``(node-local, cross-node)`` of groups for the same mean in two levels
            (:func:`~lightning_hier.comm.two_level.two_level_mean_`; ``None``: that level has one rank).
        schedule: ``'fdg'``, ``'ddg'`` or ``'sync'`` (see :mod:`.schedule`).
        order: ``'forward_first'`` or ``'backward_first'`` (FDG's order, ``fdg`` only; see :mod:`.schedule`).
        weights: ``'stash'``, ``'recompute'`` or ``'legacy'`` (see :mod:`.stage`).
        beta: Gradient shrinking: every stage but the last multiplies the incoming gradient by
            ``beta``, so stage ``k``'s gradients are scaled by ``beta ** (K - 1 - k)``.
        loss_fn: ``loss_fn(output, target) -> scalar`` on the last stage (cross-entropy by default);
            ``target`` is ``None`` for batches that are an input tensor alone.
        stats: Communication accounting.
        check_gradients: Called with the stage's gradients of every update, before they are
            averaged over the data-parallel replicas (the strategy's ``check_finite`` guard).
        wire_dtype: ``torch.bfloat16`` sends activations and activation gradients in bfloat16 (half
            the bytes of float32; the receiver computes in its parameters' dtype again, so only the
            values crossing a cut are rounded, to 8 significant bits); ``None`` sends them as they are.
        timeout: Longest wait for a neighbour's message (``None``: the pipe group's own limit; with
            gloo that is the timeout the group was created with). A neighbour that does not answer
            in time raises :class:`~lightning_hier.comm.PeerError` naming it.

    Example (plain loop on each rank; every stage of a replica iterates the same loader)::

        pipe = DecoupledPipeline(blocks_of_my_stage, stage_index=k, stage_ranks=[0, 1], pipe_group=group)

        def apply() -> None:  # called when the averaged gradient is in the parameters' .grad
            optimizer.step()

        for batch in loader:
            pipe.step(batch, apply)
        pipe.drain(apply)  # every batch applied once; all FIFOs empty
    """

    def __init__(
        self,
        stage: nn.Module,
        *,
        stage_index: int,
        stage_ranks: Sequence[int],
        pipe_group: Group | tuple[Group, Group] = None,
        data_group: Group | tuple[Group, Group] = None,
        schedule: str = "fdg",
        order: str = "forward_first",
        weights: str = "stash",
        beta: float = 1.0,
        loss_fn: LossFn | None = None,
        stats: CommStats | None = None,
        check_gradients: Callable[[list[Tensor]], None] | None = None,
        wire_dtype: torch.dtype | None = None,
        timeout: timedelta | None = None,
    ) -> None:
        self.schedule = Schedule(schedule, len(stage_ranks), order)
        if not 0 <= stage_index < len(stage_ranks):
            raise ValueError(f"DecoupledPipeline: stage_index {stage_index} out of range [0, {len(stage_ranks)}).")
        if wire_dtype not in WIRE_DTYPES:
            raise ValueError(
                f"DecoupledPipeline: `wire_dtype` must be one of {', '.join(map(str, WIRE_DTYPES))}, "
                f"got {wire_dtype!r}."
            )
        if not 0.0 < beta <= 1.0:
            raise ValueError(f"DecoupledPipeline: `beta` must be in (0, 1], got {beta!r}.")
        self.k = stage_index
        self.ranks = list(stage_ranks)
        intra, inter = data_group if isinstance(data_group, tuple) else (data_group, None)
        self._levels: tuple[Group, Group] = (intra, inter)
        self.data_groups: tuple[dist.ProcessGroup, ...] = tuple(g for g in self._levels if g is not None)
        """The groups this stage's gradients are averaged over, node-local first."""
        self.beta = beta
        self.wire_dtype = wire_dtype
        self.loss_fn: LossFn = loss_fn if loss_fn is not None else _cross_entropy
        self.stats = stats if stats is not None else CommStats()
        self.check_gradients = check_gradients
        self.runner = StageRunner(stage, weights)
        down, up = pipe_group if isinstance(pipe_group, tuple) else (pipe_group, pipe_group)
        self.down = Mailbox(down, self.runner.device, self.stats, timeout, tag=_TRAIN_TAG)
        """Activations (and labels) to stage ``k + 1``, from stage ``k - 1``."""
        self.up = Mailbox(up, self.runner.device, self.stats, timeout, tag=_TRAIN_TAG)
        """Activation gradients to stage ``k - 1``, from stage ``k + 1``."""
        self._eval_mail: dict[bool, Mailbox] = {}
        self.fifo: deque[InFlight] = deque()
        # the decoupled directions: each iteration's message is taken in the next, where it is needed
        self._inboxes: dict[str, Inbox] = {}
        if not self.first and not self.schedule.forward_locked:
            self._inboxes["activation"] = Inbox(self.down, self.ranks[self.k - 1])
        if not self.last and not self.schedule.backward_locked:
            self._inboxes["gradient"] = Inbox(self.up, self.ranks[self.k + 1])
        self.iteration = 0
        self.fed = 0
        self.updates = 0

    # ------------------------------------------------------------------ properties
    @property
    def first(self) -> bool:
        return self.k == 0

    @property
    def last(self) -> bool:
        return self.k == len(self.ranks) - 1

    @property
    def mailboxes(self) -> tuple[Mailbox, Mailbox]:
        """The training mailboxes: activations' (:attr:`down`), then gradients' (:attr:`up`)."""
        return self.down, self.up

    @property
    def staleness(self) -> int:
        """``tau_k`` of this stage."""
        return self.schedule.staleness(self.k)

    @property
    def in_flight(self) -> bool:
        """Whether batches were fed since the last drain (the same answer on every stage)."""
        return self.fed > 0

    # ------------------------------------------------------------------ training
    def step(self, batch: Any, apply: Apply) -> IterationReport:
        """Run one lock-step iteration.

        Args:
            batch: Stage 0: ``(inputs, targets)``, or an input tensor alone (no targets travel; the
                loss function then gets ``None``). Other stages: anything but ``None`` (e.g. the
                same batch) when stage 0 is fed in this iteration; ``None`` in a drain iteration.
            apply: Called after the data-parallel mean gradient was written to the stage
                parameters' ``.grad``: take the optimizer step there (gradients are cleared after).
        """
        parcel = self._input(batch)
        if batch is not None:
            self.fed += 1
        done: _Done | None = None
        if self.last:
            done = self._forward_last(parcel, apply) if parcel is not None else None
            self._send_gradient(done)
        elif self.schedule.backward_first:  # FDG's order: the forward sees this iteration's update
            done = self._delayed_backward(parcel is not None, apply)
            self._forward(parcel)
        else:
            self._forward(parcel)
            done = self._delayed_backward(parcel is not None, apply)
        report = IterationReport(
            self.iteration,
            parcel.tag if parcel is not None else None,
            done.batch if done is not None else None,
            done.loss if done is not None else None,
            done.rows if done is not None else 0,
            len(self.fifo),
        )
        self.iteration += 1
        return report

    def drain(self, apply: Apply) -> list[IterationReport]:
        """Iterate without input until every batch in flight was applied; then restart the counters."""
        if not self.in_flight:
            return []
        reports = [self.step(None, apply) for _ in range(self.schedule.drain_iterations)]
        # the last iteration's messages are empty; nothing may stay posted beyond the pipeline's run
        late = [inbox.settle() for inbox in self._inboxes.values()]
        for mail in self.mailboxes:
            mail.flush()
        if self.fifo or any(parcel is not None for parcel in late):
            raise RuntimeError(f"DecoupledPipeline: stage {self.k} still holds batches after the drain.")
        self.iteration = self.fed = 0
        return reports

    def _input(self, batch: Any) -> Parcel | None:
        if self.first:
            if batch is None:
                return None
            return Parcel(_split_batch(batch), tag=self.fed)
        if self.schedule.forward_locked:
            received = self.down.recv(self.ranks[self.k - 1]) if batch is not None else None
            parcel = received.clone() if received is not None else None
        else:  # the previous iteration's; this iteration's receive is posted if stage k - 1 sends
            fed = self.fed + (batch is not None)
            parcel = self._inboxes["activation"].take(self.schedule.sends_activation(self.k - 1, self.iteration, fed))
        if parcel is None:
            return None
        inputs, *targets = parcel.tensors  # owned copies: the FIFO keeps the input beyond the next receive
        if self.wire_dtype is not None and inputs.is_floating_point():
            inputs = inputs.to(self.runner.dtype)  # back from the wire's dtype
        return Parcel((inputs.requires_grad_(inputs.is_floating_point()), *targets), tag=parcel.tag)

    def _delayed_backward(self, fed: bool, apply: Apply) -> _Done | None:
        """Backward of the oldest FIFO entry if its gradient is there; its input gradient goes to stage ``k - 1``."""
        if self.schedule.backward_locked:
            gradient = self.up.recv(self.ranks[self.k + 1]) if fed else None  # used before the link's next message
        else:
            # waited for here: it travelled behind the forward
            sent = self.schedule.sends_gradient(self.k + 1, self.iteration, self.fed)
            gradient = self._inboxes["gradient"].take(sent)
        done = self._backward(gradient, apply) if gradient is not None else None
        self._send_gradient(done)
        return done

    def _send_gradient(self, done: _Done | None) -> None:
        if self.first:
            return
        outgoing = done.outgoing if done is not None else None
        sends = self.schedule.sends_gradient(self.k, self.iteration, self.fed)
        self._pass_on("gradient", self.up, self.ranks[self.k - 1], outgoing, self.schedule.backward_locked, sends)

    def _forward_last(self, parcel: Parcel, apply: Apply) -> _Done:
        inputs, *targets = parcel.tensors
        output, leaves = self.runner.forward_now(inputs)
        loss = self.loss_fn(output, targets[0] if targets else None)
        loss.backward()
        self._apply(leaves, apply)
        value = float(loss.detach())
        outgoing = None if self.first else Parcel((self._wire(_grad_of(inputs)),), tag=parcel.tag, value=value)
        return _Done(parcel.tag, value, int(inputs.shape[0]), outgoing)

    def _forward(self, parcel: Parcel | None) -> None:
        """Forward on a stage before the last; the activation (and the labels) go to stage ``k + 1``."""
        activation = None
        if parcel is not None:
            inputs, *targets = parcel.tensors
            if self.staleness == 0:  # sync: the gradient returns before any update
                output, leaves = self.runner.forward_now(inputs)
                entry = InFlight(parcel.tag, inputs, output, leaves)
            else:
                output, entry = self.runner.forward_delayed(inputs, parcel.tag)
            self.fifo.append(entry)
            activation = Parcel((self._wire(output.detach()), *targets), tag=parcel.tag)
        sends = self.schedule.sends_activation(self.k, self.iteration, self.fed)
        self._pass_on("activation", self.down, self.ranks[self.k + 1], activation, self.schedule.forward_locked, sends)

    def _pass_on(self, kind: str, mail: Mailbox, peer: int, parcel: Parcel | None, locked: bool, sends: bool) -> None:
        """Send ``parcel`` (if any) to ``peer``: blocking on a locked direction, left in flight on a decoupled one.

        On a decoupled direction the receiver posts a message only where the schedule ``sends`` one,
        so what this stage has must agree.
        """
        if not locked and (parcel is not None) != sends:
            has = "has" if parcel is not None else "has no"
            says = "one" if sends else "none"
            raise RuntimeError(
                f"DecoupledPipeline: stage {self.k} {has} {kind} to send at iteration {self.iteration} "
                f"({self.fed} batches fed) where the schedule says {says}: the ranks fell out of lock-step."
            )
        if parcel is None:
            return
        if locked:
            mail.send(peer, parcel)
        else:
            mail.send_later(peer, parcel)

    def _backward(self, gradient: Parcel, apply: Apply) -> _Done:
        entry = self.fifo.popleft()
        if entry.batch != gradient.tag:
            raise RuntimeError(
                f"DecoupledPipeline: stage {self.k} got the gradient of batch {gradient.tag} but its oldest "
                f"batch in flight is {entry.batch}: the ranks fell out of lock-step."
            )
        grad_output = gradient.tensors[0].to(self.runner.dtype)  # it may come in the wire's dtype
        if self.beta != 1.0:
            grad_output = grad_output * self.beta
        leaves = self.runner.backward_delayed(entry, grad_output)
        self._apply(leaves, apply)
        outgoing = None
        if not self.first:
            outgoing = Parcel((self._wire(_grad_of(entry.inputs)),), tag=entry.batch, value=gradient.value)
        return _Done(entry.batch, gradient.value, int(entry.inputs.shape[0]), outgoing)

    def _wire(self, tensor: Tensor) -> Tensor:
        """``tensor`` as it travels: in ``wire_dtype`` when that is set and ``tensor`` is a wider float."""
        wire = self.wire_dtype
        if wire is None or not tensor.is_floating_point() or tensor.element_size() <= wire.itemsize:
            return tensor
        return tensor.to(wire)

    def _apply(self, leaves: list[Tensor], apply: Apply) -> None:
        grads = self.runner.grads(leaves)
        if self.check_gradients is not None:
            self.check_gradients(grads)  # before the replicas' all-reduce could spread a NaN
        if self.data_groups:
            flat = self.runner.flatten(grads)
            two_level_mean_(flat, *self._levels, self.stats)
            grads = self.runner.flat.split(flat)
        self.runner.set_grads(grads)
        apply()
        self.runner.clear_grads()
        self.updates += 1

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def forward_eval(self, inputs: Tensor) -> Tensor:
        """Stage-by-stage forward of ``inputs`` (read on stage 0) with the current weights, no state change.

        Every stage of the replica returns the last stage's output. Call it on all stages of the
        replica together (in evaluation mode for BatchNorm and dropout).
        """
        box = Mailbox(self.down.group, self.runner.device, self.stats, self.down.timeout, tag=_EVAL_TAG)
        mail = self._eval_mail.setdefault(torch.is_inference_mode_enabled(), box)
        hidden = inputs if self.first else _received(mail.recv(self.ranks[self.k - 1]))
        output = self.runner.module(hidden)
        if not self.last:
            mail.send(self.ranks[self.k + 1], Parcel((output,)))
            return _received(mail.recv(self.ranks[-1])).clone()
        if len(self.ranks) > 1:
            mail.exchange({r: Parcel((output,)) for r in self.ranks[:-1]}, ())
        return output

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Counters (batches in flight are not part of the state: checkpoint after :meth:`drain`)."""
        return {"updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.updates = int(state["updates"])


def _cross_entropy(output: Tensor, target: Tensor | None) -> Tensor:
    if target is None:
        raise ValueError("DecoupledPipeline: the default loss (cross-entropy) needs targets: feed (inputs, targets).")
    return F.cross_entropy(output, target)


def _split_batch(batch: Any) -> tuple[Tensor, ...]:
    if isinstance(batch, Tensor):
        return (batch,)
    if isinstance(batch, list | tuple) and len(batch) == 2 and all(isinstance(t, Tensor) for t in batch):
        return batch[0], batch[1]
    raise TypeError(
        f"DecoupledPipeline: a batch must be (inputs, targets), two tensors, or an input tensor alone; got "
        f"{type(batch).__name__}. Return (x, y) from the dataloader (or convert it in on_after_batch_transfer)."
    )


def _grad_of(inputs: Tensor) -> Tensor:
    return inputs.grad if inputs.grad is not None else torch.zeros_like(inputs)


def _received(parcel: Parcel | None) -> Tensor:
    if parcel is None:
        raise RuntimeError("DecoupledPipeline: a stage sent nothing where an activation was expected.")
    return parcel.tensors[0]
