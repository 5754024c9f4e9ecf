"""Pieces of the decoupled pipeline without processes: schedules, cutting, and weight versions."""

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_hier.algorithms.decoupled import (
    Schedule,
    StageRunner,
    balanced_split,
    check_split_points,
    measure_block_costs,
    stage_ranges,
)
from lightning_hier.strategies._user_model import describe, find_network, first_input


def test_staleness_and_lags_follow_the_papers():
    for k in range(4):
        assert Schedule("fdg", 4).staleness(k) == 2 * (3 - k)  # FDG
        assert Schedule("ddg", 4).staleness(k) == 3 - k  # DDG
        assert Schedule("sync", 4).staleness(k) == 0
        assert Schedule("fdg", 4).update_lag(k) == 2 * 4 - 2 - k  # batch b applied at b + 2K - 2 - k
    assert [Schedule(s, 4).drain_iterations for s in ("fdg", "ddg", "sync")] == [6, 3, 0]
    with pytest.raises(ValueError, match="one of 'fdg', 'ddg', 'sync'"):
        Schedule("gpipe", 2)


@pytest.mark.parametrize(
    ("name", "order", "stages", "acts", "grads"),
    [
        # stage k's activations / gradients over 3 batches and the drain (iterations), by stage
        ("fdg", "forward_first", 2, [[0, 1, 2], []], [[], [1, 2, 3]]),
        ("fdg", "backward_first", 2, [[0, 1, 2], []], [[], [1, 2, 3]]),
        ("fdg", "forward_first", 3, [[0, 1, 2], [1, 2, 3], []], [[], [3, 4, 5], [2, 3, 4]]),
        ("ddg", "forward_first", 3, [[0, 1, 2], [0, 1, 2], []], [[], [1, 2, 3], [0, 1, 2]]),
    ],
)
def test_a_message_travels_once_per_batch_and_boundary(name, order, stages, acts, grads):
    """Batch ``b``'s activation leaves stage ``k`` when ``k`` forwards it, its gradient when ``k`` applies
    it; no iteration of the fill or the drain sends one, and the drain's last sends nothing at all."""
    schedule, fed = Schedule(name, stages, order), 3
    iterations = range(fed + schedule.drain_iterations)
    for k in range(stages):
        assert [i for i in iterations if schedule.sends_activation(k, i, min(i + 1, fed))] == acts[k]
        assert [i for i in iterations if schedule.sends_gradient(k, i, min(i + 1, fed))] == grads[k]
        assert max(acts[k] + grads[k]) < iterations[-1]


def _brute_force(costs, stages):
    best = None
    for points in itertools.combinations(range(1, len(costs)), stages - 1):
        bounds = (0, *points, len(costs))
        worst = max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))
        if best is None or worst < best[0]:
            best = (worst, points)
    return best


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_balanced_split_minimises_the_slowest_stage(seed, stages):
    g = torch.Generator().manual_seed(seed)
    costs = (torch.rand(7, generator=g) * 10).tolist()
    split = balanced_split(costs, stages)
    check_split_points(split, len(costs), stages)
    worst = max(sum(costs[i] for i in r) for r in stage_ranges(split, len(costs)))
    assert worst == pytest.approx(_brute_force(costs, stages)[0])


def test_balanced_split_follows_the_cost_not_the_count():
    assert balanced_split([1, 1, 1, 1, 1, 1, 6], 2) == (6,)
    assert balanced_split([5, 1, 1, 1, 1, 1], 2) == (1,)


@pytest.mark.parametrize(
    ("split", "blocks", "stages", "match"),
    [
        ((1,), 1, 2, "cannot cut 1 block"),
        ((2,), 4, 3, "must hold 2 strictly increasing"),
        ((3, 2), 4, 3, "strictly increasing"),
        ((0,), 4, 2, "strictly increasing"),
        ((4,), 4, 2, r"in \[1, 3\]"),
    ],
)
def test_bad_splits_are_rejected(split, blocks, stages, match):
    with pytest.raises(ValueError, match=match):
        check_split_points(split, blocks, stages)


def test_measuring_block_costs_changes_nothing():
    torch.manual_seed(0)
    blocks = [
        nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Dropout(0.5)),
        nn.Sequential(nn.Flatten(), nn.Linear(144, 3)),
    ]
    before = [copy.deepcopy(b.state_dict()) for b in blocks]
    sample = torch.randn(8, 1, 8, 8)
    rng = torch.get_rng_state()
    costs = measure_block_costs(blocks, sample, repeats=2)
    assert len(costs) == 2 and all(c > 0 for c in costs)
    assert torch.equal(torch.get_rng_state(), rng)
    for b, state in zip(blocks, before, strict=True):
        assert all(torch.equal(v, b.state_dict()[k]) for k, v in state.items())
        assert all(p.grad is None for p in b.parameters())


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))


def _bump(module: nn.Module) -> None:
    """An in-place update as an optimizer makes it."""
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(1.5).add_(0.1)


