"""Point-to-point messages between neighbouring ranks, in preallocated buffers, one message each.

A pipeline stage sends a few tensors per iteration to a neighbour (an activation and its labels,
or a gradient and its loss) whose shapes the receiver does not know in advance (the last batch of
an epoch is shorter; validation batches differ from training batches). Sending a size header first
would cost a second round trip per iteration. Instead each direction to or from a peer owns one
byte buffer that both sides grow identically:

- every message is exactly the buffer's current size: a fixed header (presence, an integer tag,
  a float value, the payload size, each tensor's dtype and shape) followed by the packed payload;
- a payload that does not fit is announced in the header of a full-size message and follows in a
  second message of the new size, which becomes the buffer size on both sides.

So in the steady state a parcel costs one message and no allocation; the buffer only ever grows
(to the largest parcel seen), and shorter parcels travel padded. All operations of one
:meth:`Mailbox.exchange` are posted together with ``torch.distributed.batch_isend_irecv``.

A send need not be waited for at once: :meth:`Mailbox.send_later` leaves it in flight and the
mailbox waits for it only before the link's buffer is written again (the next parcel to that
peer) or at :meth:`Mailbox.flush`, so the transfer runs behind whatever the rank computes next.
A mailbox's messages carry its ``tag``, so two mailboxes on one group (training and evaluation)
never match each other's messages, even while one has receives posted.

Every wait is bounded by the mailbox's ``timeout``: gloo limits a point-to-point operation only by
the timeout its group was created with (the long start-up one), so a neighbour that hangs would
otherwise block this rank for that long. A wait that fails raises :class:`PeerError` naming the
peer that did not answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from math import prod

import torch
import torch.distributed as dist
from torch import Tensor
from typing_extensions import override

from lightning_hier.comm.collectives import p2p_wait_limit, wait_all
from lightning_hier.comm.stats import CommStats

Group = dist.ProcessGroup | None

_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
MAX_TENSORS = 3
MAX_DIMS = 6
_FIXED = 5  # present, tag, value bits, payload bytes, number of tensors
_PER_TENSOR = 2 + MAX_DIMS  # dtype code, ndim, dims
HEADER_WORDS = 32
HEADER_BYTES = HEADER_WORDS * 8
_ALIGN = 16


@dataclass(frozen=True)
class Parcel:
    """What one message carries: up to :data:`MAX_TENSORS` tensors, an integer tag and a float.

    Received tensors are views of the link's buffer: use or copy them before the next exchange
    with the same peer.
    """

    tensors: tuple[Tensor, ...]
    tag: int = 0
    value: float = 0.0

    def clone(self) -> Parcel:
        """A copy whose tensors own their memory (a received parcel's view the link's buffer)."""
        return Parcel(tuple(t.clone() for t in self.tensors), tag=self.tag, value=self.value)


def _aligned(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


def _layout(tensors: Sequence[Tensor]) -> list[tuple[torch.dtype, tuple[int, ...], int]]:
    if len(tensors) > MAX_TENSORS:
        raise ValueError(f"Parcel: at most {MAX_TENSORS} tensors per message, got {len(tensors)}.")
    out = []
    for t in tensors:
        if t.dtype not in _DTYPES:
            raise TypeError(f"Parcel: dtype {t.dtype} cannot be sent; supported: {', '.join(map(str, _DTYPES))}.")
        if t.dim() > MAX_DIMS:
            raise ValueError(f"Parcel: tensors may have at most {MAX_DIMS} dimensions, got shape {tuple(t.shape)}.")
        out.append((t.dtype, tuple(t.shape), t.numel() * t.element_size()))
    return out


class PeerError(RuntimeError):
    """A point-to-point message to or from a neighbour did not complete (timed out, or the peer is gone).

    Attributes:
        peers: Global ranks of the neighbours whose messages were being waited for.
    """

    def __init__(self, message: str, peers: Sequence[int]) -> None:
        super().__init__(message)
        self.peers = tuple(peers)

    @override
    def __reduce__(self) -> tuple[type[PeerError], tuple[str, tuple[int, ...]]]:
        return type(self), (str(self), self.peers)  # picklable across processes (its arguments differ)


@dataclass(frozen=True)
class _Op:
    """What one posted operation is, for the error message when waiting for it fails."""

    what: str  # "send to" / "receive from"
    peer: int


class _Link:
    """The byte buffer of one direction with one peer, grown identically on both sides."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffer = torch.zeros(HEADER_BYTES, dtype=torch.uint8, device=device)

    @property
    def header(self) -> Tensor:
        return self.buffer[:HEADER_BYTES].view(torch.int64)

    def grow(self, payload: int) -> bool:
        """Make room for ``payload`` bytes; True if the buffer had to grow (a second message follows)."""
        if HEADER_BYTES + payload <= self.buffer.numel():
            return False
        self.buffer = torch.empty(HEADER_BYTES + payload, dtype=torch.uint8, device=self.device)
        return True


