"""Keep training when a replica fails: the fault-tolerant mode of the periodic strategies (:class:`FaultTolerance`).

One more object the adapter holds (``HierStrategy(fault_tolerance=...)``, or ``fault_tolerance=True``
on ``localsgd``, the GRAWA family, ``hpsgd`` and ``diloco``). Without it nothing changes: the fail-fast
behaviour of ``docs/guide/failures.md``. With it, each rank is a *replica* that may die and come back:

- **Where agreement lives.** The fork / spawn launcher hosts a coordination store in a process
  of its own (:class:`~lightning_hier.strategies._elastic_launcher.ElasticLauncher`), so no replica
  holds it; each replica beats on it (:mod:`lightning_hier.comm.membership`). With a
  ``coordinator``, each replica is a torchrun job of one process
  (:mod:`~lightning_hier.strategies._replica_launcher`) and the store is
  :mod:`lightning_hier.coordinator`'s.
- **Rounds.** Before every collective of the rule (a round, a consensus for validation, the final
  round) the replicas agree on who is alive; if that changed, a gloo group is built among the live
  replicas (members in replica order) on the coordination store, and the rule runs over it. The
  round then averages over the live replicas (GRAWA's weights over the live ones). A replica that
  dies during the round's collectives never votes to commit it, so the survivors put their
  replicas and the rule's state back as they were before the round and run it again without it:
  the dead replica's steps since the previous round are lost, nothing else.
- **HPSGD's window in flight.** HPSGD's collective is the window's all-reduce, launched at one
  merge and waited for at the next. When the replicas at the wait are not those it was launched
  over (one died meanwhile), or the wait fails, the lost replica's change is dropped: every
  survivor sums again, blocking, the change it sent (kept since the launch) with the other
  survivors', and the merge divides by their number. Every survivor's window still counts.
- **Joining.** The launcher (or torchrun) restarts a dead replica (up to ``max_restarts`` times each). It asks to
  join; the next round admits it: after that round's step, the members finish any collective in
  flight (HPSGD's new window) among themselves, and the lowest live replica sends the joiner, over
  the network, what a checkpoint at that point would hold (its model, optimizer state, the rule's
  state, the loop's counters and data position, callbacks' state); the joiner's fit restores it
  as if resuming from a checkpoint taken there, and trains on from the next batch.
- **Data.** Each replica keeps its own shard of every epoch. The batches of a dead replica's shard
  between its death and its return are not trained (skipped, as torchft does); the joiner
  resumes its shard at the position of the replica that sent it the state.
- **Lightning's collectives** during fit (``self.log(..., sync_dist=True)``, torchmetrics,
  barriers, broadcasts) run on each replica alone: its default group is a group of one, so they
  never wait for another replica (a restarted replica's set-up makes collectives the running
  replicas never make).

What it does not cover: rank 0 hosting the progress bar, loggers and checkpoint files is the
replica with identity 0; while it is down, nothing is logged or written (the others train on).
Checkpoints of a fault-tolerant run hold the consensus model and replica 0's own state for
every rank (resume is not bit-identical).
"""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_hier import _validate as v
from lightning_hier.comm import is_communication_error
from lightning_hier.comm.membership import (
    RUN_PREFIX,
    Decision,
    JobLost,
    JoinRefused,
    Membership,
    TrainingFinished,
    exit_excluded,
    replica_store,
)
from lightning_hier.rng import capture_rng
from lightning_hier.topology import ProcessGroups, Topology

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_hier.algorithms.round_guard import Undoable
    from lightning_hier.strategies.adapter import HierStrategy

log = logging.getLogger(__name__)
T = TypeVar("T")

LIVE_CHECKPOINT = "lightning_hier:live-replica"
"""The ``ckpt_path`` a restarted replica's fit is given: its state comes from a live peer, not a file."""
LIVE_STATE_KEY = "lightning_hier_live"
"""Where the sent checkpoint holds the sender's own state (the adapter's per-rank state)."""
POINT_KEY = "lightning_hier_point"
"""Where the sent checkpoint holds the sequence number of the next synchronisation point."""
START_METHODS = ("spawn", "fork")
FIT_CKPT_ARG = 4
"""Position of ``ckpt_path`` in the arguments of ``Trainer._fit_impl`` (Lightning 2.6)."""


