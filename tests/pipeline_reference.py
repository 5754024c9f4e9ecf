"""Single-process references for the decoupled pipeline, written from the papers' update rules.

Nothing here uses lightning_hier's pipeline code: the schedules are restated as formulas
(FDG: stage k forwards batch b at iteration b + k and applies it at b + 2K - 2 - k; DDG: forwards
at b, applies at b + K - 1 - k; sync: both at b), and every gradient is recomputed from a history
of per-stage weight snapshots:

- ``stash``: every stage's Jacobian at the weights it had when it forwarded the batch, which for
  DDG is the full-model snapshot of that iteration: ``w_{t+1} = w_t - lr g_{t-tau}(w_{t-tau})``;
- ``recompute``: stages at or after the updating one re-run their forward with the weights they
  had when they backpropagated the batch, on the input stored at forward time.

``order='backward_first'`` (FDG's order) makes a stage before the last forward with the weights it
has after the update of the same iteration. ``wire='bf16'`` rounds every activation and activation
gradient crossing a cut to bfloat16. :func:`fdg_loop` restates FDG's order once more, as the FDG
reference code's training loop runs it (no snapshots, no formulas): the two must agree.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

Batch = tuple[Tensor, Tensor]
Weights = dict[str, Tensor]


def forward_lag(schedule: str, k: int) -> int:
    return k if schedule == "fdg" else 0


def staleness(schedule: str, k: int, num_stages: int) -> int:
    return (num_stages - 1 - k) * {"fdg": 2, "ddg": 1, "sync": 0}[schedule]


def update_lag(schedule: str, k: int, num_stages: int) -> int:
    return forward_lag(schedule, k) + staleness(schedule, k, num_stages)


def forward_weights_at(schedule: str, k: int, num_stages: int, order: str) -> int:
    """The iteration-start snapshot (after batch ``b``'s first) holding the weights ``k`` forwarded ``b`` with."""
    fresher = order == "backward_first" and k < num_stages - 1  # after this iteration's update
    return forward_lag(schedule, k) + int(fresher)


def _round(t: Tensor, wire: str | None) -> Tensor:
    return t.to(torch.bfloat16).to(t.dtype) if wire == "bf16" else t


def flat(module: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


def _weights(module: nn.Module) -> Weights:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def simulate(
    stages: Sequence[nn.Module],
    epochs: Sequence[Sequence[Batch]],
    schedule: str,
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    weights: str = "stash",
    beta: float = 1.0,
    order: str = "forward_first",
    wire: str | None = None,
) -> list[list[Tensor]]:
    """Train ``stages`` as the pipeline would; returns each stage's flat parameters after every iteration.

    Each epoch is fed to an empty pipeline and drained at its end (as the strategy does).
    """
    num = len(stages)
    optimizers = [make_optimizer(s) for s in stages]
    history: list[list[Tensor]] = [[] for _ in stages]
    drain = max(update_lag(schedule, k, num) for k in range(num))
    for batches in epochs:
        snapshots: list[list[Weights]] = [[] for _ in stages]  # [stage][iteration]: weights at its start
        for t in range(len(batches) + drain):
            for k, s in enumerate(stages):
                snapshots[k].append(_weights(s))
            grads = {}
            for k in range(num):
                b = t - update_lag(schedule, k, num)
                if 0 <= b < len(batches):
                    grads[k] = _stage_gradient(
                        stages, snapshots, batches[b], b, k, (schedule, weights, order, wire), beta
                    )
            for k, g in grads.items():
                for p, gp in zip(stages[k].parameters(), g, strict=True):
                    p.grad = gp
                optimizers[k].step()
                optimizers[k].zero_grad(set_to_none=True)
            for k, s in enumerate(stages):
                history[k].append(flat(s))
    return history


def _stage_gradient(
    stages: Sequence[nn.Module],
    snapshots: list[list[Weights]],
    batch: Batch,
    b: int,
    k: int,
    how: tuple[str, str, str, str | None],
    beta: float,
) -> list[Tensor]:
    schedule, weights, order, wire = how
    num = len(stages)
    x, y = batch
    activations = [x]
    with torch.no_grad():
        for j in range(num - 1):
            w = snapshots[j][b + forward_weights_at(schedule, j, num, order)]
            activations.append(_round(functional_call(stages[j], w, (activations[j],)), wire))
    grad_out: Tensor | None = None
    for j in range(num - 1, k - 1, -1):
        stash = forward_weights_at(schedule, j, num, order)
        at = stash if weights == "stash" else update_lag(schedule, j, num)
        params = {n: w.clone().requires_grad_() for n, w in snapshots[j][b + at].items()}
        inp = activations[j].clone().requires_grad_(j > 0)
        out = functional_call(stages[j], params, (inp,))
        if j == num - 1:
            F.cross_entropy(out, y).backward()
        else:
            assert grad_out is not None
            out.backward(grad_out * beta)
        if j == k:
            return [params[n].grad for n, _ in stages[j].named_parameters()]  # type: ignore[misc]
        assert inp.grad is not None
        grad_out = _round(inp.grad, wire)
    raise AssertionError("unreachable")


def fdg_loop(
    stages: Sequence[nn.Module],
    epochs: Sequence[Sequence[Batch]],
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    beta: float = 1.0,
) -> list[list[Tensor]]:
    """FDG's order as the FDG code's loop runs it (``TrainDg``), weights stashed at forward time.

    Every iteration each stage before the last backpropagates its oldest output with the delayed
    gradient it was handed and steps, *then* forwards what it was handed; the last stage forwards,
    backpropagates and steps. Between iterations outputs move one stage on and input gradients one
    stage back. (FDG's last stage steps at the start of the next iteration with the gradient of
    the current weights: the same update.) Returns each stage's flat parameters after every
    iteration; each epoch is drained, as :func:`simulate` does.
    """
    num = len(stages)
    optimizers = [make_optimizer(s) for s in stages]
    history: list[list[Tensor]] = [[] for _ in stages]
    for batches in epochs:
        handed: list[Batch | None] = [None] * num  # what each stage forwards this iteration
        delayed: list[Tensor | None] = [None] * num  # the gradient each stage backpropagates this iteration
        outputs: list[deque[tuple[Tensor, Tensor, dict[str, Tensor]]]] = [deque() for _ in stages]
        for t in range(len(batches) + 2 * num - 2):
            handed[0] = batches[t] if t < len(batches) else None
            out: list[Batch | None] = [None] * num
            input_grads: list[Tensor | None] = [None] * num
            for k, stage in enumerate(stages):
                if k < num - 1 and delayed[k] is not None:  # backward and update first
                    x, y_hat, params = outputs[k].popleft()
                    y_hat.backward(delayed[k] * beta)
                    _step(optimizers[k], stage, params)
                    input_grads[k] = x.grad
                if handed[k] is None:
                    continue
                x = handed[k][0].detach().clone().requires_grad_(k > 0)  # type: ignore[index]
                params = {n: p.detach().clone().requires_grad_() for n, p in stage.named_parameters()}
                y_hat = functional_call(stage, params, (x,))
                if k < num - 1:
                    outputs[k].append((x, y_hat, params))
                    out[k] = (y_hat.detach(), handed[k][1])  # type: ignore[index]
                else:
                    F.cross_entropy(y_hat, handed[k][1]).backward()  # type: ignore[index]
                    _step(optimizers[k], stage, params)
                    input_grads[k] = x.grad
            handed = [handed[0], *out[:-1]]
            delayed = [*input_grads[1:], None]
            for k, stage in enumerate(stages):
                history[k].append(flat(stage))
    return history


def _step(optimizer: torch.optim.Optimizer, stage: nn.Module, params: dict[str, Tensor]) -> None:
    for n, p in stage.named_parameters():
        p.grad = params[n].grad
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def plain_backprop(
    model: nn.Module, epochs: Sequence[Sequence[Batch]], make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]
) -> list[Tensor]:
    """Ordinary single-process training; the whole model's flat parameters after every step."""
    optimizer = make_optimizer(model)
    out = []
    for batches in epochs:
        for x, y in batches:
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            out.append(flat(model))
    return out
