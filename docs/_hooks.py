"""MkDocs hooks of the documentation site (``mkdocs.yml``: ``hooks: [docs/_hooks.py]``).

Three jobs, all at build time and without the network:

1. The API reference is generated from the package itself: every public module of
   ``lightning_hier`` (no path component starting with ``_``) gets a page ``api/<dotted path>.md``
   holding ``::: <module>`` for mkdocstrings, and a place in the "API reference" section of the
   navigation. A module added to the package is in the reference with no edit here.
2. Pages that live outside ``docs/`` (the recipes' and the benchmarks' READMEs, the changelog,
   the contributing guide) and the plots they show are added to the site as generated files.
3. Links are written for the repository (relative paths that work on GitHub). Each page's links
   are mapped to the site: a link to a file that is a page or a plot of the site points there;
   a link to any other file of the repository (source, results, notes) points to the file on
   GitHub. A link to a path that does not exist is left alone, so ``mkdocs build --strict``
   reports it.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "lightning_hier"
GITHUB = "https://github.com/lightning-hier/lightning-hier"
API_DIR = "api"
ASSET_DIR = "repo"  # plots shown by the pages, under their repository path
ASSET_FOLDERS = ("benchmarks/results", "recipes")
NAV_API = "API reference"
NAV_RECIPES = "Recipes"


def public_modules(root: Path = REPO) -> list[str]:
    """Dotted names of the public modules of the package, packages first, in path order."""
    names = []
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if any(p.startswith("_") for p in parts):
            continue
        names.append(".".join(parts))
    return names


def api_page(module: str) -> str:
    """Site path of a module's API page."""
    return f"{API_DIR}/{module}.md"


def recipe_readmes(root: Path = REPO) -> list[str]:
    """Repository paths of the recipes' READMEs, the index first."""
    return ["recipes/README.md", *sorted(str(p.relative_to(root)) for p in root.glob("recipes/*/README.md"))]


def repo_pages(root: Path = REPO) -> dict[str, str]:
    """Repository path -> site path of every page that lives outside ``docs/``."""
    pages = {
        "benchmarks/README.md": "benchmarks.md",
        "CHANGELOG.md": "changelog.md",
        "CONTRIBUTING.md": "contributing.md",
    }
    for readme in recipe_readmes(root):
        folder = posixpath.dirname(readme)
        pages[readme] = "recipes/index.md" if folder == "recipes" else f"recipes/{posixpath.basename(folder)}.md"
    return pages


def assets(root: Path = REPO) -> list[str]:
    """Repository paths of the plots the site carries (the current results and the recipes')."""
    out = []
    for folder in ASSET_FOLDERS:
        out += sorted(str(p.relative_to(root)) for p in (root / folder).rglob("*.png"))
    return out


# --- navigation --------------------------------------------------------------------------------


def _api_nav(modules: list[str]) -> list[Any]:
    """Nested navigation of the API pages: a package is a section whose first page is its own."""
    tree: dict[str, Any] = {}
    for module in modules:
        node = tree
        for part in module.split("."):
            node = node.setdefault(part, {})
        node[""] = api_page(module)

    def entries(node: dict[str, Any], prefix: str) -> list[Any]:
        out: list[Any] = []
        for name, child in node.items():
            if name == "":
                continue
            dotted = f"{prefix}{name}"
            subs = entries(child, f"{dotted}.")
            if subs:
                out.append({dotted: [child[""], *subs] if "" in child else subs})
            else:
                out.append({dotted: child[""]})
        return out

    return entries(tree, "")


def on_config(config: Any) -> Any:
    """Fill the generated sections of the navigation: the recipes and the API reference."""
    pages = repo_pages()
    for i, entry in enumerate(config["nav"]):
        if not isinstance(entry, dict):
            continue
        ((title, value),) = entry.items()
        if title == NAV_API:
            config["nav"][i] = {title: [*(value or []), *_api_nav(public_modules())]}
        elif title == NAV_RECIPES:
            recipes = [{_title(r): pages[r]} for r in recipe_readmes()[1:]]
            config["nav"][i] = {title: [pages["recipes/README.md"], *recipes]}
    return config


def _title(readme: str) -> str:
    """A recipe's navigation title: its folder's name."""
    return posixpath.basename(posixpath.dirname(readme))


# --- generated files ---------------------------------------------------------------------------


def on_files(files: Files, config: Any) -> Files:
    """Add the API pages, the pages from outside ``docs/`` and the plots they show."""
    for module in public_modules():
        title = f"`{module}`"
        content = f"# {title}\n\n::: {module}\n"
        files.append(File.generated(config, api_page(module), content=content))
    for repo_path, site_path in repo_pages().items():
        files.append(File.generated(config, site_path, abs_src_path=str(REPO / repo_path)))
    for repo_path in assets():
        files.append(File.generated(config, f"{ASSET_DIR}/{repo_path}", abs_src_path=str(REPO / repo_path)))
    return files


# --- links -------------------------------------------------------------------------------------

_LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)(\))")
_FENCE = re.compile(r"^([ \t]*(?:```|~~~))", re.MULTILINE)


def source_of(site_path: str) -> str:
    """Repository path of the file a site page was made from."""
    reverse = {site: repo for repo, site in repo_pages().items()}
    return reverse.get(site_path, f"docs/{site_path}")


def map_link(target: str, page_repo_path: str, page_site_path: str) -> str:
    """A link written for the repository, as the site page ``page_site_path`` must write it."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
        return target  # a URL, an anchor on the page, or an absolute path (left to mkdocs)
    path, _, anchor = target.partition("#")
    repo_path = posixpath.normpath(posixpath.join(posixpath.dirname(page_repo_path), path))
    if repo_path.startswith("../") or not (REPO / repo_path).exists():
        return target  # not in the repository: mkdocs reports it
    pages, plots = repo_pages(), set(assets())
    if repo_path in pages:
        site = pages[repo_path]
    elif repo_path.startswith("docs/") and repo_path.endswith(".md"):
        site = repo_path[len("docs/") :]
    elif repo_path in plots:
        site = f"{ASSET_DIR}/{repo_path}"
    else:
        kind = "tree" if (REPO / repo_path).is_dir() else "blob"
        return f"{GITHUB}/{kind}/main/{repo_path}" + (f"#{anchor}" if anchor else "")
    relative = posixpath.relpath(site, posixpath.dirname(page_site_path) or ".")
    return relative + (f"#{anchor}" if anchor else "")


def rewrite_links(markdown: str, page_repo_path: str, page_site_path: str) -> str:
    """Every inline link and image of ``markdown`` outside fenced code, mapped by :func:`map_link`."""
    parts = _FENCE.split(markdown)
    out, inside, i = [], False, 0
    # _FENCE.split keeps the fence markers: text, marker, text, marker, ...
    while i < len(parts):
        text = parts[i]
        if not inside:
            text = _LINK.sub(
                lambda m: m.group(1) + map_link(m.group(2), page_repo_path, page_site_path) + m.group(3), text
            )
        out.append(text)
        if i + 1 < len(parts):
            out.append(parts[i + 1])
            inside = not inside
        i += 2
    return "".join(out)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """Map the page's repository links to the site (see :func:`map_link`)."""
    site_path = page.file.src_uri
    if site_path.startswith(f"{API_DIR}/"):
        return markdown
    return rewrite_links(markdown, source_of(site_path), site_path)
