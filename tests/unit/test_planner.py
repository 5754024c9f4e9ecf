"""The cost model against the paper's formulas and the reference values of docs/algorithms.md; grid constraints."""

import re
from math import ceil, log2

import pytest
from torch import nn

from lightning_hier.layers import DomainConv2d, GridContext, SlabPool2d
from lightning_hier.layers.pooling import pool_problems
from lightning_hier.models import alexnet, mlp, resnet20, small_cnn
from lightning_hier.planner import (
    REFERENCE_LINK,
    BNLayer,
    ConvLayer,
    FCLayer,
    Link,
    PoolLayer,
    Transition,
    alexnet_layers,
    bandwidth_optimal_pr,
    best_grid,
    inference_cost,
    layer_cost,
    model_layers,
    network_cost,
    plan_grids,
    vgg16_layers,
)
from lightning_hier.planner.__main__ import main
from lightning_hier.planner.plan import model_best

A, BETA = 2e-6, 4e-10


def _plans(layers, batch, world, **kw):
    return {p.grid: p for p in plan_grids(layers, batch, world, **kw)}


def _fc_paper_time(d_in, d_out, batch, pr, pc):
    """Gholami et al., FC layer i on Pr x Pc, written from the formula (|W| with the bias)."""
    lg = lambda p: ceil(log2(p)) if p > 1 else 0  # noqa: E731
    weights = d_in * d_out + d_out
    return A * (3 * lg(pr) + 2 * lg(pc)) + BETA * (
        (pr - 1) / pr * (batch / pc) * (d_out + 2 * d_in) + 2 * (pc - 1) / pc * weights / pr
    )


@pytest.mark.parametrize(("d_in", "d_out", "batch", "pr", "pc"), [(9216, 4096, 256, 8, 64), (300, 70, 96, 3, 4)])
def test_fc_layer_cost_is_the_papers_formula(d_in, d_out, batch, pr, pc):
    cost = layer_cost(FCLayer(d_in, d_out), pr, pc, batch, input_grad=True)
    assert cost.time(REFERENCE_LINK) == pytest.approx(_fc_paper_time(d_in, d_out, batch, pr, pc), rel=1e-12)
    first = layer_cost(FCLayer(d_in, d_out), pr, pc, batch, input_grad=False)  # no dX term
    assert "fc_dx" not in first.terms and first.words < cost.words


def test_alexnet_fc_reference_values():
    fc = alexnet_layers(fc_only=True)
    words = lambda plans, grid: round(plans[grid].words / 1e6, 2)  # noqa: E731
    p = _plans(fc, 2048, 512, first_input_grad=True)
    assert (words(p, (1, 512)), words(p, (512, 1)), words(p, (32, 16))) == (117.03, 89.95, 8.89)
    assert best_grid(fc, 2048, 512, first_input_grad=True).grid == (32, 16)
    p = _plans(fc, 256, 512, first_input_grad=True)
    assert (words(p, (512, 1)), words(p, (64, 8)), words(p, (1, 512))) == (11.24, 2.99, 117.03)
    assert not p[(1, 512)].feasible and "Pc=512 > B=256" in p[(1, 512)].problems[0]
    assert best_grid(fc, 256, 512, first_input_grad=True).grid == (64, 8)
    p = _plans(fc, 256, 8, first_input_grad=True)
    assert (words(p, (8, 1)), round(p[(1, 8)].words / 1e6, 1)) == (9.86, 102.6)
    assert best_grid(fc, 256, 8, first_input_grad=True).grid == (8, 1)


def test_whole_network_reference_times():
    ms = lambda plans, grid: round(plans[grid].time_s * 1e3, 2)  # noqa: E731
    p = _plans(alexnet_layers(), 256, 512)
    assert [ms(p, g) for g in [(2, 256), (4, 128), (8, 64)]] == [26.73, 15.06, 9.32]
    p = _plans(alexnet_layers(), 256, 8)
    assert [ms(p, g) for g in [(1, 8), (2, 4), (4, 2), (8, 1)]] == [43.76, 23.10, 14.81, 15.82]
    p = _plans(vgg16_layers(), 2048, 8, max_model=8)
    assert [ms(p, g) for g in [(1, 8), (2, 4), (4, 2), (8, 1)]] == [97.04, 163.99, 265.89, 506.79]
    assert best_grid(vgg16_layers(), 2048, 8, max_model=8).grid == (1, 8)


