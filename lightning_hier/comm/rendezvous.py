"""Start the default process group with a store that listens only where the ranks connect.

``torch.distributed.init_process_group`` with ``MASTER_ADDR`` / ``MASTER_PORT`` makes rank 0 host
the rendezvous store on *every* interface of its machine, whatever ``MASTER_ADDR`` says: with
``MASTER_ADDR=127.0.0.1`` anyone who can reach the machine can read and write the job's keys.
:func:`init_default_group` hands the store a socket bound to ``MASTER_ADDR`` itself
(``TCPStore(master_listen_fd=...)``), so a single-machine job listens on loopback only and a
multi-node job on the interface the other nodes use.

One exception keeps torch's behaviour: a multi-node job whose ``MASTER_ADDR`` resolves to a loopback
address on rank 0 (a host name that ``/etc/hosts`` maps to ``127.0.1.1``, while the other nodes
resolve it through DNS). Those nodes reach rank 0 on some other interface, which only a socket on
all interfaces serves. A store hosted by torchrun's agent (``TORCHELASTIC_USE_AGENT_STORE``) is
the agent's business: the ranks then join with torch's own rendezvous.

Example::

    init_default_group("gloo", rank=rank, world_size=2, address="127.0.0.1", port=29500,
                       timeout=timedelta(seconds=600), multi_node=False)
"""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist


def init_default_group(
    backend: str, *, rank: int, world_size: int, address: str, port: int, timeout: timedelta, multi_node: bool
) -> None:
    """``init_process_group`` whose store, hosted by rank 0, listens on ``address`` only.

    Args:
        backend: ``'gloo'``, ``'nccl'`` or ``'mpi'``.
        rank: This process's global rank.
        world_size: Number of ranks.
        address: ``MASTER_ADDR``: where rank 0 hosts the store and the other ranks connect.
        port: ``MASTER_PORT``.
        timeout: The start-up timeout (the store's and the group's).
        multi_node: Whether ranks run on other machines (see the module docstring).

    Raises:
        OSError: Rank 0 cannot listen on ``address:port`` (not an address of this machine, or
            the port is taken).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
        return
    if rank == 0:
        listener = listen(address, port, multi_node)
        store = dist.TCPStore(
            address,
            port,
            world_size,
            is_master=True,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=listener.detach(),  # the store owns the socket from now on
        )
    else:
        store = dist.TCPStore(address, port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def listen(address: str, port: int, multi_node: bool) -> socket.socket:
    family, _, _, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    if multi_node and ipaddress.ip_address(sockaddr[0]).is_loopback:
        family, sockaddr = socket.AF_INET6, ("::", port)  # torch's own choice (see the module docstring)
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and sockaddr[0] == "::":
            listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # and IPv4 on the same socket
        listener.bind(sockaddr)
        listener.listen(socket.SOMAXCONN)
    except OSError as err:
        listener.close()
        raise OSError(
            err.errno,
            f"lightning_hier: rank 0 cannot host the rendezvous store on MASTER_ADDR={address!r}, "
            f"MASTER_PORT={port}: {err.strerror}",
        ) from err
    return listener


def host_store(address: str, port: int, timeout: timedelta) -> tuple[dist.TCPStore, int]:
    """A master ``TCPStore`` that no rank joins, listening on ``address`` only (``port`` 0: a free one).

    The coordination store of ``python -m lightning_hier.coordinator``; returns it and the port it
    listens on. A process that forks while it hosts a store must use :class:`StoreApart`.
    """
    listener = listen(address, port, multi_node=False)
    bound = listener.getsockname()[1]
    store = dist.TCPStore(
        address, bound, is_master=True, timeout=timeout, wait_for_workers=False, master_listen_fd=listener.detach()
    )
    return store, bound


class StoreApart:
    """A coordination store hosted by a process of its own, listening on ``address`` only (a free port).

    For the fork / spawn launcher of a fault-tolerant run, which forks replicas (and restarts them)
    while the store serves: a store hosted in the forking process runs a server thread that
    resolves connecting clients' addresses, and a child forked while that thread holds glibc's
    resolver lock deadlocks in its own first connection (seen about once in ten fault-tolerance
    test runs). The socket is bound here, so :attr:`port` is known at once and clients may connect
    before the host process has imported torch (the kernel queues them); the host ends when
    :meth:`close` is called (or its ``with`` block ends), or when this process is gone.

    Args:
        address: Where the store listens and the replicas connect.
        timeout: The store's timeout, and this process's client's.
    """

    def __init__(self, address: str, timeout: timedelta) -> None:
        self.address, self.timeout = address, timeout
        listener = listen(address, 0, multi_node=False)
        self.port: int = listener.getsockname()[1]
        fd = listener.fileno()
        script = str(Path(__file__).with_name("_store_host.py"))  # by path: it imports torch alone, not Lightning
        args = [str(fd), address, str(self.port), str(os.getpid()), str(timeout.total_seconds())]
        try:
            self._host = subprocess.Popen([sys.executable, script, *args], pass_fds=(fd,))
        finally:
            listener.close()  # the host's now: a replica forked later must not hold it open
        self._client: dist.TCPStore | None = None

    @property
    def pid(self) -> int:
        """The host process's PID."""
        return self._host.pid

    def client(self) -> dist.TCPStore:
        """This process's connection to the store (made on first use: it waits for the host to serve)."""
        if self._client is None:
            self._client = dist.TCPStore(
                self.address, self.port, is_master=False, timeout=self.timeout, wait_for_workers=False
            )
        return self._client

    def __enter__(self) -> StoreApart:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End the host process (its keys are gone)."""
        self._client = None
        self._host.terminate()
        try:
            self._host.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._host.kill()
            self._host.wait()
