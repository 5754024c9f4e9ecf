import pytest
import torch

from lightning_hier.algorithms import LocalSGD, PeriodicAveraging, PeriodicSchedule, UniformCenter


def test_schedule_fires_every_tau_steps_and_round_trips():
    s = PeriodicSchedule(3)
    fired = []
    for _ in range(7):
        if s.step():
            s.synced()
            fired.append(s.steps)
    assert fired == [3, 6]
    t = PeriodicSchedule(3)
    t.load_state_dict(s.state_dict())
    assert (t.steps, t.since_sync, t.rounds) == (7, 1, 2)
    with pytest.raises(ValueError, match="tau"):
        PeriodicSchedule(0)


def test_single_worker_is_a_no_op_that_still_counts_rounds():
    lin = torch.nn.Linear(3, 2)
    before = [p.detach().clone() for p in lin.parameters()]
    avg = LocalSGD(lin.parameters(), group=None, tau=2)
    assert [avg.step() is not None for _ in range(4)] == [False, True, False, True]
    assert avg.schedule.rounds == 2
    assert all(torch.equal(a, b) for a, b in zip(before, lin.parameters(), strict=True))
    with avg.consensus():
        pass


def test_state_round_trips_the_center_and_whether_the_replicas_are_equal():
    lin = torch.nn.Linear(3, 2)
    avg = PeriodicAveraging(lin.parameters(), None, UniformCenter(), tau=1, lam=0.5, rho=0.1)
    avg.step()  # a round with lam < 1: in a group the replicas would still differ
    state = avg.state_dict()
    assert state["replicas_equal"] is False and state["schedule"]["rounds"] == 1

    other = torch.nn.Linear(3, 2)
    restored = PeriodicAveraging(other.parameters(), None, UniformCenter(), tau=1, lam=0.5, rho=0.1)
    restored.load_state_dict(state)
    assert restored._replicas_equal is False and restored.schedule.steps == 1
    assert all(torch.equal(a, b) for a, b in zip(restored.center, avg.center, strict=True))
