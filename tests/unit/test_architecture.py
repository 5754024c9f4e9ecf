"""The import direction of docs/architecture.md: the math layers never import Lightning or Hydra."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_hier"
PURE = [
    "comm",
    "algorithms",
    "sync",
    "layers",
    "planner",
    "simulator",
    "topology.py",
    "rng.py",
    "resumable.py",
    "digest.py",
    "_validate.py",
    "_pids.py",
]
HYDRA_FREE = ["comm", "algorithms", "sync", "strategies", "callbacks", "data", "models", "layers", "planner", "testing"]
HYDRA_FREE += ["__init__.py", "summary.py", "cli.py"]  # only train.py (with conf/ and recipes/) knows Hydra


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


def _pure_modules() -> list[str]:
    names = []
    for entry in PURE:
        for f in _files(entry):
            if f.name == "__main__.py":  # the planner's command line builds the reference networks (models/)
                continue
            parts = f.relative_to(PACKAGE.parent).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


# Lightning (and Hydra) made unimportable: a None entry in sys.modules makes `import x` raise ImportError.
_NO_LIGHTNING = """
import importlib, sys
for blocked in ("lightning", "pytorch_lightning", "lightning_utilities", "torchmetrics", "hydra", "omegaconf"):
    sys.modules[blocked] = None
for name in sys.argv[1:]:
    importlib.import_module(name)
import lightning_hier
try:
    lightning_hier.HPSGDStrategy
except ImportError as err:
    print("strategies:", err)
else:
    raise SystemExit("a strategy class was importable without Lightning")
"""


def test_pure_layers_import_in_a_process_without_lightning():
    modules = _pure_modules()
    required = {"algorithms", "comm", "layers", "planner", "topology"}
    assert {f"lightning_hier.{name}" for name in required} <= set(modules)
    proc = subprocess.run([sys.executable, "-c", _NO_LIGHTNING, *modules], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "HPSGDStrategy needs Lightning, which could not be imported" in proc.stdout
