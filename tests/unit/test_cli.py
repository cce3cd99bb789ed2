"""The ``ckpt`` command's own surface: every command explains itself, and mistakes name the
option to fix. (What the commands do is tested against real catalogs in tests/service.)"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from ckpt.cli import build_parser, main
from ckpt.cli.text import paragraphs
from ckpt.cli.tokens import duration, format_tokens
from service.auth.schemas import TokenOut
from service.models import Role


def command_paths(
    parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()
) -> Iterator[tuple[str, ...]]:
    """Every command and action of the parser, as the words that name it."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield (*prefix, name)
                yield from command_paths(child, (*prefix, name))


PATHS = sorted(command_paths(build_parser()))


def run(argv: list[str]) -> tuple[int, str, str]:
    """``ckpt ARGV`` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    code: int | str | None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exited:
            code = exited.code
    return (code if isinstance(code, int) else 1), out.getvalue(), err.getvalue()


def description(help_text: str) -> str:
    """The paragraphs between the usage lines and the first list of arguments."""
    blocks = help_text.split("\n\n")
    assert blocks[0].startswith("usage: "), help_text
    found = []
    for block in blocks[1:]:
        if re.match(r"(options|positional arguments):", block):
            break
        found.append(block)
    return "\n\n".join(found)


def test_the_walk_finds_every_command() -> None:
    for path in [("demo",), ("launch",), ("server",), ("verify",), ("catalog", "rebuild")]:
        assert path in PATHS
    assert {("token", "create"), ("token", "list"), ("token", "revoke")} <= set(PATHS)


@pytest.mark.parametrize("path", PATHS, ids=" ".join)
def test_every_command_describes_itself_in_its_help(path: tuple[str, ...]) -> None:
    code, out, err = run([*path, "--help"])
    assert code == 0, err
    text = description(out)
    assert len(text.split()) >= 8, f"ckpt {' '.join(path)} --help describes nothing:\n{out}"
    assert "``" not in out  # no docstring markup
    assert all(len(line) <= 80 for line in text.splitlines()), text


def test_the_demo_help_says_what_it_does_writes_and_returns() -> None:
    code, out, _ = run(["demo", "--help"])
    assert code == 0
    text = " ".join(description(out).split())
    assert "bit-identical" in text
    assert "./.ckpt" in text
    assert "Exits 0" in text


@pytest.mark.parametrize("group", ["token", "catalog"])
def test_a_group_without_its_action_explains_itself_and_exits_2(group: str) -> None:
    code, out, err = run([group])
    assert code == 2
    assert out == ""
    assert err.startswith(f"usage: ckpt {group}") and "ACTION" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--role", "run"], "--run is required for a 'run' token"),
        (["--role", "read", "--run", "r"], "--run is only for a 'run' token"),
        (["--role", "admin", "--run", "r"], "--run is only for a 'run' token"),
        (["--role", "run", "--run", "a b"], "--run: invalid run name 'a b': use 1-128 letters"),
        (["--role", "run", "--run", "r", "--name", "a\tb"], "--name: use printable characters"),
    ],
)
def test_token_create_mistakes_name_the_option_and_exit_2(
    argv: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    catalog = tmp_path / "catalog.db"
    monkeypatch.setenv("CKPT_DATABASE_URL", f"sqlite:///{catalog}")

    code, out, err = run(["token", "create", *argv])

    assert code == 2
    assert out == ""
    assert err.startswith(f"ckpt token create: {message}"), err
    assert "Value error" not in err and "run=<name>" not in err
    assert not catalog.exists()  # refused before the catalog was opened


@pytest.mark.parametrize("text", ["0", "-1", "x", "2147483648", "²"])
def test_token_revoke_refuses_what_is_not_an_id(text: str) -> None:
    code, _, err = run(["token", "revoke", text])
    assert code == 2
    assert f"{text!r} is not a token id" in err


def test_format_tokens_shows_no_secret_and_says_when_there_is_none() -> None:
    created = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    later = datetime(2999, 1, 2, 3, 4, 5, tzinfo=UTC)
    tokens = [
        TokenOut(id=1, name="ci", role=Role.RUN, run="r", created_at=created, revoked_at=created),
        TokenOut(id=2, name="ops", role=Role.ADMIN, run=None, created_at=created, revoked_at=None),
        TokenOut(
            id=3,
            name="job",
            role=Role.RUN,
            run="r",
            created_at=created,
            revoked_at=None,
            expires_at=created,
        ),
        TokenOut(
            id=4,
            name="dash",
            role=Role.READ,
            run=None,
            created_at=created,
            revoked_at=None,
            expires_at=later,
        ),
    ]
    assert format_tokens(tokens).splitlines() == [
        "ID  NAME  ROLE   RUN  CREATED              EXPIRES                        REVOKED",
        "1   ci    run    r    2026-01-02 03:04:05  never                          2026-01-02 03:04:05",
        "2   ops   admin  -    2026-01-02 03:04:05  never                          -",
        "3   job   run    r    2026-01-02 03:04:05  2026-01-02 03:04:05 (expired)  -",
        "4   dash  read   -    2026-01-02 03:04:05  2999-01-02 03:04:05            -",
    ]
    assert "no tokens" in format_tokens([])


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30d", 30 * 86400), ("12h", 43200), ("90m", 5400), ("3600s", 3600), ("7", 7)],
)
def test_token_durations(text: str, seconds: int) -> None:
    assert duration(text) == seconds


@pytest.mark.parametrize("text", ["0d", "-1h", "1.5d", "d", "", "30y", "٣d"])
def test_token_create_refuses_what_is_not_a_duration(text: str) -> None:
    code, out, err = run(["token", "create", "--role", "read", f"--expires-in={text}"])
    assert code == 2 and out == ""
    assert f"{text!r} is not a duration" in err


def test_paragraphs_wraps_each_paragraph_and_keeps_them_apart() -> None:
    text = """
        one two
        three

        four
    """
    assert paragraphs(text, width=8) == "one two\nthree\n\nfour"
