"""Fixtures shared by every test tier."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_hier.testing import isolated_global_state

# ../shared/datasets beside the checkout (a git worktree may sit one level deeper)
SHARED_DATASETS = next(
    (p / "shared" / "datasets" for p in Path(__file__).resolve().parents[1:4] if (p / "shared" / "datasets").is_dir()),
    Path(__file__).resolve().parents[2] / "shared" / "datasets",
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fault-matrix",
        choices=("subset", "full"),
        default="subset",
        help="tests/faults: run a covering subset of the fault-injection matrix (default) or every cell",
    )


@pytest.fixture(autouse=True)
def _isolated_global_state() -> Iterator[None]:
    """Undo env vars, rank-zero flags and process groups that in-process launchers leave behind."""
    with isolated_global_state():
        yield


@pytest.fixture
def shared_datasets() -> Path:
    """The real CIFAR-10 / MNIST files beside the repository (skip when absent)."""
    if not SHARED_DATASETS.is_dir():
        pytest.skip(f"real datasets not found at {SHARED_DATASETS} (only present in the development workplace)")
    return SHARED_DATASETS
