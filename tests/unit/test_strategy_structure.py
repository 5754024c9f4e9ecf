"""The shape of the strategy layer: one adapter that composes objects, not a tower of classes.

For every registered strategy: at most 3 of this package's classes in its MRO, and no Lightning
hook defined in more than 2 of them; nowhere in the package a ``super(Cls, self)`` or a
``Base.method(self, ...)`` call that steers a chain by hand; no import cycle between its modules;
and every constructor argument of every strategy visible to LightningCLI (jsonargparse).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

import lightning_hier
from lightning_hier.strategies import HierStrategy

PACKAGE = Path(lightning_hier.__file__).resolve().parent


def _registered() -> dict[str, type]:
    return {
        name: entry["strategy"]
        for name, entry in StrategyRegistry.items()
        if entry["strategy"].__module__.startswith("lightning_hier.") and not name.endswith(("_spawn", "_fork"))
    }


def _ours(cls: type) -> list[type]:
    return [k for k in cls.__mro__ if k.__module__.startswith("lightning_hier.")]


def _lightning_hooks() -> set[str]:
    # every method Lightning's strategies define (DDPStrategy's MRO holds ParallelStrategy and Strategy)
    return {name for klass in DDPStrategy.__mro__ if klass.__module__.startswith("lightning.") for name in vars(klass)}


@pytest.mark.parametrize("name", sorted(_registered()))
def test_a_registered_strategy_has_at_most_three_of_our_classes_and_two_definitions_per_hook(name):
    cls = _registered()[name]
    ours = _ours(cls)
    assert len(ours) <= 3, f"{name}: {' > '.join(k.__name__ for k in ours)}"
    for hook in _lightning_hooks():
        defined = [k.__name__ for k in ours if hook in vars(k)]
        assert len(defined) <= 2, f"{name}: {hook} is defined in {defined}"


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_chain_is_steered_by_hand():
    found = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            # super(Cls, self): a chain that skips classes
            if isinstance(func, ast.Name) and func.id == "super" and node.args:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} super(...) with arguments")
            # Base.method(self, ...): a base called past the chain
            if (
                isinstance(func, ast.Attribute)
                and isinstance(func.value, ast.Name)
                and func.value.id[:1].isupper()
                and node.args
                and isinstance(node.args[0], ast.Name)
                and node.args[0].id == "self"
            ):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {func.value.id}.{func.attr}(self, ...)")
    assert not found, found


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """The package modules ``name`` imports when it runs (``if TYPE_CHECKING:`` blocks left out).

    ``from pkg import mod`` imports the module ``pkg.mod`` (its package comes first anyway, as for
    every submodule); ``from mod import name`` imports ``mod``.
    """
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for child in node.body for n in ast.walk(child)}
    out: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            submodules = {f"{base}.{a.name}" for a in node.names} & modules
            out |= submodules if len(submodules) == len(node.names) else submodules | {base}
    return {m for m in out if m.startswith("lightning_hier")}


def test_no_import_cycle_between_modules():
    modules = {_module_name(p): p for p in _sources()}
    names = set(modules)
    graph = {
        name: {m for m in _runtime_imports(path, name, names) if m in names and m != name}
        for name, path in modules.items()
    }
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = [*stack[stack.index(nxt) :], nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


@pytest.mark.parametrize("name", sorted(_registered()))
def test_every_constructor_argument_is_visible_to_lightning_cli(name):
    resolvers = pytest.importorskip("jsonargparse._parameter_resolvers")
    cls = _registered()[name]
    seen = {p.name for p in resolvers.get_signature_parameters(cls)}
    expected = set()
    for klass in _ours(cls):
        if "__init__" in vars(klass):
            params = inspect.signature(klass.__init__).parameters.values()
            expected |= {p.name for p in params if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    if cls is not HierStrategy:
        expected -= {"sync", "allocation"}  # the objects a registered strategy builds from its arguments
    assert expected <= seen, f"{name}: LightningCLI does not see {sorted(expected - seen)}"
