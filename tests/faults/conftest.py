"""Parametrize the fault-injection tests with the subset or, with ``--fault-matrix=full``, every cell."""

from __future__ import annotations

import pytest

from tests.faults.matrix import FULL, SUBSET


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "cell" in metafunc.fixturenames:
        cells = FULL if metafunc.config.getoption("fault_matrix") == "full" else SUBSET
        metafunc.parametrize("cell", cells, ids=[c.id for c in cells])
