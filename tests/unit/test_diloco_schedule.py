"""Streaming DiLoCo's partition into fragments, their staggered schedule, and DiLoCo's bad arguments."""

from __future__ import annotations

import pytest
import torch

from lightning_hier.algorithms.diloco import DiLoCo, fragment_offsets, split_fragments


def _sizes(groups: list[list[torch.Tensor]]) -> list[list[int]]:
    return [[t.numel() for t in g] for g in groups]


def test_fragments_are_contiguous_and_about_equal():
    params = [torch.zeros(n) for n in (10, 10, 10, 10, 10, 10)]
    assert _sizes(split_fragments(params, 3)) == [[10, 10], [10, 10], [10, 10]]
    assert _sizes(split_fragments(params, 1)) == [[10] * 6]
    # a large tensor is never split; the small ones around it fall on either side
    assert _sizes(split_fragments([torch.zeros(n) for n in (2, 100, 2, 2)], 2)) == [[2, 100], [2, 2]]


def test_every_fragment_gets_a_tensor_even_when_one_dominates():
    groups = split_fragments([torch.zeros(n) for n in (1000, 1, 1)], 3)
    assert _sizes(groups) == [[1000], [1], [1]]


def test_more_fragments_than_tensors_gives_one_tensor_each():
    assert _sizes(split_fragments([torch.zeros(3), torch.zeros(4)], 5)) == [[3], [4]]


def test_offsets_stagger_the_fragments_and_the_last_ends_the_window():
    assert fragment_offsets(8, 1) == [0]  # DiLoCo: every H steps
    assert fragment_offsets(8, 2) == [4, 0]
    assert fragment_offsets(12, 3) == [4, 8, 0]
    assert fragment_offsets(4, 4) == [1, 2, 3, 0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"window": 0}, "`window` must be"),
        ({"window": 4, "delay": 4}, "`delay` must be"),
        ({"alpha": 1.0}, "`alpha` must be"),
        ({"compression": "fp8"}, "`compression` must be one of"),
        ({"outer_lr": 0.0}, "`lr` must be"),
        ({"outer_momentum": 1.0}, "`momentum` must be"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DiLoCo([torch.zeros(4, requires_grad=True)], None, **kwargs)
