"""The docs site stays true and builds offline.

The strict MkDocs build fails on any broken link between pages, to a heading, or from
README.md (the hook ``docs/hooks/readme_links.py``); the built site loads nothing from the
network; and what the pages name is checked against the code: Python blocks, ``ckpt``
subcommands and their options, REST endpoints, ``CKPT_*`` variables, the signature of
``Checkpointer``.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import inspect
import io
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from html.parser import HTMLParser
from pathlib import Path

import pytest

from tests.deploy.common import settings_read_by_the_code

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"

FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", flags=re.DOTALL | re.MULTILINE)
INLINE_CODE = re.compile(r"`([^`\n]+)`")


def pages() -> dict[str, str]:
    """Every Markdown page of the site, by its path under ``docs/``."""
    return {path.relative_to(DOCS).as_posix(): path.read_text() for path in DOCS.glob("*.md")}


def blocks(text: str, language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(text) if lang == language]


def code(text: str) -> Iterator[str]:
    """Each line of every fenced block, less its comment, then every inline code span
    outside the blocks."""
    for _, body in FENCE.findall(text):
        yield from (re.sub(r"(^|\s)#.*", "", line) for line in body.splitlines())
    yield from INLINE_CODE.findall(FENCE.sub("", text))


def everything() -> dict[str, str]:
    return {**pages(), "README.md": README.read_text()}


def build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built strictly from the repository's mkdocs.yml."""
    out = tmp_path_factory.mktemp("site")
    done = build(ROOT / "mkdocs.yml", out)
    assert done.returncode == 0, done.stderr[-5000:]
    assert "WARNING" not in done.stderr, done.stderr[-5000:]
    return out


# -- the build ---------------------------------------------------------------------------


def test_every_page_is_built(site: Path) -> None:
    # A page missing from the nav fails the strict build (omitted_files: warn).
    assert {page.removesuffix(".md") + ".html" for page in pages()} <= {
        path.name for path in site.glob("*.html")
    }


def test_a_broken_readme_link_fails_the_build(tmp_path: Path) -> None:
    shutil.copy(ROOT / "mkdocs.yml", tmp_path)
    shutil.copytree(DOCS, tmp_path / "docs", ignore=shutil.ignore_patterns("__pycache__"))
    broken = "\n[a](docs/usage.md#no-such-heading) [b](docs/no-such-page.md) [c](#nowhere)\n"
    (tmp_path / "README.md").write_text(README.read_text() + broken)
    done = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0
    for target in ("docs/usage.md#no-such-heading", "docs/no-such-page.md", "#nowhere"):
        assert f"README.md links to {target}:" in done.stderr


