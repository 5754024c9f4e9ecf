"""Turn an ordinary network into its grid-parallel form, and back.

:func:`to_grid` walks the leaf modules in the order they are registered (the execution order of
``nn.Sequential`` networks and of blocks written like :class:`~lightning_hier.models.BasicBlock`)
and replaces, in place:

==========================  ================================================================
ordinary module             grid form
==========================  ================================================================
``nn.Linear``               :class:`GridLinear` (rows sharded over MODEL); kept replicated when
                            ``out_features < Pr``
first ``nn.Conv2d``         :class:`DomainConv2d` that first takes this rank's slab of the
                            whole images (every rank of a MODEL group sees the same batch)
later ``nn.Conv2d``         :class:`DomainConv2d`
``nn.BatchNorm2d``          :class:`GridBatchNorm2d` (inside the convolutional part)
``nn.MaxPool2d/AvgPool2d``  :class:`SlabPool2d` (overlapping / padded windows exchange rows)
``nn.Flatten``, adaptive    :class:`GatherSlabs` around it: the conv -> FC transition
pooling after a conv
activations, dropout        unchanged (element-wise: correct on slabs)
a layer with tied weights,  unchanged (replicated; exact outside the convolutional part):
or whose parent reads its   see :mod:`lightning_hier.layers.replicated` (e.g. an embedding
weights (MHA ``out_proj``)  tied to the output Linear, ``nn.MultiheadAttention.out_proj``)
==========================  ================================================================

``nn.TransformerEncoderLayer`` keeps its attention whole and shards its MLP (``linear1``,
``linear2``); its fused inference path, which reads those weights directly, is turned off.
Anything else inside the convolutional part is rejected with the list of what is supported.
Custom blocks are converted through their children; their own ``forward`` code must be
element-wise or slab-safe along H. ResNet's ``x[:, :, ::2, ::2]`` shortcut is slab-safe only
where every slab of its input starts at an even row (e.g. heights divisible by 2 Pr): the
converter cannot see inside a custom ``forward``, so it does not check this.

All spatial layers of one conversion share a :class:`~lightning_hier.layers.heights.SlabHeights`
(the global height of each layer's input), filled from the trace of ``example`` when given.

:func:`full_state_dict` gathers the ordinary ``state_dict`` (same keys and shapes as the original
network), :func:`load_full_state_dict` shards one back in, :func:`to_ordinary` builds the ordinary
network for export. All three are collectives: call them on every rank.
"""

from __future__ import annotations

import copy
from collections.abc import Collection
from enum import Enum
from typing import Any

import torch
from torch import Tensor, nn

from lightning_hier.layers.context import GridContext
from lightning_hier.layers.heights import SlabHeights
from lightning_hier.layers.linear import GridLinear
from lightning_hier.layers.pooling import SlabPool2d
from lightning_hier.layers.replicated import FAST_PATH_LAYERS, disable_fast_path, replicated_leaves
from lightning_hier.layers.spatial import DomainConv2d, GatherSlabs, GridBatchNorm2d

SLAB_SAFE: tuple[type[nn.Module], ...] = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.ELU,
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.Sigmoid,
    nn.Tanh,
    nn.Hardtanh,
    nn.Hardswish,
    nn.Identity,
    nn.Dropout,
    nn.Dropout2d,
)
TRANSITIONS: tuple[type[nn.Module], ...] = (nn.Flatten, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)
Shapes = dict[str, tuple[torch.Size, torch.Size]]
GRID_MODULES: tuple[type[nn.Module], ...] = (GridLinear, DomainConv2d, GridBatchNorm2d, SlabPool2d, GatherSlabs)


def is_grid_model(module: nn.Module) -> bool:
    """Whether ``module`` already contains grid layers."""
    return any(isinstance(m, GRID_MODULES) for m in module.modules())


