import io
import random

import numpy as np
import pytest
import torch

from lightning_hier import _validate as v
from lightning_hier.rng import capture_rng, restore_rng


def test_messages_name_owner_argument_value_and_allowed_range():
    with pytest.raises(ValueError, match=r"S: argument `tau` must be an integer >= 1, got 0\."):
        v.check_int("S", "tau", 0, minimum=1)
    with pytest.raises(ValueError, match=r"argument `lam` must be a finite number in \(0.0, 1.0\], got 1.5"):
        v.check_float("S", "lam", 1.5, 0.0, 1.0, low_inclusive=False)
    with pytest.raises(ValueError, match=r"one of 'a', 'b'"):
        v.check_choice("S", "mode", "c", ("a", "b"))
    with pytest.raises(ValueError, match="True or False"):
        v.check_bool("S", "flag", 1)
    with pytest.raises(ValueError, match="an integer"):
        v.check_int("S", "n", True)
    with pytest.raises(ValueError, match="a finite number"):
        v.check_float("S", "x", float("nan"))


def test_accepted_values_pass_through():
    assert v.check_int("S", "n", 3, minimum=1, maximum=3) == 3
    assert v.check_float("S", "x", 1, 0.0, 1.0) == 1.0


def test_rng_round_trip_and_weights_only_serialisation():
    state = capture_rng()
    first = (torch.rand(3), random.random(), np.random.rand())
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    restore_rng(torch.load(buf, weights_only=True))
    second = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(first[0], second[0]) and first[1:] == second[1:]


@pytest.mark.parametrize("value", [np.int64(4), np.int32(4), np.uint8(4)])
def test_any_integral_type_is_an_integer(value):
    got = v.check_int("S", "window", value, minimum=1)
    assert got == 4 and type(got) is int


@pytest.mark.parametrize("value", [float("inf"), -float("inf"), np.float64("inf")])
def test_non_finite_floats_are_rejected_even_without_an_upper_bound(value):
    with pytest.raises(ValueError, match=r"S: argument `eps` must be a finite number > 0.0, got .*inf"):
        v.check_float("S", "eps", value, low=0.0, low_inclusive=False)


def test_numpy_floats_are_numbers():
    assert v.check_float("S", "lr", np.float32(0.5), 0.0, 1.0) == 0.5


def test_strategies_reject_infinities_and_accept_numpy_integers_before_launch():
    from lightning_hier import GrawaStrategy, HPSGDStrategy

    with pytest.raises(ValueError, match=r"GrawaStrategy: argument `eps` must be a finite number"):
        GrawaStrategy(eps=float("inf"))
    with pytest.raises(ValueError, match=r"HPSGDStrategy: argument `bucket_size_mb` must be a finite number"):
        HPSGDStrategy(bucket_size_mb=float("inf"))
    assert HPSGDStrategy(window=np.int64(4)).sync.window == 4
