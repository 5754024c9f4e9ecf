"""torchft's ``LocalSGD`` and ``DiLoCo`` as a :class:`~lightning_hier.sync.base.Sync`: a peer to compare with.

torchft (PyTorch's fault-tolerance library, PyPI ``torchft``) ships Local SGD and (Streaming)
DiLoCo as optimizer wrappers around its ``Manager``: every synchronisation first forms a quorum
through a *lighthouse* server, then all-reduces over a process group the manager reconfigures for
that quorum, and commits only when every member's all-reduce succeeded (``should_commit``). It
comes with no Lightning integration and no launcher for the lighthouse or the stores its managers
need; :class:`TorchftSync` provides both, so the same Lightning job runs torchft's algorithms
beside this library's:

- rank 0 of the data-parallel group starts a ``LighthouseServer`` in its own process
  (``min_replicas`` = the number of replicas) and tells the others its address;
- every rank is a replica group of one process: it starts its own ``TCPStore`` at the address
  through which it reaches ``MASTER_ADDR`` (so on a real cluster, or in the benchmarks' network
  namespaces, the other replicas can reach it) and builds a ``Manager`` over a
  ``torchft.process_group.ProcessGroupGloo`` (NCCL's quantized all-reduce needs CUDA and triton);
- torchft's ``LocalSGD(manager, module, optimizer, sync_every)`` or ``DiLoCo(manager, [module],
  optimizer, outer, sync_every)`` is entered around the optimizer: its step hooks do the rest.

What differs from torchft used on its own, and why:

- ``min_replica_size`` is the number of replicas and ``init_sync=False``: the adapter has already
  given every rank rank 0's weights (a digest decides whether any are sent), and a peer in a
  benchmark trains with a fixed membership. A lost replica therefore fails the run, as in every
  non-fault-tolerant strategy here; a rank still waiting in a quorum when it unwinds ends its
  process at exit rather than wait out the quorum's timeout (:meth:`TorchftSync._exit_now_if_stuck`).
- At the end of training, replicas that took steps since their last synchronisation are averaged
  once more (torchft's ``LocalSGD.sync()``), as the PostLocalSGD peer does: validation, checkpoints
  and the module after fit then hold one model's parameters (torchft synchronises parameters only:
  BatchNorm statistics stay each rank's own). During fit, validation sees each rank's replica
  (torchft has no consensus model).
- The whole module is one fragment (torchft's ``DiLoCo`` takes a list of modules; cutting a
  LightningModule into modules is the user's model's business), so ``fragment_sync_delay`` and
  ``fragment_update_alpha`` are not offered; :class:`~lightning_hier.sync.DiLoCoSync` has them.
- Checkpoints hold no torchft state: a resumed run starts a fresh manager and DiLoCo's outer
  momentum from zero.

Bytes handed to torchft's all-reduces (one per parameter tensor, float32) and the time the step
spends in a synchronisation (quorum, all-reduce, ``should_commit``) are added to the strategy's
``comm_stats``.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from contextlib import ExitStack
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hier import _validate as v
from lightning_hier.comm import broadcast_object, payload_bytes
from lightning_hier.sync.base import Binding, Sync
from lightning_hier.topology import Topology

ALGORITHMS = ("local_sgd", "diloco")
INSTALL_HINT = "pip install 'lightning-hier[torchft]'"


def require_torchft(owner: str) -> None:
    """Import torchft, or raise an ``ImportError`` naming the install command.

    torchft's Rust servers log every quorum and commit at INFO (about ten lines per
    synchronisation and rank) unless ``RUST_LOG`` says otherwise; where it is unset, only their
    warnings are shown (``RUST_LOG=info`` brings the rest back; torchft's logger takes a level, not
    per-module filters).
    """
    os.environ.setdefault("RUST_LOG", "warn")  # read once, when torchft's extension loads
    try:
        import torchft  # noqa: F401
    except ImportError as err:  # a missing package, or one of its broken dependencies
        raise ImportError(f"{owner}: torchft's algorithms need the torchft package ({INSTALL_HINT}): {err}") from err


def address_towards(peer: str) -> str:
    """This host's address on the route to ``peer`` (no packet is sent: a UDP socket is only routed).

    On a laptop that is ``127.0.0.1``; on a cluster (or in the benchmarks' network namespaces) the
    address of the interface that reaches ``MASTER_ADDR``, which the other replicas reach too.
    """
    family = socket.AF_INET6 if ":" in peer else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((peer, 9))  # any port: connect() on UDP only picks the route
        return str(probe.getsockname()[0])


class TorchftSync(Sync):
    """torchft's ``LocalSGD`` or ``DiLoCo`` over one lighthouse and one manager per rank (module docstring).

    Args:
        algorithm: ``'local_sgd'`` (torchft's ``LocalSGD``: the parameters averaged every
            ``sync_every`` steps) or ``'diloco'`` (torchft's ``DiLoCo``: an outer SGD step with
            Nesterov momentum on the averaged pseudo-gradient every ``sync_every`` steps).
        sync_every: Optimizer steps between two synchronisations.
        outer_lr: ``diloco`` only: the outer learning rate.
        outer_momentum: ``diloco`` only: the outer Nesterov momentum, in ``[0, 1)``.
        owner: The name in error messages.

    Raises:
        ValueError: An argument is out of range.
        ImportError: torchft cannot be imported.
    """

    lock_step = False  # ranks meet only in torchft's synchronisations

    def __init__(
        self,
        algorithm: str = "local_sgd",
        sync_every: int = 8,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        owner: str = "TorchftSync",
    ) -> None:
        self.owner = owner
        self.algorithm = v.check_choice(owner, "algorithm", algorithm, ALGORITHMS)
        self.sync_every = v.check_int(owner, "sync_every", sync_every, minimum=1)
        self.outer_lr = v.check_float(owner, "outer_lr", outer_lr, low=0.0, low_inclusive=False)
        self.outer_momentum = v.check_float(
            owner, "outer_momentum", outer_momentum, low=0.0, high=1.0, high_inclusive=False
        )
        require_torchft(owner)
        self._stack: ExitStack | None = None  # the manager, lighthouse, store and hooks of one run
        self._manager: Any = None
        self._servers: list[Any] = []  # this rank's TCPStore (freed when dropped)
        self._binding: Binding | None = None
        self._since_sync = 0  # optimizer steps since the last synchronisation

    @override
    def check_layout(self, topology: Topology) -> None:
        if topology.pipe != 1 or topology.model != 1:
            raise ValueError(
                f"{self.owner}: torchft's algorithms replicate the whole model on every rank; got a layout with "
                f"pipe={topology.pipe}, model={topology.model} (both must be 1)."
            )

    @override
    def fault_tolerance_problem(self) -> str | None:
        return "it is torchft's own fault tolerance, run here with a fixed membership as a benchmark peer"

    # ------------------------------------------------------------------ one run
    @override
    def bind(self, binding: Binding) -> None:
        if len(binding.optimizers) != 1:
            raise ValueError(
                f"{self.owner}: torchft's LocalSGD and DiLoCo wrap one optimizer; configure_optimizers "
                f"returned {len(binding.optimizers)}."
            )
        self.pause()  # a second fit: the first one's servers are gone already, or go now
        self._binding, self._since_sync = binding, 0
        self._stack = ExitStack()
        # CPython's hook that concurrent.futures itself uses (3.9+); without it a failed run waits out the quorum
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            register(self._exit_now_if_stuck)  # see its docstring
        try:
            self._manager = self._start_manager(binding, self._stack)
            self._time_syncs(binding.optimizers[0], self._stack)
        except BaseException:
            self.pause()
            raise

    def _start_manager(self, binding: Binding, stack: ExitStack) -> Any:
        """This rank's ``Manager`` (rank 0 starts the lighthouse first); every rank calls it."""
        from torch.distributed import TCPStore
        from torchft import Manager
        from torchft.coordination import LighthouseServer
        from torchft.process_group import ProcessGroupGloo

        group = binding.groups.data
        replicas = binding.topology.data
        timeout = binding.timeout
        host = binding.host
        main = host.cluster_environment.main_address if host is not None else "127.0.0.1"
        address = address_towards(main)
        lighthouse = None
        if binding.groups.coords.data == 0:
            lighthouse = LighthouseServer(bind="[::]:0", min_replicas=replicas)
            stack.callback(lighthouse.shutdown)
        # its own address() names this host by its hostname, which another node may not resolve
        url = None if lighthouse is None else f"http://{address}:{lighthouse.address().rsplit(':', 1)[1]}"
        url = broadcast_object(url, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        store = TCPStore(address, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        stack.callback(self._servers.remove, store)  # alive until the manager has shut down
        self._servers.append(store)
        module, optimizer = binding.module, binding.optimizers[0]
        manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            load_state_dict=lambda state: _load_replica(module, optimizer, state),
            state_dict=lambda: {"module": module.state_dict(), "optimizer": optimizer.state_dict()},
            min_replica_size=replicas,
            use_async_quorum=False,  # DiLoCo requires it; LocalSGD then forms each quorum at its sync
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
            rank=0,
            world_size=1,
            store_addr=address,
            store_port=store.port,
            lighthouse_addr=str(url),
            replica_id=f"replica_{binding.rank}",
            hostname=address,
            init_sync=False,  # every rank holds rank 0's weights already (HierStrategy's start)
        )
        stack.callback(manager.shutdown, wait=False)
        return manager

    def _wrapper(self, module: torch.nn.Module, optimizer: Optimizer) -> Any:
        from torchft.local_sgd import DiLoCo, LocalSGD

        if self.algorithm == "local_sgd":
            return LocalSGD(self._manager, module, optimizer, sync_every=self.sync_every)
        outer = torch.optim.SGD(module.parameters(), lr=self.outer_lr, momentum=self.outer_momentum, nesterov=True)
        return DiLoCo(self._manager, [module], optimizer, outer, sync_every=self.sync_every, pin_memory=False)

    def _time_syncs(self, optimizer: Optimizer, stack: ExitStack) -> None:
        """Enter torchft's wrapper between two post hooks that count each synchronisation in ``comm_stats``.

        Post hooks run in the order they were registered, so ``before`` runs after the optimizer's
        update and ``after`` once torchft's hook has synchronised (or not).
        """
        assert self._binding is not None
        module, manager = self._binding.module, self._manager
        start: list[float] = [0.0, 0.0]

        def before(*_: Any) -> None:
            start[:] = [time.perf_counter(), float(manager.current_step())]

        def after(*_: Any) -> None:
            self._since_sync += 1
            if manager.current_step() != start[1]:  # torchft committed a synchronisation in its hook
                self._count_sync(start[0])

        stack.callback(optimizer.register_step_post_hook(before).remove)
        stack.enter_context(self._wrapper(module, optimizer))
        stack.callback(optimizer.register_step_post_hook(after).remove)

    def _count_sync(self, started: float) -> None:
        """One synchronisation since ``started`` (``perf_counter``): one float32 all-reduce per parameter tensor."""
        assert self._binding is not None
        params = list(self._binding.module.parameters())
        stats = self._binding.stats
        stats.blocked_s += time.perf_counter() - started
        stats.add(payload_bytes(params), calls=len(params))
        self._since_sync = 0

    # ------------------------------------------------------------------ end of training
    @override
    def finalize(self) -> dict[str, float]:
        binding = self._binding
        if binding is None or self._since_sync == 0:
            return {}
        from torchft.local_sgd import LocalSGD

        started = time.perf_counter()
        LocalSGD(self._manager, binding.module, binding.optimizers[0], sync_every=1).sync()
        self._count_sync(started)
        return {}

    @override
    def pause(self) -> None:
        """Stop this run's manager, store and (rank 0) lighthouse once every rank is done with them."""
        if self._stack is None:
            return
        binding = self._binding
        if binding is not None and binding.groups.data is not None:
            dist.barrier(group=binding.groups.data)  # no rank still in a quorum when the lighthouse goes
        self.abort()

    def _exit_now_if_stuck(self) -> None:
        """At interpreter exit, end the process at once if a torchft quorum is still waiting.

        A rank that unwinds from a failure (a peer died, a signal) leaves the quorum it was waiting
        for running in the manager's executor thread, which the interpreter joins before it exits:
        the process would stay for ``quorum_timeout`` (the strategy's ``timeout``), and shutting
        torchft's servers down does not cancel the request. Runs before that join (callbacks
        registered later run first); after a clean end of training no quorum is waiting.
        """
        pending = getattr(self._manager, "_quorum_future", None)
        if pending is not None and not pending.done():
            print(f"{self.owner}: a torchft quorum is still waiting at exit; ending the process", file=sys.stderr)
            sys.stderr.flush()
            os._exit(1)

    @override
    def abort(self) -> None:
        """Stop this rank's torchft servers and hooks at once (a failed run; also the end of :meth:`pause`).

        Frees their ports and threads; a quorum already in flight is not cancelled by it (torchft's
        request returns at its timeout): :meth:`_exit_now_if_stuck` ends such a process at exit.
        """
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()  # the manager object stays: at exit, its quorum may still be waiting


def _load_replica(module: torch.nn.Module, optimizer: Optimizer, state: dict[str, Any]) -> None:
    """Give a joining replica a live one's module and optimizer state (torchft's healing)."""
    module.load_state_dict(state["module"])
    optimizer.load_state_dict(state["optimizer"])


__all__ = ["ALGORITHMS", "TorchftSync", "address_towards", "require_torchft"]