class _Loads(HTMLParser):
    """What a page makes the browser fetch: scripts, stylesheets, fonts, images, frames."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []
        self.styles: list[str] = []
        self._in_style = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {name: value or "" for name, value in attrs}
        if tag in ("script", "img", "iframe", "source", "embed", "audio", "video"):
            self.urls.append(values.get("src", ""))
        if tag == "link" and values.get("rel", "") not in ("canonical", "prev", "next"):
            self.urls.append(values.get("href", ""))
        self.styles.append(values.get("style", ""))
        self._in_style = tag == "style"

    def handle_endtag(self, tag: str) -> None:
        self._in_style = False

    def handle_data(self, data: str) -> None:
        if self._in_style:
            self.styles.append(data)


def css_urls(css: str) -> list[str]:
    found = re.findall(r"""url\(\s*['"]?([^'")\s]+)""", css)
    return found + re.findall(r"""@import\s+['"]([^'"]+)""", css)


def remote(url: str) -> bool:
    return re.match(r"(https?:)?//", url.strip(), flags=re.IGNORECASE) is not None


def test_the_site_loads_nothing_from_the_network(site: Path) -> None:
    fetched: dict[str, list[str]] = {}
    for page in site.rglob("*.html"):
        parser = _Loads()
        parser.feed(page.read_text())
        urls = parser.urls + [url for style in parser.styles for url in css_urls(style)]
        fetched[page.name] = [url for url in urls if remote(url)]
    for sheet in site.rglob("*.css"):
        fetched[sheet.name] = [url for url in css_urls(sheet.read_text()) if remote(url)]
    assert "index.html" in fetched
    assert {name: urls for name, urls in fetched.items() if urls} == {}


def test_the_network_check_sees_a_cdn() -> None:
    parser = _Loads()
    parser.feed(
        '<script src="https://cdn.example/x.js"></script><link rel="stylesheet" href="//x">'
    )
    assert [url for url in parser.urls if remote(url)] == ["https://cdn.example/x.js", "//x"]
    assert css_urls("@font-face{src:url('https://f.example/a.woff2')}") == [
        "https://f.example/a.woff2"
    ]
    assert not remote("data:image/svg+xml,%3csvg xmlns='http://www.w3.org/2000/svg'")


# -- Python blocks -----------------------------------------------------------------------


def test_the_usage_example_is_the_readme_example() -> None:
    (readme_example,) = blocks(README.read_text(), "python")
    examples = [b for b in blocks(pages()["usage.md"], "python") if "Checkpointer(" in b]
    assert examples == [readme_example]  # tests/unit/test_readme.py runs it


def test_every_python_block_compiles_and_those_that_only_import_run() -> None:
    imports_only = []
    for page, text in pages().items():
        for number, block in enumerate(blocks(text, "python")):
            tree = ast.parse(block, f"{page}#{number}")
            if all(isinstance(node, ast.Import | ast.ImportFrom) for node in tree.body):
                imports_only.append(block)
    assert imports_only
    for block in imports_only:
        exec(block, {})


def test_the_documented_checkpointer_signature_is_the_real_one() -> None:
    """The objects and the store by name, then every setting (``**settings``, typed by
    ``Keywords``), each defaulting to None."""
    from agent.config import Keywords
    from ckpt import Checkpointer

    (text,) = [b for b in blocks(pages()["python-api.md"], "") if b.startswith("Checkpointer(")]
    documented = ast.parse(f"def {text.strip()}: pass").body[0]
    assert isinstance(documented, ast.FunctionDef)
    parameters = documented.args
    names = [arg.arg for arg in parameters.kwonlyargs]
    defaults = [None if d is None else ast.literal_eval(d) for d in parameters.kw_defaults]
    *real, settings = inspect.signature(Checkpointer).parameters.values()
    assert settings.kind is inspect.Parameter.VAR_KEYWORD
    assert names == [p.name for p in real] + list(Keywords.__annotations__)
    assert defaults == [
        None if p.default is inspect.Parameter.empty else p.default for p in real
    ] + [None] * len(Keywords.__annotations__)
    required = [name for name, d in zip(names, parameters.kw_defaults, strict=True) if d is None]
    assert required == [p.name for p in real if p.default is inspect.Parameter.empty]


# -- the ckpt command --------------------------------------------------------------------


def invocations(text: str) -> Iterator[tuple[tuple[str, ...], list[str]]]:
    """Each ``ckpt`` command line in the code of ``text``: its subcommand path and options."""
    for line in code(text):
        tokens = line.split()
        for i, token in enumerate(tokens):
            if token != "ckpt" and not token.endswith("/ckpt"):
                continue
            before = tokens[i - 1] if i else ""
            if before in ("from", "import") or (before.startswith("-") and before != "--"):
                continue  # Python's import, or a value such as kubectl's -n ckpt
            yield _parse(tokens[i + 1 :])


def _parse(words: list[str]) -> tuple[tuple[str, ...], list[str]]:
    path: list[str] = []
    options: list[str] = []
    for word in words:
        if word in ("|", "&", "&&", ";", "--", "\\") or word.startswith(("#", ")")):
            break
        if re.fullmatch(r"[a-z][a-z-]*", word) and len(path) < 2 and not options:
            if path and path[0] not in ("token", "catalog"):
                continue  # an argument (a run's name), not an action
            path.append(word)
        options += re.findall(r"--[a-z][a-z-]*", word)
    return tuple(path), options


@cache
def help_text(path: tuple[str, ...]) -> str:
    """``ckpt PATH --help``; fails when the command does not exist."""
    from ckpt.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code: str | int | None
        try:
            code = main([*path, "--help"])
        except SystemExit as exited:  # argparse's --help, or its usage error
            code = exited.code
    assert code == 0, f"ckpt {' '.join(path)} --help exited {code}: {err.getvalue()}"
    return out.getvalue()


def test_the_invocation_parser() -> None:
    text = (
        "```sh\n.venv/bin/ckpt demo --steps 9 && kubectl -n ckpt get pods\n"
        "ckpt launch --backoff 2 -- python train.py --lr 1\n```\n"
        "`from ckpt import Checkpointer`, `ckpt token create --role run --run r`, `ckpt resumable my-run`"
    )
    assert list(invocations(text)) == [
        (("demo",), ["--steps"]),
        (("launch",), ["--backoff"]),
        (("token", "create"), ["--role", "--run"]),
        (("resumable",), []),
    ]


def test_every_ckpt_command_and_option_named_exists() -> None:
    named: dict[tuple[tuple[str, ...], str | None], str] = {}
    for page, text in everything().items():
        for path, options in invocations(text):
            for option in [None, *options]:
                named.setdefault((path, option), page)
    assert (("launch",), "--max-restarts") in named
    for (path, option), page in sorted(named.items(), key=str):
        usage = help_text(path)
        if option is not None:
            assert re.search(rf"(?<![\w-]){option}(?![\w-])", usage), (
                f"{page}: ckpt {' '.join(path)} has no option {option}"
            )


def subcommands(path: tuple[str, ...]) -> list[str]:
    """The subcommands ``ckpt PATH --help`` lists (none for a command without any)."""
    return re.findall(r"^    (\w[\w-]*)(?: |$)", help_text(path), flags=re.MULTILINE)


def test_every_subcommand_is_documented() -> None:
    documented = {path for path, _ in invocations(pages()["cli.md"])}
    commands = subcommands(())
    assert {"demo", "token"} <= set(commands)
    for command in commands:
        assert (command,) in documented or any(p[:1] == (command,) for p in documented), command
        for action in subcommands((command,)):
            assert (command, action) in documented, f"ckpt {command} {action}"


# -- the REST API ------------------------------------------------------------------------

ENDPOINT = re.compile(r"\b(GET|POST|PUT|PATCH|DELETE) (/[\w/{}.-]*)")
URL = re.compile(r"https?://127\.0\.0\.1:8470(/[\w/{}.-]*)")


@pytest.fixture(scope="module")
def routes(tmp_path_factory: pytest.TempPathFactory) -> set[tuple[str, str]]:
    """Every (method, path template) the control plane serves, parameters as ``{}``."""
    from service.app import create_app
    from service.settings import Settings

    tmp = tmp_path_factory.mktemp("service")
    settings = Settings(
        database_url=f"sqlite:///{tmp / 'c.db'}",
        store=str(tmp / "store"),
        admin_token="x" * 20,
        auto_migrate=False,
    )
    app = create_app(settings)
    app.state.context.close()
    return {
        (method.upper(), template(path))
        for path, operations in app.openapi()["paths"].items()
        for method in operations
    }


def template(path: str) -> str:
    return re.sub(r"\{[^}]*\}", "{}", path)


def test_every_endpoint_named_exists(routes: set[tuple[str, str]]) -> None:
    patterns = [re.compile(re.sub(r"\\\{\\\}", "[^/]+", re.escape(path))) for _, path in routes]
    for page, text in everything().items():
        for method, path in ENDPOINT.findall(text):
            assert (method, template(path)) in routes, f"{page}: {method} {path}"
        for line in code(text):
            for path in URL.findall(line):
                assert any(p.fullmatch(path) for p in patterns), f"{page}: {path}"


def test_every_endpoint_is_documented(routes: set[tuple[str, str]]) -> None:
    documented = {(m, template(p)) for m, p in ENDPOINT.findall(pages()["rest-api.md"])}
    assert routes
    assert routes - documented == set()


# -- CKPT_* variables --------------------------------------------------------------------

VARIABLE = re.compile(r"\bCKPT_[A-Z0-9_]*[A-Z0-9]\b")


@cache
def read_by_the_tests() -> frozenset[str]:
    """``CKPT_*`` names the test suite itself reads (``CKPT_REQUIRE_POSTGRES``...)."""
    names = set()
    for path in (ROOT / "tests").rglob("*.py"):
        if path != Path(__file__):
            names |= set(
                re.findall(r"""environ(?:\.get)?[(\[]\s*["'](CKPT_\w+)""", path.read_text())
            )
    return frozenset(names)


def test_every_variable_named_is_one_the_code_reads() -> None:
    assert "CKPT_REQUIRE_POSTGRES" in read_by_the_tests()
    known = settings_read_by_the_code() | read_by_the_tests()
    for page, text in everything().items():
        assert set(VARIABLE.findall(text)) - known == set(), page


def test_every_variable_the_code_reads_is_documented() -> None:
    configuration = pages()["configuration.md"]
    documented = set(VARIABLE.findall(configuration))
    assert settings_read_by_the_code() | read_by_the_tests() <= documented


def test_every_keyword_sits_beside_its_variable() -> None:
    from agent.config import ENV, Config

    rows = pages()["configuration.md"].splitlines()
    assert set(ENV) == {field.name for field in dataclasses.fields(Config)}
    for keyword, variable in ENV.items():
        assert any(row.startswith(f"| `{keyword}` | `{variable}` |") for row in rows), keyword


# -- metrics -----------------------------------------------------------------------------

METRIC = re.compile(r"\bckpt_[a-z_]+[a-z]\b")
# Names of that shape that are not metrics: the dashboard's cookies.
NOT_METRICS = {"ckpt_session", "ckpt_csrf"}


def test_every_metric_named_exists_and_every_one_is_documented() -> None:
    from service.metrics import Metrics

    served = {family.name for family in Metrics().registry.collect()}
    table = [row for row in pages()["control-plane.md"].splitlines() if row.startswith("| `ckpt_")]
    documented = {name.removesuffix("_total") for row in table for name in METRIC.findall(row)}
    assert served
    assert documented == served
    for page, text in everything().items():
        for name in set(METRIC.findall(text)) - NOT_METRICS:
            assert name.removesuffix("_total") in served, f"{page}: {name}"
