"""GRAWA's fresh probe batches: drawn from the whole training set, seeded, apart from the training RNG."""

import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

from lightning_hier import GrawaStrategy
from lightning_hier.strategies._probe import FreshBatches, draw, fresh_batches_of, isolated_rng

N, B = 40, 4


def _loader(**kwargs) -> DataLoader:
    data = TensorDataset(torch.arange(N).float().unsqueeze(1), torch.arange(N))
    return DataLoader(data, batch_size=B, **kwargs)


def test_probe_batches_come_from_the_whole_dataset_not_the_ranks_shard():
    # the rank's training shard: every other index, as Lightning's DistributedSampler gives rank 0
    loader = _loader(sampler=DistributedSampler(_loader().dataset, num_replicas=2, rank=0, shuffle=False))
    shard = {int(i) for i in loader.sampler}
    assert shard == set(range(0, N, 2))
    fresh = FreshBatches.from_loader(loader, seed=3, rank=0, owner="GrawaStrategy")
    seen: set[int] = set()
    for step in range(100):
        x, y = fresh.draw(step)  # collated by the loader's collate function
        assert x.shape == (B, 1) and torch.equal(x.squeeze(1).long(), y)
        assert len(set(y.tolist())) == B  # without replacement within a batch
        seen |= set(y.tolist())
    assert seen - shard  # indices the rank never trains on
    assert seen == set(range(N))


def test_probe_batches_are_a_function_of_seed_rank_and_step():
    def indices(seed: int, rank: int, step: int) -> list[int]:
        return FreshBatches.from_loader(_loader(), seed, rank, "GrawaStrategy").indices(step).tolist()

    assert indices(3, 0, 8) == indices(3, 0, 8)  # the same batch again (e.g. after a resume)
    assert len({tuple(indices(s, r, t)) for s, r, t in [(3, 0, 8), (4, 0, 8), (3, 1, 8), (3, 0, 16)]}) == 4
    tiny = FreshBatches(list(range(3)), lambda xs: xs, batch_size=8, seed=0, rank=0)
    assert sorted(tiny.draw(0)) == [0, 1, 2]  # capped at the dataset's size


def test_several_training_loaders_give_a_batch_of_the_same_structure():
    fresh = fresh_batches_of({"a": _loader(), "b": [_loader(), _loader()]}, seed=0, rank=1, owner="GrawaStrategy")
    batch = draw(fresh, 5)
    assert set(batch) == {"a", "b"} and len(batch["b"]) == 2
    assert batch["b"][0][0].shape == (B, 1)


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(N))


@pytest.mark.parametrize(
    ("loaders", "match"),
    [
        (DataLoader(_Stream(), batch_size=B), "map-style dataset.*_Stream"),
        (DataLoader(TensorDataset(torch.zeros(N)), batch_size=None), "batch size is None"),
        (iter(range(3)), "not a DataLoader"),
    ],
)
def test_training_data_it_cannot_draw_from_is_rejected_with_the_alternatives(loaders, match):
    with pytest.raises(ValueError, match=match) as info:
        fresh_batches_of(loaders, seed=0, rank=0, owner="GrawaStrategy")
    assert "probe='fresh'" in str(info.value) and "probe='batch' or probe='step'" in str(info.value)


def test_the_probe_runs_on_its_own_seed_and_leaves_the_training_streams_where_they_were():
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    with isolated_rng(11):
        inside = (torch.rand(3), random.random(), np.random.rand())
    after = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    assert torch.equal(after[0], torch.rand(3)) and after[1:] == (random.random(), np.random.rand())
    torch.manual_seed(11)
    assert torch.equal(inside[0], torch.rand(3))


def test_probe_and_seed_arguments_are_checked():
    assert GrawaStrategy().sync.norms.probe == "fresh"
    with pytest.raises(ValueError, match="`probe` must be one of 'fresh', 'batch', 'step', got 'own'"):
        GrawaStrategy(probe="own")
    with pytest.raises(ValueError, match="probe_seed"):
        GrawaStrategy(probe_seed=-1)