def test_bandwidth_only_optimum_is_near_the_best_grid():
    pr = bandwidth_optimal_pr(alexnet_layers(fc_only=True), 2048, 512)
    assert 16 < pr < 64  # the best grid is 32 x 16


def test_constraints():
    conv = [ConvLayer(3, 8, 8, 4, 3), PoolLayer(8, 2), Transition(4 * 4 * 4), FCLayer(64, 10)]
    p = _plans(conv, 6, 4)
    assert "not divisible by Pc=4" in p[(1, 4)].problems[0] and p[(1, 4)].undefined
    assert p[(4, 1)].feasible and p[(2, 2)].feasible  # 2-row slabs of a 3x3 convolution run
    thin = _plans(conv, 6, 4, slab_min_kernel=True)[(4, 1)]
    assert thin.excluded == ("layer ConvLayer: slabs of 2 rows are thinner than the kernel (3)",)
    assert "Pr=2 > max_model=1" in _plans(conv, 8, 4, max_model=1)[(2, 2)].excluded[0]
    limited = _plans(conv, 8, 4, memory_limit_bytes=1.0)
    assert all("MiB > limit" in plan.problems[-1] for plan in limited.values())
    with pytest.raises(ValueError, match="no feasible grid for P=4"):
        best_grid(conv, 8, 4, memory_limit_bytes=1.0)


def test_what_cannot_run_on_slabs_is_the_layers_own_check():
    """The planner's reasons are the ones the layers raise (one source of truth)."""
    odd = [
        ConvLayer(3, 8, 8, 4, 3, padding_mode="circular", name="c"),
        PoolLayer(8, 2, kernel=3, ceil_mode=True, name="p"),
        Transition(4 * 4 * 4),
        FCLayer(64, 10),
    ]
    p = _plans(odd, 8, 4)
    assert p[(1, 4)].feasible and not p[(2, 2)].undefined
    assert p[(2, 2)].unsupported == (
        "layer c: padding_mode='circular' (only 'zeros' is supported on slabs)",
        "layer p: ceil_mode=True (a partial last window is not supported on slabs)",
    )
    grid = GridContext(pr=2, model_group=object(), model_ranks=(0, 1))  # construction only: no collective
    with pytest.raises(ValueError, match=re.escape(p[(2, 2)].unsupported[1].removeprefix("layer p: "))):
        SlabPool2d(nn.MaxPool2d(3, 2, ceil_mode=True), grid)
    with pytest.raises(ValueError, match=re.escape(p[(2, 2)].unsupported[0].removeprefix("layer c: "))):
        DomainConv2d(3, 4, 3, padding=1, padding_mode="circular", grid=grid)
    for pool in (nn.MaxPool2d(3, 2, ceil_mode=True), nn.AvgPool2d(3, 2, 1, count_include_pad=False)):
        traced = model_layers(nn.Sequential(nn.Conv2d(1, 1, 1), pool, nn.Flatten()), (1, 8, 8))[1]
        assert traced.problems() == pool_problems(pool) != []
    assert PoolLayer(8, 2, return_indices=True).problems() == pool_problems(nn.MaxPool2d(2, return_indices=True))


@pytest.mark.parametrize("batch", [256, 2048])
def test_whole_alexnet_has_domain_parallel_grids_and_the_planner_picks_the_models_best(batch):
    """Issue 17: whole AlexNet (the paper's layers, and the nn.Module with its overlapping pools) at P = 8..512."""
    traced = model_layers(alexnet(), (3, 227, 227))
    for layers in (alexnet_layers(), traced):
        for world in [2**i for i in range(3, 10)]:
            plans = plan_grids(layers, batch, world)
            assert any(p.feasible and p.pr > 1 for p in plans), (batch, world)
            assert not any(p.unsupported for p in plans)
            assert best_grid(layers, batch, world).grid == model_best(plans).grid
    assert model_best(plan_grids(alexnet_layers(), 2048, 512)).grid == (16, 32)
    assert round(best_grid(alexnet_layers(), 2048, 512).time_s * 1e3, 1) == 9.5


