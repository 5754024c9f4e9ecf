"""lightning-hier: five distributed-training algorithms as PyTorch Lightning strategies.

Importing the package registers every strategy name with Lightning, so
``Trainer(strategy="hpsgd")`` (and ``"hpsgd_spawn"``, ``"hpsgd_fork"``) work.

The pure layers (:mod:`lightning_hier.algorithms`, :mod:`~lightning_hier.comm`,
:mod:`~lightning_hier.layers`, :mod:`~lightning_hier.planner`, :mod:`~lightning_hier.topology`)
need torch only: without Lightning the package still imports, registers nothing, and the
strategy classes raise an ``ImportError`` that says why when they are asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_hier.topology import Topology

__version__ = "0.1.0"


def _import_lightning() -> BaseException | None:
    """Import Lightning; return the error instead of raising it.

    Besides ``ImportError`` (not installed), a ``RuntimeError`` is caught: torchmetrics imports
    torchvision whenever it is installed, and a torchvision built for another torch fails at
    import ("operator torchvision::nms does not exist"), which makes ``import lightning`` fail.
    The pure layers must stay usable in such an environment.
    """
    try:
        import lightning.pytorch  # noqa: F401
    except (ImportError, RuntimeError) as err:
        return err
    return None


_LIGHTNING_ERROR = _import_lightning()


if TYPE_CHECKING or _LIGHTNING_ERROR is None:
    from lightning_hier.strategies import (
        STRATEGIES,
        AsgdStrategy,
        AsyncDBSStrategy,
        CheckpointError,
        DBSHPSGDStrategy,
        DBSLocalSGDStrategy,
        DBSStrategy,
        DDPCommHookStrategy,
        DecoupledStrategy,
        DiLoCoStrategy,
        EasgdStrategy,
        GrawaStrategy,
        Grid2DStrategy,
        HierStrategy,
        HPSGDStrategy,
        LocalSGDStrategy,
        LsgdStrategy,
        NonFiniteError,
        SoftsyncStrategy,
        TorchftStrategy,
        register_all,
    )

if _LIGHTNING_ERROR is None:
    register_all()


def __getattr__(name: str) -> Any:
    """Explain a missing strategy class when Lightning could not be imported."""
    if name in _STRATEGY_EXPORTS and _LIGHTNING_ERROR is not None:
        hint = ""
        if "torchvision" in str(_LIGHTNING_ERROR):
            hint = (
                " The installed torchvision does not match torch: uninstall it, or install the build made for "
                "your torch (CPU: pip install torchvision --index-url https://download.pytorch.org/whl/cpu)."
            )
        raise ImportError(
            f"lightning_hier.{name} needs Lightning, which could not be imported "
            f"({type(_LIGHTNING_ERROR).__name__}: {_LIGHTNING_ERROR}).{hint}"
        ) from _LIGHTNING_ERROR
    raise AttributeError(f"module 'lightning_hier' has no attribute {name!r}")


__all__ = [
    "STRATEGIES",
    "AsgdStrategy",
    "AsyncDBSStrategy",
    "CheckpointError",
    "DBSHPSGDStrategy",
    "DBSLocalSGDStrategy",
    "DBSStrategy",
    "DDPCommHookStrategy",
    "DecoupledStrategy",
    "DiLoCoStrategy",
    "EasgdStrategy",
    "GrawaStrategy",
    "Grid2DStrategy",
    "HPSGDStrategy",
    "HierStrategy",
    "LocalSGDStrategy",
    "LsgdStrategy",
    "NonFiniteError",
    "SoftsyncStrategy",
    "Topology",
    "TorchftStrategy",
    "__version__",
]
_STRATEGY_EXPORTS = frozenset(__all__) - {"Topology", "__version__"}
