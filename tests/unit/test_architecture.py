"""The import direction of ARCHITECTURE.md: the math layers never import Lightning or Hydra."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_hier"
PURE = ["comm", "algorithms", "layers", "planner", "topology.py", "rng.py", "_validate.py"]
HYDRA_FREE = ["comm", "algorithms", "strategies", "callbacks", "data", "models", "layers", "planner", "testing"]


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _files(entry: str) -> list[Path]:
    p = PACKAGE / entry
    return sorted(p.rglob("*.py")) if p.is_dir() else [p]


@pytest.mark.parametrize("entry", PURE)
def test_pure_layers_import_neither_lightning_nor_hydra(entry):
    for f in _files(entry):
        bad = _imports(f) & {"lightning", "pytorch_lightning", "hydra", "omegaconf"}
        assert not bad, f"{f.relative_to(PACKAGE)} imports {bad}"


@pytest.mark.parametrize("entry", HYDRA_FREE)
def test_only_the_entry_point_knows_hydra(entry):
    for f in _files(entry):
        bad = _imports(f) & {"hydra", "omegaconf"}
        assert not bad, f"{f.relative_to(PACKAGE)} imports {bad}"
