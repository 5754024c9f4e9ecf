"""GRAWA's pieces and the averaging strategies' arguments, without process groups."""

import copy
import math

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry

from lightning_hier import EasgdStrategy, GrawaStrategy, LocalSGDStrategy, LsgdStrategy
from lightning_hier.algorithms import (
    GradientWeightedCenter,
    NormEMA,
    PeriodicAveraging,
    RoundReport,
    UniformCenter,
    probe_grad_norms,
)
from lightning_hier.algorithms.grawa import grawa_scores, normalise_weights
from lightning_hier.callbacks import PullToCenter
from lightning_hier.strategies._probe import side_effect_free
from tests.helpers import digits_classifier


def test_norm_ema_is_bias_corrected_like_adam():
    ema = NormEMA(beta=0.5, size=2)
    torch.testing.assert_close(ema.update(torch.tensor([2.0, 0.0])), torch.tensor([2.0, 0.0], dtype=torch.float64))
    # m = 0.5 * (1, 0) + 0.5 * (4, 6) = (2.5, 3); corrected by 1 - 0.5^2 = 0.75
    expected = torch.tensor([2.5 / 0.75, 4.0], dtype=torch.float64)
    torch.testing.assert_close(ema.update(torch.tensor([4.0, 6.0])), expected)
    restored = NormEMA(beta=0.5, size=2)
    restored.load_state_dict(ema.state_dict())
    assert restored.r == 2 and torch.equal(restored.m, ema.m)
    assert torch.equal(NormEMA(0.0, 1).update(torch.tensor([3.0])), torch.tensor([3.0], dtype=torch.float64))


def test_grawa_state_of_the_other_variant_is_rejected():
    saved = GradientWeightedCenter("model").state_dict()
    with pytest.raises(ValueError, match=r"variant='model', this run uses variant='layer'"):
        GradientWeightedCenter("layer").load_state_dict(saved)


def test_scores_are_inverse_powers_and_stay_finite_at_zero():
    s = grawa_scores(torch.tensor([1.0, 3.0, 0.0]), eps=1e-8, p=2.0)
    assert s[0] == pytest.approx(1.0, rel=1e-7) and s[1] == pytest.approx(1 / 9, rel=1e-7)
    assert torch.isfinite(s).all() and s[2] > 1e15
    w = normalise_weights(torch.stack([grawa_scores(torch.tensor([0.0]), 1e-300, 8.0)] * 3))
    assert torch.equal(w, torch.full((3, 1), 1 / 3, dtype=torch.float64))


def test_probe_measures_the_gradient_norm_and_leaves_grads_and_batchnorm_alone():
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 1)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    lin.weight.grad = torch.full_like(lin.weight, 7.0)  # the optimizer's gradients must survive
    norms = probe_grad_norms(list(lin.parameters()), lambda: ((lin(x) - y) ** 2).mean(), lin.buffers())
    residual = (x @ lin.weight.detach().T + lin.bias.detach() - y) * 2 / 8  # d mean(r^2) / d r
    expected = torch.tensor([float((residual.T @ x).norm()), float(residual.sum().abs())], dtype=torch.float64)
    torch.testing.assert_close(norms, expected, rtol=1e-5, atol=0)
    assert torch.equal(lin.weight.grad, torch.full_like(lin.weight, 7.0)) and lin.bias.grad is None

    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1)).train()
    reference = copy.deepcopy(net)
    state = copy.deepcopy(net.state_dict())
    norms = probe_grad_norms(list(net.parameters()), lambda: net(x).pow(2).mean(), net.buffers())
    reference(x).pow(2).mean().backward()  # independent: autograd on an untouched copy
    torch.testing.assert_close(norms, torch.stack([p.grad.norm().double() for p in reference.parameters()]))
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in state.items())  # running stats restored
    assert all(p.grad is None for p in net.parameters())


def test_training_step_rerun_logs_nothing_and_keeps_torchmetrics_state():
    module = digits_classifier()
    batch = (torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 2, 3]))
    module.train_acc.update(module(batch[0]), torch.tensor([0, 0, 0, 0]))
    before = (module.train_acc._copy_state_dict(), module.train_acc._update_count)
    with side_effect_free(module):
        loss = module.training_step(batch, 0)  # would raise without a trainer if it logged
    assert loss.requires_grad
    after = (module.train_acc._copy_state_dict(), module.train_acc._update_count)
    assert before[1] == after[1] and all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    assert "log" not in vars(module)


