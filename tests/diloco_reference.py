"""An independent single-process reference of (Streaming) DiLoCo: W workers simulated in one process.

Written from the papers' recurrences (Douillard et al., arXiv 2311.08105 and 2501.18512), not from
lightning_hier's classes: each worker keeps its own module and inner optimizer; each fragment (a
list of parameter indices) keeps its global tensors ``S_f`` and an outer ``torch.optim.SGD`` with
Nesterov momentum stepped on the outer gradient ``-mean_w (x_w,f - S_f)``. Fragment ``f`` is sent
at the steps ``t`` with ``t mod H == offset_f``, applied ``delay`` steps later, and then every
worker's fragment becomes ``alpha x + (1 - alpha) S``. Floating-point buffers are averaged every
``H`` steps. At the end, what is in flight is applied, every fragment not sent at the last step
takes one more outer step, and every worker becomes ``S``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from tests.quantized_reference import quantized_sum

Batch = tuple[Tensor, Tensor]


class Reference:
    """``run`` returns each worker's parameters (per tensor) at the end of training."""

    def __init__(
        self,
        make_module: Callable[[], nn.Module],
        make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
        loss: Callable[[nn.Module, Batch], Tensor],
        workers: int,
        window: int,
        fragments: Sequence[Sequence[int]],
        offsets: Sequence[int],
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        delay: int = 0,
        alpha: float = 0.0,
        quantized: int | None = None,
    ) -> None:
        self.modules = [make_module() for _ in range(workers)]
        self.opts = [make_optimizer(m) for m in self.modules]
        self.loss, self.window, self.delay, self.alpha, self.quantized = loss, window, delay, alpha, quantized
        self.fragments, self.offsets = [list(f) for f in fragments], list(offsets)
        first = list(self.modules[0].parameters())
        self.S = [[nn.Parameter(first[i].detach().clone()) for i in f] for f in self.fragments]
        self.outer = [
            torch.optim.SGD(s, lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0) for s in self.S
        ]
        numel = [sum(first[i].numel() for i in f) for f in self.fragments]
        self.E = [[torch.zeros(n) for _ in self.modules] for n in numel]  # quantization residuals
        self.pending: dict[int, tuple[list[Tensor], int]] = {}  # fragment -> (mean change, step to apply)
        self.last_sent = [0 for _ in self.fragments]

    def _params(self, w: int, f: int) -> list[Tensor]:
        p = list(self.modules[w].parameters())
        return [p[i] for i in self.fragments[f]]

    @torch.no_grad()
    def _send(self, f: int, step: int) -> None:
        world = len(self.modules)
        changes = [[x - s for x, s in zip(self._params(w, f), self.S[f], strict=True)] for w in range(world)]
        if self.quantized is None:
            mean = [torch.stack(ts).sum(0) / world for ts in zip(*changes, strict=True)]
        else:
            flat = quantized_sum([torch.cat([t.reshape(-1) for t in c]) for c in changes], self.E[f], self.quantized)
            mean, offset = [], 0
            for s in self.S[f]:
                mean.append(flat[offset : offset + s.numel()].view_as(s) / world)
                offset += s.numel()
        self.pending[f] = (mean, step + self.delay)
        self.last_sent[f] = step

    @torch.no_grad()
    def _apply(self, f: int, alpha: float) -> None:
        mean, _ = self.pending.pop(f)
        for s, u in zip(self.S[f], mean, strict=True):
            s.grad = -u
        self.outer[f].step()
        for w in range(len(self.modules)):
            for x, s in zip(self._params(w, f), self.S[f], strict=True):
                x.copy_(alpha * x + (1 - alpha) * s)

    @torch.no_grad()
    def _average_buffers(self) -> None:
        buffers = [[b for b in m.buffers() if b.is_floating_point()] for m in self.modules]
        for same in zip(*buffers, strict=True):
            mean = torch.stack(same).mean(0)
            for b in same:
                b.copy_(mean)

    def run(self, data: Callable[[int, int], Batch], total: int) -> list[list[Tensor]]:
        """``data(worker, step)`` is a worker's batch at 0-based ``step``."""
        for step in range(1, total + 1):
            for w, (module, opt) in enumerate(zip(self.modules, self.opts, strict=True)):
                opt.zero_grad()
                self.loss(module, data(w, step - 1)).backward()
                opt.step()
            for f in range(len(self.fragments)):
                if f in self.pending and self.pending[f][1] == step:
                    self._apply(f, self.alpha)
                if step % self.window == self.offsets[f] and f not in self.pending:
                    self._send(f, step)
                    if self.delay == 0:
                        self._apply(f, self.alpha)
            if step % self.window == 0:
                self._average_buffers()
        with torch.no_grad():
            self._finish(total)
        return [[p.detach().clone() for p in m.parameters()] for m in self.modules]

    def _finish(self, total: int) -> None:
        for f in range(len(self.fragments)):
            if f in self.pending:
                self._apply(f, self.alpha)
            if self.last_sent[f] < total:
                self._send(f, total)
                self._apply(f, 0.0)
            for w in range(len(self.modules)):
                for x, s in zip(self._params(w, f), self.S[f], strict=True):
                    x.copy_(s)
        self._average_buffers()
