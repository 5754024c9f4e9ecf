"""Registering a strategy under its three launcher names, shared by every strategy class here."""

from __future__ import annotations

from typing import Any

from lightning.fabric.strategies import _StrategyRegistry

# name suffix -> start method: `x` starts ranks like Lightning's DDP (popen), `x_spawn` and
# `x_fork` with multiprocessing (notebooks, tests, Hydra sweeps)
LAUNCH_SUFFIXES = (("", "popen"), ("_spawn", "spawn"), ("_fork", "fork"))


def register_family(registry: _StrategyRegistry, cls: type, name: str, description: str, **init_params: Any) -> None:
    """Register ``name``, ``name_spawn`` and ``name_fork`` for ``cls`` with fixed ``init_params``."""
    for suffix, method in LAUNCH_SUFFIXES:
        registry.register(
            f"{name}{suffix}",
            cls,
            description=f"{description} (start_method='{method}')",
            override=True,
            start_method=method,
            **init_params,
        )
