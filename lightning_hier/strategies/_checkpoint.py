"""Checkpoint format of lightning-hier strategies.

Lightning writes rank 0's view of the run. Strategies whose replicas differ between
synchronisations (local steps, in-flight reductions, pipeline stages) must also store every
rank's own state, or a resume silently restarts all ranks from rank 0. The strategy gathers one
``RankState`` per rank into the file rank 0 writes, under :data:`STATE_KEY`::

    checkpoint["lightning_hier"] = {
        "format": 1,
        "strategy": "hpsgd",                  # registry name of the writer
        "topology": {"world_size": 2, ...},   # Topology.describe()
        "ranks": [rank_state_0, rank_state_1, ...],
    }
    rank_state = {"model": ..., "optimizer_states": [...], "rng": {...}, "algorithm": {...}, "comm": {...}}

Everything is tensors and plain Python types, so the file loads with ``weights_only=True``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

STATE_KEY = "lightning_hier"
FORMAT_VERSION = 1
# layout fields that must match for a resume; num_nodes may differ (same ranks, other hosts)
_LAYOUT_FIELDS = ("world_size", "data", "pipe", "model")


def detach_state(state: Any) -> Any:
    """Deep copy of a (nested) state with every tensor cloned to a compact CPU tensor.

    Cloning matters: parameters are views of large flat buckets, and pickling a view would ship
    the whole bucket.
    """
    if isinstance(state, Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, Mapping):
        return {k: detach_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [detach_state(v) for v in state]
    if isinstance(state, tuple):
        return tuple(detach_state(v) for v in state)
    return state


def strategy_section(strategy: str, topology: Mapping[str, int], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    return {"format": FORMAT_VERSION, "strategy": strategy, "topology": dict(topology), "ranks": ranks}


def select_rank_state(
    checkpoint: Mapping[str, Any], path: str, strategy: str, topology: Mapping[str, int], rank: int
) -> dict[str, Any]:
    """This rank's saved state, after checking the checkpoint was written by a compatible run.

    Raises:
        ValueError: The checkpoint has no lightning-hier state, or was written by another strategy,
            format or layout.
    """
    section = checkpoint.get(STATE_KEY)
    if not isinstance(section, Mapping):
        raise ValueError(
            f"Cannot resume '{strategy}' from {path}: the checkpoint has no lightning-hier strategy state "
            "(it was written by another strategy such as Lightning's DDP, or with weights_only=True). "
            "To start a new run from its weights, load its 'state_dict' into the model and call fit() "
            "without ckpt_path."
        )
    if section.get("format") != FORMAT_VERSION:
        raise ValueError(
            f"Cannot resume from {path}: checkpoint format {section.get('format')!r} is not supported "
            f"(this version reads format {FORMAT_VERSION})."
        )
    if section.get("strategy") != strategy:
        raise ValueError(
            f"Cannot resume from {path}: it was written by strategy '{section.get('strategy')}', "
            f"but this run uses '{strategy}'. Resume with the same strategy."
        )
    saved = {k: section["topology"].get(k) for k in _LAYOUT_FIELDS}
    current = {k: topology[k] for k in _LAYOUT_FIELDS}
    if saved != current:
        raise ValueError(
            f"Cannot resume '{strategy}' from {path}: it was written with layout {saved}, "
            f"but this run has layout {current}. Resume with the same number of processes and layout."
        )
    ranks = section["ranks"]
    return dict(ranks[rank])


def atomic_save(checkpoint: Mapping[str, Any], filepath: str | Path) -> None:
    """Write ``checkpoint`` so that an existing file at ``filepath`` is replaced only by a complete one.

    A crash mid-write leaves the previous checkpoint intact (write to a temporary file in the same
    directory, fsync, then an atomic rename).
    """
    path = Path(filepath)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, _plain_file_mode())  # mkstemp makes 0600; Lightning's own writes follow the umask
        with os.fdopen(fd, "wb") as f:
            torch.save(dict(checkpoint), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _plain_file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file: 0666 less the process umask (0644 usually)."""
    umask = os.umask(0)  # the only portable way to read it: set and restore at once
    os.umask(umask)
    return 0o666 & ~umask
