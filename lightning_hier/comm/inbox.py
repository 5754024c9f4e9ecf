"""One message per iteration from one neighbour, received in the background and taken when needed.

A lock-step pipeline gets exactly one parcel per iteration on each decoupled link, and uses the
parcel of iteration ``t`` somewhere in iteration ``t + 1``. :class:`Inbox` keeps the receive of
the current iteration's parcel posted until the rank needs it, so the transfer runs behind the
compute that comes before the point of use (rather than ending the iteration that sent it).

With two *lanes* (mailboxes with different tags; parcel ``t`` travels on lane ``t % 2``) the
receive of parcel ``t + 1`` is posted when parcel ``t - 1`` is taken, an iteration before it is
needed. gloo sends a point-to-point message only after the receiver's notice that the receive is
posted, and that notice travels behind whatever the other direction is sending; posted one
iteration early, it is there before the sender is (docs/lightning.md, section 10).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from lightning_hier.comm.p2p import Mailbox, Parcel, Posted


class Inbox:
    """The parcels one peer sends over a :class:`Mailbox`, one per iteration, taken one iteration later.

    Call :meth:`take` exactly once per iteration (the peer sends exactly once per iteration, on
    lane ``iteration % len(lanes)``), and :meth:`settle` once after the last one. With more than
    one lane, set :attr:`last` before the run's last ``len(lanes) - 1`` iterations, so no receive
    is posted for a parcel that will not be sent.

    Args:
        lanes: The mailbox of the link, or several with different tags (their ``tag`` keeps other
            mailboxes' messages apart, and a parcel's follow-up message on its own lane).
        peer: Global rank of the sender.
    """

    def __init__(self, lanes: Mailbox | Sequence[Mailbox], peer: int) -> None:
        self.lanes = (lanes,) if isinstance(lanes, Mailbox) else tuple(lanes)
        if not self.lanes:
            raise ValueError("Inbox: needs at least one mailbox.")
        self.peer = peer
        self.last: int | None = None
        """Index of the run's last parcel, once known (``None``: the run goes on)."""
        self._posted: deque[Posted] = deque()
        self._taken = 0  # takes so far: the index of the parcel the next take posts (at least)
        self._next = 0  # index of the next parcel to post a receive for

    def take(self) -> Parcel | None:
        """The previous iteration's parcel (a copy, ``None`` if empty or none); posts the next receives."""
        got = self._wait_oldest() if self._taken > 0 else None
        limit = self._taken + len(self.lanes)  # this iteration's parcel and the lanes' look-ahead
        if self.last is not None:
            limit = min(limit, self.last + 1)
        while self._next < limit:
            lane = self.lanes[self._next % len(self.lanes)]
            self._posted.append(lane.post({}, (self.peer,)))
            self._next += 1
        self._taken += 1
        return got

    def settle(self) -> Parcel | None:
        """Wait for every receive in flight and return the newest parcel (a copy); nothing stays posted.

        The counters restart: the next :meth:`take` is an iteration 0 again.
        """
        got = None
        while self._posted:
            got = self._wait_oldest()
        self._taken = self._next = 0
        self.last = None
        return got

    def _wait_oldest(self) -> Parcel | None:
        parcel = self._posted.popleft().wait()[self.peer]
        # the received tensors view the lane's buffer, which its next receive overwrites
        return parcel.clone() if parcel is not None else None

    @property
    def pending(self) -> bool:
        """Whether a receive is posted."""
        return bool(self._posted)
