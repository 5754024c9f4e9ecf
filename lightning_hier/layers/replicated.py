"""Layers the grid converter must leave whole (replicated), and why.

Sharding a layer replaces it with a grid module that owns *new* parameters of a different shape.
That is only correct when nothing else reads the layer's parameters. Two patterns break it:

- **Shared (tied) parameters**: an ``nn.Embedding`` whose weight is also the output ``nn.Linear``'s.
  A converted Linear would get a copy of the weight and the tie would silently break (two
  independent tensors, each with half of the gradient).
- **Parameters read directly by a parent**: ``nn.MultiheadAttention`` never calls its ``out_proj``
  module; ``F.multi_head_attention_forward`` reads ``out_proj.weight`` itself, and would read a
  shard. Generally: a Linear or Conv2d that the traced forward never calls.

Leaving such a layer unconverted is exact outside the convolutional part: its input is replicated
over MODEL there, so every rank computes the same values and its gradients are reduced like any
replicated parameter (mean over BATCH). Inside the convolutional part (slabs of rows) an
unconverted convolution would be wrong, so the converter rejects it when ``Pr > 1``.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from torch import nn

# Modules whose forward reads their children's parameters instead of calling the children.
READS_CHILD_WEIGHTS: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)
# Leaf kinds whose weights a parent might read directly (the ones the converter would replace).
_WEIGHTED: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv2d)
# Layers with an inference fast path that reads the weights of their Linear children directly.
FAST_PATH_LAYERS: tuple[type[nn.Module], ...] = (nn.TransformerEncoderLayer,)


def replicated_leaves(module: nn.Module, called: Collection[str] | None = None, scope: str = "") -> dict[str, str]:
    """``{path: reason}`` of the leaf modules of ``module`` that must not be sharded.

    Args:
        module: The network (before conversion).
        called: Paths of the leaves a traced forward called (``None``: no trace; then only the
            structural rules apply).
        scope: Path of the submodule the trace ran through (``""``: ``module`` itself); leaves
            outside it are not judged by ``called``.
    """
    kept: dict[str, str] = {}
    owners: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)
    shared = {pid: names for pid, names in owners.items() if len(names) > 1}
    for path, m in module.named_modules():
        if list(m.children()):
            continue
        reason = _shared_reason(m, shared) or _parent_reason(module, path) or _uncalled_reason(m, path, called, scope)
        if reason:
            kept[path] = reason
    return kept


def _shared_reason(m: nn.Module, shared: dict[int, list[str]]) -> str:
    for p in m.parameters(recurse=False):
        if id(p) in shared:
            return f"its parameter is shared (tied) with {', '.join(shared[id(p)])}"
    return ""


def _parent_reason(module: nn.Module, path: str) -> str:
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        parent = module.get_submodule(".".join(parts[:i]))
        if isinstance(parent, READS_CHILD_WEIGHTS):
            return f"its parent {type(parent).__name__} reads its weights directly"
    return ""


def _uncalled_reason(m: nn.Module, path: str, called: Collection[str] | None, scope: str) -> str:
    if called is None or not isinstance(m, _WEIGHTED) or not _inside(path, scope) or path in called:
        return ""
    return "the traced forward never calls it (its parent reads its weights directly)"


def _inside(path: str, scope: str) -> bool:
    return not scope or path == scope or path.startswith(f"{scope}.")


def disable_fast_path(layer: nn.Module) -> None:
    """Make ``layer`` take its ordinary (module-calling) forward, also in inference.

    ``nn.TransformerEncoderLayer`` in eval mode without autograd runs a fused kernel on
    ``linear1.weight`` and ``linear2.weight`` directly, which would read this rank's shards. The
    fused path is skipped whenever a forward hook is attached (a documented condition of its
    forward), so a no-op pre-hook keeps the sharded layers in charge.
    """
    if _no_fast_path not in layer._forward_pre_hooks.values():
        layer.register_forward_pre_hook(_no_fast_path)


def _no_fast_path(module: nn.Module, args: Any) -> None:
    """A no-op forward pre-hook (see :func:`disable_fast_path`)."""
    return None