def _write_header(header: Tensor, parcel: Parcel | None, payload: int) -> None:
    words = [0] * HEADER_WORDS
    if parcel is not None:
        words[0], words[1], words[3], words[4] = 1, int(parcel.tag), payload, len(parcel.tensors)
        words[2] = int(torch.tensor(float(parcel.value), dtype=torch.float64).view(torch.int64))
        for i, (dtype, shape, _) in enumerate(_layout(parcel.tensors)):
            base = _FIXED + i * _PER_TENSOR
            words[base], words[base + 1] = _DTYPES.index(dtype), len(shape)
            words[base + 2 : base + 2 + len(shape)] = shape
    header.copy_(torch.tensor(words, dtype=torch.int64))


def _pack(buffer: Tensor, tensors: Sequence[Tensor]) -> None:
    offset = HEADER_BYTES
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if nbytes:
            buffer[offset : offset + nbytes].view(t.dtype).view(t.shape).copy_(t.detach())
        offset += _aligned(nbytes)


def _unpack(buffer: Tensor, words: list[int]) -> Parcel | None:
    if not words[0]:
        return None
    value = float(torch.tensor(words[2], dtype=torch.int64).view(torch.float64))
    tensors = []
    offset = HEADER_BYTES
    for i in range(words[4]):
        base = _FIXED + i * _PER_TENSOR
        dtype, shape = _DTYPES[words[base]], tuple(words[base + 2 : base + 2 + words[base + 1]])
        nbytes = prod(shape) * torch.empty((), dtype=dtype).element_size()
        tensors.append(buffer[offset : offset + nbytes].view(dtype).view(shape))
        offset += _aligned(nbytes)
    return Parcel(tuple(tensors), tag=words[1], value=value)


def _payload_bytes(parcel: Parcel | None) -> int:
    if parcel is None:
        return 0
    return sum(_aligned(nbytes) for _, _, nbytes in _layout(parcel.tensors))


class Mailbox:
    """Batched, preallocated point-to-point parcels between this rank and its neighbours.

    Both ends of a direction must exchange the same number of messages in the same order (a
    lock-step schedule); a rank that has nothing to say sends an empty message (``None``).

    Args:
        group: Process group the peers belong to (peers are named by *global* rank).
        device: Where the buffers live (the device of the tensors being sent).
        stats: Communication accounting (payload bytes sent and time blocked waiting).
        timeout: Longest wait for one message (``None``: the group's own limit, which gloo takes
            from the group's creation). Ignored with NCCL, whose watchdog bounds every operation.
        tag: Message tag of every operation (both ends of a link must use the same).

    Example:
        >>> box = Mailbox(group=None, device=torch.device("cpu"))  # doctest: +SKIP
        >>> got = box.exchange({nxt: Parcel((act, labels), tag=7)}, recv_from=[prev])  # doctest: +SKIP
        >>> act_in, labels_in = got[prev].tensors  # doctest: +SKIP
    """

    def __init__(
        self,
        group: Group,
        device: torch.device,
        stats: CommStats | None = None,
        timeout: timedelta | None = None,
        tag: int = 0,
    ) -> None:
        self.group = group
        self.device = device
        self.stats = stats
        self.timeout = timeout
        self.tag = tag
        self._send: dict[int, _Link] = {}
        self._recv: dict[int, _Link] = {}
        self._sending: dict[int, Posted] = {}  # sends of send_later() not yet waited for, by peer

    def _link(self, table: dict[int, _Link], peer: int) -> _Link:
        if peer not in table:
            table[peer] = _Link(self.device)
        return table[peer]

    def exchange(self, send: Mapping[int, Parcel | None], recv_from: Iterable[int]) -> dict[int, Parcel | None]:
        """Send one parcel (or an empty message) to each peer of ``send``; receive one from each of ``recv_from``.

        Returns:
            The parcel received from each peer of ``recv_from`` (``None`` for an empty message).
        """
        return self.post(send, recv_from).wait()

    def post(self, send: Mapping[int, Parcel | None], recv_from: Iterable[int], follow_now: bool = False) -> Posted:
        """Start :meth:`exchange` without waiting: compute can run while the parcels travel.

        The parcels to send are packed now (their tensors may change afterwards). Until
        :meth:`Posted.wait` returns, the links involved are busy: post nothing else on them
        (a send of :meth:`send_later` to one of ``send``'s peers is completed first).
        ``follow_now``: post the second message of a parcel that outgrew its buffer at once (the
        peer matches a link's messages in order), not when :meth:`Posted.wait` is called.
        """
        self._complete_sends(send)
        ops: list[dist.P2POp] = []
        labels: list[_Op] = []
        follow: list[dist.P2POp] = []  # posted by wait(), with the peers' follow-up receives
        sent = 0
        for peer, parcel in send.items():
            link = self._link(self._send, peer)
            payload = _payload_bytes(parcel)
            first = link.buffer
            grew = link.grow(payload)
            _write_header(first[:HEADER_BYTES].view(torch.int64), parcel, payload)
            if parcel is not None:
                _pack(link.buffer, parcel.tensors)
            ops.append(dist.P2POp(dist.isend, first, peer, self.group, self.tag))
            labels.append(_Op("send to", peer))
            if grew:  # the peer reads the header of `first`, grows, then receives the follow-up
                (ops if follow_now else follow).append(dist.P2POp(dist.isend, link.buffer, peer, self.group, self.tag))
                if follow_now:
                    labels.append(_Op("send to", peer))
            sent += first.numel() + (link.buffer.numel() if grew else 0)
        peers = list(recv_from)
        for peer in peers:
            ops.append(dist.P2POp(dist.irecv, self._link(self._recv, peer).buffer, peer, self.group, self.tag))
            labels.append(_Op("receive from", peer))
        if self.stats is not None:
            self.stats.add(sent, calls=len(send))
        return Posted(self, dist.batch_isend_irecv(ops) if ops else [], labels, peers, follow)

    def send(self, peer: int, parcel: Parcel | None) -> None:
        """Blocking send of one parcel (the peer calls :meth:`recv`)."""
        self.exchange({peer: parcel}, ())

    def send_later(self, peer: int, parcel: Parcel | None) -> None:
        """Send one parcel and leave it in flight: it is waited for before the next write to the link.

        A parcel that outgrows the link's buffer has its second message posted at once too: the
        peer may take its receive before this rank waits for anything.
        """
        self._sending[peer] = self.post({peer: parcel}, (), follow_now=True)

    def flush(self) -> None:
        """Wait for every send of :meth:`send_later` still in flight."""
        self._complete_sends(list(self._sending))

    def _complete_sends(self, peers: Iterable[int]) -> None:
        for peer in peers:
            posted = self._sending.pop(peer, None)
            if posted is not None:
                posted.wait()

    def recv(self, peer: int) -> Parcel | None:
        """Blocking receive of one parcel (the peer calls :meth:`send`)."""
        return self.exchange({}, (peer,))[peer]


