"""The FailureBoard's watchdog ends a rank whose job cannot finish, and its report names the right ranks."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from lightning_hier.comm import FailureBoard
from lightning_hier.comm.failures import Parent
from tests.helpers import process_alive

_FORK = mp.get_context("fork")


def _host_store(conn: mp.connection.Connection) -> None:
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    conn.send(store.port)
    time.sleep(600)


def test_a_rank_whose_store_is_gone_ends_itself_after_the_grace_period():
    reader, writer = _FORK.Pipe(duplex=False)
    host = _FORK.Process(target=_host_store, args=(writer,), daemon=True)
    host.start()
    try:
        store = dist.TCPStore("127.0.0.1", reader.recv(), 2, is_master=False, timeout=timedelta(seconds=5))
        board = FailureBoard(store, rank=1, world_size=2, prefix="t", grace_s=0.2, poll_s=0.1, store_grace_s=1.0)
        ended: list[str] = []
        done = threading.Event()
        board.start_watchdog(terminate=lambda why: (ended.append(why), done.set()))
        time.sleep(1.0)
        assert not ended  # a reachable store is no reason to end
        os.kill(host.pid, signal.SIGKILL)  # rank 0's process, which hosts the store, dies
        assert done.wait(30), "the watchdog did not end the rank"
        assert "rendezvous store has been unreachable for 1 s" in ended[0] and "rank 1" in ended[0]
    finally:
        host.kill()
        host.join()


def _orphan_a_hung_rank(conn: mp.connection.Connection) -> None:
    """The launching process: starts a rank that hangs, then dies (as a killed rank 0 of popen does)."""
    launcher = os.getpid()
    child = os.fork()
    if child == 0:  # the rank: a watchdog watching its launcher, then stuck outside any collective
        try:
            board = FailureBoard(dist.HashStore(), rank=1, world_size=2, prefix="t", grace_s=0.2, poll_s=0.1)
            board.start_watchdog(parent=Parent(launcher, "rank 0"))
            time.sleep(600)
        finally:
            os._exit(0)
    conn.send(child)
    os._exit(0)


def test_a_rank_whose_launcher_died_ends_itself():
    reader, writer = _FORK.Pipe(duplex=False)
    launcher = _FORK.Process(target=_orphan_a_hung_rank, args=(writer,))
    launcher.start()
    rank = reader.recv()
    launcher.join()
    deadline = time.monotonic() + 30
    while process_alive(rank) and time.monotonic() < deadline:
        time.sleep(0.1)
    if process_alive(rank):
        os.kill(rank, signal.SIGKILL)
        raise AssertionError("the orphaned rank outlived its launcher by 30 s")


def test_the_reporting_rank_is_not_counted_as_silent():
    # rank 1 could not even write its own report (the store went away with rank 0)
    board = FailureBoard(dist.HashStore(), rank=1, world_size=3, prefix="t")
    text = board.describe({})
    assert "No failure report from rank(s) [0, 2]" in text
    board.report("RuntimeError: connection reset")
    assert "No failure report from rank(s) [0, 2]" in board.describe(board.reports())


def _launch_a_rank_on_a_store(port: int, out: str, conn: mp.connection.Connection) -> None:
    """The launching process: starts a rank watching it and a remote store, then waits to be killed."""
    launcher = os.getpid()
    child = os.fork()
    if child == 0:  # the rank: writes the watchdog's reason to `out` instead of printing it
        try:
            store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=5))
            board = FailureBoard(store, rank=1, world_size=2, prefix="t", grace_s=0.2, poll_s=0.1, store_grace_s=2.0)
            ended = threading.Event()

            def record(why: str) -> None:
                with open(out, "w") as f:
                    f.write(why)
                ended.set()

            board.start_watchdog(terminate=record, parent=Parent(launcher, "rank 0"))
            ended.wait(60)
        finally:
            os._exit(0)
    conn.send(child)
    time.sleep(600)


def test_a_launcher_that_dies_while_the_store_is_lost_is_named(tmp_path):
    """The store goes first, the launcher during the store's grace period: the launcher is the cause named.

    Under popen the store lives in rank 0, which also launched the other ranks, so both go at
    once and the watchdog may see either first; the launcher's death is the precise cause.
    """
    reader, writer = _FORK.Pipe(duplex=False)
    host = _FORK.Process(target=_host_store, args=(writer,), daemon=True)
    host.start()
    out = tmp_path / "why.txt"
    ranks, rank_writer = _FORK.Pipe(duplex=False)
    launcher = _FORK.Process(target=_launch_a_rank_on_a_store, args=(reader.recv(), str(out), rank_writer))
    launcher.start()
    rank = ranks.recv()
    try:
        time.sleep(1.0)  # the rank's watchdog is watching
        os.kill(host.pid, signal.SIGKILL)  # the store is lost: the watchdog waits its 2 s grace
        time.sleep(0.5)
        os.kill(launcher.pid, signal.SIGKILL)  # ... during which the launcher dies
        deadline = time.monotonic() + 30
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "rank 0 (PID" in out.read_text() and "which launched it, is gone" in out.read_text()
    finally:
        for p in (host, launcher):
            p.kill()
            p.join()
        if process_alive(rank):
            os.kill(rank, signal.SIGKILL)
