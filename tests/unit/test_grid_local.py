"""Grid layers and strategy arguments in one process (Pr = Pc = 1: the converted model is the original)."""

import copy

import pytest
import torch
from torch import nn

from lightning_hier import Grid2DStrategy
from lightning_hier.layers import (
    DomainConv2d,
    GatherSlabs,
    GridBatchNorm2d,
    GridCommStats,
    GridContext,
    GridLinear,
    ParamKind,
    Role,
    RowWindow,
    SlabPool2d,
    classify,
    even_shard_sizes,
    full_state_dict,
    is_grid_model,
    load_full_state_dict,
    parameter_kinds,
    replicated_leaves,
    slab_plan,
    to_grid,
    to_ordinary,
    trace_shapes,
)
from lightning_hier.models import mlp, resnet20, small_cnn
from tests.helpers import trainer

NETS = {
    "mlp": (lambda: mlp((1, 8, 8), 10), (1, 8, 8)),
    "small_cnn": (lambda: small_cnn((1, 8, 8), 10), (1, 8, 8)),
    "resnet20": (lambda: resnet20((3, 8, 8), 10), (3, 8, 8)),
}


@pytest.mark.parametrize("name", list(NETS))
def test_conversion_on_one_rank_is_the_identity_and_reversible(name):
    make, shape = NETS[name]
    torch.manual_seed(0)
    ref = make().double()
    net = to_grid(copy.deepcopy(ref), GridContext(), torch.zeros(1, *shape, dtype=torch.float64))
    assert is_grid_model(net) and to_grid(net, GridContext()) is net  # converting twice is a no-op
    x = torch.randn(4, *shape, dtype=torch.float64)
    torch.testing.assert_close(net(x), ref(x), rtol=0, atol=0)
    assert {k: v.shape for k, v in full_state_dict(net).items()} == {k: v.shape for k, v in ref.state_dict().items()}
    back = to_ordinary(net)
    assert not is_grid_model(back) and is_grid_model(net)
    torch.testing.assert_close(back(x), ref(x), rtol=0, atol=0)
    load_full_state_dict(net, {k: torch.zeros_like(v) for k, v in ref.state_dict().items()})
    assert all(float(p.detach().abs().sum()) == 0 for p in net.parameters())


def test_roles_and_parameter_kinds():
    net = small_cnn((1, 8, 8), 10)
    roles = [role for _, _, role, _ in classify(net)]
    assert roles[:5] == [Role.FIRST_CONV, Role.BATCHNORM, Role.SLAB_SAFE, Role.POOL, Role.CONV]
    assert roles[8:] == [Role.TRANSITION, Role.LINEAR, Role.REPLICATED, Role.LINEAR]
    to_grid(net, GridContext())
    kinds = {name: kind for name, _, kind in parameter_kinds(net)}
    assert kinds["0.0.weight"] == kinds["0.1.bias"] == ParamKind.PARTIAL
    assert kinds["2.1.weight"] == ParamKind.SHARDED
    assert [type(m) for m in (net[0][0], net[0][1], net[0][3], net[2][0])] == [
        DomainConv2d,
        GridBatchNorm2d,
        SlabPool2d,
        GatherSlabs,
    ]
    assert net[0][0].split_input and not net[1][0].split_input and isinstance(net[3][0], GridLinear)


def test_shards_have_tensor_split_sizes():
    for n, p in [(10, 4), (8, 4), (5, 5), (1000, 64)]:
        assert even_shard_sizes(n, p) == [len(t) for t in torch.arange(n).tensor_split(p)]


def test_row_windows_of_convolutions():
    g = GridContext()
    window = lambda **kw: DomainConv2d.from_conv(nn.Conv2d(2, 2, **kw), g).window  # noqa: E731
    assert window(kernel_size=1) == RowWindow(1)
    assert window(kernel_size=3, padding=1) == RowWindow(3, 1, 1, 1)
    assert window(kernel_size=11, stride=4) == RowWindow(11, 4)
    assert window(kernel_size=4, padding="same", dilation=2) == RowWindow(4, 1, 3, 3, 2)
    assert window(kernel_size=4, padding="same") == RowWindow(4, 1, 1, 2)  # as torch: the extra row goes last