def trace_shapes(module: nn.Module, example: Tensor) -> dict[str, tuple[torch.Size, torch.Size]]:
    """Input and output shapes of every leaf module called by ``module(example)`` (eval mode, no grad)."""
    shapes: dict[str, tuple[torch.Size, torch.Size]] = {}
    names = {id(m): n for n, m in module.named_modules()}

    def hook(m: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        if args and isinstance(args[0], Tensor) and isinstance(out, Tensor):
            shapes.setdefault(names[id(m)], (args[0].shape, out.shape))

    leaves = [m for m in module.modules() if not list(m.children())]
    handles = [m.register_forward_hook(hook) for m in leaves]
    was_training = module.training
    try:
        module.eval()
        with torch.no_grad():
            module(example)
    finally:
        module.train(was_training)
        for h in handles:
            h.remove()
    return shapes


class Role(str, Enum):
    """What a leaf module is in the grid: decided by :func:`classify`, acted on by :func:`to_grid`."""

    LINEAR = "linear"  # fully connected on activations replicated over MODEL: sharded by rows
    FIRST_CONV = "first_conv"  # the first convolution: takes its slab of the replicated input
    CONV = "conv"
    BATCHNORM = "batchnorm"  # BatchNorm2d on slabs
    POOL = "pool"
    TRANSITION = "transition"  # the conv -> FC transition: gather the slabs
    SLAB_SAFE = "slab_safe"  # element-wise on slabs: unchanged
    REPLICATED = "replicated"  # any other module on activations replicated over MODEL: unchanged
    UNSUPPORTED = "unsupported"  # cannot run on slabs (fine with Pr = 1)


def classify(
    module: nn.Module, called: Collection[str] | None = None, scope: str = ""
) -> list[tuple[str, nn.Module, Role, str]]:
    """``(path, leaf module, role, reason)`` for every leaf, in registration order.

    Before the first ``Conv2d`` activations are whole inputs replicated over MODEL; from it to the
    first ``Flatten`` / adaptive pooling they are slabs of rows; after that, replicated again.
    ``reason`` says why a leaf is ``UNSUPPORTED`` (empty otherwise). Leaves that must stay whole
    (tied parameters, weights read by the parent: :func:`~lightning_hier.layers.replicated.replicated_leaves`,
    with ``called`` and ``scope`` from a trace) are ``REPLICATED``, or ``UNSUPPORTED`` where they
    would have to run on slabs.
    """
    out: list[tuple[str, nn.Module, Role, str]] = []
    kept = replicated_leaves(module, called, scope)
    region = "input"  # -> "spatial" after the first conv -> "fc" after the transition
    for path, m in module.named_modules():
        if list(m.children()):
            continue
        role, reason = _role(m, region)
        if path in kept and role not in (Role.SLAB_SAFE, Role.REPLICATED, Role.UNSUPPORTED):
            role, reason = _kept_role(m, region, kept[path])
        if role in (Role.FIRST_CONV, Role.CONV):
            region = "spatial"
        elif role is Role.TRANSITION:
            region = "fc"
        out.append((path, m, role, reason))
    return out


def _role(m: nn.Module, region: str) -> tuple[Role, str]:
    if isinstance(m, nn.Conv2d):
        if region == "fc":
            return Role.UNSUPPORTED, "a convolution after the conv -> FC transition (only one convolutional part)"
        return (Role.FIRST_CONV if region == "input" else Role.CONV), ""
    if region != "spatial":
        return (Role.LINEAR if isinstance(m, nn.Linear) else Role.REPLICATED), ""
    if type(m) is nn.BatchNorm2d:
        return Role.BATCHNORM, ""
    if isinstance(m, nn.MaxPool2d | nn.AvgPool2d):
        return Role.POOL, ""
    if isinstance(m, TRANSITIONS):
        return Role.TRANSITION, ""
    if isinstance(m, SLAB_SAFE):
        return Role.SLAB_SAFE, ""
    allowed = ", ".join(t.__name__ for t in (nn.Conv2d, nn.BatchNorm2d, nn.MaxPool2d, nn.AvgPool2d, *SLAB_SAFE))
    ends = ", ".join(t.__name__ for t in TRANSITIONS)
    what = "a Linear on image activations" if isinstance(m, nn.Linear) else type(m).__name__
    return Role.UNSUPPORTED, (
        f"{what} cannot run on slabs of image rows; inside the convolutional part use {allowed}, and end it with {ends}"
    )


def _kept_role(m: nn.Module, region: str, why: str) -> tuple[Role, str]:
    if region == "spatial" or isinstance(m, nn.Conv2d):
        return Role.UNSUPPORTED, f"{type(m).__name__} must stay whole ({why}), but it would run on slabs of image rows"
    return Role.REPLICATED, ""


def _grid_form(m: nn.Module, role: Role, grid: GridContext, heights: SlabHeights, path: str) -> nn.Module:
    if role is Role.LINEAR and isinstance(m, nn.Linear) and m.out_features >= grid.pr:
        return GridLinear.from_linear(m, grid)
    if role in (Role.FIRST_CONV, Role.CONV) and isinstance(m, nn.Conv2d):
        return DomainConv2d.from_conv(m, grid, role is Role.FIRST_CONV, heights, path)
    if role is Role.BATCHNORM and isinstance(m, nn.BatchNorm2d):
        return GridBatchNorm2d.from_batchnorm(m, grid, heights, path)
    if role is Role.POOL and isinstance(m, nn.MaxPool2d | nn.AvgPool2d):
        return SlabPool2d(m, grid, heights, path)
    if role is Role.TRANSITION:
        return GatherSlabs(m, grid, heights, path)
    return m


def _learn_heights(heights: SlabHeights, leaves: list[tuple[str, nn.Module, Role, str]], shapes: Shapes) -> None:
    """Record each spatial layer's global input height for the traced image size."""
    first = next((path for path, _, role, _ in leaves if role is Role.FIRST_CONV and path in shapes), None)
    if first is None:
        return
    size = shapes[first][0][2:]
    for path, _, role, _ in leaves:
        if role in (Role.CONV, Role.BATCHNORM, Role.POOL, Role.TRANSITION) and path in shapes:
            heights.learn(path, size, shapes[path][0][2])


def to_grid(module: nn.Module, grid: GridContext, example: Tensor | None = None, network: str = "") -> nn.Module:
    """Convert ``module`` in place into its grid-parallel form (see the module docstring).

    Args:
        module: An ordinary network, identical on every rank (broadcast it first).
        grid: This rank's grid context.
        example: An example input batch of the submodule at ``network``: its shapes let every
            spatial layer be checked now, with the layer's name in the message, rather than at the
            first forward, and the leaves it never calls are kept whole (their parent reads them).
        network: Dotted path of the submodule ``example`` is the input of (``""``: ``module``
            itself, e.g. a LightningModule without a ``forward`` of its own traces its network).

    Returns:
        ``module``, converted. A model converted before (e.g. fitted by an earlier Trainer) is only
        re-attached to ``grid`` (its process groups and accounting), which must have the same shape
        and coordinates.

    Raises:
        ValueError: A layer cannot be split on this grid (the message names it and says why).
    """
    if is_grid_model(module):
        _rebind(module, grid)
        return module
    shapes: Shapes = {}
    if example is not None:
        prefix = f"{network}." if network else ""
        traced = trace_shapes(module.get_submodule(network), example)
        shapes = {f"{prefix}{path}" if path else network: io for path, io in traced.items()}
    leaves = classify(module, set(shapes) if example is not None else None, network)
    for path, m, role, reason in leaves:
        if role is Role.UNSUPPORTED and grid.pr > 1:
            raise ValueError(f"to_grid: layer {path} ({type(m).__name__}): {reason} (Pr={grid.pr}).")
    roles = {r for _, _, r, _ in leaves}
    if grid.pr > 1 and Role.FIRST_CONV in roles and Role.TRANSITION not in roles:
        raise ValueError(
            "to_grid: the convolutional part never ends: add an nn.Flatten or adaptive pooling module before "
            "the fully connected layers (the conv -> FC transition gathers the slabs there)."
        )
    heights = SlabHeights()
    _learn_heights(heights, leaves, shapes)
    converted: list[str] = []
    for path, m, role, _ in leaves:
        try:
            new = _grid_form(m, role, grid, heights, path)
        except ValueError as err:
            raise ValueError(f"to_grid: layer {path}: {err}") from None
        if new is not m:
            parent, _, name = path.rpartition(".")
            setattr(module.get_submodule(parent), name, new)
            converted.append(path)
    _keep_module_calls(module, converted)
    return module


def _keep_module_calls(module: nn.Module, converted: list[str]) -> None:
    """Turn off the fused inference paths that would read converted children's weights directly."""
    for prefix, m in module.named_modules():
        if not any(p.startswith(f"{prefix}.") or not prefix for p in converted):
            continue
        if isinstance(m, FAST_PATH_LAYERS):
            disable_fast_path(m)
        elif isinstance(m, nn.TransformerEncoder):
            m.use_nested_tensor = False  # nested tensors cannot be all-gathered by the grid layers


def _rebind(module: nn.Module, grid: GridContext) -> None:
    for m in module.modules():
        if isinstance(m, GRID_MODULES):
            old: GridContext = vars(m)["grid"]  # a plain attribute: neither a module nor a tensor
            if (old.pr, old.pc, old.r, old.c) != (grid.pr, grid.pc, grid.r, grid.c):
                raise ValueError(
                    f"to_grid: the model was converted for rank (r={old.r}, c={old.c}) of a {old.pr} x {old.pc} grid, "
                    f"not (r={grid.r}, c={grid.c}) of {grid.pr} x {grid.pc}; convert a fresh model, or load its "
                    "ordinary state_dict (full_state_dict) into one."
                )
            vars(m)["grid"] = grid


# ---------------------------------------------------------------------------- back to ordinary
def full_state_dict(module: nn.Module) -> dict[str, Tensor]:
    """The ``state_dict`` of the ordinary network: sharded weights gathered over MODEL (a collective)."""
    state = {k: v.detach() for k, v in module.state_dict().items()}
    for prefix, m in module.named_modules():
        if isinstance(m, GridLinear):
            state.update({_key(prefix, name): value for name, value in m.full_parameters().items()})
    return state


def load_full_state_dict(module: nn.Module, state: dict[str, Tensor], strict: bool = True) -> None:
    """Load an ordinary ``state_dict`` into the grid model (each rank keeps its own shards)."""
    local = dict(state)
    for prefix, m in module.named_modules():
        if isinstance(m, GridLinear):
            for name in ("weight", "bias"):
                if _key(prefix, name) in local:
                    local[_key(prefix, name)] = m.shard(local[_key(prefix, name)])
    module.load_state_dict(local, strict=strict)


def to_ordinary(module: nn.Module, inplace: bool = False) -> nn.Module:
    """The ordinary network with the gathered weights (a collective; a copy unless ``inplace``)."""
    target = module if inplace else copy.deepcopy(module)
    _unconvert(target)
    return target


def _unconvert(parent: nn.Module) -> None:
    for name, child in list(parent.named_children()):
        if isinstance(child, GridLinear):
            setattr(parent, name, child.to_linear())
        elif isinstance(child, DomainConv2d):
            setattr(parent, name, child.to_conv())
        elif isinstance(child, GridBatchNorm2d):
            setattr(parent, name, child.to_batchnorm())
        elif isinstance(child, SlabPool2d | GatherSlabs):
            setattr(parent, name, child.inner)
        else:
            _unconvert(child)


def _key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
