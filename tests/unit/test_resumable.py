"""Samplers that resume mid-epoch, and the data position strategies save and restore."""

import math

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler, TensorDataset

from lightning_hier.resumable import SkippingSampler
from lightning_hier.strategies._data_position import DataPosition, resumable_sampler

N, BATCH = 103, 8


def _loader(drop_last: bool = False, sampler=None) -> DataLoader:
    data = TensorDataset(torch.arange(N))
    sampler = sampler if sampler is not None else DistributedSampler(data, num_replicas=2, rank=1, seed=4)
    return DataLoader(data, batch_size=BATCH, sampler=sampler, drop_last=drop_last)


def _epoch(loader: DataLoader, epoch: int | None = None) -> list[list[int]]:
    if epoch is not None:
        loader.sampler.set_epoch(epoch)  # what Lightning does, on the loader's own sampler
        loader.batch_sampler.sampler.set_epoch(epoch)  # and on the batch sampler's
    return [b[0].tolist() for b in loader]


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_resumed_iteration_continues_the_epoch_where_it_stopped(drop_last):
    reference = _loader(drop_last)
    whole = {e: _epoch(reference, e) for e in (2, 3)}
    assert whole[2] != whole[3] and len(whole[2][-1]) == (BATCH if drop_last else 52 % BATCH)

    loader = _loader(drop_last)
    position = DataPosition()
    position.install(loader)
    assert isinstance(loader.batch_sampler.sampler, SkippingSampler) and len(loader) == len(reference)
    position.restore({"epoch": 2, "batches": 5})
    # Lightning's set_epoch after a max_steps resume is one ahead: the pending position wins
    assert _epoch(loader, 3) == whole[2][5:]
    assert _epoch(loader, 3) == whole[3]  # later iterations follow set_epoch again


def test_the_position_is_recorded_per_batch_and_moves_to_the_next_epoch_at_its_end():
    position = DataPosition()
    assert position.state_dict(11) is None
    position.batch_started(epoch=1, batch_idx=4)
    assert position.state_dict(11) == {"epoch": 1, "batches": 5}
    position.batch_started(epoch=1, batch_idx=10)
    assert position.state_dict(11) == {"epoch": 2, "batches": 0}
    assert position.state_dict(math.inf) == {"epoch": 1, "batches": 11}
    restored = DataPosition()
    restored.restore({"epoch": 3, "batches": 2})
    assert restored.state_dict(11) == {"epoch": 3, "batches": 2}  # saved again before any batch trained


def test_a_position_restored_before_the_loader_exists_is_handed_over_when_it_is_installed():
    loader, reference = _loader(), _loader()
    position = DataPosition()
    position.restore({"epoch": 1, "batches": 3})
    position.install(loader)
    assert _epoch(loader) == _epoch(reference, 1)[3:]


def test_a_position_is_handed_over_once_not_again_to_a_reloaded_loader():
    position = DataPosition()
    position.restore({"epoch": 1, "batches": 3})
    position.install(_loader())
    reloaded, reference = _loader(), _loader()  # reload_dataloaders_every_n_epochs builds a new one
    position.install(reloaded)
    assert _epoch(reloaded, 2) == _epoch(reference, 2)
    assert position.state_dict(11) == {"epoch": 1, "batches": 3}  # nothing trained since the restore


def test_an_epoch_start_overrides_a_wrong_set_epoch():
    loader, reference = _loader(), _loader()
    position = DataPosition()
    position.install(loader)
    loader.batch_sampler.sampler.set_epoch(5)  # Lightning's value, one ahead after a max_steps resume
    position.epoch_started(4)  # trainer.current_epoch, from the strategy's callback
    assert _epoch(loader) == _epoch(reference, 4)


def test_only_samplers_whose_order_is_a_function_of_the_epoch_are_resumed():
    assert resumable_sampler(_loader(sampler=SequentialSampler(range(N)))) is not None
    assert resumable_sampler(_loader(sampler=RandomSampler(range(N)))) is None  # draws from the global RNG
    assert resumable_sampler([1, 2, 3]) is None
    loader = _loader()
    assert resumable_sampler(loader) is resumable_sampler(loader)  # wrapped once


def test_resume_at_rejects_negative_positions():
    with pytest.raises(ValueError, match="cannot resume at epoch -1"):
        SkippingSampler(SequentialSampler(range(3)), 1).resume_at(-1, 0)
