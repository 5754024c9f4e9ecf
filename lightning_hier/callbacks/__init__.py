"""Callbacks: the averaging schedule (PullToCenter), monitors (SampleThroughput, DBSCallback) and Straggler."""

from lightning_hier.callbacks.dbs import DBSCallback
from lightning_hier.callbacks.pull import PullToCenter
from lightning_hier.callbacks.sample_throughput import SampleThroughput
from lightning_hier.callbacks.straggler import Straggler

__all__ = ["DBSCallback", "PullToCenter", "SampleThroughput", "Straggler"]
