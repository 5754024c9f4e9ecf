"""The bad-input table holds: every listed value is rejected with its message; every argument has a row.

The table (docs/reference/bad-input.md, "Bad input: what each argument rejects") has one row per argument: the
strategies it applies to (registry names, or the groups all / hier / averaging / GRAWA / ddp_*), the
values it rejects (Python expressions, or ``name=value, ...`` combinations) and the message after
``<Class>: ``. Every strategy of a row is built from its registry entry with every value of the row.
"""

from __future__ import annotations

import inspect
import math
import re
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch.strategies import StrategyRegistry

import lightning_hier  # noqa: F401  (registers the names)
from lightning_hier.strategies import DDPCommHookStrategy, GrawaStrategy, HierStrategy
from lightning_hier.sync import AveragingSync

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "bad-input.md"
HEADING = "# Bad input: what each argument rejects"
README = PAGE.parents[2] / "README.md"
START, END = "<!-- bad-input:table:start -->", "<!-- bad-input:table:end -->"
CODE = re.compile(r"``(.+?)``|`([^`]+)`")
VALUES = {"inf": math.inf, "nan": math.nan, "timedelta": timedelta}  # the names a rejected value may use


@dataclass(frozen=True)
class Row:
    """One row of the table."""

    arguments: tuple[str, ...]
    strategies: tuple[str, ...]
    rejected: tuple[str, ...]
    message: str


def registered() -> dict[str, tuple[type, dict[str, Any]]]:
    """This package's registry names (not the ``_spawn`` / ``_fork`` forms) -> (class, fixed arguments)."""
    out = {}
    for name, entry in StrategyRegistry.items():
        cls = entry["strategy"]
        if cls.__module__.startswith("lightning_hier.") and not name.endswith(("_spawn", "_fork")):
            out[name] = (cls, {k: v for k, v in entry["init_params"].items() if k != "start_method"})
    return out


def groups(names: dict[str, tuple[type, dict[str, Any]]]) -> dict[str, list[str]]:
    def of(base: type) -> list[str]:
        return sorted(n for n, (cls, _) in names.items() if issubclass(cls, base))

    def averaging() -> list[str]:  # the strategies whose rule is the averaging family's
        hier = [(n, cls, fixed) for n, (cls, fixed) in names.items() if issubclass(cls, HierStrategy)]
        return sorted(n for n, cls, fixed in hier if isinstance(cls(**fixed).sync, AveragingSync))

    return {
        "all": sorted(names),
        "hier": of(HierStrategy),
        "averaging": averaging(),
        "GRAWA": of(GrawaStrategy),
        "ddp_*": of(DDPCommHookStrategy),
    }


def code_spans(cell: str) -> list[str]:
    return [double or single for double, single in CODE.findall(cell)]


def table_rows() -> list[Row]:
    text = PAGE.read_text()
    assert text.count(START) == text.count(END) == 1, "bad-input page: one table between its markers"
    body = text[text.index(START) + len(START) : text.index(END)].strip().splitlines()
    assert body[0].startswith("| argument | strategies |") and set(body[1]) <= {"|", "-"}
    names = registered()
    named_groups = groups(names)
    rows = []
    for line in body[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == 5, f"bad-input row has {len(cells)} cells, not 5: {line}"
        strategies: list[str] = []
        for token in (t.strip() for t in cells[1].split(",")):
            spans = code_spans(token)
            members = spans if spans else named_groups.get(token.replace("\\", ""))
            assert members and all(m in names for m in members), f"bad-input row names {token!r}: {line}"
            strategies += members
        messages = code_spans(cells[4])
        assert len(messages) <= 1, line
        row = Row(tuple(code_spans(cells[0])), tuple(strategies), tuple(code_spans(cells[3])), "".join(messages))
        assert row.arguments and bool(row.rejected) == bool(row.message), line
        rows.append(row)
    return rows


def arguments_of(value: str, row: Row) -> dict[str, Any]:
    """The constructor arguments one rejected value stands for."""
    if re.match(r"^\w+=", value):
        return eval(f"dict({value})", {"__builtins__": {"dict": dict}}, VALUES)  # a repository file, names restricted
    assert len(row.arguments) == 1, f"{row.arguments}: give combinations as name=value, got {value!r}"
    return {row.arguments[0]: eval(value, {"__builtins__": {}}, VALUES)}


def cases() -> list[Any]:
    names = registered()
    out = []
    for row in table_rows():
        for name in row.strategies:
            for value in row.rejected:
                out.append(pytest.param(names[name], row, value, id=f"{name}-{'+'.join(row.arguments)}={value}"))
    return out


@pytest.mark.parametrize(("registered_as", "row", "value"), cases())
def test_every_listed_value_is_rejected_at_construction_with_the_listed_message(registered_as, row, value):
    cls, fixed = registered_as
    with pytest.raises(ValueError) as raised:
        cls(**{**fixed, **arguments_of(value, row)})
    expected = f"{cls.__name__}: {row.message}"
    assert expected in str(raised.value), f"{value!r}: {str(raised.value)!r} does not contain {expected!r}"


def constructor_arguments(cls: type) -> set[str]:
    """Named constructor arguments of ``cls`` and of this package's bases (``**kwargs`` forward to them).

    The adapter's ``sync`` and ``allocation`` are the objects a registered class builds itself.
    """
    out: set[str] = set()
    for klass in cls.__mro__:
        if "__init__" in vars(klass) and klass.__module__.startswith("lightning_hier."):
            params = inspect.signature(klass.__init__).parameters.values()
            out |= {p.name for p in params if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    return out - {"sync", "allocation"} if cls is not HierStrategy else out


def test_every_constructor_argument_of_every_registered_strategy_has_a_row():
    covered = {(name, arg) for row in table_rows() for name in row.strategies for arg in row.arguments}
    names = registered()
    assert len(names) >= 13  # localsgd ... grid2d and the three ddp_* peers
    missing = sorted(
        (n, a) for n, (cls, _) in names.items() for a in constructor_arguments(cls) if (n, a) not in covered
    )
    assert not missing, f"bad-input table: no row for {missing}"
    unknown = sorted(
        (n, a) for n, a in covered if a not in constructor_arguments(names[n][0])
    )  # a row for an argument that does not exist
    assert not unknown, f"bad-input table: {unknown} are not constructor arguments"


def test_the_page_opens_with_its_heading_and_the_readme_and_the_strategies_page_link_it():
    text = PAGE.read_text()
    assert text.startswith(HEADING) and text.index(HEADING) < text.index(START)
    assert "docs/reference/bad-input.md" in README.read_text()
    assert "reference/bad-input.md" in (PAGE.parents[1] / "guide" / "strategies" / "index.md").read_text()
