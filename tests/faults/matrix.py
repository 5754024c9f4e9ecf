"""The cells of the fault-injection matrix: strategy family x start method x fault."""

from __future__ import annotations

from itertools import product
from typing import NamedTuple

from tests.faults.fault_fit import FAULTS

FAMILIES = ("mgrawa", "mgrawa@async", "hpsgd", "dbs", "decoupled", "grid2d", "ddp_post_local_sgd", "asgd")
"""One strategy per family (mgrawa stands for the averaging family: localsgd, easgd, lsgd, grawa;
``mgrawa@async`` for GRAWA's rounds over the parameter server; asgd for the parameter-server
family: softsync, dbs_async)."""
START_METHODS = ("fork", "popen")


class Cell(NamedTuple):
    strategy: str
    start_method: str
    fault: str

    @property
    def id(self) -> str:
        return f"{self.strategy}-{self.start_method}-{self.fault}"


FULL = [Cell(*c) for c in product(FAMILIES, START_METHODS, FAULTS)]

# Every family, every fault and both start methods at least once, in about 3 minutes on 2 cores.
SUBSET = [
    Cell("decoupled", "popen", "hang"),
    Cell("mgrawa", "popen", "kill0"),
    Cell("hpsgd", "fork", "sigint"),
    Cell("dbs", "popen", "sigterm"),
    Cell("grid2d", "fork", "kill1"),
    Cell("ddp_post_local_sgd", "popen", "raise"),
    Cell("mgrawa", "fork", "kill_save"),
    Cell("mgrawa@async", "fork", "hang"),
    Cell("mgrawa@async", "fork", "kill0"),
    Cell("asgd", "fork", "hang"),
]
