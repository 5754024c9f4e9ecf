"""The DBS batch sampler: equal step counts, exact partitions of each global batch, DDP's data order."""

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    SequentialSampler,
    TensorDataset,
    WeightedRandomSampler,
)

from lightning_hier.algorithms.dbs_sampler import Allocation, DynamicBatchSampler, dynamic_batch_loader
from lightning_hier.algorithms.dbs_split import split_remainder

N = 103


def samplers(sizes: list[int], shuffle: bool = True, seed: int = 5) -> list[DynamicBatchSampler]:
    return [DynamicBatchSampler(N, Allocation(sizes, r), shuffle=shuffle, seed=seed) for r in range(len(sizes))]


def epoch(ranks: list[DynamicBatchSampler], index: int) -> list[list[list[int]]]:
    for s in ranks:
        s.set_epoch(index)
    return [list(s) for s in ranks]


@pytest.mark.parametrize("sizes", [[5, 11], [8, 8], [1, 7, 3, 13]])
def test_every_rank_runs_the_same_steps_and_each_step_partitions_one_global_batch(sizes):
    ranks = samplers(sizes)
    batches = epoch(ranks, 0)
    total = sum(sizes)
    assert [len(b) for b in batches] == [N // total] * len(sizes) == [len(s) for s in ranks]
    order = torch.randperm(N, generator=torch.Generator().manual_seed(5)).tolist()
    for step in range(N // total):
        joined = [i for rank in range(len(sizes)) for i in batches[rank][step]]
        assert joined == order[step * total : (step + 1) * total]  # rank slices in rank order
        assert [len(batches[r][step]) for r in range(len(sizes))] == sizes


def test_global_batches_hold_the_same_samples_as_ddp_with_distributed_sampler():
    world, per_rank, seed = 2, 8, 3
    ddp = [
        list(BatchSampler(DistributedSampler(range(N), world, r, shuffle=True, seed=seed), per_rank, True))
        for r in range(world)
    ]
    dbs = epoch(samplers([11, 5], seed=seed), 0)
    assert len(dbs[0]) == len(ddp[0])
    for step in range(len(dbs[0])):
        assert sorted(dbs[0][step] + dbs[1][step]) == sorted(ddp[0][step] + ddp[1][step])


def test_set_epoch_gives_a_new_order_and_the_same_epoch_repeats_it():
    ranks = samplers([4, 6])
    first, second, again = epoch(ranks, 0), epoch(ranks, 1), epoch(ranks, 0)
    assert first != second and first == again
    assert ranks[0].sampler is ranks[0]  # the alias Lightning uses to reach set_epoch
    sequential = epoch(samplers([4, 6], shuffle=False), 3)
    assert sequential[0][0] == [0, 1, 2, 3] and sequential[1][0] == [4, 5, 6, 7, 8, 9]


def test_a_new_split_applies_to_batches_not_yet_drawn():
    alloc = Allocation([5, 5], rank=1)
    it = iter(DynamicBatchSampler(N, alloc, shuffle=False))
    drawn = [next(it), next(it)]
    with pytest.raises(ValueError, match="already drawn"):
        alloc.update([7, 3], effective_from=1)
    alloc.update([7, 3], effective_from=alloc.drawn)
    drawn += list(it)
    assert drawn[:2] == [[5, 6, 7, 8, 9], [15, 16, 17, 18, 19]]  # rank 1, old split
    assert drawn[2] == [27, 28, 29]  # step 2: the slice after rank 0's 7 samples
    assert len(drawn) == N // 10
    assert [alloc.consume_share()[0] for _ in range(3)] == [5, 5, 3]  # sizes in the order the batches were drawn
    assert alloc.sizes_at(0) == [5, 5] and alloc.sizes_at(2) == [7, 3]
    next(iter(DynamicBatchSampler(N, alloc)))  # a new epoch starts with the newest split
    assert alloc.sizes_at(0) == [7, 3]


@pytest.mark.parametrize("sizes", [[5, 11], [8, 8], [1, 7, 3, 13]])
def test_drop_last_false_adds_one_smaller_global_batch_split_by_the_same_shares(sizes):
    total = sum(sizes)
    ranks = [DynamicBatchSampler(N, Allocation(sizes, r), seed=5, drop_last=False) for r in range(len(sizes))]
    batches = epoch(ranks, 0)
    full, rest = divmod(N, total)
    assert rest and [len(b) for b in batches] == [full + 1] * len(sizes) == [len(s) for s in ranks]
    order = torch.randperm(N, generator=torch.Generator().manual_seed(5)).tolist()
    last = split_remainder(rest, sizes)
    shares = [s.allocation.consume_share() for s in ranks for _ in range(full)]
    assert all(share == (b, total) for share, b in zip(shares, [b for b in sizes for _ in range(full)], strict=True))
    assert [s.allocation.consume_share() for s in ranks] == [(r, rest) for r in last]
    joined = [i for rank in range(len(sizes)) if last[rank] for i in batches[rank][full]]
    assert joined == order[full * total :]  # the samples left, each used once
    for rank in range(len(sizes)):
        if last[rank] == 0:  # no share: a stand-in sample (weight 0) keeps the step counts equal
            assert batches[rank][full] == [order[full * total]]


def test_drop_last_false_trains_a_dataset_smaller_than_one_global_batch():
    alloc = Allocation([20, 4], rank=1)
    sampler = DynamicBatchSampler(10, alloc, shuffle=False, drop_last=False)
    assert list(sampler) == [[8, 9]] and alloc.consume_share() == (2, 10)
    with pytest.raises(ValueError, match="has 10 samples, fewer than one global batch of 24, and drop_last=True"):
        DynamicBatchSampler(10, alloc, drop_last=True)
    with pytest.raises(ValueError, match="has 0 samples"):
        DynamicBatchSampler(0, alloc, drop_last=False)


@pytest.mark.parametrize("drop_last", [True, False])
def test_the_loader_drop_last_reaches_the_sampler(drop_last):
    loader = DataLoader(_dataset(), batch_size=4, drop_last=drop_last)
    new = dynamic_batch_loader(loader, Allocation([3, 5], rank=0), seed=0)
    assert new.batch_sampler.drop_last is drop_last and len(new) == N // 8 + (0 if drop_last else 1)


def test_allocation_checks():
    alloc = Allocation([5, 5], rank=0)
    with pytest.raises(RuntimeError, match="did not draw"):
        alloc.consume_share()
    with pytest.raises(ValueError, match="not a split of 10"):
        alloc.update([6, 5], 0)
    with pytest.raises(ValueError, match=">= 1"):
        Allocation([4, 0], rank=0)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        DynamicBatchSampler(9, alloc)


def _dataset() -> TensorDataset:
    return TensorDataset(torch.arange(N, dtype=torch.float32).unsqueeze(1), torch.arange(N))


def _collate(batch: list) -> torch.Tensor:
    return torch.stack([y for _, y in batch])


@pytest.mark.parametrize(
    ("loader", "shuffled", "seed"),
    [
        (DataLoader(_dataset(), batch_size=4, shuffle=False, collate_fn=_collate), False, 9),
        (DataLoader(_dataset(), batch_size=4, shuffle=True, collate_fn=_collate), True, 9),
        (DataLoader(_dataset(), sampler=DistributedSampler(_dataset(), 2, 0, seed=4), collate_fn=_collate), True, 4),
    ],
)
def test_an_ordinary_dataloader_is_rebuilt_around_the_sampler(loader, shuffled, seed):
    new = dynamic_batch_loader(loader, Allocation([3, 5], rank=1), seed=9)
    sampler = new.batch_sampler
    assert isinstance(sampler, DynamicBatchSampler)
    assert (sampler.shuffle, sampler.seed) == (shuffled, seed)
    assert new.collate_fn is _collate and new.dataset is loader.dataset
    first = next(iter(new))
    assert first.shape == (5,)  # rank 1's share, collated by the user's collate_fn
    assert dynamic_batch_loader(new, Allocation([3, 5], rank=1), seed=0) is new


class _Stream(IterableDataset):
    def __iter__(self):
        yield from range(10)


class _Pairs(BatchSampler):
    pass


@pytest.mark.parametrize(
    ("loader", "match"),
    [
        (DataLoader(_Stream(), batch_size=2), "map-style dataset"),
        (DataLoader(_dataset(), sampler=WeightedRandomSampler([1.0] * N, N)), "sampler WeightedRandomSampler"),
        (DataLoader(_dataset(), batch_sampler=_Pairs(SequentialSampler(range(N)), 2, False)), "batch sampler _Pairs"),
    ],
)
def test_loaders_dbs_cannot_honour_are_rejected_clearly(loader, match):
    with pytest.raises(TypeError, match=match):
        dynamic_batch_loader(loader, Allocation([3, 5], rank=0), seed=0)


def test_an_epoch_resumed_mid_way_draws_every_later_batch_with_the_split_it_had():
    # a DataLoader with workers draws batches ahead: the rebalance after step 3 applies from batch 5,
    # so batches 3 and 4 (drawn, not yet trained at the checkpoint after step 3) keep the old split
    alloc = Allocation([5, 5], rank=0)
    sampler = DynamicBatchSampler(N, alloc, seed=2)
    sampler.set_epoch(1)
    it = iter(sampler)
    drawn = [next(it) for _ in range(5)]
    alloc.update([7, 3], effective_from=alloc.drawn)
    rest = drawn[3:] + list(it)
    saved = alloc.segments()
    assert saved == [(0, [5, 5]), (5, [7, 3])]

    resumed = Allocation([7, 3], rank=0)  # the checkpoint's newest split, as DynamicBatchSize.bind makes it
    resumed.resume_segments(saved)
    again = DynamicBatchSampler(N, resumed, seed=2)
    again.resume_at(1, 3)
    again.set_epoch(2)  # ignored: the resume position wins for this iteration
    assert list(again) == rest
    assert [len(b) for b in rest[:3]] == [5, 5, 7]
    assert resumed.segments() == saved and [len(b) for b in list(again)[:1]] == [7]  # a new iteration: the newest split
