"""Rounds of the averaging family on real gloo groups, against hand computations written here.

Each rank holds a two-tensor "model" with known values and known gradients; the expected
weights, centers and pulled replicas are computed in the test from the papers' formulas, in one
process, with every rank's values (never with the classes under test).
"""

import math

import pytest
import torch
import torch.distributed as dist

from lightning_hier.algorithms import (
    ElasticCenter,
    GradientWeightedCenter,
    LeaderCenter,
    LocalSGD,
    PeriodicAveraging,
    UniformCenter,
)
from lightning_hier.testing import run_workers


def _x(rank: int) -> list[torch.Tensor]:
    """Known replica of ``rank``: a 3-vector and a 2x2 matrix."""
    return [torch.tensor([1.0, -2.0, 0.5]) * (rank + 1), torch.tensor([[0.25, 1.0], [-1.0, 2.0]]) - rank]


def _norms(rank: int, round_index: int) -> list[float]:
    """Known gradient norms per tensor; rank 2 has the flattest first tensor."""
    return [[1.0, 3.0, 0.5, 2.0][rank] * (round_index + 1), [2.0, 0.5, 1.5, 1.0][rank] + round_index]


def _grads_with_norms(params: list[torch.Tensor], norms: list[float]) -> None:
    for p, n in zip(params, norms, strict=True):
        direction = torch.arange(1.0, p.numel() + 1).reshape(p.shape)
        p.grad = direction / direction.norm() * n


def _params(rank: int) -> list[torch.nn.Parameter]:
    """Every rank starts from rank 0's model (as after the initial broadcast)."""
    return [torch.nn.Parameter(t.clone()) for t in _x(0)]


def _local_training(params: list[torch.nn.Parameter], rank: int) -> None:
    """Stand-in for local steps: the replicas diverge to the known values."""
    with torch.no_grad():
        for p, x in zip(params, _x(rank), strict=True):
            p.copy_(x)


def _run(policy_name: str, rounds: int, lam: float | None, variant: str = "model", norm: str = "sum") -> dict:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    params = _params(rank)
    policy = {
        "uniform": lambda: UniformCenter(),
        # eps comparable to the norms: the bias correction changes the weights only through eps
        "grawa": lambda: GradientWeightedCenter(variant, beta=0.5, eps=0.5, p=1.5, norm=norm),
        "leader": lambda: LeaderCenter(),
        "elastic": lambda: ElasticCenter(beta=0.3),
    }[policy_name]()
    avg = PeriodicAveraging(params, group=dist.group.WORLD, policy=policy, tau=1, lam=lam)
    _local_training(params, rank)
    history, reports = [], []
    for r in range(rounds):
        _grads_with_norms(params, _norms(rank, r))
        avg.observe(torch.tensor(float([3.0, 1.0, 2.0, 1.0][rank] + r * rank)))
        reports.append(avg.step())
        history.append([p.detach().clone() for p in params])
    center = None if avg.center is None else [t.clone() for t in avg.flat.split(avg.center)]
    with avg.consensus():
        consensus = [p.detach().clone() for p in params]
    assert all(torch.equal(p, h) for p, h in zip(params, history[-1], strict=True))  # replica restored
    return {"history": history, "reports": reports, "center": center, "lam": avg.lam, "consensus": consensus}


