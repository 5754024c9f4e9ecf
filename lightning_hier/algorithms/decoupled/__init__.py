"""Data parallelism x fully decoupled backpropagation: a lock-step pipeline with delayed gradients.

Pham and Ahn, "Distributed Deep Learning using Stochastic Gradient Staleness", arXiv 2509.05679
(2025), built on FDG (Zhuang, Wang, Xiao, Xiao, Lin, "Fully Decoupled Neural Network Learning
Using Delayed Gradients", arXiv 1906.09108, IEEE TNNLS 2022; code github.com/ZHUANGHP/FDG) and DDG
(Huo, Gu, Yang, Huang, "Decoupled Parallel Backpropagation with Convergence Guarantee", ICML 2018,
arXiv 1804.10574; code github.com/slowbull/DDG).

The network is cut into ``K`` sequential stages on ``K`` ranks; each stage updates with a delayed
gradient, so forward, backward and update never wait on each other. The pipeline is replicated
``N`` times (an ``N x K`` grid, ``rank(d, k) = d * K + k``) and each stage averages its gradient
over its data-parallel group ``{d * K + k}``. Pure torch; usable from a plain training loop:

- :mod:`.schedule`: staleness and iteration arithmetic of ``fdg`` / ``ddg`` / ``sync``;
- :mod:`.partition`: cutting an ordered list of blocks into stages (explicit or time-balanced);
- :mod:`.stage`: a stage's forward/backward at a weight version (``stash`` / ``recompute`` / ``legacy``);
- :mod:`.engine`: :class:`DecoupledPipeline`, the lock-step iteration with per-stage FIFOs.
"""

from lightning_hier.algorithms.decoupled.engine import WIRE_DTYPES, DecoupledPipeline, IterationReport
from lightning_hier.algorithms.decoupled.partition import (
    balanced_split,
    block_output_bytes,
    check_split_points,
    check_stage_count,
    measure_block_costs,
    stage_ranges,
)
from lightning_hier.algorithms.decoupled.schedule import ORDERS, SCHEDULES, Schedule
from lightning_hier.algorithms.decoupled.stage import WEIGHTS, InFlight, StageRunner

__all__ = [
    "ORDERS",
    "SCHEDULES",
    "WEIGHTS",
    "WIRE_DTYPES",
    "DecoupledPipeline",
    "InFlight",
    "IterationReport",
    "Schedule",
    "StageRunner",
    "balanced_split",
    "block_output_bytes",
    "check_split_points",
    "check_stage_count",
    "measure_block_costs",
    "stage_ranges",
]
