"""The pages a user reads hold results, not the lab log; result files are named by what they measure.

Measurement history (dated runs, superseded tables, commit hashes, per-issue or per-session
sections, run tags) lives in the dated notes under ``benchmarks/notes/``; ``benchmarks/results/``
holds one current result set per workload and study.
"""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [
    REPO / "README.md",
    REPO / "CONTRIBUTING.md",
    REPO / "CHANGELOG.md",
    REPO / "benchmarks" / "README.md",
    *sorted((REPO / "recipes").rglob("README.md")),
    *sorted((REPO / "docs").rglob("*.md")),
]
HISTORY = {
    # a commit hash: 7 to 40 hex digits with at least one letter and one digit (not "decade", not "1000000")
    "commit hash": re.compile(r"(?<![\w./-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w-])"),
    "issue reference": re.compile(r"\b[Ii]ssues? #?\d+"),
    "session reference": re.compile(r"\b[Ss]essions? \d+"),
    "run tag": re.compile(r"\bsim\d+[a-z]?\b|_s\d+\b|\bs\d{2}-[a-z]+"),
    "re-measured note": re.compile(r"\b[Rr]e-?measured\b"),
    "superseded section": re.compile(r"\b[Ss]uperseded\b"),
}


def _offences(path: Path) -> list[str]:
    text = path.read_text()
    where = str(path.relative_to(REPO))
    out = []
    for kind, pattern in HISTORY.items():
        for m in pattern.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            out.append(f"{where}:{line}: {kind} {m.group(0)!r}")
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_a_page_holds_no_measurement_history(page):
    assert not _offences(page), "\n".join(_offences(page))


def test_the_patterns_find_what_they_are_for():
    text = "commit `0c037b7`; issue 18; session 24; sim18d/x.json, decoupled_layers_s29.json, branch s25-twolevel"
    found = {kind for kind, pattern in HISTORY.items() if pattern.search(text)}
    assert found == {"commit hash", "issue reference", "session reference", "run tag"}
    assert not HISTORY["commit hash"].search("1000000 samples, 2.5e-05 s, the decade, sha256 of 12 bytes")


def test_result_files_are_named_by_what_they_measure():
    tag = re.compile(r"sim\d|_s\d+\b|(^|[_-])s\d{2}([_-]|$)|issue|session", re.IGNORECASE)
    named = [p.relative_to(REPO / "benchmarks" / "results") for p in (REPO / "benchmarks" / "results").rglob("*")]
    bad = [str(p) for p in named if any(tag.search(part.split(".")[0]) for part in p.parts)]
    assert named and not bad, bad
