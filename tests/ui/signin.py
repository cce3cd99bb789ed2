"""Sign in to the dashboard over plain HTTP (no browser): the form's CSRF field and cookie,
then the session cookie, in an httpx client."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

CSRF_FIELD = re.compile(r'name="csrf"[^>]*value="([^"]+)"|value="([^"]+)"[^>]*name="csrf"')


def csrf_field(html: str) -> str:
    """The value of the form's hidden ``csrf`` input."""
    found = CSRF_FIELD.search(html)
    assert found, f"no csrf field in the page:\n{html[:2000]}"
    return found.group(1) or found.group(2)


@contextmanager
def signed_in_client(url: str, token: str) -> Iterator[httpx.Client]:
    """A client holding a dashboard session made with ``token``."""
    with httpx.Client(base_url=url, timeout=60) as client:
        form = client.get("/ui/signin")
        assert form.status_code == 200, form.text
        done = client.post("/ui/signin", data={"token": token, "csrf": csrf_field(form.text)})
        assert done.status_code == 303, done.text
        assert "ckpt_session" in client.cookies
        yield client
