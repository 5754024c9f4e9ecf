"""Checkpoint format of lightning-hier strategies.

Lightning writes rank 0's view of the run. Strategies whose replicas differ between
synchronisations (local steps, in-flight reductions, pipeline stages) must also store every
rank's own state, or a resume silently restarts all ranks from rank 0. The strategy gathers one
``RankState`` per rank into the file rank 0 writes, under :data:`STATE_KEY`::

    checkpoint["lightning_hier"] = {
        "format": 3,
        "strategy": "hpsgd",                  # registry name of the writer
        "topology": {"world_size": 2, ...},   # Topology.describe()
        "ranks": [rank_state_0, rank_state_1, ...],   # absent in a weights-only checkpoint
        "checksums": {"state_dict": "<sha256>", "ranks": ["<sha256 of rank 0's state>", ...]},
    }
    rank_state = {"model": ..., "optimizer_states": [...], "rng": {...},
                  "algorithm": {...},    # the strategy's synchronisation rule (its Sync object)
                  "allocation": {...},   # how it splits the batches (its Allocation object: DBS's shares)
                  "comm": {...}, "data": {"epoch": ..., "batches": ...}}

Everything is tensors and plain Python types, so the file loads with ``weights_only=True``.

**Checksums** (format 2). A damaged file can still unpickle: flipped bytes inside a tensor's
record load as other numbers, and the run would resume from a wrong model. Each rank's state and
the consensus ``state_dict`` therefore carry a SHA-256 of their content (:func:`state_digest`:
every tensor's dtype, shape and bytes and every plain value, in order), checked on load. Format
1 (written by earlier versions, without checksums) still loads, with a warning that its integrity
cannot be checked.

**State keyed by object** (format 3). Each rank's state holds one entry per object of the strategy
(:class:`~lightning_hier.strategies.HierStrategy` holds a ``sync`` and an ``allocation``). Format 2
kept DBS's shares inside ``algorithm`` (beside the averaging rule's state, or instead of it);
:func:`upgrade_rank_state` moves them to ``allocation`` on load, so those files resume as before.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from lightning_hier.digest import state_digest

STATE_KEY = "lightning_hier"
FORMAT_VERSION = 3
LEGACY_FORMATS = (1,)  # readable, without checksums
CHECKSUMMED = (2, 3)  # formats with checksums; 2 keeps DBS's shares in `algorithm` (upgrade_rank_state)
# layout fields that must match for a resume; num_nodes may differ (same ranks, other hosts)
_LAYOUT_FIELDS = ("world_size", "data", "pipe", "model")


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used: unreadable, damaged, or written by an incompatible run."""


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


# ---------------------------------------------------------------------------------- writing
def strategy_section(
    strategy: str,
    topology: Mapping[str, int],
    state_dict: Mapping[str, Any],
    ranks: list[dict[str, Any]] | None,
    rank_digests: list[str] | None,
) -> dict[str, Any]:
    """The section rank 0 writes under :data:`STATE_KEY`.

    Args:
        strategy: Registry name of the writer.
        topology: ``Topology.describe()``.
        state_dict: The checkpoint's (consensus) ``state_dict``, checksummed here.
        ranks: Every rank's state, by global rank; ``None`` for a weights-only checkpoint.
        rank_digests: :func:`state_digest` of each rank's state, computed by that rank.
    """
    section: dict[str, Any] = {"format": FORMAT_VERSION, "strategy": strategy, "topology": dict(topology)}
    checksums: dict[str, Any] = {"state_dict": state_digest(state_dict)}
    if ranks is not None:
        section["ranks"] = ranks
        checksums["ranks"] = list(rank_digests or [])
    section["checksums"] = checksums
    return section


# ---------------------------------------------------------------------------------- reading
def select_rank_state(
    checkpoint: Mapping[str, Any], path: str, strategy: str, topology: Mapping[str, int], rank: int
) -> dict[str, Any]:
    """This rank's saved state, after checking the checkpoint was written by a compatible run.

    The checksum of the state is checked separately (:func:`rank_state_damaged`), so that the
    ranks can agree on which states are damaged before any of them raises.

    Raises:
        CheckpointError: The checkpoint has no lightning-hier state, holds no per-rank states
            (weights only), or was written by another strategy, format or layout, or holds
            fewer or more rank states than its world size.
    """
    section = _section(checkpoint, path, strategy)
    if section.get("strategy") != strategy:
        raise CheckpointError(
            f"Cannot resume from {path}: it was written by strategy '{section.get('strategy')}', "
            f"but this run uses '{strategy}'. Resume with the same strategy."
        )
    saved = {k: section["topology"].get(k) for k in _LAYOUT_FIELDS}
    current = {k: topology[k] for k in _LAYOUT_FIELDS}
    if saved != current:
        raise CheckpointError(
            f"Cannot resume '{strategy}' from {path}: it was written with layout {saved}, "
            f"but this run has layout {current}. Resume with the same number of processes and layout."
        )
    if "ranks" not in section:
        raise CheckpointError(
            f"Cannot resume '{strategy}' from {path}: it was saved with weights only (no optimizer or per-rank "
            "state). To start a new run from its weights, load its 'state_dict' into the model and call fit() "
            "without ckpt_path."
        )
    ranks = section["ranks"]
    world_size = int(current["world_size"])
    if not isinstance(ranks, list) or len(ranks) != world_size:
        count = len(ranks) if isinstance(ranks, list) else type(ranks).__name__
        raise CheckpointError(
            f"Cannot resume '{strategy}' from {path}: it holds the states of {count} rank(s), but its world size "
            f"is {world_size}: the file is incomplete or damaged. Resume from another checkpoint."
        )
    if section["format"] in CHECKSUMMED:
        digests = section.get("checksums", {}).get("ranks")
        if not isinstance(digests, list) or len(digests) != world_size:
            raise CheckpointError(
                f"Cannot resume '{strategy}' from {path}: its checksums of the {world_size} rank states are missing "
                "or incomplete: the file is damaged. Resume from another checkpoint."
            )
    return upgrade_rank_state(dict(ranks[rank]), int(section["format"]), strategy)


