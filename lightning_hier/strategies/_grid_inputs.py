"""What :class:`~lightning_hier.strategies.Grid2DStrategy` reads from its arguments and the user's module.

The ``grid`` argument, the DataLoader batch size and input shape that ``grid='auto'`` costs, and
where in the module the network to trace lives.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr
from torch import Tensor

from lightning_hier import _validate as v
from lightning_hier.strategies._user_model import defines_forward, find_network


def check_grid(owner: str, grid: Any) -> tuple[int, int] | None:
    """``None`` for ``'auto'``, else the validated ``(Pr, Pc)``."""
    if isinstance(grid, str) and grid == "auto":
        return None
    allowed = "'auto' or a pair (Pr, Pc) of integers >= 1"
    pr, pc = v.check_int_list(owner, "grid", grid, minimum=1, length=2, allowed=allowed)
    return (pr, pc)


def lookup(module: Any, name: str) -> Any:
    """``name`` on the module, its hparams or datamodule (``lightning_getattr``), or ``None``."""
    return lightning_getattr(module, name) if module is not None and lightning_hasattr(module, name) else None


def input_shape(module: Any) -> tuple[int, ...] | None:
    """One sample's shape: from ``example_input_array``, else ``input_shape``; ``None`` if neither."""
    example = getattr(module, "example_input_array", None)
    if isinstance(example, Tensor):
        return tuple(example.shape[1:])
    shape = lookup(module, "input_shape")
    return tuple(int(s) for s in shape) if shape is not None else None


def network_path(module: Any) -> str | None:
    """Where to trace: ``""`` (the module's own forward), the network's path, or ``None`` (unknown)."""
    if defines_forward(module):
        return ""
    try:
        return find_network(module)
    except ValueError:
        return None
