"""Every documentation reference in code, configs and pages points at a page (and section) in the repository."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCES = [
    *(REPO / d for d in ("lightning_hier", "tests", "benchmarks", "conf", "recipes", "docs")),
    REPO / "README.md",
    REPO / "CONTRIBUTING.md",
    REPO / "CHANGELOG.md",
]
# the pages whose numbered sections code and docstrings cite ("docs/algorithms.md, section 5")
NUMBERED = ["algorithms.md", "architecture.md", "lightning.md"]
# the pages a reader reaches from the README and the site; their relative links must resolve
PAGES = [
    REPO / "README.md",
    REPO / "CONTRIBUTING.md",
    REPO / "CHANGELOG.md",
    REPO / "benchmarks" / "README.md",
    *sorted((REPO / "recipes").rglob("README.md")),
    *sorted((REPO / "docs").rglob("*.md")),
]


def _files() -> list[Path]:
    out: list[Path] = []
    for src in SOURCES:
        files = [src] if src.is_file() else src.rglob("*")
        out += [f for f in files if f.suffix in {".py", ".md", ".yaml"} and not {"results", "notes"} & set(f.parts)]
    return out


def _sections(page: str) -> set[str]:
    return set(re.findall(r"^## (\d+)\. ", (REPO / "docs" / page).read_text(), re.MULTILINE))


@pytest.mark.parametrize("page", ["index.md", *NUMBERED])
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


def test_every_numbered_section_of_the_algorithms_has_its_page():
    text = (REPO / "docs" / "algorithms.md").read_text()
    sections = re.findall(r"^## (\d+)\. .*?\n\n(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert [n for n, _ in sections] == [str(i) for i in range(1, len(sections) + 1)] and len(sections) >= 8
    for number, body in sections:
        links = re.findall(r"\]\((algorithms/[\w-]+\.md)\)", body)
        assert links and all((REPO / "docs" / link).is_file() for link in links), f"section {number}: {links}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_and_pictures_of_each_page_exist(page):
    """A link is written for the repository (GitHub); the site maps it (docs/_hooks.py). The API
    reference's pages are generated at build time, so a link into docs/api/ names a public module."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    for target in re.findall(r"\]\(([^)#\s]+)", text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue
        path = (page.parent / target).resolve()
        if path.parent == (REPO / "docs" / "api").resolve():
            module = path.stem
            assert (REPO / Path(*module.split("."))).with_suffix(".py").is_file() or (
                REPO / Path(*module.split(".")) / "__init__.py"
            ).is_file(), f"{page.relative_to(REPO)}: {target}"
            continue
        assert path.exists(), f"{page.relative_to(REPO)}: {target}"


def test_cross_references_between_pages_name_existing_sections():
    link = re.compile(r"\]\((?:\.\./)?(\w+\.md)\),? section (\d+)")
    found = 0
    for page in (REPO / "docs").rglob("*.md"):
        for target, section in link.findall(page.read_text()):
            if target in NUMBERED:
                assert section in _sections(target), f"{page.relative_to(REPO)} cites {target} section {section}"
                found += 1
    assert found >= 3


def test_the_readme_is_a_front_door_of_at_most_400_lines():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 400, f"README.md has {len(lines)} lines: move reference material to docs/"
    for marker in ("<!-- ci:run-command -->", "<!-- ci:test-command -->"):
        at = lines.index(marker)
        assert lines[at + 1] == "```bash" and lines[at + 3] == "```", f"{marker}: one fenced line after it"