class Posted:
    """Point-to-point operations of :meth:`Mailbox.post` in flight."""

    def __init__(
        self, box: Mailbox, works: list[dist.Work], labels: list[_Op], peers: list[int], follow: list[dist.P2POp]
    ) -> None:
        self._box, self._works, self._labels, self._peers, self._follow = box, works, labels, peers, follow

    def wait(self) -> dict[int, Parcel | None]:
        """Wait for every operation; returns the parcel received from each peer (``None``: empty message).

        Raises:
            PeerError: An operation did not complete within the mailbox's ``timeout`` (or its peer
                is gone); the message names the peer.
        """
        box = self._box
        self._wait(self._works, self._labels)
        links = {peer: box._recv[peer] for peer in self._peers}
        headers = {peer: link.header.tolist() for peer, link in links.items()}
        grown = [peer for peer, link in links.items() if link.grow(headers[peer][3])]
        follow = self._follow + [dist.P2POp(dist.irecv, links[peer].buffer, peer, box.group, box.tag) for peer in grown]
        if follow:
            labels = [_Op("send to", op.peer) for op in self._follow] + [_Op("receive from", p) for p in grown]
            self._wait(dist.batch_isend_irecv(follow), labels)
        return {peer: _unpack(link.buffer, headers[peer]) for peer, link in links.items()}

    def _wait(self, works: list[dist.Work], labels: list[_Op]) -> None:
        box = self._box
        limit = p2p_wait_limit(box.group, box.timeout)
        # gloo returns one handle per operation; a backend that coalesces returns fewer
        pairs = list(zip(works, labels, strict=True)) if len(works) == len(labels) else [(w, None) for w in works]
        for work, label in pairs:
            try:
                wait_all([work], box.stats, limit)
            except RuntimeError as err:
                raise _peer_error(err, [label] if label is not None else labels, limit) from err


def _peer_error(err: RuntimeError, labels: list[_Op], limit: timedelta | None) -> PeerError:
    rank = dist.get_rank()
    what = " and ".join(f"{op.what} rank {op.peer}" for op in labels)
    waited = f"within {limit.total_seconds():g} s" if limit is not None else "within the group's timeout"
    peers = sorted({op.peer for op in labels})
    return PeerError(
        f"lightning_hier: rank {rank}: a point-to-point message ({what}) did not complete {waited}: "
        f"rank(s) {peers} did not answer. {str(err).strip().splitlines()[0] if str(err).strip() else repr(err)}",
        peers,
    )
