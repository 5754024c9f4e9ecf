"""Communication cost model and grid planner of the integrated model x batch x domain grid.

Gholami, Azad, Jin, Keutzer, Buluc, "Integrated Model, Batch and Domain Parallelism in Training
Neural Networks", SPAA 2018, arXiv 1712.04432. Pure torch (no Lightning): the alpha-beta model per
layer and per network (:mod:`~lightning_hier.planner.cost`), every factorisation P = Pr x Pc with
its constraints (:func:`plan_grids`, :func:`best_grid`), the paper's reference networks and any
``nn.Module`` traced on an input shape (:mod:`~lightning_hier.planner.networks`), and alpha / beta
measured on a live group (:func:`measure_link`).

Example:
    >>> from lightning_hier.planner import alexnet_layers, best_grid
    >>> best_grid(alexnet_layers(fc_only=True), 256, 512, first_input_grad=True).grid
    (64, 8)

From a shell (prints one table per world size)::

    python -m lightning_hier.planner --model alexnet-fc --batch-size 256 --world-size 512
    python -m lightning_hier.planner --model small_cnn --input-shape 3 32 32 --batch-size 256 --world-size 2 4 8
"""

from lightning_hier.planner.cost import (
    REFERENCE_LINK,
    BNLayer,
    ConvLayer,
    Cost,
    FCLayer,
    Layer,
    Link,
    Links,
    PoolLayer,
    ReplicatedLayer,
    Transition,
    UnsupportedLayer,
    inference_cost,
    layer_cost,
    network_cost,
)
from lightning_hier.planner.measure import measure_link, measure_links
from lightning_hier.planner.networks import alexnet_layers, model_layers, vgg16_layers
from lightning_hier.planner.plan import (
    GridPlan,
    bandwidth_optimal_pr,
    best_grid,
    cheapest,
    format_table,
    model_best,
    plan_grids,
)

__all__ = [
    "REFERENCE_LINK",
    "BNLayer",
    "ConvLayer",
    "Cost",
    "FCLayer",
    "GridPlan",
    "Layer",
    "Link",
    "Links",
    "PoolLayer",
    "ReplicatedLayer",
    "Transition",
    "UnsupportedLayer",
    "alexnet_layers",
    "bandwidth_optimal_pr",
    "best_grid",
    "cheapest",
    "format_table",
    "inference_cost",
    "layer_cost",
    "measure_link",
    "measure_links",
    "model_best",
    "model_layers",
    "network_cost",
    "plan_grids",
    "vgg16_layers",
]
