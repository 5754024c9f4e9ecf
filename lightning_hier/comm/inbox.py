"""One message per iteration from one neighbour, received in the background and taken when needed.

A lock-step pipeline gets at most one parcel per iteration on each decoupled link, and uses the
parcel of iteration ``t`` somewhere in iteration ``t + 1``. :class:`Inbox` keeps the receive of
the current iteration's parcel posted until the rank needs it, so the transfer runs behind the
compute that comes before the point of use (rather than ending the iteration that sent it).
"""

from __future__ import annotations

from lightning_hier.comm.p2p import Mailbox, Parcel, Posted


class Inbox:
    """The parcels one peer sends over a :class:`Mailbox`, at most one per iteration, taken one iteration later.

    Call :meth:`take` exactly once per iteration, saying whether the peer sends in it (both ends
    know that from the schedule, so an iteration with nothing to say sends no message at all), and
    :meth:`settle` once after the last one.

    Args:
        mail: The mailbox of the link (its ``tag`` keeps other mailboxes' messages apart).
        peer: Global rank of the sender.
    """

    def __init__(self, mail: Mailbox, peer: int) -> None:
        self.mail = mail
        self.peer = peer
        self._posted: Posted | None = None

    def take(self, expect: bool = True) -> Parcel | None:
        """The previous iteration's parcel (a copy, ``None`` if empty or none); posts this iteration's receive.

        Args:
            expect: Whether the peer sends in this iteration (``False``: nothing is posted).
        """
        got = self.settle()
        if expect:
            self._posted = self.mail.post({}, (self.peer,))
        return got

    def settle(self) -> Parcel | None:
        """Wait for the receive in flight, if any, and return its parcel (a copy); nothing stays posted."""
        posted, self._posted = self._posted, None
        if posted is None:
            return None
        parcel = posted.wait()[self.peer]
        # the received tensors view the link's buffer, which the next receive overwrites
        return parcel.clone() if parcel is not None else None

    @property
    def pending(self) -> bool:
        """Whether a receive is posted."""
        return self._posted is not None