def test_stash_backpropagates_at_the_forward_time_weights():
    stage = _mlp()
    old = copy.deepcopy(stage)
    runner = StageRunner(stage, "stash")
    x, g = torch.randn(6, 4, requires_grad=True), torch.randn(6, 3)
    out, entry = runner.forward_delayed(x, batch=0)
    _bump(stage)
    leaves = runner.backward_delayed(entry, g)
    x_ref = x.detach().clone().requires_grad_()
    old(x_ref).backward(g)
    torch.testing.assert_close(out, old(x_ref).detach())
    torch.testing.assert_close(
        torch.cat([g.reshape(-1) for g in runner.grads(leaves)]),
        torch.cat([p.grad.reshape(-1) for p in old.parameters()]),
    )
    torch.testing.assert_close(x.grad, x_ref.grad)


def test_legacy_keeps_the_graph_but_reads_the_current_weights():
    stage = _mlp()
    runner = StageRunner(stage, "legacy")
    x, g = torch.randn(6, 4, requires_grad=True), torch.randn(6, 3)
    _, entry = runner.forward_delayed(x, batch=0)
    w1_old, b1_old = stage[0].weight.detach().clone(), stage[0].bias.detach().clone()
    _bump(stage)
    leaves = runner.backward_delayed(entry, g)
    # by hand: activations from forward time, weights from now (where autograd saved them)
    h_pre = x.detach() @ w1_old.T + b1_old
    h = h_pre.clamp(min=0)
    dh = (g @ stage[2].weight.detach()) * (h_pre > 0)
    expected = torch.cat([(dh.T @ x.detach()).reshape(-1), dh.sum(0), (g.T @ h).reshape(-1), g.sum(0)])
    torch.testing.assert_close(torch.cat([g.reshape(-1) for g in runner.grads(leaves)]), expected)
    torch.testing.assert_close(x.grad, dh @ stage[0].weight.detach())


def test_recompute_reruns_with_current_weights_same_dropout_and_one_statistics_update():
    torch.manual_seed(1)
    stage = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 3))
    runner = StageRunner(stage, "recompute")
    x, g = torch.randn(16, 4, requires_grad=True), torch.randn(16, 3)
    state = torch.get_rng_state()
    out, entry = runner.forward_delayed(x, batch=0)
    stats_after_forward = [b.clone() for b in stage.buffers()]
    assert not out.requires_grad and entry.output is None  # nothing but the input waits
    _bump(stage)
    after_forward_rng = torch.get_rng_state()
    leaves = runner.backward_delayed(entry, g)
    assert torch.equal(torch.get_rng_state(), after_forward_rng)  # the replay leaves the RNG alone
    assert all(torch.equal(a, b) for a, b in zip(stage.buffers(), stats_after_forward, strict=True))
    # reference: a fresh forward with the current weights and the forward's RNG state (same mask)
    ref = copy.deepcopy(stage)
    x_ref = x.detach().clone().requires_grad_()
    torch.set_rng_state(state)
    ref(x_ref).backward(g)
    torch.testing.assert_close(
        torch.cat([g.reshape(-1) for g in runner.grads(leaves)]),
        torch.cat([p.grad.reshape(-1) for p in ref.parameters()]),
    )
    torch.testing.assert_close(x.grad, x_ref.grad)


def test_staleness_zero_forward_needs_no_copy_and_sees_live_weights():
    stage = _mlp()
    runner = StageRunner(stage, "stash")
    x = torch.randn(3, 4)
    out, leaves = runner.forward_now(x)
    assert leaves[0].data_ptr() == stage[0].weight.data_ptr()  # a view of the live weights, not a copy
    F.cross_entropy(out, torch.tensor([0, 1, 2])).backward()
    assert leaves[0].grad is not None and stage[0].weight.grad is None  # gradients land on the version leaf


@pytest.mark.parametrize("weights", ["stash", "legacy", "recompute"])
def test_graphs_waiting_in_the_fifo_survive_later_batchnorm_updates(weights):
    torch.manual_seed(2)
    stage = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))
    plain = copy.deepcopy(stage)
    runner = StageRunner(stage, weights)
    xs = [torch.randn(5, 4) for _ in range(3)]
    entries = [runner.forward_delayed(x, batch=i)[1] for i, x in enumerate(xs)]
    for x in xs:
        plain(x)
    # each forward updated the statistics exactly once, as the plain module's forwards did
    assert all(torch.equal(a, b) for a, b in zip(stage.buffers(), plain.buffers(), strict=True))
    for entry in entries:
        runner.backward_delayed(entry, torch.ones(5, 2))
    assert all(torch.equal(a, b) for a, b in zip(stage.buffers(), plain.buffers(), strict=True))


class _Holder(nn.Module):
    """Stands in for a LightningModule: the rule only looks at the submodules."""

    def __init__(self, **children: nn.Module) -> None:
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)


