"""An emulated cluster on one host: one network namespace per node, veth links, a bridge, tbf.

Layout (nothing is created in the host's own network namespace)::

    namespace lhb-<tag>-0   lhbeth 10.213.0.1 --veth--+
    namespace lhb-<tag>-1   lhbeth 10.213.0.2 --veth--+-- lhbr<i> ports of bridge lhbbr
    ...                                               |   in namespace lhb-<tag>-hub
                                                      +

A *node* is one namespace. With one rank per node (the default) every rank has its own shaped
link. With ``ranks_per_node=R`` the R ranks of a node share its namespace and its address: what
they send each other never leaves the namespace (the kernel routes a local address over ``lo``:
an unlimited, loopback-speed link, like NVLink/PCIe inside a real node), while everything
between nodes crosses the shaped veths: the two levels of a hierarchical cluster.

Bandwidth is limited with ``tc qdisc replace dev <veth> root tbf rate R burst 256kb latency 100ms``
on *both* ends of every node's link (the node's upload on its own side, its download on the
bridge's side); netem is not available on the development machines, so there is no added latency
or loss. ``<tag>`` starts with the id of the process that built the cluster, which makes leftovers
of a killed run recognisable: :func:`cleanup` removes namespaces whose owner is gone (or, with
``stale_only=False``, every namespace with the ``lhb-`` prefix). Deleting a namespace deletes its
veth ends and the bridge, so cleaning up never has to touch anything outside the prefix.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from benchmarks.leftovers import PREFIX, of_dead_runs

SUBNET = "10.213.0"
RANK_IF = "lhbeth"
BRIDGE = "lhbbr"
MAX_RANKS = 250
_RATE = re.compile(r"^(\d+(?:\.\d+)?)([kmg]?)bit$")
_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9}
INTERRUPTS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


class NetnsError(RuntimeError):
    """A command building or inspecting the emulated cluster failed (its stderr is in the message)."""


def parse_rate(rate: str) -> float | None:
    """Bits per second of a tc rate such as ``'100mbit'`` / ``'1gbit'``; ``None`` for ``'unlimited'``.

    Raises:
        ValueError: ``rate`` is neither ``'unlimited'`` nor ``<number>[k|m|g]bit``.
    """
    text = rate.strip().lower()
    if text == "unlimited":
        return None
    match = _RATE.match(text)
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"link rate must be 'unlimited' or <number>[k|m|g]bit (e.g. 100mbit, 1gbit), got {rate!r}.")
    return float(match.group(1)) * _UNITS[match.group(2)]


@dataclass(frozen=True)
class Link:
    """A link's token-bucket shaping (``rate='unlimited'``: no qdisc)."""

    rate: str = "1gbit"
    burst: str = "256kb"
    latency: str = "100ms"

    def __post_init__(self) -> None:
        parse_rate(self.rate)

    def tbf_args(self) -> list[str] | None:
        """Arguments after ``tc qdisc replace dev <veth> root``; ``None`` when unlimited."""
        if parse_rate(self.rate) is None:
            return None
        return ["tbf", "rate", self.rate, "burst", self.burst, "latency", self.latency]


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM/SIGHUP inside the block; they are raised again right after it.

    For steps that must not stop half-way: starting ranks (an interrupt inside ``Popen``, after
    the fork, would leave a started rank untracked) and tearing the cluster down. Python-level
    handlers, not a signal mask: a mask is per thread, and torch runs threads of its own. Call
    from the main thread (as ``signal.signal`` requires); elsewhere the block runs undeferred.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: pending.append(signum)) for sig in INTERRUPTS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for signum in pending:
            signal.raise_signal(signum)


def run_cmd(*argv: str) -> str:
    """Run a command, return its stdout; raise :class:`NetnsError` with its stderr on failure."""
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def requirements_problem() -> str | None:
    """Why an emulated cluster cannot be built here, or ``None`` when it can."""
    if os.geteuid() != 0:
        return "the emulated cluster needs root (network namespaces, tc, cgroups); run it as root"
    missing = [tool for tool in ("ip", "tc", "taskset") if shutil.which(tool) is None]
    if missing:
        return f"missing tool(s) {', '.join(missing)} (install iproute2 and util-linux)"
    try:
        run_cmd("ip", "netns", "list")
    except NetnsError as err:
        return f"`ip netns` is unavailable: {err}"
    return None


def list_namespaces(prefix: str = PREFIX) -> list[str]:
    """Names of the network namespaces created by this harness (``<prefix>-...``)."""
    names = [line.split()[0] for line in run_cmd("ip", "netns", "list").splitlines() if line.strip()]
    return sorted(n for n in names if n.startswith(f"{prefix}-"))


def cleanup(stale_only: bool = True, prefix: str = PREFIX) -> list[str]:
    """Delete this harness's namespaces (with them their veths and bridges); return their names.

    Args:
        stale_only: Only namespaces whose owning process (the ``<tag>`` pid) is gone, so a run in
            progress is left alone. ``False`` removes every ``<prefix>-`` namespace.
        prefix: Name prefix of the harness's namespaces.
    """
    removed = []
    names = list_namespaces(prefix)
    for name in of_dead_runs(names, prefix) if stale_only else names:
        try:
            run_cmd("ip", "netns", "delete", name)
            removed.append(name)
        except NetnsError:
            if name in list_namespaces(prefix):
                raise
    return removed


