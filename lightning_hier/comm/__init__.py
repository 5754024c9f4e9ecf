"""torch.distributed helpers: flat buffers, explicit-group collectives, P2P parcels, accounting, failure reports.

This layer imports torch only (never lightning or hydra).
"""

from lightning_hier.comm.clock import PhaseClock
from lightning_hier.comm.collectives import (
    all_reduce_mean_,
    all_reduce_sum_,
    all_reduce_sum_async,
    broadcast_,
    broadcast_object,
    broadcast_unless_equal_,
    gather_objects,
    group_size,
    payload_bytes,
    wait_all,
)
from lightning_hier.comm.failures import FailureBoard, is_communication_error
from lightning_hier.comm.flat import FlatTensors, Segment
from lightning_hier.comm.inbox import Inbox
from lightning_hier.comm.p2p import Mailbox, Parcel, PeerError
from lightning_hier.comm.stats import CommStats

__all__ = [
    "CommStats",
    "FailureBoard",
    "FlatTensors",
    "Inbox",
    "Mailbox",
    "Parcel",
    "PeerError",
    "PhaseClock",
    "Segment",
    "all_reduce_mean_",
    "all_reduce_sum_",
    "all_reduce_sum_async",
    "broadcast_",
    "broadcast_object",
    "broadcast_unless_equal_",
    "gather_objects",
    "group_size",
    "is_communication_error",
    "payload_bytes",
    "wait_all",
]
