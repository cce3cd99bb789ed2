"""Clouds' notices of a coming preemption, read from the instance's metadata service.

A cloud announces that it takes a spot (preemptible) machine back before it sends SIGTERM:
AWS two minutes ahead (and earlier still, sometimes, with a rebalance recommendation), GCP
about thirty seconds, Azure at least thirty through its Scheduled Events. Read at a low
rate (``CKPT_NOTICE_POLL_SECONDS``, 5 by default), a notice makes the next step boundary
save at once, unhurried, instead of racing the grace period after the signal; the attempt
records the notice. Training goes on until the signal comes, which then saves only what
the steps since added (if it fits).

What is read, in each cloud's own shapes:

- ``aws``: IMDSv2 (a session token from ``PUT /latest/api/token``), then
  ``/latest/meta-data/spot/instance-action`` (``{"action": "terminate", "time": ...}``) and
  ``/latest/meta-data/events/recommendations/rebalance`` (``{"noticeTime": ...}``); 404
  means none.
- ``gcp``: ``/computeMetadata/v1/instance/preempted`` (``TRUE``) and
  ``/computeMetadata/v1/instance/maintenance-event`` (anything but ``NONE``), with
  ``Metadata-Flavor: Google``.
- ``azure``: ``/metadata/scheduledevents?api-version=2020-07-01`` with ``Metadata: true``;
  an event of type ``Preempt``, ``Terminate``, ``Reboot`` or ``Redeploy`` (each ends this
  process; ``Freeze`` only pauses it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import httpx

log = logging.getLogger("ckpt")

CLOUDS = ("aws", "gcp", "azure")


@dataclass(frozen=True)
class Notice:
    """A notice as the control plane records it on the attempt."""

    cloud: str
    kind: str  # instance-action, rebalance, preempted, maintenance, preempt, ...
    detail: str | None = None

    def __str__(self) -> str:
        return f"{self.cloud} {self.kind}" + (f": {self.detail}" if self.detail else "")


class Probe(Protocol):
    cloud: str
    default_url: str

    def poll(self, http: httpx.Client, base: str) -> Notice | None:
        """The notice the metadata service at ``base`` shows now, or None.

        Raises:
            httpx.HTTPError: it could not be read.
        """
        ...


class Aws:
    """EC2's instance metadata service, version 2 (a session token on every request)."""

    cloud = "aws"
    default_url = "http://169.254.169.254"
    _TTL = 21600  # seconds a token lives, the most EC2 grants

    def __init__(self) -> None:
        self._token: str | None = None
        self._renew_at = 0.0

    def poll(self, http: httpx.Client, base: str) -> Notice | None:
        action = self._get(http, base, "/latest/meta-data/spot/instance-action")
        if action is not None:
            detail = f"{action.get('action', '?')} at {action.get('time', '?')}"
            return Notice(self.cloud, "instance-action", detail)
        rebalance = self._get(http, base, "/latest/meta-data/events/recommendations/rebalance")
        if rebalance is not None:
            return Notice(self.cloud, "rebalance", f"noticed at {rebalance.get('noticeTime', '?')}")
        return None

    def _get(self, http: httpx.Client, base: str, path: str) -> dict[str, Any] | None:
        for _ in range(2):  # once more with a new token if the old one was refused
            response = http.get(
                base + path, headers={"X-aws-ec2-metadata-token": self._auth(http, base)}
            )
            if response.status_code == 401:
                self._token = None
                continue
            if response.status_code == 404:
                return None
            response.raise_for_status()
            found: dict[str, Any] = response.json()
            return found
        response.raise_for_status()
        return None

    def _auth(self, http: httpx.Client, base: str) -> str:
        if self._token is None or time.monotonic() >= self._renew_at:
            response = http.put(
                base + "/latest/api/token",
                headers={"X-aws-ec2-metadata-token-ttl-seconds": str(self._TTL)},
            )
            response.raise_for_status()
            self._token, self._renew_at = response.text, time.monotonic() + self._TTL / 2
        return self._token


class Gcp:
    """Compute Engine's metadata server."""

    cloud = "gcp"
    default_url = "http://metadata.google.internal"
    _HEADERS: ClassVar[dict[str, str]] = {"Metadata-Flavor": "Google"}

    def poll(self, http: httpx.Client, base: str) -> Notice | None:
        path = "/computeMetadata/v1/instance/"
        preempted = http.get(base + path + "preempted", headers=self._HEADERS)
        preempted.raise_for_status()
        if preempted.text.strip().upper() == "TRUE":
            return Notice(self.cloud, "preempted", "instance/preempted is TRUE")
        event = http.get(base + path + "maintenance-event", headers=self._HEADERS)
        event.raise_for_status()
        if event.text.strip().upper() not in ("", "NONE"):
            return Notice(self.cloud, "maintenance", event.text.strip()[:120])
        return None


class Azure:
    """Azure's Scheduled Events."""

    cloud = "azure"
    default_url = "http://169.254.169.254"
    ENDING = ("Preempt", "Terminate", "Reboot", "Redeploy")  # Freeze only pauses the VM

    def poll(self, http: httpx.Client, base: str) -> Notice | None:
        response = http.get(
            base + "/metadata/scheduledevents",
            params={"api-version": "2020-07-01"},
            headers={"Metadata": "true"},
        )
        response.raise_for_status()
        for event in response.json().get("Events", []):
            kind = event.get("EventType")
            if kind in self.ENDING:
                detail = f"{event.get('EventId', '?')} not before {event.get('NotBefore') or '?'}"
                return Notice(self.cloud, str(kind).lower(), detail)
        return None


PROBES: dict[str, Callable[[], Probe]] = {"aws": Aws, "gcp": Gcp, "azure": Azure}


class NoticeWatch:
    """Polls each cloud's metadata service every ``poll_seconds`` on a thread of its own
    until one shows a notice; then calls ``on_notice`` (from that thread) and stops."""

    def __init__(
        self,
        clouds: Sequence[str],
        *,
        poll_seconds: float,
        on_notice: Callable[[Notice], None],
        url: str | None = None,
    ) -> None:
        self._probes = [PROBES[cloud]() for cloud in clouds]
        self._poll_seconds, self._on_notice, self._url = poll_seconds, on_notice, url
        self.notice: Notice | None = None
        self.noticed_at: float | None = None  # time.monotonic() when it was read
        self._taken = False
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="ckpt-notices", daemon=True)

    def start(self) -> NoticeWatch:
        self._thread.start()
        return self

    def take(self) -> Notice | None:
        """The notice, the first time it is asked for after it came; else None."""
        if self.notice is None or self._taken:
            return None
        self._taken = True
        return self.notice

    def stop(self) -> None:
        self._stopping.set()

    def _watch(self) -> None:
        failing: set[str] = set()
        # A metadata service answers in milliseconds or not at all (not on that cloud).
        with httpx.Client(timeout=2.0, trust_env=False) as http:
            while not self._stopping.is_set():
                for probe in self._probes:
                    try:
                        notice = probe.poll(http, self._url or probe.default_url)
                    except (httpx.HTTPError, ValueError) as err:
                        if probe.cloud not in failing:  # once, not every poll
                            log.warning("ckpt: cannot read %s's notices: %s", probe.cloud, err)
                            failing.add(probe.cloud)
                        continue
                    failing.discard(probe.cloud)
                    if notice is not None:
                        self.noticed_at = time.monotonic()
                        self.notice = notice
                        log.warning("ckpt: %s: saving at the next step boundary", notice)
                        self._on_notice(notice)
                        return
                self._stopping.wait(self._poll_seconds)
