"""Parcels between neighbours: shapes and dtypes unknown to the receiver, growth, empty messages."""

import time
from collections.abc import Callable
from datetime import timedelta
from functools import partial

import pytest
import torch
import torch.distributed as dist

from lightning_hier.comm import CommStats, Mailbox, Parcel, PeerError
from lightning_hier.comm.p2p import HEADER_BYTES
from lightning_hier.layers.collectives import exchange
from lightning_hier.layers.context import GridContext
from lightning_hier.testing import run_workers

ROWS = [4, 4, 7, 2, 0, 9, 3]  # 0: an empty message


def _parcel(i: int, rank: int, rows: int) -> Parcel | None:
    if rows == 0:
        return None
    x = torch.arange(rows * 3, dtype=torch.float32).view(rows, 3) + 100 * rank + i
    return Parcel((x, torch.arange(rows) * (rank + 1), x[:, :1].to(torch.bfloat16) > 0), tag=10 * i + rank, value=i / 4)


def _swap() -> dict:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    peer = 1 - rank
    stats = CommStats()
    box = Mailbox(None, torch.device("cpu"), stats)
    got, sizes = [], []
    for i, rows in enumerate(ROWS):
        parcel = box.exchange({peer: _parcel(i, rank, rows)}, [peer])[peer]
        got.append(None if parcel is None else (parcel.tag, parcel.value, [t.clone() for t in parcel.tensors]))
        sizes.append(box._recv[peer].buffer.numel())
    if rank == 0:
        box.send(1, Parcel((torch.ones(2, 2, dtype=torch.float64),), tag=-3, value=float("inf")))
    else:
        one_way = box.recv(0)
        assert one_way is not None
        got.append((one_way.tag, one_way.value, list(one_way.tensors)))
    return {"got": got, "sizes": sizes, "bytes": stats.bytes}


def test_parcels_arrive_intact_and_buffers_only_grow():
    out = run_workers(_swap, devices=2)
    for rank, o in enumerate(out):
        peer = 1 - rank
        for i, rows in enumerate(ROWS):
            want = _parcel(i, peer, rows)
            if want is None:
                assert o["got"][i] is None
                continue
            tag, value, tensors = o["got"][i]
            assert (tag, value) == (want.tag, want.value)
            for a, b in zip(tensors, want.tensors, strict=True):
                assert a.dtype == b.dtype and torch.equal(a, b)
        assert o["sizes"] == sorted(o["sizes"]) and o["sizes"][0] > HEADER_BYTES
        assert o["bytes"] > 0
    assert out[1]["got"][-1][:2] == (-3, float("inf"))


def test_unsupported_parcels_fail_before_sending():
    box = Mailbox(None, torch.device("cpu"))
    with pytest.raises(TypeError, match="cannot be sent"):
        box.exchange({1: Parcel((torch.zeros(2, dtype=torch.complex64),))}, ())
    with pytest.raises(ValueError, match="at most 3 tensors"):
        box.exchange({1: Parcel(tuple(torch.zeros(1) for _ in range(4)))}, ())


def _mailbox_receive() -> None:
    Mailbox(None, torch.device("cpu"), CommStats(), timeout=timedelta(seconds=1)).recv(1)


def _halo_receive() -> None:
    grid = GridContext(pr=2, model_group=dist.group.WORLD, model_ranks=(0, 1), timeout=timedelta(seconds=1))
    exchange([], [(torch.empty(4), 1)], grid, "halo")


def _silent_neighbour(receive: Callable[[], None]) -> tuple[BaseException, float] | None:
    # the group's own limit is long (as after start-up with init_timeout); the receive's is 1 s
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 1:  # alive, but never sends: a hung neighbour
        store.wait(["done"], timedelta(seconds=120))
        return None
    start = time.monotonic()
    try:
        receive()
    except RuntimeError as err:
        return err, time.monotonic() - start
    finally:
        store.set("done", "1")
    return None


def test_a_silent_neighbour_fails_the_mailbox_within_its_timeout_and_is_named():
    err, waited = run_workers(partial(_silent_neighbour, _mailbox_receive), devices=2, timeout=90)[0]
    assert isinstance(err, PeerError) and err.peers == (1,)
    assert "rank 0" in str(err) and "receive from rank 1" in str(err) and "rank(s) [1] did not answer" in str(err)
    assert waited < 30, f"waited {waited:.1f} s for a 1 s timeout"


def test_a_silent_neighbour_fails_a_grid_halo_exchange_within_its_timeout():
    err, waited = run_workers(partial(_silent_neighbour, _halo_receive), devices=2, timeout=90)[0]
    assert "timed out" in str(err).lower()
    assert waited < 30, f"waited {waited:.1f} s for a 1 s timeout"


def _lazy_chain() -> dict:
    """The decoupled pipeline's ``ddg`` pattern: each round rank 1 waits on a blocking receive from rank 0, then
    leaves a growing parcel in flight (a second message follows its header); rank 0 sends, then takes rank 1's
    parcel of the previous round. A parcel's second message must not wait for the receiver's next take."""
    from lightning_hier.comm import Inbox

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    box = Mailbox(None, torch.device("cpu"), timeout=timedelta(seconds=10))
    got = []
    inbox = Inbox(box, 1)
    for i, rows in enumerate([2, 50, 400, 400]):
        if rank == 1:
            got.append(int(box.recv(0).tensors[0].shape[0]))  # blocking
            box.send_later(0, _parcel(i, 1, rows))  # waited for before the link is written again, next round
        else:
            box.send(1, Parcel((torch.zeros(i + 1),)))
            parcel = inbox.take()  # the previous round's parcel; posts this round's receive
            got.append(None if parcel is None else (parcel.tag, parcel.tensors[0].shape[0]))
    if rank == 0:
        last = inbox.settle()
        assert last is not None
        got.append((last.tag, last.tensors[0].shape[0]))
    else:
        box.flush()
    return {"got": got, "pending": inbox.pending}


def test_sends_left_in_flight_complete_while_both_ranks_go_on_with_blocking_messages():
    out = run_workers(_lazy_chain, devices=2, timeout=60)
    assert out[0]["got"] == [None, (1, 2), (11, 50), (21, 400), (31, 400)]
    assert out[1]["got"] == [1, 2, 3, 4]
    assert not out[0]["pending"]


def _two_mailboxes() -> list:
    dist.init_process_group("gloo")
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    train = Mailbox(None, torch.device("cpu"), tag=0)
    evaluation = Mailbox(None, torch.device("cpu"), tag=1)
    posted = train.post({}, [peer])  # a training receive stays posted while evaluation talks
    got = evaluation.exchange({peer: Parcel((torch.full((3,), 7.0 + rank),))}, [peer])[peer]
    train.send_later(peer, Parcel((torch.full((2,), 1.0 + rank),)))
    trained = posted.wait()[peer]
    train.flush()
    assert got is not None and trained is not None
    return [got.tensors[0].tolist(), trained.tensors[0].tolist()]


def test_a_mailboxs_tag_keeps_its_messages_from_another_mailbox_on_the_same_peers():
    out = run_workers(_two_mailboxes, devices=2, timeout=60)
    assert out[0] == [[8.0] * 3, [2.0] * 2]
    assert out[1] == [[7.0] * 3, [1.0] * 2]