def test_the_network_is_the_shallowest_container_with_parameters_or_the_only_child():
    mlp = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    acts = nn.Sequential(nn.ReLU())  # no parameters: never the network
    assert find_network(_Holder(model=mlp, acts=acts)) == "model"
    assert find_network(_Holder(backbone=_Holder(stem=nn.ModuleList([nn.Linear(2, 2)])), acts=acts)) == "backbone.stem"
    assert find_network(_Holder(layer=nn.Linear(2, 2))) == "layer"  # BoringModel: one block
    with pytest.raises(ValueError, match=r"several containers could be the network: `a` \(Sequential\), `b` \(Module"):
        find_network(_Holder(a=mlp, b=nn.ModuleList([nn.Linear(2, 2)])))
    with pytest.raises(ValueError, match=r"submodules with parameters: `x` \(Linear\), `y` \(Linear\)"):
        find_network(_Holder(x=nn.Linear(2, 2), y=nn.Linear(2, 2)))


def test_the_input_of_a_batch_is_the_tensor_its_first_element_or_first_value():
    x = torch.zeros(3, 2)
    assert first_input(x) is x and first_input((x, 1)) is x and first_input([x]) is x
    assert first_input({"image": x, "label": 0}) is x
    assert first_input({"text": ["a"]}) is None and first_input(()) is None and first_input("a") is None
    assert describe({"text": ["a"], "y": x}) == "a dict of ('text': list, 'y': tensor [3, 2])"


def test_fdg_order_lags_one_update_less_before_the_last_stage():
    from lightning_hier.algorithms.decoupled import Schedule

    for k in range(4):
        forward_first, backward_first = Schedule("fdg", 4), Schedule("fdg", 4, "backward_first")
        want = 2 * (3 - k) - 1 if k < 3 else 0
        assert backward_first.staleness(k) == want
        # the iteration a batch is applied in is the same in either order: only the forward's weights differ
        assert backward_first.update_lag(k) == forward_first.update_lag(k)
    assert Schedule("fdg", 4, "backward_first").drain_iterations == Schedule("fdg", 4).drain_iterations
    for schedule in ("ddg", "sync"):
        with pytest.raises(ValueError, match=r"order='backward_first'.*needs schedule 'fdg'"):
            Schedule(schedule, 2, "backward_first")
    with pytest.raises(ValueError, match="`order` must be one of"):
        Schedule("fdg", 2, "sideways")


def test_the_fdg_codes_loop_equals_the_formula_reference_of_its_order():
    """Two independent restatements of FDG's order agree, and differ from the forward-first order."""
    from tests.pipeline_reference import fdg_loop, simulate

    def blocks() -> list[nn.Module]:
        torch.manual_seed(0)
        return [nn.Sequential(nn.Linear(4, 6), nn.Tanh()), nn.Sequential(nn.Linear(6, 6), nn.ReLU()), nn.Linear(6, 3)]

    def sgd(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)

    g = torch.Generator().manual_seed(1)
    epochs = [
        [(torch.randn(5, 4, generator=g), torch.randint(0, 3, (5,), generator=g)) for _ in range(n)] for n in (6, 2)
    ]
    loop = fdg_loop(blocks(), epochs, sgd, beta=0.5)
    formula = simulate(blocks(), epochs, "fdg", sgd, beta=0.5, order="backward_first")
    other = simulate(blocks(), epochs, "fdg", sgd, beta=0.5)
    for k in range(3):
        assert (
            len(loop[k]) == len(formula[k]) == (6 + 4) + (2 + 4)
        )  # epochs of 6 and 2 batches, 4 drain iterations each
        for t, (a, b) in enumerate(zip(loop[k], formula[k], strict=True)):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=f"stage {k} iteration {t}")
    assert not torch.allclose(loop[0][-1], other[0][-1], atol=1e-4)  # the order changes stage 0's weights


def test_balanced_split_charges_each_stage_the_cuts_it_borders():
    from lightning_hier.algorithms.decoupled import balanced_split

    costs = [3.0, 3.0, 3.0, 3.0]
    assert balanced_split(costs, 2) == (2,)  # compute alone: the middle
    # a wide activation after block 1 (the middle) and a narrow one after block 2
    assert balanced_split(costs, 2, cut_costs=[5.0, 5.0, 0.5]) == (3,)  # 9 + 0.5 beats 6 + 5
    # a stage in the middle borders two cuts
    assert balanced_split([1.0, 1.0, 1.0], 3, cut_costs=[1.0, 1.0]) == (1, 2)
    with pytest.raises(ValueError, match=r"`cut_costs` needs one entry per cut point \(3\), got 2"):
        balanced_split(costs, 2, cut_costs=[1.0, 1.0])


def test_block_output_bytes_counts_what_each_cut_sends_and_changes_nothing():
    from lightning_hier.algorithms.decoupled import block_output_bytes

    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.MaxPool2d(2)), nn.Flatten()]
    blocks[0].train()
    before = copy.deepcopy(blocks[0].state_dict())
    sample = torch.randn(5, 3, 8, 8)
    assert block_output_bytes(blocks, sample) == [5 * 4 * 4 * 4 * 4, 5 * 64 * 4]
    assert block_output_bytes(blocks, sample, torch.bfloat16) == [5 * 4 * 4 * 4 * 2, 5 * 64 * 2]
    assert blocks[0].training  # modes restored, statistics untouched
    for name, value in blocks[0].state_dict().items():
        assert torch.equal(value, before[name]), name
