"""Callbacks: a rule on Lightning's own DDP (OnDDP), the averaging schedule (PullToCenter), monitors and Straggler."""

from lightning_hier.callbacks.dbs import DBSCallback
from lightning_hier.callbacks.on_ddp import OnDDP
from lightning_hier.callbacks.pull import PullToCenter
from lightning_hier.callbacks.sample_throughput import SampleThroughput
from lightning_hier.callbacks.straggler import Straggler

__all__ = ["DBSCallback", "OnDDP", "PullToCenter", "SampleThroughput", "Straggler"]