@dataclass
class FaultTolerance:
    """Opt-in fault tolerance of a periodic strategy (see the module docstring).

    Args:
        max_restarts: How many times the launcher restarts each replica (0: a dead replica stays
            dead and the others finish without it). With ``coordinator``, the same number as
            torchrun's ``--max-restarts``: the end of training waits (up to ``init_timeout``) for
            a dead replica that has restarts left.
        heartbeat_s: Seconds between two heartbeats of a replica.
        dead_after_s: Seconds without a heartbeat after which a replica counts as dead. A replica
            that still beats but does not reach a round (hung) is dropped after the strategy's
            ``timeout``.
        coordinator: ``"host:port"`` of a coordination store started apart from the replicas
            (``python -m lightning_hier.coordinator``): each replica is then its own job of one
            process, started and restarted by torchrun (``--max-restarts``) or any other launcher,
            instead of the fork / spawn launcher. ``None`` (default): the fork / spawn launcher
            hosts the store and restarts replicas itself.
        replica: With ``coordinator``: this replica's identity, ``0 <= replica < replicas`` (the
            same after every restart; it picks the replica's data shard, and replica 0 logs and
            writes checkpoints).
        replicas: With ``coordinator``: how many replicas the job has.

    Example:
        >>> from lightning_hier.strategies import FaultTolerance, LocalSGDStrategy
        >>> strategy = LocalSGDStrategy(tau=8, start_method="fork", fault_tolerance=FaultTolerance(max_restarts=5))
        >>> one_of_three = FaultTolerance(coordinator="10.0.0.1:29600", replica=0, replicas=3)  # under torchrun
    """

    max_restarts: int = 3
    heartbeat_s: float = 0.2
    dead_after_s: float = 2.0
    coordinator: str | None = None
    replica: int | None = None
    replicas: int | None = None
    # set by the launcher before each replica starts (copied into it by fork, pickled by spawn)
    store_port: int = field(default=0, repr=False)
    store_prefix: str = field(default="", repr=False)
    coordinator_host: str = field(default="", init=False, repr=False)
    incarnation: int = field(default=0, repr=False)
    # this replica's runtime state
    membership: Membership | None = field(default=None, init=False, repr=False)
    _strategy: HierStrategy | None = field(default=None, init=False, repr=False)
    _point: int = field(default=0, init=False, repr=False)  # the next synchronisation point's number (all agree)
    _expected: tuple[int, ...] = field(default=(), init=False, repr=False)  # who should arrive there
    _admitted: Decision | None = field(default=None, init=False, repr=False)  # joiners of the last round
    _synced_step: int | None = field(default=None, init=False, repr=False)  # the step of the last committed point
    received: dict[str, Any] | None = field(default=None, init=False, repr=False)
    donating: bool = field(default=False, init=False, repr=False)
    groups: ProcessGroups | None = field(default=None, init=False, repr=False)
    """The live replicas' groups (the rule's), after :meth:`connect`."""

    def __post_init__(self) -> None:
        owner = "FaultTolerance"
        self.max_restarts = v.check_int(owner, "max_restarts", self.max_restarts, minimum=0)
        self.heartbeat_s = v.check_float(owner, "heartbeat_s", self.heartbeat_s, low=0.01, high=60.0)
        self.dead_after_s = v.check_float(
            owner, "dead_after_s", self.dead_after_s, low=2 * self.heartbeat_s, high=3600.0
        )
        if self.coordinator is None:
            if self.replica is not None or self.replicas is not None:
                raise ValueError(
                    f"{owner}: arguments `replica` and `replicas` name a replica started apart from the others, "
                    f"which needs `coordinator` ('host:port'), got coordinator=None, replica={self.replica!r}, "
                    f"replicas={self.replicas!r}."
                )
            return
        self.coordinator_host, self.store_port = _host_port(owner, self.coordinator)
        self.store_prefix = RUN_PREFIX
        if self.replicas is None or self.replica is None:
            raise ValueError(
                f"{owner}: argument `coordinator` needs this replica's `replica` and the job's `replicas`, "
                f"got replica={self.replica!r}, replicas={self.replicas!r}."
            )
        self.replicas = v.check_int(owner, "replicas", self.replicas, minimum=1)
        self.replica = v.check_int(owner, "replica", self.replica, minimum=0, maximum=self.replicas - 1)

    @property
    def external(self) -> bool:
        """Whether each replica is its own job (torchrun) meeting the others on ``coordinator``."""
        return self.coordinator is not None

    @staticmethod
    def of(owner: str, value: FaultTolerance | Mapping[str, Any] | bool | None) -> FaultTolerance | None:
        """The strategy argument: an object, its arguments (Hydra), ``True`` (the defaults) or ``False`` / ``None``."""
        if isinstance(value, FaultTolerance):
            return value
        if isinstance(value, Mapping) and value:
            try:
                return FaultTolerance(**{str(k): v for k, v in value.items()})
            except (TypeError, ValueError) as err:  # from Hydra: say which strategy's argument it was
                raise ValueError(f"{owner}: {err}") from None
        if value is None or value is False:
            return None
        if value is True:
            return FaultTolerance()
        raise ValueError(
            f"{owner}: argument `fault_tolerance` must be a FaultTolerance, a mapping of its arguments, True or False, "
            f"got {value!r}."
        )

    def check(self, owner: str, problem: str | None, start_method: str, num_nodes: int, processes: int = 1) -> None:
        """Refuse, before any rank starts, what the fault-tolerant mode cannot run."""
        if problem is not None:
            raise ValueError(f"{owner}: argument `fault_tolerance` cannot be used here: {problem}.")
        if self.external:
            if start_method != "popen":
                raise ValueError(
                    f"{owner}: argument `fault_tolerance` with a `coordinator` runs each replica as its own job "
                    f"(torchrun), which needs start_method='popen', got start_method={start_method!r}."
                )
            if num_nodes * processes != 1:
                raise ValueError(
                    f"{owner}: argument `fault_tolerance` with a `coordinator` runs one process per replica "
                    f"(devices=1, num_nodes=1; torchrun --nproc-per-node=1), got devices={processes}, "
                    f"num_nodes={num_nodes}."
                )
            return
        if start_method not in START_METHODS:
            raise ValueError(
                f"{owner}: argument `fault_tolerance` needs start_method in {START_METHODS} (its launcher restarts "
                f"failed replicas and hosts their coordination store), or a `coordinator` for replicas started "
                f"by torchrun, got start_method={start_method!r}."
            )
        if num_nodes != 1:
            raise ValueError(
                f"{owner}: argument `fault_tolerance` runs on one node (num_nodes=1), got num_nodes={num_nodes}."
            )

    # ------------------------------------------------------------------ start
    def claim_incarnation(self, timeout: timedelta) -> int:
        """A replica started apart from the others: which start of it this is (0: the job's first).

        Counted in the coordinator's store (``incarnation/{replica}``), so it does not matter what
        restarted the replica; the end of training reads the counts to know who may still come back.
        A restart also marks itself as coming until it asks to join (the count alone would say
        its restarts are used up while it is starting).
        """
        assert self.external and self.replica is not None
        store = replica_store(self.coordinator_host, self.store_port, self.store_prefix, timeout)
        self.incarnation = int(store.add(f"incarnation/{self.replica}", 1)) - 1
        if store.check(["lost"]):
            raise JobLost("every replica failed at once earlier in this run (start it again, from its last checkpoint)")
        if self.incarnation > 0:
            store.set(f"restarting/{self.replica}", "1")
        return self.incarnation

    def connect(self, strategy: HierStrategy, init_timeout: timedelta) -> None:
        """Join the job (``setup_environment``): every replica at the start, or a restarted one through a peer."""
        self._strategy = strategy
        assert strategy.cluster_environment is not None
        address = strategy.cluster_environment.main_address
        replicas = strategy.world_size
        store = replica_store(address, self.store_port, self.store_prefix, init_timeout)
        membership = Membership(
            store,
            strategy.global_rank,
            replicas,
            strategy._timeout,
            heartbeat_s=self.heartbeat_s,
            dead_after_s=self.dead_after_s,
        )
        self.membership = membership
        # the default group is this replica alone (see Membership.form_world); the rule's group is the live world
        dist.init_process_group(strategy.process_group_backend, store=dist.HashStore(), rank=0, world_size=1)
        strategy._groups = Topology(world_size=1).build(0)
        beats = replica_store(address, self.store_port, self.store_prefix, init_timeout)
        if self.incarnation == 0:
            membership.start(beats)
            start = membership.agree("start", tuple(range(replicas)), admit=False, wait_s=init_timeout.total_seconds())
            self._form(start.members, "start", regroup=False)
            self._expected = start.members
            return
        membership.ask_to_join(self.incarnation)
        membership.start(beats)
        try:
            decision = membership.wait_admission(self.incarnation, init_timeout.total_seconds())
        except (TrainingFinished, JobLost):
            raise  # nothing left to train, or nobody to train with: its launcher ends it
        except JoinRefused as err:
            raise RuntimeError(f"lightning_hier: replica {membership.replica} could not rejoin: {err}.") from err
        self._form(decision.world, f"{decision.point}/admit", regroup=False)
        payload = _receive_bytes(0, self._live_groups().data)  # from the lowest live replica, a peer of this job
        self.received = torch.load(io.BytesIO(payload), weights_only=False)
        self._point = int(self.received.pop(POINT_KEY))
        self._expected = decision.world
        step = self.received.get("global_step")
        log.info("lightning_hier: replica %d rejoined at point %d (step %s)", membership.replica, self._point, step)

    def live_checkpoint(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The checkpoint a restarted replica received, and the sender's own state in it (its fit loads them)."""
        if self.received is None:
            raise RuntimeError(f"lightning_hier: {LIVE_CHECKPOINT!r} is only a ckpt_path of a restarted replica.")
        checkpoint, self.received = self.received, None
        state = checkpoint.pop(LIVE_STATE_KEY)
        state["rng"] = capture_rng()  # its own random stream: a copy of the sender's would repeat its dropout
        return checkpoint, state

    # ------------------------------------------------------------------ the rounds (RoundGuard)
    def run(self, algorithm: Undoable, collective: Callable[[], T], admit: bool) -> T:
        """Run one of the rule's collectives over the live replicas (see the module docstring)."""
        membership = self._require()
        admit = admit and self._only_training_follows()
        attempt = 0
        while True:
            point = f"{self._point}.{attempt}"
            decision = membership.agree(point, self._expected, admit=admit)
            if membership.replica not in decision.members:
                exit_excluded(membership.replica, point)
            if set(decision.members) != set(membership.world):
                self._form(decision.members, point)
            undo = algorithm.undo_point()
            try:
                output = collective()
                ok = True
            except Exception as err:
                if not _lost_peer(err):
                    raise  # a bug, not a failure of a replica: the peers see this replica die and go on
                ok = False
            if membership.vote(point, ok, decision.members):
                self._point += 1
                self._synced_step = self._step()
                self._expected = decision.members  # the joiners are expected once they hold the state
                if decision.joiners:
                    self._admitted = decision
                    if membership.replica == decision.members[0]:
                        membership.admit(decision)  # only now: an undone round's joiners wait for the next
                return output
            undo()
            membership.events.append({"point": point, "undone": True})
            log.warning("lightning_hier: replica %d: %s undone (a replica failed during it)", membership.replica, point)
            attempt += 1

    def _form(self, world: tuple[int, ...], point: str, regroup: bool = True) -> None:
        """Make ``world`` the live group (every replica in it calls this); the rule runs over it."""
        membership = self._require()
        before, step = membership.world, self._step()
        group = membership.form_world(world, point, step=step)
        left = sorted(set(before) - set(world))
        if left:  # what the job lost: the replicas' steps since the last synchronisation they took part in
            membership.events[-1]["lost_since_step"] = self._synced_step
            log.warning(
                "lightning_hier: replica %d: replica(s) %s left at step %s; their steps since step %s are lost",
                membership.replica,
                left,
                step,
                self._synced_step,
            )
        topology = Topology(world_size=len(world))
        rank = world.index(membership.replica)
        # one flat data-parallel group of one node: the data group is the node's and its only level
        self.groups = ProcessGroups(
            topology, rank, topology.coords(rank), data=group, pipe=None, model=None, node=group, data_intra=group
        )
        if regroup:
            assert self._strategy is not None
            self._strategy.sync.regroup(self.groups, self)

    def _only_training_follows(self) -> bool:
        """Whether this batch's end is followed by the next training batch: where a joiner may come in.

        A joiner restores the loop as at this batch's end; when validation, the epoch's end or the
        end of training follows it, Lightning's restored loop does not run them as the others do,
        and the collectives they contain would no longer pair up. The same answer on every replica
        (the same loop position): Lightning's own rule (``_should_check_val_fx``), taken
        conservatively (validation by time may come at any batch).
        """
        trainer = self._trainer()
        if trainer is None:
            return False
        loop = trainer.fit_loop.epoch_loop
        if (
            loop.batch_progress.is_last_batch
            or trainer.should_stop
            or getattr(trainer, "_val_check_time_interval", None) is not None
        ):
            return False
        if 0 < trainer.max_steps <= trainer.global_step + 1:
            return False
        every = trainer.val_check_batch
        if trainer.enable_validation and every is not None and every != float("inf"):
            index = loop.total_batch_idx if trainer.check_val_every_n_epoch is None else loop.batch_idx
            return (index + 1) % int(every) != 0
        return True

    def _step(self) -> int | None:
        """The optimizer steps this replica has completed (``None`` outside fit): for the membership log."""
        trainer = self._trainer()
        return trainer.global_step if trainer is not None else None

    def _trainer(self) -> pl.Trainer | None:
        module = self._strategy.lightning_module if self._strategy is not None else None
        return module.trainer if module is not None and module._trainer is not None else None

    def attach(self, strategy: HierStrategy) -> None:
        """The rule is bound: run its rounds over the live group, through this object, from now on."""
        strategy.sync.regroup(self._live_groups(), self)

    def broadcast_initial(self, tensors: list[torch.Tensor]) -> None:
        """Every replica starts from replica 0's weights (as DDP's constructor does)."""
        group = self._live_groups().data
        with torch.no_grad():
            for tensor in tensors:
                dist.broadcast(tensor, group_src=0, group=group)

    def _live_groups(self) -> ProcessGroups:
        if self.groups is None:
            raise RuntimeError("FaultTolerance: no live group yet (the strategy connects it in setup_environment).")
        return self.groups

    # ------------------------------------------------------------------ a joiner's state
    def donate(self, trainer: pl.Trainer) -> None:
        """After the step of a round that admitted replicas: send them the state (every live replica calls it)."""
        admitted, self._admitted = self._admitted, None
        if admitted is None:
            return
        membership = self._require()
        strategy = self._strategy
        assert strategy is not None
        strategy.sync.settle()  # a window in flight (HPSGD) is summed among the members it was sent to
        self._form(admitted.world, f"{admitted.point}/admit")
        self._expected = admitted.world
        if membership.replica != admitted.members[0]:
            return  # the lowest live replica sends; the others go on
        started = time.monotonic()
        self.donating = True  # the replica itself, not a consensus: right after the round they are equal
        try:
            checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
            checkpoint[LIVE_STATE_KEY] = strategy._rank_state(checkpoint)
            checkpoint[POINT_KEY] = self._point
        finally:
            self.donating = False
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        payload = buffer.getvalue()
        for rank in range(len(admitted.members), len(admitted.world)):
            _send_bytes(payload, rank, self._live_groups().data)
        log.info(
            "lightning_hier: replica %d sent its state (%d bytes) to %s in %.3f s",
            membership.replica,
            len(payload),
            list(admitted.joiners),
            time.monotonic() - started,
        )

    # ------------------------------------------------------------------ the end
    def finish(self, trainer: pl.Trainer) -> None:
        """Training is over: replicas being restarted get the finished model, then joins are refused.

        Every live replica calls it (the strategy's ``on_train_end``). A replica the launcher is
        restarting is waited for up to the start-up timeout, admitted and sent the state of the
        finished fit; its own fit then ends at once with that model (so replica 0, whose result
        the main process keeps, may be one of them).
        """
        membership = self.membership
        if membership is None or self._strategy is None:
            return
        wait_s = self._strategy._init_timeout.total_seconds()
        restarts = self.max_restarts if self.external else None  # torchrun's restarts are not marked
        decision = membership.agree(
            f"{self._point}.final", self._expected, admit=True, restarting_s=wait_s, max_restarts=restarts
        )
        if decision.joiners:
            if membership.replica == decision.members[0]:
                membership.admit(decision)
            self._admitted = decision
            self.donate(trainer)
        membership.finished()
        membership.stop()

    def install(self, trainer: pl.Trainer) -> None:
        """Add the callback that sends the state to admitted replicas (after every other callback's batch end).

        A restarted replica skips Lightning's sanity check: its validation would enter the
        consensus (a collective) while the others are training.
        """
        if self.incarnation > 0:
            trainer.num_sanity_val_steps = 0
        callbacks: list[Any] = trainer.callbacks  # type: ignore[attr-defined]
        if not any(isinstance(c, _SendState) for c in callbacks):
            callbacks.append(_SendState())

    def _require(self) -> Membership:
        if self.membership is None:
            raise RuntimeError("FaultTolerance: not connected (the strategy connects it in setup_environment).")
        return self.membership


class _SendState(Callback):
    """At a batch's end (where checkpoints of a step are taken), the state goes to replicas admitted in its round."""

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        fault = getattr(trainer.strategy, "fault_tolerance", None)
        if isinstance(fault, FaultTolerance):
            fault.donate(trainer)


# ---------------------------------------------------------------------------------- helpers
def live_fit_args(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``Trainer._fit_impl``'s arguments with ``ckpt_path`` (the fifth, Lightning 2.6) as :data:`LIVE_CHECKPOINT`."""
    return (*args[:FIT_CKPT_ARG], LIVE_CHECKPOINT, *args[FIT_CKPT_ARG + 1 :])


def _host_port(owner: str, address: str) -> tuple[str, int]:
    host, sep, port = str(address).rpartition(":")
    if sep and host and port.isdigit() and 0 < int(port) < 65536:
        return host.strip("[]"), int(port)
    raise ValueError(
        f"{owner}: argument `coordinator` must be 'host:port' (the address of `python -m lightning_hier.coordinator`), "
        f"got {address!r}."
    )


def _lost_peer(err: BaseException) -> bool:
    """Whether a collective failed because a replica was lost.

    On a group made outside the default one, torch's c10d logger raises a ``ValueError`` (it cannot
    name the group) while handling the collective's own error, which is then the context.
    """
    return is_communication_error(err) or (err.__context__ is not None and is_communication_error(err.__context__))


def _send_bytes(payload: bytes, dst: int, group: dist.ProcessGroup | None) -> None:
    assert group is not None
    size = torch.tensor([len(payload)], dtype=torch.int64)
    group.send([size], dst, 0).wait()
    group.send([torch.frombuffer(bytearray(payload), dtype=torch.uint8)], dst, 1).wait()


def _receive_bytes(src: int, group: dist.ProcessGroup | None) -> bytes:
    assert group is not None
    size = torch.empty(1, dtype=torch.int64)
    group.recv([size], src, 0).wait()
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    group.recv([payload], src, 1).wait()
    return payload.numpy().tobytes()
