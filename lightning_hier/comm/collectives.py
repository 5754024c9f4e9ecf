"""Thin, explicit-group wrappers around ``torch.distributed`` with byte accounting.

Every function takes the group as an argument (``None`` means "a group of one": nothing to do),
so algorithm code never reaches for a global default group by accident.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_hier.comm.stats import CommStats
from lightning_hier.digest import state_digest

Group = dist.ProcessGroup | None


def group_size(group: Group) -> int:
    """Number of ranks in ``group`` (1 for ``None``)."""
    return 1 if group is None else dist.get_world_size(group)


def payload_bytes(tensors: Sequence[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def all_reduce_sum_(tensors: Sequence[Tensor], group: Group, stats: CommStats | None = None) -> None:
    """In-place blocking SUM all-reduce of each tensor over ``group``."""
    if group is None:
        return
    works = [dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=True) for t in tensors]
    _wait(works, stats)
    if stats is not None:
        stats.add(payload_bytes(tensors), calls=len(tensors))


def all_reduce_mean_(tensors: Sequence[Tensor], group: Group, stats: CommStats | None = None) -> None:
    """In-place blocking mean over ``group`` (SUM then divide: gloo has no AVG)."""
    if group is None:
        return
    all_reduce_sum_(tensors, group, stats)
    torch._foreach_div_(list(tensors), float(group_size(group)))


def all_reduce_sum_async(tensors: Sequence[Tensor], group: Group, stats: CommStats | None = None) -> list[dist.Work]:
    """Launch SUM all-reduces in the background; wait with :func:`wait_all` before touching the tensors."""
    if group is None:
        return []
    works = [dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=True) for t in tensors]
    if stats is not None:
        stats.add(payload_bytes(tensors), calls=len(tensors))
    return [w for w in works if w is not None]


def wait_all(works: Sequence[dist.Work], stats: CommStats | None = None, timeout: timedelta | None = None) -> None:
    """Wait for background collectives, timing the wait as blocked communication.

    Args:
        works: The handles to wait for.
        stats: Where the blocked time is counted.
        timeout: Longest wait for each handle (``None``: the group's own limit). Collectives obey
            the group's timeout by themselves, but gloo bounds a point-to-point receive by the
            timeout its group was *created* with (the start-up ``init_timeout``), so point-to-point
            waits pass the run's ``timeout`` here.
    """
    _wait(list(works), stats, timeout)


def p2p_wait_limit(group: Group, timeout: timedelta | None) -> timedelta | None:
    """The limit to pass to :func:`wait_all` for point-to-point operations on ``group``.

    gloo needs ``timeout`` (it would wait for the group's creation-time limit); NCCL's watchdog
    bounds every operation itself, and a limit there would block the CPU thread until completion.
    """
    if timeout is None or dist.get_backend(group) == "nccl":
        return None
    return timeout


def broadcast_(tensors: Sequence[Tensor], src: int, group: Group, stats: CommStats | None = None) -> None:
    """Broadcast tensors from global rank ``src`` to ``group``, in place."""
    if group is None:
        return
    works = [dist.broadcast(t, src=src, group=group, async_op=True) for t in tensors]
    _wait(works, stats)
    if stats is not None:
        stats.add(payload_bytes(tensors), calls=len(tensors))


def broadcast_unless_equal_(tensors: Sequence[Tensor], src: int, group: Group, stats: CommStats | None = None) -> bool:
    """Make every rank of ``group`` hold global rank ``src``'s tensors, sending them only if needed.

    Each rank hashes its tensors (:func:`~lightning_hier.digest.state_digest`, SHA-256) and the
    digests are all-gathered; the tensors are broadcast only when some rank's digest differs from
    ``src``'s. Ranks that built their model from one seed (``seed_everything`` before the model,
    Lightning's usual set-up) start equal, and on a slow link the start-up broadcast of a float32
    model is worth many compressed rounds. Hashing moves each tensor to the CPU once, one tensor at
    a time.

    Returns:
        Whether the tensors were broadcast.
    """
    if group is None:
        return False
    device = tensors[0].device if tensors else torch.device("cpu")
    digest = bytearray.fromhex(state_digest(list(tensors)))
    mine = torch.frombuffer(digest, dtype=torch.uint8).to(device)
    every = [torch.empty_like(mine) for _ in range(group_size(group))]
    dist.all_gather(every, mine, group=group)
    if stats is not None:
        stats.add(payload_bytes([mine]) * len(every))
    reference = every[dist.get_group_rank(group, src)]
    if all(torch.equal(d, reference) for d in every):
        return False
    broadcast_(tensors, src, group, stats)
    return True


def gather_objects(obj: Any, dst: int = 0, group: Group = None) -> list[Any] | None:
    """Gather a picklable object from every rank of ``group`` onto global rank ``dst``."""
    if group is None:
        return [obj]
    out: list[Any] | None = [None] * group_size(group) if dist.get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst, group=group)
    return out


def broadcast_object(obj: Any, src: int = 0, group: Group = None) -> Any:
    """Broadcast a picklable object from global rank ``src``."""
    if group is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def _wait(works: Sequence[dist.Work | None], stats: CommStats | None, timeout: timedelta | None = None) -> None:
    if stats is None:
        _wait_each(works, timeout)
        return
    with stats.blocked():
        _wait_each(works, timeout)


def _wait_each(works: Sequence[dist.Work | None], timeout: timedelta | None) -> None:
    for w in works:
        if w is not None:
            # timedelta(0) is torch's "no limit of its own": the group's timeout applies
            w.wait(timeout if timeout is not None else timedelta(0))
