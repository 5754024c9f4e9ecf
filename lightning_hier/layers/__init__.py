"""2D-parallel layers of the integrated model x batch x domain grid (pure torch, no Lightning).

Gholami, Azad, Jin, Keutzer, Buluc, "Integrated Model, Batch and Domain Parallelism in Training
Neural Networks", SPAA 2018, arXiv 1712.04432. P = Pr x Pc ranks, rank = c * Pr + r: the MODEL
dimension (size Pr) shards fully connected layers by output features and convolutions by image
rows (domain parallelism); the BATCH dimension (size Pc) splits the batch.

Plain-torch use (any training loop)::

    grid = GridContext.from_groups(Topology(world, model=2).build(rank), GridCommStats())
    to_grid(net, grid, example=torch.zeros(1, 3, 32, 32))   # in place; weights identical on all ranks
    reducer = GradientReducer(net, grid)
    loss_fn(net(x_c), y_c).backward(); reducer.reduce(); optimizer.step()
    torch.save(full_state_dict(net), "net.pt")              # a collective; loads into the original net
"""

from lightning_hier.layers.collectives import (
    all_reduce_sum,
    copy_to_model,
    even_shard_sizes,
    gather_along,
    row_exchange,
    shard_range,
    split_along,
)
from lightning_hier.layers.context import GridCommStats, GridContext, ParamKind
from lightning_hier.layers.convert import (
    Role,
    classify,
    full_state_dict,
    is_grid_model,
    load_full_state_dict,
    to_grid,
    to_ordinary,
    trace_shapes,
)
from lightning_hier.layers.grads import GradientReducer, parameter_kinds
from lightning_hier.layers.heights import SlabHeights
from lightning_hier.layers.linear import GridLinear
from lightning_hier.layers.pooling import SlabPool2d
from lightning_hier.layers.replicated import replicated_leaves
from lightning_hier.layers.rows import RowWindow, SlabPlan, slab_plan, split_problems
from lightning_hier.layers.spatial import DomainConv2d, GatherSlabs, GridBatchNorm2d

__all__ = [
    "DomainConv2d",
    "GatherSlabs",
    "GradientReducer",
    "GridBatchNorm2d",
    "GridCommStats",
    "GridContext",
    "GridLinear",
    "ParamKind",
    "Role",
    "RowWindow",
    "SlabHeights",
    "SlabPlan",
    "SlabPool2d",
    "all_reduce_sum",
    "classify",
    "copy_to_model",
    "even_shard_sizes",
    "full_state_dict",
    "gather_along",
    "is_grid_model",
    "load_full_state_dict",
    "parameter_kinds",
    "replicated_leaves",
    "row_exchange",
    "shard_range",
    "slab_plan",
    "split_along",
    "split_problems",
    "to_grid",
    "to_ordinary",
    "trace_shapes",
]
