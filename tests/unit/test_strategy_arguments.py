"""Strategy arguments: any integral type is an integer, lists of integers are checked entry by entry.

The bad values of every argument, with their messages, are in the bad-input table (docs/reference/bad-input.md)
(``tests/unit/test_bad_input_table.py``); this file checks what must be *accepted*.
"""

from datetime import timedelta

import numpy as np
import pytest
from omegaconf import OmegaConf

from lightning_hier import _validate as v
from lightning_hier.data import SyntheticDataModule
from lightning_hier.strategies import (
    DBSStrategy,
    DDPCommHookStrategy,
    DecoupledStrategy,
    EasgdStrategy,
    GrawaStrategy,
    Grid2DStrategy,
    HPSGDStrategy,
    LocalSGDStrategy,
    LsgdStrategy,
)
from lightning_hier.topology import Topology
from tests.helpers import argument

I = np.int64  # noqa: E741  (the type a numpy computation or array element gives)

# (strategy, its arguments with numpy integers, attribute -> the plain value it must hold)
INTEGER_ARGUMENTS = [
    (HPSGDStrategy, {"window": I(4)}, {"window": 4}),
    (LocalSGDStrategy, {"tau": I(4)}, {"tau": 4}),
    (EasgdStrategy, {"tau": np.int32(3)}, {"tau": 3}),
    (LsgdStrategy, {"tau": np.uint8(5)}, {"tau": 5}),
    (GrawaStrategy, {"tau": I(16), "probe_seed": I(7)}, {"tau": 16, "probe_seed": 7}),
    (
        DBSStrategy,
        {
            "global_batch_size": I(64),
            "rebalance_every": I(10),
            "min_batch_size": I(2),
            "max_batch_size": I(60),
            "warmup_steps": I(0),
            "initial_sizes": [I(48), I(16)],
        },
        {
            "global_batch_size": 64,
            "rebalance_every": 10,
            "min_batch_size": 2,
            "max_batch_size": 60,
            "warmup_steps": 0,
            "initial_sizes": [48, 16],
        },
    ),
    (DecoupledStrategy, {"stages": I(3), "split": (I(2), I(4))}, {"stages": 3, "split": (2, 4)}),
    (DecoupledStrategy, {"stages": 2, "split": np.array([3])}, {"split": (3,)}),
    (DBSStrategy, {"initial_sizes": np.array([8, 24], dtype=np.int32)}, {"initial_sizes": [8, 24]}),
    (Grid2DStrategy, {"grid": (I(2), I(2)), "max_model": I(2)}, {"grid": (2, 2), "max_model": 2}),
    (
        DDPCommHookStrategy,
        {"hook": "post_local_sgd", "model_averaging_period": I(4), "warmup_steps": I(3)},
        {"model_averaging_period": 4, "warmup_steps": 3},
    ),
    (DDPCommHookStrategy, {"hook": "powersgd", "powersgd_rank": I(2)}, {"powersgd_rank": 2}),
    (DDPCommHookStrategy, {"hook": "fp16", "warmup_steps": I(0)}, {"warmup_steps": 0}),
]


@pytest.mark.parametrize(("cls", "kwargs", "expected"), INTEGER_ARGUMENTS)
def test_every_integer_argument_takes_any_integral_type_and_keeps_a_plain_int(cls, kwargs, expected):
    strategy = cls(**kwargs)
    for name, value in expected.items():
        got = argument(strategy, name)
        assert got == value
        assert all(type(x) is int for x in got) if isinstance(got, list | tuple) else type(got) is int, (name, got)


def test_numpy_floats_and_timedeltas_are_numbers():
    s = GrawaStrategy(lam=np.float32(0.5), eps=np.float64(1e-6), timeout=timedelta(seconds=30))
    assert (argument(s, "lam"), s._timeout) == (0.5, timedelta(seconds=30))


def test_hydra_lists_are_lists():
    # Hydra passes ListConfig, not list: `strategy.split=[2]` with stages='auto' means K = 2
    assert DecoupledStrategy(split=OmegaConf.create([2]))._num_stages == 2
    assert Grid2DStrategy(grid=OmegaConf.create([1, 2])).grid == (1, 2)


def test_documented_nones_stay_accepted():
    assert argument(EasgdStrategy(alpha=None), "lam") is None  # beta / W at set-up
    s = DBSStrategy(global_batch_size=None, max_batch_size=None, initial_sizes=None)
    assert [argument(s, n) for n in ("global_batch_size", "max_batch_size", "initial_sizes")] == [None] * 3
    assert Grid2DStrategy(alpha=None, beta=None, max_model=None).alpha is None
    assert DecoupledStrategy(split=None, module_attr=None).split is None


def test_max_model_is_a_bound_for_auto_only_and_must_not_contradict_a_given_grid():
    assert Grid2DStrategy(grid=(2, 1), max_model=2).grid == (2, 1)
    assert Grid2DStrategy(grid="auto", max_model=1).max_model == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, r"S: argument `xs` must be a non-empty list of integers, got \[\]"),
        ({"minimum": 1}, r"must be a non-empty list of integers >= 1, got \[\]"),
        ({"length": 2, "minimum": 1, "maximum": 9}, r"must be a list of 2 integers in \[1, 9\], got \[\]"),
        ({"length": 2, "increasing": True}, r"must be a list of 2 strictly increasing integers, got \[\]"),
        ({"allowed": "what the owner says"}, r"must be what the owner says, got \[\]"),
    ],
)
def test_int_list_messages(kwargs, message):
    with pytest.raises(ValueError, match=message):
        v.check_int_list("S", "xs", [], **kwargs)


@pytest.mark.parametrize(
    "value",
    [
        *(None, 3, "12", b"12", {1: 2}),
        *([1, True], [1, 2.0], [1, "2"], [1, None], (0, 1), [1, 10], [np.float64(1.0)]),
        *(np.array([1.0, 2.0]), np.array([[1, 2]]), np.array(3)),
    ],
)
def test_int_list_rejects_non_lists_bools_floats_and_out_of_range_entries(value):
    with pytest.raises(ValueError, match=r"S: argument `xs` must be"):
        v.check_int_list("S", "xs", value, minimum=1, maximum=9)


def test_int_list_length_and_order():
    assert v.check_int_list("S", "xs", (I(1), np.uint16(3)), length=2, increasing=True) == [1, 3]
    with pytest.raises(ValueError, match="got \\[3, 3\\]"):
        v.check_int_list("S", "xs", [3, 3], increasing=True)
    with pytest.raises(ValueError, match="got \\[1, 2, 3\\]"):
        v.check_int_list("S", "xs", [1, 2, 3], length=2)
    assert v.check_int_list("S", "xs", [], length=0) == []  # an exact length of zero is a length


def test_the_former_scattered_list_checks_share_the_helper():
    # numpy integers were rejected by each of these before they used check_int_list
    assert SyntheticDataModule(input_shape=[I(3), I(8), I(8)]).shape == (3, 8, 8)
    assert Topology(world_size=I(4), model=I(2)).data == 2


def test_straggler_ranks_share_the_int_list_check():
    from lightning_hier.callbacks import Straggler

    assert Straggler(ranks=I(1)).ranks == [1] and Straggler(ranks=(I(0), 1)).ranks == [0, 1]
    for bad in (True, -1, [1, True], [], "1", None):
        with pytest.raises(ValueError, match=r"Straggler: argument `ranks` must be a global rank or a non-empty list"):
            Straggler(ranks=bad)