def test_exact_convention_counts_edge_slabs_and_uneven_shards():
    conv = ConvLayer(2, 16, 5, 3, 3)  # same convolution, halo 1 row each side
    paper = layer_cost(conv, 4, 1, 6, input_grad=True).terms["halo"]
    interior = layer_cost(conv, 4, 1, 6, input_grad=True, rank=1).terms["halo"]
    edge = layer_cost(conv, 4, 1, 6, input_grad=True, rank=0).terms["halo"]
    assert paper == interior == [4, 4 * 6 * 2 * 5]
    assert edge == [2, 2 * 6 * 2 * 5]
    stride2 = layer_cost(ConvLayer(2, 16, 5, 3, 3, stride=2), 4, 1, 6, input_grad=False, rank=1).terms["halo"]
    assert stride2 == [1, 6 * 2 * 5]  # only the row above is needed
    fc = FCLayer(7, 10)  # 10 rows on 4 ranks: 3, 3, 2, 2 (padded to 3 in the all-gather)
    assert layer_cost(fc, 4, 2, 8, True, rank=3).terms["grad_batch"][1] == pytest.approx(2 * 0.5 * 2 * 8)
    assert layer_cost(fc, 4, 2, 8, True, rank=3).terms["fc_gather"][1] == pytest.approx(0.75 * 4 * 12)


def test_batchnorm_and_replicated_terms():
    bn = layer_cost(BNLayer(8, 4, 4), 2, 2, 8, input_grad=True)
    assert bn.terms["bn_stats"] == [4, 2 * (2 * 0.5 * 16)] and bn.terms["grad_grid"][1] == pytest.approx(1.5 * 16)
    narrow = layer_cost(FCLayer(16, 3), 4, 2, 8, input_grad=True)  # 3 outputs < Pr: replicated
    assert set(narrow.terms) == {"grad_batch"} and narrow.terms["grad_batch"][1] == 16 * 3 + 3


def test_model_layers_trace_our_networks():
    layers = model_layers(small_cnn((3, 32, 32), 10), (3, 32, 32))
    kinds = [type(layer).__name__ for layer in layers]
    assert kinds == ["ConvLayer", "BNLayer", "PoolLayer"] * 2 + ["Transition", "FCLayer", "FCLayer"]
    assert layers[0].splits_input and not layers[3].splits_input
    assert layers[6] == Transition(64 * 8 * 8, name="2.0", h=8)
    res = model_layers(resnet20((3, 32, 32), 10), (3, 32, 32))
    assert sum(isinstance(layer, ConvLayer) for layer in res) == 19 and isinstance(res[-2], Transition)
    assert network_cost(res, 1, 4, 128).words == pytest.approx(2 * 0.75 * sum(layer.params for layer in res))
    assert [type(layer).__name__ for layer in model_layers(mlp((1, 8, 8), 10), (1, 8, 8))] == ["FCLayer"] * 3


def test_replica_scope_compares_time_per_sample():
    layers = model_layers(mlp((1, 8, 8), 10, hidden=(2048,)), (1, 8, 8))
    plans = _plans(layers, 8, 4, links=Link(0.0, 4e-10), batch_scope="replica")
    assert [plans[g].batch for g in [(1, 4), (2, 2), (4, 1)]] == [32, 16, 8]
    best = best_grid(layers, 8, 4, links=Link(0.0, 4e-10), batch_scope="replica")
    assert best.grid == min(plans, key=lambda g: plans[g].time_s / plans[g].batch)


def test_cli_prints_the_table(capsys):
    assert main(["--model", "alexnet-fc", "--batch-size", "256", "--world-size", "512"]) == 0
    out = capsys.readouterr().out
    assert "64 x 8" in out and "best" in out and "infeasible: Pc=512 > B=256" in out
    assert main(["--model", "small_cnn", "--input-shape", "3", "32", "32", "--world-size", "2", "4"]) == 0
    assert capsys.readouterr().out.count("grid Pr x Pc") == 2


def test_a_validation_forward_sends_only_the_forward_terms():
    """Evaluation mode: each FC layer's all-gather of its output block, (Pr - 1) / Pr of b d_out words
    (b = B / Pc), and a convolution's halo rows one way; no input-gradient reduction, no gradient
    all-reduce, and BatchNorm uses its running statistics (no ``bn_stats``)."""
    pr, pc, batch = 4, 2, 16
    fcs = [FCLayer(300, 64), FCLayer(64, 64), FCLayer(64, 10)]
    forward = inference_cost(fcs, pr, pc, batch)
    assert set(forward.terms) == {"fc_gather"}
    assert forward.words == pytest.approx(sum((pr - 1) / pr * (batch / pc) * fc.d_out for fc in fcs))
    conv, bn = ConvLayer(2, 16, 5, 3, 3), BNLayer(16, 5, 5)
    slabs = inference_cost([conv, bn], pr, 1, 6)
    assert set(slabs.terms) == {"halo"} and slabs.terms["halo"] == [2, 2 * 6 * 2 * 5]  # a row each way, sent once