class EmulatedCluster:
    """``ranks`` ranks on ``ranks / ranks_per_node`` node namespaces joined by shaped veth links to one bridge.

    Use as a context manager (or call :meth:`up` / :meth:`down`): everything is removed on exit,
    also when building it or the run inside fails.

    Args:
        ranks: Number of ranks (1 to 250 nodes of ``ranks_per_node``).
        link: Shaping of every node's link (both directions); links inside a node are loopback.
        tag: Name component of this cluster's namespaces (default: this process's id). Keep the
            process id first (``f"{os.getpid()}-label"``): :func:`cleanup` reads it.
        ranks_per_node: Ranks sharing one namespace (node); must divide ``ranks``.
    """

    def __init__(self, ranks: int, link: Link, tag: str | None = None, ranks_per_node: int = 1) -> None:
        if ranks_per_node < 1 or ranks % ranks_per_node:
            raise ValueError(
                f"EmulatedCluster: `ranks_per_node` must be >= 1 and divide ranks={ranks}, got {ranks_per_node}."
            )
        if not 1 <= ranks // ranks_per_node <= MAX_RANKS:
            raise ValueError(
                f"EmulatedCluster: `ranks` / `ranks_per_node` (nodes) must be in [1, {MAX_RANKS}], "
                f"got {ranks} / {ranks_per_node}."
            )
        self.ranks = ranks
        self.ranks_per_node = ranks_per_node
        self.nodes = ranks // ranks_per_node
        self.link = link
        self.tag = tag if tag is not None else str(os.getpid())
        self.hub = f"{PREFIX}-{self.tag}-hub"
        self._created: list[str] = []

    def node_of(self, rank: int) -> int:
        """The node (namespace index) of ``rank``: ranks of a node are consecutive, as Lightning numbers them."""
        return rank // self.ranks_per_node

    def namespace(self, rank: int) -> str:
        """The namespace ``rank`` runs in (its node's)."""
        return self.node_namespace(self.node_of(rank))

    def node_namespace(self, node: int) -> str:
        return f"{PREFIX}-{self.tag}-{node}"

    def address(self, rank: int) -> str:
        """The address of ``rank``'s node (shared by every rank of the node)."""
        return f"{SUBNET}.{self.node_of(rank) + 1}"

    @property
    def interface(self) -> str:
        """Name of every node's link inside its namespace (``GLOO_SOCKET_IFNAME``)."""
        return RANK_IF

    def exec_prefix(self, rank: int) -> list[str]:
        """Command prefix that runs a program inside ``rank``'s (node's) namespace."""
        return ["ip", "netns", "exec", self.namespace(rank)]

    def up(self) -> EmulatedCluster:
        try:
            self._add_namespace(self.hub)
            run_cmd("ip", "-n", self.hub, "link", "add", BRIDGE, "type", "bridge")
            run_cmd("ip", "-n", self.hub, "link", "set", BRIDGE, "up")
            for node in range(self.nodes):
                self._add_node(node)
            self.set_link(self.link)
        except BaseException:
            self.down()
            raise
        return self

    def _add_namespace(self, name: str) -> None:
        run_cmd("ip", "netns", "add", name)
        self._created.append(name)
        run_cmd("ip", "-n", name, "link", "set", "lo", "up")

    def _add_node(self, node: int) -> None:
        ns, port = self.node_namespace(node), f"lhbr{node}"
        self._add_namespace(ns)
        # both ends are created directly inside their namespaces: no name ever exists in the host's
        run_cmd("ip", "link", "add", RANK_IF, "netns", ns, "type", "veth", "peer", "name", port, "netns", self.hub)
        run_cmd("ip", "-n", ns, "addr", "add", f"{SUBNET}.{node + 1}/24", "dev", RANK_IF)
        run_cmd("ip", "-n", ns, "link", "set", RANK_IF, "up")
        run_cmd("ip", "-n", self.hub, "link", "set", port, "master", BRIDGE, "up")

    def set_link(self, link: Link) -> None:
        """(Re)shape every node's link, both directions (loopback inside a node stays unlimited)."""
        args = link.tbf_args()
        for node in range(self.nodes):
            for ns, dev in ((self.node_namespace(node), RANK_IF), (self.hub, f"lhbr{node}")):
                if args is None:
                    subprocess.run(
                        ["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True, check=False
                    )
                else:
                    run_cmd("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *args)
        self.link = link

    def qdisc(self, node: int, dev: str = RANK_IF) -> str:
        """``tc qdisc show`` of ``node``'s link (or its loopback, ``dev='lo'``), for logs and tests."""
        return run_cmd("tc", "-n", self.node_namespace(node), "qdisc", "show", "dev", dev).strip()

    def counters(self, node: int) -> dict[str, int]:
        """Bytes ``node`` has sent (``tx``) and received (``rx``) on its link since it was built, and
        sent inside itself (``intra_tx``: its loopback, i.e. between its own ranks)."""
        link, loop = (self._stats(node, dev) for dev in (RANK_IF, "lo"))
        return {"tx": int(link["tx"]["bytes"]), "rx": int(link["rx"]["bytes"]), "intra_tx": int(loop["tx"]["bytes"])}

    def _stats(self, node: int, dev: str) -> dict[str, Any]:
        out = run_cmd("ip", "-n", self.node_namespace(node), "-s", "-j", "link", "show", "dev", dev)
        return dict(json.loads(out)[0]["stats64"])

    def down(self) -> None:
        """Delete every namespace this cluster created (idempotent, not interruptible half-way)."""
        errors = []
        with interrupts_deferred():
            for name in reversed(self._created):
                try:
                    run_cmd("ip", "netns", "delete", name)
                except NetnsError as err:
                    if name in list_namespaces():
                        errors.append(str(err))
            self._created.clear()
        if errors:
            raise NetnsError("could not remove namespaces: " + "; ".join(errors))

    def __enter__(self) -> EmulatedCluster:
        return self.up()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.down()