def test_pull_helpers_validate_and_single_worker_rounds_report():
    lin = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="lam"):
        PeriodicAveraging(lin.parameters(), None, UniformCenter(), tau=1, lam=0.0)
    with pytest.raises(ValueError, match="rho"):
        PeriodicAveraging(lin.parameters(), None, UniformCenter(), tau=1, rho=1.5)
    report = PeriodicAveraging(lin.parameters(), None, UniformCenter(), tau=1).step()
    assert report is not None and report.consensus_distance == 0.0 and report.world == 1


def test_round_report_logs_every_rank_up_to_sixteen_then_summaries():
    small = RoundReport(0, 4, 0.5, 0.1, 100, 2, weights=torch.tensor([[0.25, 0.75], [0.75, 0.25]]))
    m = small.metrics()
    assert m["grawa/weight/rank0"] == 0.5 and m["grawa/layer_weight_max/rank0"] == 0.75
    assert m["comm/rounds"] == 1.0 and m["comm/bytes"] == 100.0 and m["avg/consensus_dist"] == 0.1
    big = RoundReport(3, 8, 1.0, 0.0, 0, 32, grad_norms=torch.arange(32.0)).metrics()
    assert big["grawa/grad_norm/max"] == 31.0 and not any("rank" in k for k in big)


BAD_ARGS = [
    (LocalSGDStrategy, {"tau": 0}, "tau"),
    (GrawaStrategy, {"tau": 0}, "tau"),
    (GrawaStrategy, {"lam": 0.0}, "lam"),
    (GrawaStrategy, {"lam": 1.5}, "lam"),
    (GrawaStrategy, {"rho": -0.1}, "rho"),
    (GrawaStrategy, {"beta": 1.0}, "beta"),
    (GrawaStrategy, {"eps": 0.0}, "eps"),
    (GrawaStrategy, {"p": 0.0}, "p"),
    (GrawaStrategy, {"p": 9.0}, "p"),
    (GrawaStrategy, {"norm": "max"}, "norm"),
    (GrawaStrategy, {"variant": "block"}, "variant"),
    (GrawaStrategy, {"probe": "loader"}, "probe"),
    (GrawaStrategy, {"sync_buffers": "yes"}, "sync_buffers"),
    (EasgdStrategy, {"beta": 0.0}, "beta"),
    (EasgdStrategy, {"alpha": 2.0}, "alpha"),
    (EasgdStrategy, {"rho": -1.0}, "rho"),
    (LsgdStrategy, {"lam": -0.1}, "lam"),
    (LsgdStrategy, {"tau": 2.5}, "tau"),
    (LsgdStrategy, {"bucket_size_mb": 0.0}, "bucket_size_mb"),
]


@pytest.mark.parametrize(("cls", "kwargs", "name"), BAD_ARGS)
def test_bad_arguments_fail_at_construction_naming_argument_and_value(cls, kwargs, name):
    value = next(iter(kwargs.values()))
    with pytest.raises(ValueError, match=rf"{cls.__name__}: argument `{name}` must be .*got {value!r}"):
        cls(**kwargs)


def test_pull_callback_validates_its_constants():
    with pytest.raises(ValueError, match=r"`lam` must be .*got 0"):
        PullToCenter(lam=0)
    with pytest.raises(ValueError, match=r"`tau` must be .*got 0"):
        PullToCenter(tau=0)
    schedule = PullToCenter(lam=lambda r: 0.1 * (r + 1), rho=0.2)
    assert schedule.lam_at(2, 0.5) == pytest.approx(0.3) and schedule.rho_at(7, 0.0) == 0.2
    assert schedule.tau_at(0, 32) == 32


def test_pull_callback_refuses_a_strategy_that_does_not_average():
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    with pytest.raises(ValueError, match=r"averaging strategy .* SingleDeviceStrategy"):
        PullToCenter().setup(trainer, digits_classifier(), "fit")


def test_registered_names_fix_the_variant():
    for name, variant in (("mgrawa", "model"), ("lgrawa", "layer"), ("lgrawa_fork", "layer")):
        entry = StrategyRegistry[name]
        assert entry["strategy"] is GrawaStrategy and entry["init_params"]["variant"] == variant
    for name in ("grawa", "easgd", "lsgd", "localsgd", "easgd_spawn", "lsgd_fork"):
        assert name in StrategyRegistry
    assert math.isclose(GrawaStrategy().sync.policy().beta, 0.9**8)
