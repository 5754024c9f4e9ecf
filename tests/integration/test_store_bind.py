"""The rendezvous store listens on MASTER_ADDR only (here 127.0.0.1), not on every interface."""

from __future__ import annotations

import ipaddress
import json
import multiprocessing as mp
import os
import signal
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import Callback

from lightning_hier.comm.rendezvous import StoreApart
from tests.helpers import digits, digits_classifier, process_alive, trainer

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp*


def listening_addresses(port: int) -> list[str]:
    """Local addresses of the sockets listening on TCP ``port`` (from /proc/net/tcp and tcp6)."""
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == _LISTEN and int(hex_port, 16) == port:
                raw = bytes.fromhex(address)
                # the kernel prints each 32-bit word in host (little-endian) order
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                found.append(str(ipaddress.ip_address(socket.inet_ntop(family, words))))
    return found


class RecordStoreListeners(Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if trainer.global_rank == 0:  # rank 0 hosts the store
            port = int(os.environ["MASTER_PORT"])
            self.out.write_text(json.dumps({"addr": os.environ["MASTER_ADDR"], "listen": listening_addresses(port)}))


@pytest.mark.parametrize("strategy", ["hpsgd_fork", "ddp_post_local_sgd_fork"])
def test_the_store_listens_on_master_addr_only(strategy, tmp_path):
    out = tmp_path / "listeners.json"
    trainer(strategy=strategy, max_steps=2, callbacks=[RecordStoreListeners(out)]).fit(
        digits_classifier(), datamodule=digits(batch_size=64)
    )
    seen = json.loads(out.read_text())
    assert seen["addr"] == "127.0.0.1"
    assert seen["listen"] == ["127.0.0.1"]


def test_a_store_apart_is_hosted_by_another_process_on_the_address_only_and_ends_with_close():
    store = StoreApart("127.0.0.1", timedelta(seconds=30))
    try:
        assert store.pid != os.getpid()
        store.client().set("key", "value")  # waits until the host serves
        assert store.client().get("key") == b"value"
        assert listening_addresses(store.port) == ["127.0.0.1"]
    finally:
        store.close()
    assert not process_alive(store.pid)


def test_a_store_apart_ends_when_the_process_that_made_it_is_killed():
    def launcher(conn: Any) -> None:
        conn.send(StoreApart("127.0.0.1", timedelta(seconds=30)).pid)
        time.sleep(3600)

    reader, writer = mp.get_context("fork").Pipe(duplex=False)
    child = mp.get_context("fork").Process(target=launcher, args=(writer,))
    child.start()
    host = reader.recv()
    os.kill(child.pid, signal.SIGKILL)  # no close(): the host notices its parent is gone
    child.join()
    deadline = time.monotonic() + 10
    while process_alive(host) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not process_alive(host)
