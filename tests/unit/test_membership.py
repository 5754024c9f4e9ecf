"""The live membership protocol on a real TCPStore, each replica a thread: agreement, deaths, joins, votes."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_hier.comm.membership import Decision, JobLost, JoinRefused, Membership, replica_store

TIMEOUT = timedelta(seconds=20)


@pytest.fixture
def store_port():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    yield store.port
    del store


def _member(port: int, prefix: str, replica: int, replicas: int = 3, dead_after_s: float = 0.5) -> Membership:
    store = replica_store("127.0.0.1", port, prefix, TIMEOUT)
    membership = Membership(store, replica, replicas, TIMEOUT, heartbeat_s=0.05, dead_after_s=dead_after_s)
    membership.start(replica_store("127.0.0.1", port, prefix, TIMEOUT))
    return membership


def _together(calls: list[Callable[[], Any]]) -> list[Any]:
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result(timeout=30) for f in [pool.submit(c) for c in calls]]


def test_every_replica_gets_the_same_decision(store_port):
    prefix = uuid.uuid4().hex
    members = [_member(store_port, prefix, r) for r in range(3)]
    decisions = _together([lambda m=m: m.agree("0.0", (0, 1, 2), admit=True) for m in members])
    assert decisions == [Decision("0.0", (0, 1, 2), ())] * 3
    for m in members:
        m.stop()


def test_a_replica_that_stops_beating_is_dropped_after_dead_after_s(store_port):
    prefix = uuid.uuid4().hex
    members = [_member(store_port, prefix, r) for r in range(3)]
    members[2].stop()  # dead: no heartbeat, never arrives
    started = time.monotonic()
    decisions = _together([lambda m=m: m.agree("1.0", (0, 1, 2), admit=False) for m in members[:2]])
    waited = time.monotonic() - started
    assert decisions[0] == decisions[1] and decisions[0].members == (0, 1)
    assert waited >= 0.5  # at least dead_after_s of silence before it is declared dead
    for m in members[:2]:
        m.stop()


def test_a_late_replica_reads_the_decision_made_without_it(store_port):
    prefix = uuid.uuid4().hex
    a, b = _member(store_port, prefix, 0, 2), _member(store_port, prefix, 1, 2)
    b.stop()
    first = a.agree("0.0", (0, 1), admit=False)
    assert first.members == (0,)
    assert b.agree("0.0", (0, 1), admit=False) == first  # it may not change what was decided
    a.stop()


def test_a_restarted_replica_is_not_waited_for_and_is_admitted_after_the_commit(store_port):
    prefix = uuid.uuid4().hex
    members = [_member(store_port, prefix, r) for r in range(2)]
    restarted = Membership(replica_store("127.0.0.1", store_port, prefix, TIMEOUT), 2, 3, TIMEOUT, 0.05, 0.5)
    restarted.ask_to_join(incarnation=1)
    restarted.start(replica_store("127.0.0.1", store_port, prefix, TIMEOUT))
    started = time.monotonic()
    decisions = _together([lambda m=m: m.agree("3.0", (0, 1, 2), admit=True) for m in members])
    assert time.monotonic() - started < 0.5  # it asked to join: nobody waits for the replica it was
    assert decisions == [Decision("3.0", (0, 1), (2,))] * 2
    assert decisions[0].world == (0, 1, 2)
    members[0].admit(decisions[0])
    assert restarted.wait_admission(1, deadline_s=5) == decisions[0]
    for m in [*members, restarted]:
        m.stop()


def test_a_joiner_gives_up_when_training_finished(store_port):
    prefix = uuid.uuid4().hex
    a = _member(store_port, prefix, 0, 2)
    a.finished()
    late = _member(store_port, prefix, 1, 2)
    late.ask_to_join(1)
    with pytest.raises(JoinRefused, match="finished"):
        late.wait_admission(1, deadline_s=5)
    with pytest.raises(JoinRefused, match=r"within 0\.1 s"):
        _member(store_port, uuid.uuid4().hex, 1, 2).wait_admission(1, deadline_s=0.1)
    a.stop()
    late.stop()


def test_joiners_with_no_live_replica_left_fail_within_dead_after_s_and_so_does_every_later_one(store_port):
    prefix = uuid.uuid4().hex
    gone = _member(store_port, prefix, 0, 3)
    gone.stop()  # the last replica that trained dies; the two others are restarts waiting to join
    joiners = [_member(store_port, prefix, r, 3) for r in (1, 2)]
    for j in joiners:
        j.ask_to_join(1)
    started = time.monotonic()
    with pytest.raises(JobLost, match="every replica failed at once"):
        joiners[0].wait_admission(1, deadline_s=10)
    assert time.monotonic() - started < 2.0  # dead_after_s (0.5 s), not the admission deadline
    started = time.monotonic()
    with pytest.raises(JobLost):
        joiners[1].wait_admission(1, deadline_s=10)  # the run is marked lost: at once
    assert time.monotonic() - started < 0.2
    for j in joiners:
        j.stop()


def test_a_round_commits_only_when_every_member_votes_yes(store_port):
    prefix = uuid.uuid4().hex
    members = [_member(store_port, prefix, r) for r in range(3)]
    assert _together([lambda m=m: m.vote("0.0", True, (0, 1, 2)) for m in members]) == [True] * 3
    assert _together([lambda m=m, r=r: m.vote("1.0", r != 1, (0, 1, 2)) for r, m in enumerate(members)]) == [False] * 3
    members[2].stop()  # died before voting
    assert _together([lambda m=m: m.vote("2.0", True, (0, 1, 2)) for m in members[:2]]) == [False] * 2
    for m in members[:2]:
        m.stop()


def test_form_world_builds_a_gloo_group_of_the_world_in_its_order(store_port):
    prefix = uuid.uuid4().hex
    members = {r: _member(store_port, prefix, r) for r in (0, 2)}
    world = (2, 0)  # members first, then joiners: the order is the rank order

    def reduce(replica: int) -> tuple[int, float]:
        group = members[replica].form_world(world, "5.0")
        value = torch.tensor([float(replica + 1)])
        dist.all_reduce(value, group=group)
        return group.rank(), float(value)

    assert _together([lambda r=r: reduce(r) for r in (0, 2)]) == [(1, 4.0), (0, 4.0)]
    event = dict(members[0].events[-1])
    assert abs(event.pop("at") - time.time()) < 30
    assert event == {"point": "5.0", "step": None, "world": [2, 0], "left": [], "joined": []}
    for m in members.values():
        m.stop()


def test_bad_replica_identity_is_refused(store_port):
    with pytest.raises(ValueError, match=r"`replica` must be in \[0, 2\), got 2"):
        Membership(replica_store("127.0.0.1", store_port, "x", TIMEOUT), 2, 2, TIMEOUT)


def test_heartbeats_stop_with_stop(store_port):
    prefix = uuid.uuid4().hex
    m = _member(store_port, prefix, 0, 1)
    m.stop()
    time.sleep(0.2)
    store = replica_store("127.0.0.1", store_port, prefix, TIMEOUT)
    before = store.add("hb/0", 0)
    time.sleep(0.2)
    assert store.add("hb/0", 0) == before
    assert not any(t.name == "lightning-hier-heartbeat-0" and t.is_alive() for t in threading.enumerate())