def _expected_grawa(world: int, rounds: int, lam: float, variant: str, norm: str) -> tuple[list, list]:
    """GRAWA by hand: EMA with bias correction, inverse-norm weights, weighted center, pull."""
    beta, eps, p = 0.5, 0.5, 1.5
    xs = [_x(r) for r in range(world)]
    m = [[0.0, 0.0] for _ in range(world)]
    weights_per_round, xs_per_round = [], []
    for t in range(1, rounds + 1):
        scores = []
        for r in range(world):
            n = _norms(r, t - 1)
            if variant == "model":
                n = [sum(n)] * 2 if norm == "sum" else [math.sqrt(sum(v * v for v in n))] * 2
            m[r] = [beta * m[r][i] + (1 - beta) * n[i] for i in range(2)]
            nh = [m[r][i] / (1 - beta**t) for i in range(2)]
            scores.append([1.0 / (nh[i] + eps) ** p for i in range(2)])
        w = [[scores[r][i] / sum(scores[q][i] for q in range(world)) for i in range(2)] for r in range(world)]
        c = [sum(w[r][i] * xs[r][i] for r in range(world)) for i in range(2)]
        xs = [[xs[r][i] + lam * (c[i] - xs[r][i]) for i in range(2)] for r in range(world)]
        weights_per_round.append(w)
        xs_per_round.append(xs)
    return weights_per_round, xs_per_round


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(("variant", "norm"), [("model", "sum"), ("model", "l2"), ("layer", "sum")])
def test_grawa_weights_center_and_pull_match_the_formulas(world, variant, norm):
    out = run_workers(_run, "grawa", 2, 0.4, variant, norm, devices=world)
    weights, xs = _expected_grawa(world, 2, 0.4, variant, norm)
    for t in range(2):
        table = out[0]["reports"][t].weights
        assert table.shape == (world, 2 if variant == "layer" else 1)
        for r in range(world):
            expected_w = torch.tensor(weights[t][r][: table.shape[1]], dtype=torch.float64)
            torch.testing.assert_close(table[r], expected_w, rtol=1e-6, atol=0)
            for got, want in zip(out[r]["history"][t], xs[t][r], strict=True):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # the second round's center: its weights applied to the replicas as the first round left them
    center = [sum(weights[1][r][i] * xs[0][r][i] for r in range(world)) for i in range(2)]
    for r in range(world):  # right after a round the consensus is the center, on every rank
        for got, want in zip(out[r]["consensus"], center, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # every rank logs every rank's raw probe norm
    raw = [sum(_norms(r, 1)) if norm == "sum" else math.hypot(*_norms(r, 1)) for r in range(world)]
    logged = out[1]["reports"][1].grad_norms
    torch.testing.assert_close(logged, torch.tensor(raw, dtype=torch.float64), rtol=1e-6, atol=0)


@pytest.mark.parametrize("world", [2, 4])
def test_uniform_leader_and_elastic_centers_and_pulls_match_the_formulas(world):
    xs = [_x(r) for r in range(world)]
    mean = [sum(x[i] for x in xs) / world for i in range(2)]
    uniform = run_workers(_run, "uniform", 1, 0.25, devices=world)
    for r in range(world):
        for got, x, c in zip(uniform[r]["history"][0], xs[r], mean, strict=True):
            torch.testing.assert_close(got, x + 0.25 * (c - x), rtol=0, atol=1e-6)
        # lam < 1 left the replicas apart: the consensus is the mean of the pulled replicas (= c)
        for got, c in zip(uniform[r]["consensus"], mean, strict=True):
            torch.testing.assert_close(got, c, rtol=0, atol=1e-6)

    # LSGD: leader = lowest mean observed loss (rank 1 and 3 tie at 1.0: the lowest rank wins)
    leader = run_workers(_run, "leader", 1, 0.2, devices=world)
    assert leader[0]["reports"][0].leader == 1
    for r in range(world):
        for got, x, c in zip(leader[r]["history"][0], xs[r], xs[1], strict=True):
            torch.testing.assert_close(got, x + 0.2 * (c - x), rtol=0, atol=1e-6)
        assert all(torch.equal(got, c) for got, c in zip(leader[r]["consensus"], xs[1], strict=True))

    # EASGD: replicas pulled toward the *old* center (the initial model), alpha = beta / W; the
    # center moves toward the mean of the pre-pull replicas
    elastic = run_workers(_run, "elastic", 1, None, devices=world)
    alpha = 0.3 / world
    assert elastic[0]["lam"] == pytest.approx(alpha)
    for r in range(world):
        for got, x, c_old in zip(elastic[r]["history"][0], xs[r], xs[0], strict=True):
            torch.testing.assert_close(got, x - alpha * (x - c_old), rtol=0, atol=1e-6)
        for got, c_old, m in zip(elastic[r]["center"], xs[0], mean, strict=True):
            torch.testing.assert_close(got, c_old + 0.3 * (m - c_old), rtol=0, atol=1e-6)
        assert all(torch.equal(a, b) for a, b in zip(elastic[r]["consensus"], elastic[r]["center"], strict=True))


def _grawa_vs_localsgd() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    a, b = _params(rank), _params(rank)
    grawa = PeriodicAveraging(a, dist.group.WORLD, GradientWeightedCenter("layer", p=2.0), tau=2, lam=1.0)
    local = LocalSGD(b, dist.group.WORLD, tau=2)
    for step in range(4):
        _local_training(a, rank + step)
        _local_training(b, rank + step)
        _grads_with_norms(a, [0.7, 1.3])  # equal on every rank
        grawa.step()
        local.step()
    return [p.detach() for p in a], [p.detach() for p in b]


@pytest.mark.parametrize("world", [2, 4])
def test_equal_norms_and_full_pull_reproduce_local_sgd_exactly(world):
    for a, b in run_workers(_grawa_vs_localsgd, devices=world):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _zero_norm(all_zero: bool) -> dict:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    params = _params(rank)
    avg = PeriodicAveraging(params, dist.group.WORLD, GradientWeightedCenter("layer", eps=1e-12, p=8.0), tau=1)
    _local_training(params, rank)
    for p in params:
        p.grad = torch.zeros_like(p) if (rank == 0 or all_zero) else torch.ones_like(p)
    report = avg.step()
    return {"weights": report.weights, "params": [p.detach().clone() for p in params]}


@pytest.mark.parametrize("all_zero", [False, True])
def test_a_zero_gradient_norm_gives_finite_weights(all_zero):
    out = run_workers(_zero_norm, all_zero, devices=2)
    w = out[0]["weights"]
    assert torch.isfinite(w).all() and torch.allclose(w.sum(dim=0), torch.ones(2, dtype=torch.float64))
    if all_zero:
        assert torch.equal(w, torch.full_like(w, 0.5))
    else:
        assert (w[0] > 1 - 1e-12).all()  # the zero-norm replica dominates
    assert all(torch.isfinite(p).all() for o in out for p in o["params"])


def _toy(policy_name: str, world: int) -> dict:
    """Quadratic f_w(x) = 0.5 ||x - a_w||^2 per rank, plain SGD, 7 steps, tau = 2, then finalize."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x = torch.nn.Parameter(torch.zeros(3))
    policy = ElasticCenter(beta=0.4) if policy_name == "easgd" else LeaderCenter()
    avg = PeriodicAveraging([x], dist.group.WORLD, policy, tau=2, lam=None if policy_name == "easgd" else 0.3, rho=0.2)
    target = _toy_target(rank)
    for _ in range(7):
        loss = 0.5 * (x - target).pow(2).sum()
        loss.backward()
        with torch.no_grad():
            x -= 0.1 * x.grad
        x.grad = None
        avg.observe(loss.detach())
        avg.step()
    with avg.consensus():
        consensus = x.detach().clone()
    avg.finalize()
    return {"final": x.detach().clone(), "consensus": consensus}


def _toy_target(rank: int) -> torch.Tensor:
    return torch.tensor([1.0, -1.0, 2.0]) * (rank + 1) + torch.tensor([0.0, 3.0, -1.0]) * (rank % 2)


def _toy_reference(policy_name: str, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(consensus during training, model after finalize) by the papers' formulas."""
    xs = [torch.zeros(3) for _ in range(world)]
    center = torch.zeros(3)
    beta, alpha, lam, rho, tau = 0.4, 0.4 / world, 0.3, 0.2, 2
    losses: list[list[float]] = [[] for _ in range(world)]
    last = [float("inf")] * world
    for step in range(1, 8):
        for r in range(world):
            t = _toy_target(r)
            losses[r].append(float(0.5 * (xs[r] - t).pow(2).sum()))
            xs[r] = xs[r] - 0.1 * (xs[r] - t)
            xs[r] = xs[r] + rho / tau * (center - xs[r])  # proximal pull toward the last center
        if step % tau:
            continue
        if policy_name == "easgd":
            mean = sum(xs) / world
            xs = [x - alpha * (x - center) for x in xs]
            center = center + beta * (mean - center)
        else:
            last = [sum(v) / len(v) for v in losses]
            losses = [[] for _ in range(world)]
            leader = min(range(world), key=lambda r: (last[r], r))
            center = xs[leader].clone()
            xs = [x + lam * (center - x) for x in xs]
    if policy_name == "easgd":  # the center; at the end the center catches up with the replicas' mean
        return center, sum(xs) / world
    running = [sum(v) / len(v) if v else last[r] for r, v in enumerate(losses)]
    leader = xs[min(range(world), key=lambda r: (running[r], r))]
    return leader, leader


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("policy_name", ["easgd", "lsgd"])
def test_easgd_and_lsgd_match_their_formulas_on_a_toy_problem(policy_name, world):
    out = run_workers(_toy, policy_name, world, devices=world)
    consensus, final = _toy_reference(policy_name, world)
    for o in out:
        torch.testing.assert_close(o["final"], final, rtol=0, atol=1e-6)
        torch.testing.assert_close(o["consensus"], consensus, rtol=0, atol=1e-6)
