"""What the deployment files must agree with: the ``CKPT_*`` variables the code reads, the
control plane's port, the images' user."""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

from agent.config import ENV
from service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
PORT = 8470  # service.settings.DEFAULT_PORT
UID = 10001  # the non-root user of both images (deploy/docker/*.Dockerfile)

# A name the code reads appears in it as a string literal ("CKPT_POD"); names built from a
# field (service/settings.py: f"CKPT_{field.name.upper()}") come from the fields themselves.
_LITERAL = re.compile(r"""["'](CKPT_[A-Z0-9_]*[A-Z0-9])["']""")

# Read by the tests only, never by a deployment.
_TEST_ONLY = {"CKPT_TEST_PG", "CKPT_REQUIRE_POSTGRES", "CKPT_REQUIRE_KUBECTL"}


@functools.cache
def settings_read_by_the_code() -> frozenset[str]:
    """Every ``CKPT_*`` variable that the packages read."""
    names = {f"CKPT_{field.name.upper()}" for field in dataclasses.fields(Settings)}
    names |= set(ENV.values())
    for package in ("ckpt", "agent", "service", "migrations"):
        for path in (ROOT / package).rglob("*.py"):
            names |= set(_LITERAL.findall(path.read_text()))
    return frozenset(names - _TEST_ONLY)


def unknown(names: set[str]) -> set[str]:
    """The ``CKPT_*`` names among ``names`` that no code reads (typos, stale settings)."""
    return {name for name in names if name.startswith("CKPT_")} - settings_read_by_the_code()
