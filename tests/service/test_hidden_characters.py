"""Characters a reader cannot see (a bidirectional override makes "\\u202elive" read "evil";
a zero-width space hides in a name): names refuse them (422 naming the field and the
character); free text keeps them, and the log and the pages show each as an escape."""

from __future__ import annotations

import logging
import re
import sys
import unicodedata

import pytest

from ckpt.core.contract import HIDDEN_CATEGORIES
from service.logsafe import escape, protect, reveal
from service.names import HIDDEN
from tests.service.conftest import Server
from tests.service.helpers import register


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/runs/{run}/attempts", {"pod": "\u202elive"}),
        ("POST", "/v1/runs/{run}/attempts", {"node": "node-\u20667\u2069"}),
        ("POST", "/v1/runs/{run}/attempts", {"pool": "spot\u200f"}),
        ("POST", "/v1/runs/{run}/attempts", {"pod": "pod\u200b1"}),
        ("POST", "/v1/tokens", {"role": "read", "name": "ops\u202a"}),
        ("PATCH", "/v1/runs/{run}", {"dedup_group": "team\ufeff"}),
    ],
)
def test_names_refuse_hidden_characters(
    server: Server, run_name: str, method: str, path: str, body: dict[str, str]
) -> None:
    """A bidirectional override or a zero-width mark makes a name read as another
    ("\\u202elive" reads "evil"): 422, naming the field and the character."""
    field, value = next((k, v) for k, v in body.items() if not v.isprintable())
    char = next(c for c in value if not c.isprintable())
    with server.client() as client:
        client.post("/v1/runs", json={"name": run_name}).raise_for_status()
        answer = client.request(method, path.format(run=run_name), json=body)
        lineage = client.get(f"/v1/runs/{run_name}/lineage")
    assert answer.status_code == 422, answer.text
    message = answer.json()["message"]
    for word in (f"body.{field}", f"U+{ord(char):04X}", "format characters"):
        assert word in message, (word, message)
    assert lineage.json()["attempts"] == [], "a refused name was kept"


def test_hidden_characters_in_free_text_are_kept_and_logged_as_escapes(
    server: Server, run_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A notice is the cloud's words: kept as said, but logged with the override escaped."""
    protect()
    with server.client() as client:
        attempt = register(client, run_name)
        with caplog.at_level(logging.INFO):
            noticed = client.post(
                f"/v1/attempts/{attempt['attempt_id']}/notice",
                json={"cloud": "aws", "kind": "instance-action", "detail": "at \u202e12:00"},
            )
    assert noticed.status_code == 200, noticed.text
    assert noticed.json()["notice"] == "aws instance-action: at \u202e12:00"
    logged = [record.getMessage() for record in caplog.records if "notice" in record.getMessage()]
    assert logged and all("\u202e" not in line for line in logged), logged
    assert any("at \\u202e12:00" in line for line in logged), logged


def test_the_hidden_class_is_unicodes_control_and_format_characters() -> None:
    """``HIDDEN`` holds every character the running Python's Unicode database files under
    Cc, Cf, Zl, Zp or Cs, and nothing else but code points it does not know yet; the log and
    the pages escape each of them."""
    pattern = re.compile(f"[{HIDDEN}]")
    for code in range(sys.maxunicode + 1):
        char = chr(code)
        category = unicodedata.category(char)
        if category in HIDDEN_CATEGORIES:
            assert pattern.match(char), f"U+{code:04X} ({category}) is missing"
            assert "\\" in escape(f"a{char}"), f"U+{code:04X} is logged raw"
            if char not in "\t\n\r":
                assert "\\" in reveal(f"a{char}"), f"U+{code:04X} is shown raw"
        elif pattern.match(char):
            assert category == "Cn", f"U+{code:04X} ({category}) is not hidden"


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("plain é✓ \\n", "plain é✓ \\n"),
        ("a\nb\tc", "a\nb\tc"),  # whitespace on a page, and the stuff markup is made of
        ("\u202elive\u2069", "\\u202elive\\u2069"),
        ("zero\u200bwidth\x1b", "zero\\u200bwidth\\x1b"),
        ("esc\x1b[31m\x7f", "esc\\x1b[31m\\x7f"),
        ("no\u00a0break", "no\u00a0break"),  # not printable for Python, yet seen: a space
    ],
)
def test_reveal(text: str, shown: str) -> None:
    assert reveal(text) == shown