def upgrade_rank_state(state: dict[str, Any], fmt: int, strategy: str) -> dict[str, Any]:
    """A rank's saved state in this version's layout (format 3: one entry per object of the strategy).

    Formats 1 and 2 kept DBS's shares in ``algorithm``: alone (``dbs``), beside the server's state
    (``dbs_async``: ``{"dbs", "server"}``) or beside the window rule's and its sample counts
    (``dbs_hpsgd``, ``dbs_localsgd``: ``{"sync", "dbs", "samples"}``). They move to ``allocation``.
    """
    if fmt >= 3:
        return state
    algorithm = state.get("algorithm") or {}
    if strategy == "dbs":
        algorithm, allocation = {}, algorithm
    elif strategy == "dbs_async" and algorithm:
        algorithm, allocation = algorithm["server"], algorithm["dbs"]
    elif strategy in ("dbs_hpsgd", "dbs_localsgd") and algorithm:
        allocation = algorithm["dbs"]
        algorithm = {"sync": algorithm["sync"], "samples": algorithm["samples"]}
    else:
        allocation = {}
    return {**state, "algorithm": algorithm, "allocation": allocation}


def rank_state_damaged(checkpoint: Mapping[str, Any], rank: int) -> bool:
    """Whether ``rank``'s saved state differs from the checksum written with it (format 1: never known)."""
    section = checkpoint[STATE_KEY]
    if section["format"] not in CHECKSUMMED:
        return False
    return state_digest(section["ranks"][rank]) != section["checksums"]["ranks"][rank]


def damaged_ranks_error(path: str, strategy: str, ranks: list[int]) -> CheckpointError:
    """The error every rank raises when the saved states of ``ranks`` do not match their checksums."""
    which = f"rank {ranks[0]}'s saved state does" if len(ranks) == 1 else f"the saved states of ranks {ranks} do"
    return CheckpointError(
        f"Cannot resume '{strategy}' from {path}: {which} not match the SHA-256 checksum written with it: "
        "the file was damaged after it was saved (disk, copy or transfer). Resume from another checkpoint."
    )


def check_state_dict(checkpoint: Mapping[str, Any], path: str) -> None:
    """Check the consensus ``state_dict`` against its checksum (validate / test / predict from a file).

    Raises:
        CheckpointError: It does not match; nothing is checked for checkpoints without a
            lightning-hier section or of format 1.
    """
    section = checkpoint.get(STATE_KEY)
    if not isinstance(section, Mapping) or section.get("format") not in CHECKSUMMED:
        return
    expected = section.get("checksums", {}).get("state_dict")
    if expected != state_digest(checkpoint.get("state_dict")):
        raise CheckpointError(
            f"Cannot load the model from {path}: its 'state_dict' does not match the SHA-256 checksum written "
            "with it: the file was damaged after it was saved. Use another checkpoint."
        )


def _section(checkpoint: Mapping[str, Any], path: str, strategy: str) -> Mapping[str, Any]:
    section = checkpoint.get(STATE_KEY)
    if not isinstance(section, Mapping):
        raise CheckpointError(
            f"Cannot resume '{strategy}' from {path}: the checkpoint has no lightning-hier strategy state "
            "(it was written by another strategy such as Lightning's DDP, or saved with weights only). "
            "To start a new run from its weights, load its 'state_dict' into the model and call fit() "
            "without ckpt_path."
        )
    fmt = section.get("format")
    if fmt in LEGACY_FORMATS:
        warnings.warn(
            f"{path} was written in checkpoint format {fmt}, without checksums: its integrity cannot be checked. "
            "Save a new checkpoint to get checksums.",
            UserWarning,
            stacklevel=3,
        )
    elif fmt not in CHECKSUMMED:
        raise CheckpointError(
            f"Cannot resume from {path}: checkpoint format {fmt!r} is not supported "
            f"(this version reads formats {[*LEGACY_FORMATS, *CHECKSUMMED]})."
        )
    return section
