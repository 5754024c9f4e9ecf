"""The final round of the averaging family: a partial last period (or no round at all) is averaged.

Real gloo groups; the expected models are computed in the test, in one process, from the papers'
formulas (docs/algorithms.md, section 4) and the decisions documented in
:meth:`PeriodicAveraging.finalize`: a final round over the replicas as they are (Local SGD: the
mean; LSGD: the leader of the period's losses; GRAWA: weights from a new probe folded into the
norm EMA), and EASGD's center catching up with the replicas' mean.
"""

import pytest
import torch
import torch.distributed as dist

from lightning_hier.algorithms import (
    ElasticCenter,
    GradientWeightedCenter,
    LeaderCenter,
    PeriodicAveraging,
    UniformCenter,
)
from lightning_hier.testing import run_workers

LR, BETA_EMA, EPS, P, LAM, BETA_C = 0.1, 0.5, 0.05, 1.5, 0.5, 0.3
SHAPES = [(3,), (2,)]


def _targets(rank: int) -> list[torch.Tensor]:
    """Rank r minimises 0.5 ||x_l - a_{r,l}||^2 per tensor: a different optimum per rank and tensor."""
    g = torch.Generator().manual_seed(10 + rank)
    return [torch.randn(s, generator=g, dtype=torch.float64) * (1 + rank) for s in SHAPES]


def _policy(name: str):
    return {
        "localsgd": lambda: UniformCenter(),
        "easgd": lambda: ElasticCenter(beta=BETA_C),
        "lsgd": lambda: LeaderCenter(),
        "mgrawa": lambda: GradientWeightedCenter("model", beta=BETA_EMA, eps=EPS, p=P),
        "lgrawa": lambda: GradientWeightedCenter("layer", beta=BETA_EMA, eps=EPS, p=P),
    }[name]()


def _train(name: str, tau: int, steps: int, more: int) -> dict:
    """``steps`` plain SGD steps with rounds every ``tau``; finalize (twice); then ``more`` steps."""
    dist.init_process_group("gloo")
    targets = _targets(dist.get_rank())
    xs = [torch.nn.Parameter(torch.zeros(s, dtype=torch.float64)) for s in SHAPES]
    lam = None if name in ("localsgd", "easgd") else LAM
    avg = PeriodicAveraging(xs, dist.group.WORLD, _policy(name), tau=tau, lam=lam)

    def step() -> object:
        for x in xs:
            x.grad = None
        loss = sum(0.5 * (x - a).pow(2).sum() for x, a in zip(xs, targets, strict=True))
        loss.backward()
        with torch.no_grad():
            for x in xs:
                x -= LR * x.grad
        avg.observe(loss.detach())
        return avg.step()  # GRAWA's norms: the gradients in .grad (those of the step just taken)

    for _ in range(steps):
        step()
    avg.finalize()
    final = [x.detach().clone() for x in xs]
    avg.finalize()  # idempotent
    again = [x.detach().clone() for x in xs]
    with avg.consensus():
        consensus = [x.detach().clone() for x in xs]
    reports = [step() for _ in range(more)]  # training goes on from the finished model
    return {"final": final, "again": again, "consensus": consensus, "rounds_after": [r is not None for r in reports]}


def _reference(name: str, tau: int, steps: int, world: int) -> list[torch.Tensor]:
    """Every replica in one process; returns the model every rank holds after finalize."""
    targets = [_targets(r) for r in range(world)]
    xs = [[torch.zeros(s, dtype=torch.float64) for s in SHAPES] for _ in range(world)]
    grads: list[list[torch.Tensor]] = []
    center = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    m, rounds = None, 0
    losses: list[list[float]] = [[] for _ in range(world)]

    def weighted(weights: list[torch.Tensor]) -> list[torch.Tensor]:
        return [sum(weights[r][i] * xs[r][i] for r in range(world)) for i in range(len(SHAPES))]

    def grawa_weights() -> list[torch.Tensor]:
        nonlocal m, rounds
        norms = torch.stack([torch.stack([g.norm() for g in grads[r]]) for r in range(world)])  # [W, L]
        if name == "mgrawa":
            norms = norms.sum(dim=1, keepdim=True)
        m = (1 - BETA_EMA) * norms if m is None else BETA_EMA * m + (1 - BETA_EMA) * norms
        rounds += 1
        scores = (m / (1 - BETA_EMA**rounds) + EPS) ** -P
        w = scores / scores.sum(dim=0, keepdim=True)
        return [w[r].expand(len(SHAPES)) for r in range(world)]

    def leader() -> int:
        running = [sum(v) / len(v) for v in losses]
        return min(range(world), key=lambda r: (running[r], r))

    for s in range(1, steps + 1):
        grads = [[x - a for x, a in zip(xs[r], targets[r], strict=True)] for r in range(world)]
        for r in range(world):
            losses[r].append(float(sum(0.5 * g.pow(2).sum() for g in grads[r])))
            xs[r] = [x - LR * g for x, g in zip(xs[r], grads[r], strict=True)]
        if s % tau:
            continue
        if name == "easgd":
            mean = [sum(x[i] for x in xs) / world for i in range(len(SHAPES))]
            xs = [[x - BETA_C / world * (x - c) for x, c in zip(xr, center, strict=True)] for xr in xs]
            center = [c + BETA_C * (mu - c) for c, mu in zip(center, mean, strict=True)]
            continue
        if name == "localsgd":
            c, lam = [sum(x[i] for x in xs) / world for i in range(len(SHAPES))], 1.0
        elif name == "lsgd":
            c, lam = [t.clone() for t in xs[leader()]], LAM
            losses = [[] for _ in range(world)]
        else:
            c, lam = weighted(grawa_weights()), LAM
        xs = [[x + lam * (ci - x) for x, ci in zip(xr, c, strict=True)] for xr in xs]
    # the final round over the partial period (steps % tau of them)
    if name in ("localsgd", "easgd"):
        return [sum(x[i] for x in xs) / world for i in range(len(SHAPES))]
    if name == "lsgd":
        return xs[leader()]
    return weighted(grawa_weights())


@pytest.mark.parametrize("name", ["localsgd", "easgd", "lsgd", "mgrawa", "lgrawa"])
@pytest.mark.parametrize(("tau", "steps"), [(4, 6), (8, 3)], ids=["partial-last-period", "no-round"])
def test_finalize_averages_the_partial_last_period(name, tau, steps):
    world = 3
    out = run_workers(_train, name, tau, steps, tau, devices=world)
    expected = _reference(name, tau, steps, world)
    assert not all(torch.equal(e, torch.zeros_like(e)) for e in expected)  # not the initial model
    for o in out:
        for got, again, held, want in zip(o["final"], o["again"], o["consensus"], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
            assert torch.equal(again, got) and torch.equal(held, got)  # idempotent; the consensus is it
        assert torch.equal(torch.cat(o["final"]), torch.cat(out[0]["final"]))  # bit-identical on every rank
        # a new period starts after finalize: the next round comes tau steps later
        assert o["rounds_after"] == [False] * (tau - 1) + [True]
