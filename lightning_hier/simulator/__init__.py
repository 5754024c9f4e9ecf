"""A calibrated performance model of every strategy: what happens at 1,000 workers.

From a workload's measured compute (forward, backward and optimizer step per sample; per block
for the pipeline), its parameter and activation sizes, the link's alpha and beta (the planner's
probe, :func:`~lightning_hier.planner.measure_link`), the all-reduce algorithm and the workers'
speeds, :func:`predict` gives each strategy's time per step and epoch, bytes per worker, time
blocked in communication and staleness. Closed form, steady state; the assumptions are listed in
:mod:`lightning_hier.simulator.strategies` and the README ("Predicting performance"). Pure
torch (no Lightning).

Example:
    >>> from lightning_hier.simulator import Cluster, Workload, parse_link, predict
    >>> w = Workload("mlp", params=5_300_000, batch_size=512, samples_per_epoch=49152,
    ...              forward_s=1.6e-4, backward_s=3.1e-4)
    >>> round(predict("hpsgd", w, Cluster(2, parse_link("1gbit")), window=4).samples_per_s)
    4255

From a shell::

    python -m lightning_hier.simulator calibrate --model mlp --batch-size 512 --out mlp.json
    python -m lightning_hier.simulator predict --workload mlp.json --link 1gbit --stragglers lognormal:0.1
"""

from lightning_hier.simulator.collectives import Comm, all_reduce, broadcast, p2p
from lightning_hier.simulator.inputs import (
    ALGORITHMS,
    Block,
    Cluster,
    Workload,
    link_of_rate,
    lognormal_speeds,
    one_straggler,
    parse_link,
    parse_speeds,
)
from lightning_hier.simulator.prediction import Prediction, compute_s
from lightning_hier.simulator.registry import MODELS, predict

__all__ = [
    "ALGORITHMS",
    "MODELS",
    "Block",
    "Cluster",
    "Comm",
    "Prediction",
    "Workload",
    "all_reduce",
    "broadcast",
    "compute_s",
    "link_of_rate",
    "lognormal_speeds",
    "one_straggler",
    "p2p",
    "parse_link",
    "parse_speeds",
    "predict",
]
