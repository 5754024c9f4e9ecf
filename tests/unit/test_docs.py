"""Every documentation reference in code, configs and READMEs points at a page (and section) in the repository."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCES = [
    *(REPO / d for d in ("lightning_hier", "tests", "benchmarks", "conf", "recipes")),
    REPO / "README.md",
    REPO / "CONTRIBUTING.md",
]
PAGES = ["README.md", "algorithms.md", "architecture.md", "lightning.md"]


def _files() -> list[Path]:
    out: list[Path] = []
    for src in SOURCES:
        files = [src] if src.is_file() else src.rglob("*")
        out += [f for f in files if f.suffix in {".py", ".md", ".yaml"} and "results" not in f.parts]
    return out


def _sections(page: str) -> set[str]:
    return set(re.findall(r"^## (\d+)\. ", (REPO / "docs" / page).read_text(), re.MULTILINE))


@pytest.mark.parametrize("page", PAGES)
def test_documentation_pages_exist(page):
    assert (REPO / "docs" / page).is_file()


def test_no_reference_to_notes_outside_the_repository():
    stale = re.compile(r"ALGORITHMS\.md|ARCHITECTURE\.md|LIGHTNING_NOTES\.md|shared/docs")
    hits = [f"{f.relative_to(REPO)}" for f in _files() if f.name != "test_docs.py" and stale.search(f.read_text())]
    assert not hits


def test_docs_references_name_existing_pages_and_sections():
    ref = re.compile(r"docs/(\w+\.md)(?:\)?,? section (\d+))?")
    checked = 0
    for f in _files():
        for page, section in ref.findall(f.read_text()):
            where = f.relative_to(REPO)
            assert (REPO / "docs" / page).is_file(), f"{where} cites docs/{page}"
            if section:
                assert section in _sections(page), f"{where} cites docs/{page} section {section}"
            checked += 1
    assert checked >= 10


def test_readme_links_and_pictures_exist():
    for target in re.findall(r"\]\(([^)#\s]+)", (REPO / "README.md").read_text()):
        if not target.startswith("http"):
            assert (REPO / target).exists(), target


def test_cross_references_between_pages_name_existing_sections():
    link = re.compile(r"\]\((\w+\.md)\),? section (\d+)")
    found = 0
    for page in PAGES:
        for target, section in link.findall((REPO / "docs" / page).read_text()):
            assert section in _sections(target), f"docs/{page} cites {target} section {section}"
            found += 1
    assert found >= 3