def test_slab_plans_cover_every_window_and_agree_between_ranks():
    """Every rank's received pieces and own rows tile exactly the rows its window reads; what r sends q, q receives."""
    windows = [RowWindow(11, 4), RowWindow(3, 2), RowWindow(3, 2, 1, 1), RowWindow(7, 2, 3, 3), RowWindow(1, 2)]
    windows += [RowWindow(5, 1, 2, 2), RowWindow(3, 1, 2, 2, 2), RowWindow(2, 2)]
    for window in windows:
        for height in [1, 2, 5, 7, 13, 27, 28, 55, 224, 227]:
            for pr in [1, 2, 3, 4, 8, 16]:
                if window.out_height(height) < 1:
                    continue
                plans = [slab_plan(window, height, pr, r) for r in range(pr)]
                assert [p.out for p in plans] == [
                    (sum(len(t) for t in torch.arange(window.out_height(height)).tensor_split(pr)[:r]),) * 1
                    + (sum(len(t) for t in torch.arange(window.out_height(height)).tensor_split(pr)[: r + 1]),)
                    for r in range(pr)
                ]
                for p in plans:
                    lo, hi = window.rows_needed(*p.out)
                    assert (p.read[0] - p.pad[0], p.read[1] + p.pad[1]) == ((lo, hi) if hi > lo else (0, 0))
                    mine = (max(p.read[0], p.own[0]), min(p.read[1], p.own[1]))
                    pieces = sorted([(a, b) for _, a, b in p.recv] + ([mine] if mine[0] < mine[1] else []))
                    rows = [row for a, b in pieces for row in range(a, b)]
                    assert rows == list(range(*p.read)), (window, height, pr, p)
                    for q, a, b in p.send:
                        assert (p.rank, a, b) in plans[q].recv


def test_comm_stats_round_trip_and_older_states():
    stats = GridCommStats()
    stats.add(64)
    stats.add_wire("halo", 32.0)
    again = GridCommStats()
    again.load_state_dict(stats.state_dict())
    assert again == stats
    again.load_state_dict({"bytes": 1, "calls": 1, "blocked_s": 0.0})  # a plain CommStats state
    assert again.by_kind == {} and again.wire_bytes == 0.0


def test_grid_context_checks_its_coordinates():
    with pytest.raises(ValueError, match=r"invalid coordinates \(r=2"):
        GridContext(pr=2, r=2, model_ranks=(0, 1))
    with pytest.raises(ValueError, match="`model_group` must be given"):
        GridContext(pr=2, model_ranks=(0, 1))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"grid": (0, 2)}, r"`grid` must be 'auto' or a pair \(Pr, Pc\) of integers >= 1, got \(0, 2\)"),
        ({"grid": "big"}, "`grid` must be 'auto' or a pair"),
        ({"grid": (2, 2, 1)}, "got \\(2, 2, 1\\)"),
        ({"alpha": 1e-6}, "give both `alpha` and `beta`"),
        ({"alpha": -1.0, "beta": 1.0}, "`alpha` must be a finite number >= 0.0"),
        ({"max_model": 0}, "`max_model` must be an integer >= 1"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Grid2DStrategy(**kwargs)


def test_grid_that_does_not_match_the_processes_fails_before_launch():
    with pytest.raises(ValueError, match=r"grid=\(2, 2\) has 4 ranks, but the Trainer runs 2 processes"):
        trainer(strategy=Grid2DStrategy(grid=[2, 2], start_method="fork"), devices=2)
    assert Grid2DStrategy(grid=[2, 1]).grid == (2, 1)


def test_a_converted_model_is_reattached_to_a_new_context_of_the_same_shape():
    net = to_grid(small_cnn((1, 8, 8), 10), GridContext())
    fresh = GridContext(stats=GridCommStats())
    assert to_grid(net, fresh) is net and net[0][0].grid is fresh and net[3][0].grid is fresh


class _ReadsWeight(nn.Module):
    """A parent that reads its child's weight instead of calling it (as MultiheadAttention does)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.proj.weight.t()


def test_tied_and_directly_read_layers_stay_whole_and_cannot_run_on_slabs():
    emb, head = nn.Embedding(6, 4), nn.Linear(4, 6)
    head.weight = emb.weight
    net = nn.Sequential(_ReadsWeight(), nn.Linear(4, 4), nn.MultiheadAttention(4, 2))
    tied = nn.Sequential(emb, nn.Linear(4, 4), head)
    called = set(trace_shapes(net[:2], torch.zeros(1, 4)))
    assert replicated_leaves(net, called) == {
        "0.proj": "the traced forward never calls it (its parent reads its weights directly)",
        "2.out_proj": "its parent MultiheadAttention reads its weights directly",
    }
    assert [role for _, _, role, _ in classify(net, called)] == [Role.REPLICATED, Role.LINEAR, Role.REPLICATED]
    assert [role for _, _, role, _ in classify(tied)] == [Role.REPLICATED, Role.LINEAR, Role.REPLICATED]
    assert replicated_leaves(tied)["2"] == "its parameter is shared (tied) with 0.weight, 2.weight"
    conv = nn.Conv2d(2, 2, 3, padding=1)
    shared_conv = nn.Sequential(nn.Conv2d(2, 2, 1), conv, conv, nn.Flatten())
    (_, _, role, reason) = classify(shared_conv)[1]
    assert role is Role.UNSUPPORTED and "Conv2d must stay whole" in reason and "slabs" in reason
