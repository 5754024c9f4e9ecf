"""The rendezvous store listens on MASTER_ADDR only (here 127.0.0.1), not on every interface."""

from __future__ import annotations

import ipaddress
import json
import os
import socket
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import Callback

from tests.helpers import digits, digits_classifier, trainer

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
