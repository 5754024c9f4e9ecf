"""Live membership of a fault-tolerant data-parallel job: heartbeats, a quorum per round, joins.

Each replica (one training process) keeps its own identity ``replica`` (0..replicas-1) for the
whole job; the *world* is the set of live replicas that currently share a default process group.
The coordination lives in a store that no replica hosts (the supervising launcher's
``TCPStore``, or :mod:`lightning_hier.coordinator`'s), so any replica may die without taking the
store with it. Under that store:

- ``hb/{replica}``: a counter each replica's heartbeat thread increments every ``heartbeat_s``.
  Replica ``j`` counts as dead once an observer has seen its counter stand still for
  ``dead_after_s`` (only counter changes are compared, never clocks of two machines).
- ``arrive/{point}/{replica}``: set by each replica at a synchronisation point (``point`` is the
  round's sequence number and attempt, the same on every replica).
- ``decide/{point}``: the point's decision, written once with ``compare_set`` by whichever replica
  decides first, and read by all: so every replica acts on the same members even when two see
  different arrivals. A replica decides when every expected replica has arrived or is dead, or
  after ``timeout`` (a replica that still beats but never arrives is hung).
- ``join/{replica}``: a restarted replica asks to join (before its first heartbeat, so a round
  never waits for it as the member it was); the next round that admits joiners lists
  it, and once that round commits its lowest member writes ``admit/{replica}/{incarnation}`` with
  the decision (the point and the new world), which the joiner waits for.
- ``restarting/{replica}``: set by the launcher when it starts a replica again, cleared when that
  replica asks to join; the end of training waits for it (:meth:`Membership.agree`'s
  ``restarting_s``). A replica restarted by a launcher outside the job (torchrun) counts its own
  starts in ``incarnation/{replica}`` instead, and the end of training waits for every absent
  replica with restarts left.
- ``lost``: set by a restarted replica that finds no live replica to admit it (every replica
  failed at once): the run cannot go on, and every later start fails at once.
- ``vote/{point}/{replica}``: after a round's collectives every member votes whether they
  succeeded; the round counts (commits) only when every member voted yes. A member that died
  mid-round never votes, so the survivors undo the round and run it again among themselves
  (torchft's ``should_commit`` has the same purpose).

After a decision whose world differs from the last, every member of the new world calls
:meth:`Membership.form_world`: a new gloo group among the members (ordered: members, then
joiners, so rank 0 is always a replica that trained), on a store prefix unique to the point, with
the collective ``timeout``; the rule runs over it.

Pure torch; the Lightning adapter is :class:`~lightning_hier.strategies.FaultTolerance`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import cast

import torch.distributed as dist

log = logging.getLogger(__name__)

POLL_S = 0.005
"""Pause between two looks at the store while waiting (a round costs a few of them)."""
RUN_PREFIX = "lightning_hier/run"
"""The store prefix of a run whose replicas meet on :mod:`lightning_hier.coordinator` (one run per coordinator)."""


@dataclass(frozen=True)
class Decision:
    """Who takes part in a synchronisation point.

    Attributes:
        point: The point's key (sequence number and attempt).
        members: Replicas that arrived, ordered: they run the round.
        joiners: Restarted replicas admitted after the round (they receive the state, then train).
    """

    point: str
    members: tuple[int, ...]
    joiners: tuple[int, ...] = ()

    @property
    def world(self) -> tuple[int, ...]:
        """The world after the round: members then joiners (rank 0 is a member)."""
        return self.members + self.joiners

    def encode(self) -> str:
        return json.dumps({"point": self.point, "members": self.members, "joiners": self.joiners})

    @classmethod
    def decode(cls, text: bytes | str) -> Decision:
        raw = json.loads(text)
        return cls(raw["point"], tuple(raw["members"]), tuple(raw["joiners"]))


class Liveness:
    """Which replicas still beat, from the changes of their heartbeat counters (no clocks compared)."""

    def __init__(self, store: dist.Store, dead_after_s: float) -> None:
        self.store = store
        self.dead_after_s = dead_after_s
        self._seen: dict[int, tuple[int, float]] = {}  # replica -> (counter, when it was seen to change)

    def alive(self, replica: int) -> bool:
        key = f"hb/{replica}"
        now = time.monotonic()
        value = self.store.add(key, 0) if self.store.check([key]) else -1
        seen = self._seen.get(replica)
        if seen is None or seen[0] != value:
            self._seen[replica] = (value, now)
            return value >= 0 or seen is None  # never seen beating: alive until dead_after_s says otherwise
        return now - seen[1] < self.dead_after_s


class Membership:
    """The live membership protocol of one replica (see the module docstring).

    Args:
        store: The job's coordination store (hosted outside every replica), under this job's prefix.
        replica: This replica's identity, ``0 <= replica < replicas``.
        replicas: How many replicas the job has when none has failed.
        timeout: Longest wait for a replica that beats but does not arrive, and every
            collective's limit in the groups formed.
        heartbeat_s: Seconds between two heartbeats.
        dead_after_s: Seconds without a heartbeat after which a replica counts as dead.
    """

    def __init__(
        self,
        store: dist.Store,
        replica: int,
        replicas: int,
        timeout: timedelta,
        heartbeat_s: float = 0.2,
        dead_after_s: float = 2.0,
    ) -> None:
        if not 0 <= replica < replicas:
            raise ValueError(f"Membership: `replica` must be in [0, {replicas}), got {replica}.")
        self.store = store
        self.replica = replica
        self.replicas = replicas
        self.timeout = timeout
        self.heartbeat_s = heartbeat_s
        self.liveness = Liveness(store, dead_after_s)
        self.world: tuple[int, ...] = ()
        """The replicas of the current live group, in rank order (empty before the first point)."""
        self.events: list[dict[str, object]] = []
        """What happened: one entry per change of the world and per undone round (also logged)."""
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    # ------------------------------------------------------------------ heartbeat
    def start(self, heartbeat_store: dist.Store) -> None:
        """Start beating on ``heartbeat_store`` (a second connection, so a long wait never delays a beat)."""
        if self._beat is not None:
            return
        heartbeat_store.add(f"hb/{self.replica}", 1)

        def beat() -> None:
            while not self._stop.wait(self.heartbeat_s):
                try:
                    heartbeat_store.add(f"hb/{self.replica}", 1)
                except Exception:  # the store (the launcher) is gone: the next round's store access fails
                    return

        self._beat = threading.Thread(target=beat, name=f"lightning-hier-heartbeat-{self.replica}", daemon=True)
        self._beat.start()

    def stop(self) -> None:
        self._stop.set()

    # ------------------------------------------------------------------ agreement
    def agree(
        self,
        point: str,
        expected: tuple[int, ...],
        admit: bool,
        wait_s: float | None = None,
        restarting_s: float = 0.0,
        max_restarts: int | None = None,
    ) -> Decision:
        """Arrive at ``point`` and return its decision (the same on every replica).

        Args:
            point: The synchronisation point's key (the same on every replica).
            expected: The replicas that should arrive (the world, and the joiners admitted before).
            admit: Whether restarted replicas waiting to join are admitted at this point.
            wait_s: Wait this long for every expected replica, whether it beats or not (the start
                of the job: a replica still importing has not begun to beat). ``None``: wait for
                the replicas that beat, at most ``timeout``.
            restarting_s: Also wait this long for replicas the launcher is restarting to ask to
                join (the end of training: the last chance to hand them the model).
            max_restarts: Replicas restarted by a launcher outside the job (torchrun), which marks
                nothing: with ``restarting_s``, also wait for every absent replica that has not
                used its restarts (it counts its starts in ``incarnation/{replica}``).
        """
        self.store.set(f"arrive/{point}/{self.replica}", "1")
        wait_all = wait_s is not None
        started = time.monotonic()
        deadline = started + (wait_s if wait_s is not None else self.timeout.total_seconds())
        key = f"decide/{point}"
        while True:
            if self.store.check([key]):
                return Decision.decode(self.store.get(key))
            arrived = tuple(j for j in expected if self.store.check([f"arrive/{point}/{j}"]))
            pending = [j for j in expected if j not in arrived and (wait_all or self._coming(j))]
            if restarting_s and time.monotonic() < started + restarting_s:
                pending += [j for j in range(self.replicas) if self._restarting(j, arrived, max_restarts)]
            if not pending or time.monotonic() > deadline:
                joiners = self._joiners(arrived) if admit else ()
                mine = Decision(point, tuple(sorted(arrived)), joiners)
                return Decision.decode(self.store.compare_set(key, "", mine.encode()))
            time.sleep(POLL_S)

    def _restarting(self, replica: int, arrived: tuple[int, ...], max_restarts: int | None) -> bool:
        if self.store.check([f"restarting/{replica}"]):
            return True  # the launcher's mark
        if max_restarts is None or replica in arrived or self.store.check([f"join/{replica}"]):
            return False
        return self.store.add(f"incarnation/{replica}", 0) <= max_restarts

    def _anyone_training(self) -> bool:
        """Whether a replica that is not itself waiting to join still beats (one that could admit this one)."""
        others = (j for j in range(self.replicas) if j != self.replica)
        return any(self.liveness.alive(j) for j in others if not self.store.check([f"join/{j}"]))

    def _coming(self, replica: int) -> bool:
        """Whether an expected replica that has not arrived may still come (it beats, and it is not a restart)."""
        return not self.store.check([f"join/{replica}"]) and self.liveness.alive(replica)

    def _joiners(self, members: tuple[int, ...]) -> tuple[int, ...]:
        candidates = (j for j in range(self.replicas) if j not in members)
        return tuple(j for j in candidates if self.store.check([f"join/{j}"]) and self.liveness.alive(j))

    def admit(self, decision: Decision) -> None:
        """Tell the joiners of a committed ``decision`` that they are in (one member calls it)."""
        for j in decision.joiners:
            incarnation = self.store.get(f"join/{j}").decode()
            self.store.set(f"admit/{j}/{incarnation}", decision.encode())
            self.store.delete_key(f"join/{j}")

    def ask_to_join(self, incarnation: int) -> None:
        """A restarted replica asks to join (before it beats: the others must not wait for it at a round)."""
        self.store.set(f"join/{self.replica}", str(incarnation))
        # one beat before the launcher's mark goes: an observer that no longer sees the mark must
        # see a live joiner, not the dead replica's still counter (the end of training would
        # otherwise finish without it)
        self.store.add(f"hb/{self.replica}", 1)
        self.store.delete_key(f"restarting/{self.replica}")  # the launcher's mark: from now on it is a joiner

    def wait_admission(self, incarnation: int, deadline_s: float) -> Decision:
        """Wait until a round admits this restarted replica; its decision."""
        key = f"admit/{self.replica}/{incarnation}"
        deadline = time.monotonic() + deadline_s
        while not self.store.check([key]):
            if self.store.check(["finished"]):
                raise TrainingFinished("the other replicas finished training before this one could join")
            if self.store.check(["lost"]) or not self._anyone_training():
                self.store.set("lost", "1")  # every later start learns it at once
                raise JobLost(
                    "every replica failed at once: none is left with the training state to send "
                    "(start the run again, from its last checkpoint)"
                )
            if time.monotonic() > deadline:
                raise JoinRefused(f"no round admitted it within {deadline_s:g} s")
            time.sleep(POLL_S * 10)
        return Decision.decode(self.store.get(key))

    def vote(self, point: str, ok: bool, members: tuple[int, ...]) -> bool:
        """Vote on whether ``point``'s collectives succeeded here; True when every member voted yes."""
        self.store.set(f"vote/{point}/{self.replica}", "1" if ok else "0")
        deadline = time.monotonic() + self.timeout.total_seconds()
        while True:
            votes = {j: self.store.get(f"vote/{point}/{j}") for j in members if self.store.check([f"vote/{point}/{j}"])}
            if any(v == b"0" for v in votes.values()):
                return False
            if len(votes) == len(members):
                return True
            missing = [j for j in members if j not in votes]
            if not any(self.liveness.alive(j) for j in missing) or time.monotonic() > deadline:
                return False
            time.sleep(POLL_S)

    def finished(self) -> None:
        """Say that training is over (a replica still waiting to join gives up instead of waiting)."""
        self.store.set("finished", "1")

    # ------------------------------------------------------------------ groups
    def form_world(self, world: tuple[int, ...], point: str, step: int | None = None) -> dist.ProcessGroup:
        """A new process group over the replicas of ``world``, in that order (a collective among them).

        The group is made directly on the coordination store (``ProcessGroupGloo``), not as the
        default group: the default group of a replica stays a group of one, so collectives that
        Lightning, torchmetrics or user code make on it never wait for another replica (a
        restarted replica's set-up makes collectives the running replicas never make). ``step``: the
        training steps this replica completed, for the log of :attr:`events`.
        """
        store = dist.PrefixStore(f"world/{point}", self.store)
        gloo = dist.ProcessGroupGloo(store, world.index(self.replica), len(world), self.timeout)
        group = cast(dist.ProcessGroup, gloo)  # torch.distributed's collectives take it as their group
        if world != self.world:
            left = sorted(set(self.world) - set(world))
            joined = sorted(set(world) - set(self.world)) if self.world else []
            event = {"point": point, "step": step, "world": list(world), "left": left, "joined": joined}
            self.events.append({**event, "at": time.time()})  # wall clock: compared with a driver's kill times
            log.info("lightning_hier: replica %d: world %s at %s", self.replica, list(world), point)
        self.world = world
        return group


class JoinRefused(RuntimeError):
    """A restarted replica could not join (training finished, or no round came in time)."""


class TrainingFinished(JoinRefused):
    """A restarted replica came back after the others had finished training."""


class JobLost(JoinRefused):
    """A restarted replica found no live replica to take the state from: every replica failed at once."""


def replica_store(address: str, port: int, prefix: str, timeout: timedelta) -> dist.Store:
    """A client of the launcher's coordination store, under this job's ``prefix``."""
    client = dist.TCPStore(address, port, is_master=False, timeout=timeout, wait_for_workers=False)
    return dist.PrefixStore(prefix, client)


def exit_excluded(replica: int, point: str) -> None:
    """A replica that arrived after its round was decided without it: end it so the launcher restarts it.

    Its replica missed the round's average; the way back in is the join path (the state from a peer).
    """
    print(
        f"lightning_hier: replica {replica} arrived at {point} after it was decided without it; "
        "it restarts and joins again.",
        flush=True,
    )
    os._exit(EXIT_REJOIN)


EXIT_REJOIN = 75
"""Exit status of a replica that ends itself to rejoin (``EX_TEMPFAIL``): the launcher restarts it."""
