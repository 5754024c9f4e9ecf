"""Host a coordination ``TCPStore`` on an inherited listening socket until the launching process ends.

The fork / spawn launcher of a fault-tolerant run keeps the replicas' store out of its own process
(:class:`lightning_hier.comm.rendezvous.StoreApart`): a store hosted there runs a server
thread that resolves each connecting client's address (``getnameinfo``), and a replica forked
while that thread holds glibc's resolver lock inherits the lock held by a thread it does not
have, and deadlocks in its own first store connection. The launcher runs this file by its path,
so the process imports torch alone, not the package (and Lightning)::

    python _store_host.py FD ADDRESS PORT PARENT_PID TIMEOUT_S
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch.distributed as dist

POLL_S = 0.2


def main(argv: list[str]) -> int:
    """Serve until the parent (the launcher) is gone; the launcher ends this process with SIGTERM first."""
    fd, address, port, parent, timeout_s = int(argv[0]), argv[1], int(argv[2]), int(argv[3]), float(argv[4])
    store = dist.TCPStore(  # noqa: F841  (serves while referenced)
        address,
        port,
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=fd,
    )
    while os.getppid() == parent:  # a launcher killed with SIGKILL leaves no store behind
        time.sleep(POLL_S)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
