"""The documentation site: it builds with ``mkdocs build --strict`` and covers every public module and strategy.

The build runs only where the ``docs`` extra is installed (``pip install -e ".[dev,docs]"``, as
CI does); it needs no network.
"""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch.strategies import StrategyRegistry

import lightning_hier  # noqa: F401  (registers the names)

REPO = Path(__file__).resolve().parents[2]
STRATEGIES_PAGE = REPO / "docs" / "guide" / "strategies" / "index.md"


def public_modules() -> list[str]:
    """Every module of the package whose dotted path has no part starting with ``_`` (packages by name)."""
    out = []
    for path in sorted((REPO / "lightning_hier").rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if not any(p.startswith("_") for p in parts):
            out.append(".".join(parts))
    return out


def registered_names() -> list[str]:
    return sorted(
        name
        for name, entry in StrategyRegistry.items()
        if entry["strategy"].__module__.startswith("lightning_hier.") and not name.endswith(("_spawn", "_fork"))
    )


def test_every_registered_strategy_is_on_the_strategies_page():
    text = STRATEGIES_PAGE.read_text()
    missing = [name for name in registered_names() if f"`{name}`" not in text]
    assert not missing, f"docs/guide/strategies/index.md names no {missing}"


def test_the_sites_hooks_list_the_same_public_modules():
    spec = importlib.util.spec_from_file_location("docs_hooks", REPO / "docs" / "_hooks.py")
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (pip install -e '.[docs]')")
    assert spec is not None and spec.loader is not None
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    assert hooks.public_modules() == public_modules()
    assert "lightning_hier.algorithms" in public_modules() and "lightning_hier.strategies._base" not in public_modules()


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="mkdocs is not installed (the docs extra)")
def test_the_site_builds_strictly_and_has_a_page_for_every_public_module_and_recipe(tmp_path):
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    warnings = [line for line in done.stderr.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert done.returncode == 0 and not warnings, done.stderr[-4000:]
    missing = [m for m in public_modules() if not (site / "api" / m / "index.html").is_file()]
    assert not missing, f"no API page for {missing}"
    recipes = [p.parent.name for p in (REPO / "recipes").glob("*/README.md")]
    assert recipes and all((site / "recipes" / r / "index.html").is_file() for r in recipes)
    for page in ("benchmarks", "changelog", "reference/bad-input", "guide/strategies", "algorithms/hpsgd"):
        assert (site / page / "index.html").is_file(), page
    strategies = (site / "guide" / "strategies" / "index.html").read_text()
    assert all(re.search(rf"<code>{name}</code>", strategies) for name in registered_names())
