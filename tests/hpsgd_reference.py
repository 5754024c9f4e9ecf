"""An independent single-process reference of HPSGD: W workers simulated in one process.

Written from the recurrence (docs/algorithms.md, section 1), not from lightning_hier's classes: every
worker keeps its own module, optimizer and window start V; the global model advances by the mean
of the *previous* window's changes, theta_r = theta_{r-1} + mean_w Delta_{r-1}^w (or by a
Nesterov outer step on that mean, written as torch.optim.SGD's formula), and the replicas restart
from it ('paper') or from it plus their own newest change ('eager'). A compressed payload is each
worker's change plus its residual rounded to bfloat16 (error feedback). Parameters and
floating-point buffers are handled as flat vectors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from tests.quantized_reference import quantized_sum

Batch = tuple[Tensor, Tensor]


def params_of(module: nn.Module) -> Tensor:
    return parameters_to_vector(module.parameters()).detach().clone()


def buffers_of(module: nn.Module) -> Tensor:
    bufs = [b.reshape(-1) for b in module.buffers() if b.is_floating_point()]
    return torch.cat(bufs).clone() if bufs else torch.zeros(0)


def _set_buffers(module: nn.Module, flat: Tensor) -> None:
    offset = 0
    for b in module.buffers():
        if b.is_floating_point():
            b.copy_(flat[offset : offset + b.numel()].view_as(b))
            offset += b.numel()


def fixed_merge_steps(window: int, total: int) -> list[int]:
    """1-based optimizer steps at which mode 'fixed' merges: launch at step 1, then every H steps."""
    return list(range(1 + window, total + 1, window))


class Reference:
    """W simulated workers; ``run`` returns the global model after each merge and at the end."""

    def __init__(
        self,
        make_module: Callable[[], nn.Module],
        make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
        loss: Callable[[nn.Module, Batch], Tensor],
        workers: int,
        sync_buffers: bool = True,
        reset_optimizer_state: bool = False,
        clip_norm: float | None = None,
        micro_batches: int = 1,
        merge: str = "paper",
        outer_lr: float = 1.0,
        outer_momentum: float = 0.0,
        bf16: bool = False,
        quantized: int | None = None,
    ) -> None:
        self.modules = [make_module() for _ in range(workers)]
        self.opts = [make_optimizer(m) for m in self.modules]
        self.loss, self.sync_buffers, self.reset = loss, sync_buffers, reset_optimizer_state
        self.clip_norm, self.micro_batches = clip_norm, micro_batches
        self.S = params_of(self.modules[0])
        self.B = buffers_of(self.modules[0])
        self.V = [self.S.clone() for _ in self.modules]
        self.merge, self.outer_lr, self.outer_momentum, self.bf16 = merge, outer_lr, outer_momentum, bf16
        self.M: Tensor | None = None  # outer momentum buffer
        self.E = [torch.zeros_like(self.S) for _ in self.modules]  # rounding residuals (bf16, int8, int4)
        self.quantized = quantized  # bits of the quantized all-reduce, or None

    def _sent(self, deltas: list[Tensor]) -> list[Tensor]:
        """What each worker contributes to the sum: its change, or bf16(change + residual)."""
        if self.quantized is not None:
            return [self._quantized_sum(deltas)]
        if not self.bf16:
            return deltas
        out = []
        for w, d in enumerate(deltas):
            p = (d + self.E[w]).to(torch.bfloat16)
            self.E[w] = d + self.E[w] - p.float()
            out.append(p)
        return out

    def _quantized_sum(self, deltas: list[Tensor]) -> Tensor:
        """The quantized all-reduce's SUM of every worker's change, with each worker's residual."""
        assert self.quantized is not None
        return quantized_sum(deltas, self.E, self.quantized)

    def _outer_step(self, sent: list[Tensor]) -> None:
        # torch.optim.SGD(lr, momentum, nesterov=True) on the outer gradient g = -mean(sent)
        count = len(self.modules)  # the quantized sum arrives as one tensor
        u = (torch.stack(sent).sum(0).float() if self.bf16 else torch.stack(sent).sum(0)) / count
        if self.outer_momentum == 0.0:
            self.S = self.S + self.outer_lr * u
            return
        self.M = u.clone() if self.M is None else self.outer_momentum * self.M + u
        self.S = self.S + self.outer_lr * (u + self.outer_momentum * self.M)

    def _train_step(self, batches: Sequence[Batch]) -> None:
        for module, opt, batch in zip(self.modules, self.opts, batches, strict=True):
            opt.zero_grad()
            # gradient accumulation: equal micro-batches, each loss scaled by 1 / count
            for x, y in zip(batch[0].chunk(self.micro_batches), batch[1].chunk(self.micro_batches), strict=True):
                (self.loss(module, (x, y)) / self.micro_batches).backward()
            if self.clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(module.parameters(), self.clip_norm)
            opt.step()

    def _x(self) -> list[Tensor]:
        return [params_of(m) for m in self.modules]

    @torch.no_grad()
    def _restart_from_global(self, merge: bool = True, deltas: list[Tensor] | None = None) -> None:
        """Every replica restarts from S, plus its own newest change ``deltas[w]`` (eager rule)."""
        starts = [self.S + d for d in deltas] if deltas is not None else [self.S.clone() for _ in self.modules]
        for module, opt, start in zip(self.modules, self.opts, starts, strict=True):
            vector_to_parameters(start.clone(), module.parameters())
            if self.sync_buffers:
                _set_buffers(module, self.B)
            if self.reset and merge:
                opt.state.clear()
        self.V = starts

    def run(self, data: Callable[[int, int], Batch], total: int, merge_steps: Sequence[int]) -> list[Tensor]:
        """``data(worker, step)`` is worker's batch at 0-based ``step``; returns S after every merge + final."""
        history: list[Tensor] = []
        pending: list[Tensor] | None = None  # the launched window's per-worker deltas
        pending_buffers: list[Tensor] = []
        last_launch = 0
        for step in range(1, total + 1):
            self._train_step([data(w, step - 1) for w in range(len(self.modules))])
            x = self._x()
            if pending is None:  # the very first window: ship step 1's change, keep the replica
                pending = self._sent([xw - vw for xw, vw in zip(x, self.V, strict=True)])
                pending_buffers = [buffers_of(m) for m in self.modules]
                self.V = x
                last_launch = step
            elif step in merge_steps:
                delta = [xw - vw for xw, vw in zip(x, self.V, strict=True)]
                self._outer_step(pending)
                new_buffers = [buffers_of(m) for m in self.modules]
                if self.sync_buffers:
                    self.B = torch.stack(pending_buffers).mean(0)
                self._restart_from_global(deltas=delta if self.merge == "eager" else None)
                history.append(self.S.clone())
                pending, pending_buffers, last_launch = self._sent(delta), new_buffers, step
        if pending is not None:  # drain: the in-flight window, then the steps since its launch
            x = self._x()
            self._outer_step(pending)
            self.B = torch.stack(pending_buffers).mean(0)
            if total > last_launch:
                self._outer_step(self._sent([xw - vw for xw, vw in zip(x, self.V, strict=True)]))
                self.B = torch.stack([buffers_of(m) for m in self.modules]).mean(0)
            self._restart_from_global(merge=False)
        history.append(self.S.clone())
        return history

    @torch.no_grad()
    def _merge_delayed(self, pending: list[Tensor], pending_buffers: list[Tensor]) -> None:
        """The eager merge ``delay`` steps after a launch: S advances; each replica keeps its steps since."""
        self._outer_step(pending)
        if self.sync_buffers:
            self.B = torch.stack(pending_buffers).mean(0)
        for w, module in enumerate(self.modules):
            since = params_of(module) - self.V[w]
            vector_to_parameters(self.S + since, module.parameters())
            if self.sync_buffers:
                _set_buffers(module, self.B)
            if self.reset:
                self.opts[w].state.clear()
        self.V = [self.S.clone() for _ in self.modules]

    def run_delayed(
        self,
        data: Callable[[int, int], Batch],
        total: int,
        window: int,
        delay: int,
        first_delay: int | None = None,
        first_windows: int = 1,
    ) -> list[Tensor]:
        """HPSGD with ``delay``: launches at steps 1, 1 + H, ...; each merged ``delay`` steps later (eager rule).

        ``first_delay``: the delay of the first ``first_windows`` windows instead (``delay='auto'``
        merges the first two at ``window``, then chooses).
        Returns S after every merge and at the end, like :meth:`run`.
        """
        assert self.merge == "eager"
        history: list[Tensor] = []
        pending: list[Tensor] | None = None  # the launched, not yet merged window's per-worker payloads
        pending_buffers: list[Tensor] = []
        last_launch = None
        for step in range(1, total + 1):
            self._train_step([data(w, step - 1) for w in range(len(self.modules))])
            early = last_launch is not None and last_launch <= 1 + (first_windows - 1) * window
            wait = first_delay if first_delay is not None and early else delay
            if pending is not None and last_launch is not None and step - last_launch == wait:
                self._merge_delayed(pending, pending_buffers)
                history.append(self.S.clone())
                pending = None
            if last_launch is None or step - last_launch == window:
                x = self._x()
                pending = self._sent([xw - vw for xw, vw in zip(x, self.V, strict=True)])
                pending_buffers = [buffers_of(m) for m in self.modules]
                self.V, last_launch = x, step
        if last_launch is not None:  # drain: the window in flight, then the steps since the last launch
            if pending is not None:
                self._merge_delayed(pending, pending_buffers)
            if total > last_launch:
                x = self._x()
                self._outer_step(self._sent([xw - vw for xw, vw in zip(x, self.V, strict=True)]))
                self.B = torch.stack([buffers_of(m) for m in self.modules]).mean(0)
            self._restart_from_global(merge=False)
        history.append(self.S.clone())
        return history
