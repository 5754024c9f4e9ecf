"""Messages between parameter-server workers and the server: a float64 header, then flat tensors.

A message is a fixed-size ``float64`` header (the sender's scalars, the number of tensors, each
tensor's dtype code and length) followed by one point-to-point message per tensor, all on the
group and tag given. Tensors travel flat (1-D); the receiver allocates them from the header, so
sizes may change between messages (a worker's batch, a handler's own payload). Every wait is
bounded by ``timeout`` (gloo would otherwise wait for the group's creation-time limit) and a
failed wait raises :class:`~lightning_hier.comm.p2p.PeerError` naming the peer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_hier.comm.collectives import p2p_wait_limit
from lightning_hier.comm.p2p import PeerError

Group = dist.ProcessGroup | None

SCALARS = 4
"""Scalars a message carries before its tensor table (kind, version, batch size, seconds)."""
MAX_TENSORS = 4
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32)
HEADER_LEN = SCALARS + 1 + 2 * MAX_TENSORS


def _header(scalars: Sequence[float], tensors: Sequence[Tensor]) -> Tensor:
    if len(scalars) > SCALARS or len(tensors) > MAX_TENSORS:
        raise ValueError(f"ps_wire: at most {SCALARS} scalars and {MAX_TENSORS} tensors per message.")
    words = [0.0] * HEADER_LEN
    words[: len(scalars)] = [float(s) for s in scalars]
    words[SCALARS] = len(tensors)
    for i, t in enumerate(tensors):
        if t.dtype not in _DTYPES:
            raise TypeError(f"ps_wire: dtype {t.dtype} cannot be sent; supported: {', '.join(map(str, _DTYPES))}.")
        words[SCALARS + 1 + 2 * i : SCALARS + 3 + 2 * i] = [_DTYPES.index(t.dtype), t.numel()]
    return torch.tensor(words, dtype=torch.float64)


def _wait(post: Callable[[], dist.Work | None], what: str, peer: int, group: Group, timeout: timedelta | None) -> None:
    """Post one operation and wait for it; any failure (posting too: a closed pair) names ``peer``."""
    limit = p2p_wait_limit(group, timeout)
    try:
        work = post()
        if work is not None:
            work.wait(limit if limit is not None else timedelta(0))
    except Exception as err:
        within = f" within {timeout.total_seconds():g} s" if timeout is not None else ""
        raise PeerError(
            f"lightning_hier parameter server: {what} rank {peer} did not answer{within} "
            f"(rank {peer} is hung, dead or too slow: {type(err).__name__}: {err})",
            [peer],
        ) from err


def to_host(tensors: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """``tensors``, detached, in host memory (CPU tensors as they are): where messages live.

    The server keeps its state there too, so a worker training on a GPU and rank 0's in-process
    worker hand it the same kind of tensor as a message from the wire (gloo, host memory only).
    """
    return tuple(t.detach().cpu() for t in tensors)


def send_message(
    scalars: Sequence[float], tensors: Sequence[Tensor], dst: int, group: Group, timeout: timedelta, tag: int = 0
) -> None:
    """Send a header of ``scalars`` and the flat ``tensors`` to global rank ``dst`` (blocking)."""
    flat = [t.reshape(-1).contiguous() for t in to_host(tensors)]
    for t in [_header(scalars, flat), *(t for t in flat if t.numel())]:
        _wait(partial(dist.isend, t, dst, group=group, tag=tag), "sending to", dst, group, timeout)


def recv_message(
    src: int, group: Group, timeout: timedelta | None, tag: int = 0, device: torch.device | None = None
) -> tuple[list[float], list[Tensor]]:
    """Receive one :func:`send_message` from global rank ``src``; returns its scalars and tensors.

    ``timeout=None`` waits as long as the group's own limit allows.
    """
    header = torch.empty(HEADER_LEN, dtype=torch.float64)
    _wait(partial(dist.irecv, header, src, group=group, tag=tag), "receiving from", src, group, timeout)
    words = header.tolist()
    tensors = []
    for i in range(int(words[SCALARS])):
        code, numel = words[SCALARS + 1 + 2 * i : SCALARS + 3 + 2 * i]
        t = torch.empty(int(numel), dtype=_DTYPES[int(code)], device=device)
        if t.numel():
            _wait(partial(dist.irecv, t, src, group=group, tag=tag), "receiving from", src, group, timeout)
        tensors.append(t)
    return words[:SCALARS], tensors
