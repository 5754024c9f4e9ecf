"""EASGD at the end of fit: accuracy of the center variable vs the replicas' mean after N steps.

Two replicas simulated in one process (plain torch, the paper's synchronous rule with the
strategy's defaults tau 4, beta 0.1, alpha = beta / 2), digits MLP, SGD lr 0.1 with Nesterov
momentum 0.9, batch 32 per replica, 3 seeds. Run from the repository root::

    python -m benchmarks.studies.easgd_end
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_hier.data.digits import load_digits_arrays
from lightning_hier.models import mlp

W, BATCH, TAU, BETA, LR = 2, 32, 4, 0.1, 0.1
CHECKPOINTS = (3, 11, 22, 44, 88, 176)


def _accuracy(params: list[Tensor], net: nn.Module, x: Tensor, y: Tensor) -> float:
    with torch.no_grad():
        for p, v in zip(net.parameters(), params, strict=True):
            p.copy_(v)
        return float((net(x).argmax(1) == y).float().mean())


def _run(seed: int) -> dict[int, tuple[float, float]]:
    a = load_digits_arrays()
    torch.manual_seed(seed)
    nets = [mlp((1, 8, 8), 10, hidden=(32,)) for _ in range(W)]
    for n in nets[1:]:
        n.load_state_dict(nets[0].state_dict())
    opts = [torch.optim.SGD(n.parameters(), lr=LR, momentum=0.9, nesterov=True, weight_decay=1e-4) for n in nets]
    center = [p.detach().clone() for p in nets[0].parameters()]
    probe = mlp((1, 8, 8), 10, hidden=(32,))
    g = torch.Generator().manual_seed(100 + seed)
    out: dict[int, tuple[float, float]] = {}
    step = 0
    while step < max(CHECKPOINTS):
        perm = torch.randperm(len(a.x_train), generator=g)
        shards = [perm[r::W] for r in range(W)]
        for i in range(0, len(shards[0]) - BATCH + 1, BATCH):
            for r in range(W):
                idx = shards[r][i : i + BATCH]
                opts[r].zero_grad()
                F.cross_entropy(nets[r](a.x_train[idx]), a.y_train[idx]).backward()
                opts[r].step()
            step += 1
            if step % TAU == 0:
                replicas = [[p.detach().clone() for p in n.parameters()] for n in nets]
                mean = [sum(ts) / W for ts in zip(*replicas, strict=True)]
                with torch.no_grad():
                    for n in nets:
                        for p, c in zip(n.parameters(), center, strict=True):
                            p.sub_(BETA / W * (p - c))
                center = [c + BETA * (m - c) for c, m in zip(center, mean, strict=True)]
            if step in CHECKPOINTS:  # the end of a fit: the replicas as the round (if any) left them
                mean = [sum(ts) / W for ts in zip(*(n.parameters() for n in nets), strict=True)]
                out[step] = (_accuracy(center, probe, a.x_val, a.y_val), _accuracy(mean, probe, a.x_val, a.y_val))
            if step >= max(CHECKPOINTS):
                break
    return out


def main() -> None:
    runs = [_run(seed) for seed in range(3)]
    print("steps  center  replicas' mean  (mean over 3 seeds)")
    for s in CHECKPOINTS:
        center = sum(r[s][0] for r in runs) / len(runs)
        mean = sum(r[s][1] for r in runs) / len(runs)
        print(f"{s:5d}  {center:.3f}  {mean:.3f}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
