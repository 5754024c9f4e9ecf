import pytest
import torch

from lightning_hier.comm import FlatTensors


def test_tensors_become_views_of_one_bucket_and_keep_their_values():
    lin = torch.nn.Linear(4, 3)
    before = [p.detach().clone() for p in lin.parameters()]
    flat = FlatTensors(list(lin.parameters()))
    assert len(flat.buckets) == 1 and flat.numel == 15
    assert all(torch.equal(a, b) for a, b in zip(before, lin.parameters(), strict=True))
    flat.buckets[0].fill_(2.0)
    assert torch.all(lin.weight == 2.0) and torch.all(lin.bias == 2.0)
    assert flat.is_aliased()


def test_identity_of_parameters_is_kept_for_optimizers():
    lin = torch.nn.Linear(4, 3)
    ids = [id(p) for p in lin.parameters()]
    opt = torch.optim.SGD(lin.parameters(), lr=1.0)
    FlatTensors(list(lin.parameters()))
    lin(torch.ones(2, 4)).sum().backward()
    opt.step()
    assert [id(p) for p in lin.parameters()] == ids


def test_bucket_bound_and_dtypes_split_buckets():
    a, b, c = torch.zeros(10), torch.zeros(10), torch.zeros(3, dtype=torch.float64)
    flat = FlatTensors([a, b, c], bucket_bytes=48)
    assert [x.numel() for x in flat.buckets] == [10, 10, 3]
    assert flat.segment_indices(1) == [1]
    assert flat.nbytes == 20 * 4 + 3 * 8


def test_split_copy_and_clone():
    ts = [torch.arange(3.0), torch.arange(4.0).view(2, 2)]
    flat = FlatTensors(ts)
    snap = flat.clone()
    views = flat.split(snap)
    assert torch.equal(views[1], torch.arange(4.0).view(2, 2))
    flat.buckets[0].zero_()
    flat.copy_(snap)
    assert torch.equal(ts[0], torch.arange(3.0))
    with pytest.raises(ValueError, match="do not match"):
        flat.copy_([torch.zeros(2)])


def test_moving_a_module_breaks_aliasing_detectably():
    lin = torch.nn.Linear(2, 2)
    flat = FlatTensors(list(lin.parameters()))
    lin.double()
    assert not flat.is_aliased()


def test_bad_bucket_size():
    with pytest.raises(ValueError, match="bucket_bytes"):
        FlatTensors([torch.zeros(1)], bucket_bytes=0)
