"""Bearer tokens as read from the environment or a file: the whitespace around one is
dropped (a Secret made from a command's output ends with a newline); one with whitespace
or control characters inside is a configuration error that says so, never a network
error, and never prints the token."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

from agent.catalog.client import ControlPlane
from agent.config import Config
from ckpt import Checkpointer
from ckpt.cli import main
from ckpt.core.tokens import bearer, clean_token, default_token

SECRET = "ckpt_Zx9-secret_part"


@pytest.mark.parametrize("text", [f"{SECRET}\n", f"  {SECRET}\r\n", f"\t{SECRET} "])
def test_the_whitespace_around_a_token_is_dropped(text: str) -> None:
    assert clean_token(text, source="CKPT_TOKEN") == SECRET
    assert bearer(text) == {"Authorization": f"Bearer {SECRET}"}


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("ckpt_Zx9 secret_part", "whitespace at character 9 of 20"),
        ("ckpt_Zx9\nsecret_part\n", "whitespace"),
        ("ckpt_Zx9\x00secret_part", "a control character"),
        ("ckpt_Zx9\x7fsecret_part", "a control character"),
        ("ckpt_Zx9\u00e9secret_part", "a non-ASCII character"),
    ],
)
def test_a_token_with_a_break_inside_is_refused_without_printing_it(text: str, kind: str) -> None:
    with pytest.raises(ValueError, match="bearer token in CKPT_TOKEN contains") as caught:
        clean_token(text, source="CKPT_TOKEN")
    assert kind in str(caught.value)
    assert "Zx9" not in str(caught.value) and "secret_part" not in str(caught.value)


def test_an_empty_token_is_refused() -> None:
    with pytest.raises(ValueError, match="bearer token in CKPT_TOKEN is empty"):
        clean_token(" \n", source="CKPT_TOKEN")


def test_the_agent_reads_ckpt_token_cleaned() -> None:
    config = Config.resolve({"run": "r"}, env={"CKPT_TOKEN": f"{SECRET}\n"})
    assert config.token == SECRET
    with pytest.raises(ValueError, match=r"token \(CKPT_TOKEN\) contains whitespace"):
        Config.resolve({"run": "r"}, env={"CKPT_TOKEN": "ckpt_a b"})


def test_a_bad_token_fails_the_checkpointer_at_construction() -> None:
    """A configuration error, before any call: not 'cannot reach the control plane'."""
    with pytest.raises(ValueError, match="contains a control character") as caught:
        Checkpointer(
            run="r", models=nn.Linear(2, 2), server="http://127.0.0.1:9", token="ckpt_a\x01b"
        )
    assert "reach" not in str(caught.value)
    with pytest.raises(ValueError, match="contains whitespace"):
        ControlPlane("http://127.0.0.1:9", token="ckpt_a\nb")


def test_a_token_file_is_read_cleaned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "admin-token"
    monkeypatch.delenv("CKPT_TOKEN", raising=False)
    monkeypatch.setenv("CKPT_ADMIN_TOKEN_FILE", str(path))
    assert default_token() is None
    path.write_text(f"{SECRET}\r\n")
    assert default_token() == SECRET
    path.write_text(f"{SECRET} {SECRET}\n")
    with pytest.raises(ValueError, match=f"token file {path} contains whitespace"):
        default_token()


def test_the_cli_says_what_is_wrong_with_the_token(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CKPT_TOKEN", "ckpt_Zx9\tsecret_part\n")
    monkeypatch.setenv("CKPT_SERVER", "http://127.0.0.1:9")
    with pytest.raises(SystemExit) as caught:
        main(["runs"])
    message = str(caught.value.code)
    assert "the bearer token in CKPT_TOKEN contains whitespace" in message
    assert "reach" not in message and "Zx9" not in message
    with pytest.raises(SystemExit, match="bearer token in --token contains whitespace"):
        main(["runs", "--token", "ckpt_a b"])
