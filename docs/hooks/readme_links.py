"""A MkDocs hook: every relative link in README.md must land somewhere real.

README.md is not a page of the site, so MkDocs does not check its links; this hook does,
once every page is rendered. A link into ``docs/`` must name a page of the build (or a file
it copies, such as an image) and, with ``#anchor``, a heading of that page; ``#anchor``
alone must name a heading of README.md; any other relative link must name a file or folder of the repository. Each broken link is
a warning, and ``mkdocs build --strict`` fails on warnings.
"""

from __future__ import annotations

import logging
from html.parser import HTMLParser
from pathlib import Path, PurePosixPath
from urllib.parse import unquote, urlsplit

import markdown  # type: ignore[import-untyped, unused-ignore]
from jinja2 import Environment
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import Files

# Under "mkdocs", so that the strict build counts these warnings.
log = logging.getLogger("mkdocs.hooks.readme_links")


class _Links(HTMLParser):
    """The link targets and the element ids of an HTML fragment."""

    def __init__(self) -> None:
        super().__init__()
        self.targets: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if tag == "a" and values.get("href"):
            self.targets.append(values["href"] or "")
        if tag == "img" and values.get("src"):
            self.targets.append(values["src"] or "")
        if values.get("id"):
            self.ids.add(values["id"] or "")


def parse_readme(path: Path, config: MkDocsConfig) -> _Links:
    """README.md rendered with the site's Markdown extensions (the same heading ids)."""
    html = markdown.markdown(
        path.read_text(encoding="utf-8"),
        extensions=config.markdown_extensions,
        extension_configs=config.mdx_configs,
    )
    links = _Links()
    links.feed(html)
    return links


def broken_links(readme: Path, docs_dir: Path, files: Files, config: MkDocsConfig) -> list[str]:
    """What is wrong with each relative link of ``readme``, one line per broken link."""
    links = parse_readme(readme, config)
    problems = []
    for target in links.targets:
        parts = urlsplit(target)
        if parts.scheme or parts.netloc:
            continue  # an external URL: not this build's business
        path, anchor = unquote(parts.path), unquote(parts.fragment)
        if not path:
            if anchor not in links.ids:
                problems.append(f"{target}: README.md has no heading with this anchor")
            continue
        problem = _check(readme.parent, docs_dir, files, path=path, anchor=anchor)
        if problem:
            problems.append(f"{target}: {problem}")
    return problems


def _check(root: Path, docs_dir: Path, files: Files, *, path: str, anchor: str) -> str | None:
    resolved = (root / PurePosixPath(path)).resolve()
    try:
        in_docs = resolved.relative_to(docs_dir.resolve()).as_posix()
    except ValueError:
        return None if resolved.exists() else "no such file in the repository"
    if in_docs in (".", ""):
        in_docs = "index.md"
    file = files.get_file_from_path(in_docs)
    if file is not None and file.page is None and not anchor:
        return None  # an image or another file the site copies as it is
    if file is None or file.page is None:
        return f"docs/{in_docs} is not a page of the site"
    if anchor and anchor not in (file.page.present_anchor_ids or set()):
        return f"docs/{in_docs} has no heading with this anchor"
    return None


def on_env(env: Environment, *, config: MkDocsConfig, files: Files) -> Environment:
    """After every page is rendered (so their anchors are known): check README.md."""
    docs_dir = Path(config.docs_dir)
    readme = Path(config.config_file_path).parent / "README.md"
    for problem in broken_links(readme, docs_dir, files, config):
        log.warning("README.md links to %s", problem)
    return env
