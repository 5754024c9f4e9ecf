"""Every generated block of the pages equals what ``python -m benchmarks.publish`` writes from the committed results.

The simulator's scaling tables (``recipes/README.md``, predictions from its presets, about a minute)
are left out here; ``python -m benchmarks.publish --check`` checks them too.
"""

import re

from benchmarks import pages, publish
from benchmarks.scenarios import REPO

BLOCK = re.compile(r"<!-- bench:([\w-]+):start -->(.*?)<!-- bench:\1:end -->", re.DOTALL)


def test_every_generated_block_and_file_is_what_the_command_writes():
    generated = pages.pages(predictions=False)
    stale = [str(p.relative_to(REPO)) for p in generated.differences()]
    assert not stale, f"run `python -m benchmarks.publish`: {stale} differ from the committed results"


def test_every_page_with_a_block_is_generated_and_every_block_names_existing_files():
    generated = pages.pages(predictions=False)
    with_blocks = [
        p
        for p in [
            REPO / "README.md",
            *REPO.glob("recipes/**/README.md"),
            *REPO.glob("docs/**/*.md"),
            REPO / "benchmarks" / "README.md",
        ]
        if "<!-- bench:" in p.read_text()
    ]
    assert set(with_blocks) - {REPO / "recipes" / "README.md"} <= set(generated.text)
    for page in with_blocks:
        for name, body in BLOCK.findall(page.read_text()):
            named = re.findall(r"_Source: (.*?); regenerate", body) or re.findall(r"_Predicted by `(.*?)`", body)
            assert named, f"{page.relative_to(REPO)}: block {name} names no source"
            for path in re.findall(r"`(benchmarks/results/[^`]+)`", named[0]):
                assert (REPO / path).exists(), f"{page.relative_to(REPO)}: block {name} names {path}"


def test_check_mode_names_a_stale_page_and_fails(monkeypatch, capsys, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("a\n<!-- bench:x:start -->\nold\n<!-- bench:x:end -->\n")

    def fake(predictions: bool = True) -> pages.Pages:
        out = pages.Pages()
        out.block(readme, "x", "new")
        return out

    monkeypatch.setattr(pages, "pages", fake)
    monkeypatch.setattr(publish, "REPO", tmp_path)
    assert publish.main(["--check"]) == 1
    assert "README.md" in capsys.readouterr().err and "old" in readme.read_text()
    assert publish.main(["--no-plots"]) == 0
    assert "new" in readme.read_text() and publish.main(["--check"]) == 0
