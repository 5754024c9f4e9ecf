"""Every strategy's model by registry name, and :func:`predict`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_hier.simulator.asynchronous import asgd, dbs_async, softsync
from lightning_hier.simulator.inputs import Cluster, Workload
from lightning_hier.simulator.peers import (
    ddp_fp16,
    ddp_post_local_sgd,
    ddp_powersgd,
    torchft_diloco,
    torchft_local_sgd,
)
from lightning_hier.simulator.prediction import Prediction
from lightning_hier.simulator.strategies import (
    dbs,
    ddp,
    decoupled,
    diloco,
    easgd,
    grid2d,
    hpsgd,
    lgrawa,
    localsgd,
    lsgd,
    mgrawa,
    no_comm,
)

MODELS: dict[str, Callable[..., Prediction]] = {
    "ddp": ddp,
    "hpsgd": hpsgd,
    "diloco": diloco,
    "localsgd": localsgd,
    "easgd": easgd,
    "lsgd": lsgd,
    "mgrawa": mgrawa,
    "grawa": mgrawa,
    "lgrawa": lgrawa,
    "dbs": dbs,
    "decoupled": decoupled,
    "grid2d": grid2d,
    "asgd": asgd,
    "softsync": softsync,
    "dbs_async": dbs_async,
    "no-comm": no_comm,
    "ddp_post_local_sgd": ddp_post_local_sgd,
    "ddp_powersgd": ddp_powersgd,
    "ddp_fp16": ddp_fp16,
    "torchft_local_sgd": torchft_local_sgd,
    "torchft_diloco": torchft_diloco,
}
"""Registry name -> model (GRAWA's asynchronous rounds: ``mgrawa`` / ``lgrawa`` with ``rounds='async'``;
torch's DDP hooks and torchft's algorithms by their strategy names, :mod:`lightning_hier.simulator.peers`)."""


def predict(strategy: str, workload: Workload, cluster: Cluster, **args: Any) -> Prediction:
    """The prediction of ``strategy`` with its arguments ``args`` (unknown ones are an error)."""
    if strategy not in MODELS:
        raise ValueError(f"simulator.predict: `strategy` must be one of {sorted(MODELS)}, got {strategy!r}.")
    try:
        return MODELS[strategy](workload, cluster, **args)
    except TypeError as err:
        raise ValueError(f"simulator.predict: bad arguments {args} for strategy {strategy!r}: {err}") from err
