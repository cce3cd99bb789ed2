"""Checkpointer configuration from keyword arguments and ``CKPT_*`` environment variables.

A keyword argument wins over the environment; the environment wins over the default.
"""

from __future__ import annotations

import enum
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TypedDict
from urllib.parse import urlparse

from agent.attempt.notices import CLOUDS
from agent.format.chunking import DEFAULT_BLOB_BYTES, MAX_BLOB_BYTES
from agent.save.yielding import save_yield_seconds
from agent.verify.compare import Mode
from ckpt.core.storage.keys import check_run_name
from ckpt.core.threads import save_niceness
from ckpt.core.tokens import clean_token

DEFAULT_STORE = ".ckpt/store"

ENV = {
    "run": "CKPT_RUN",
    "store": "CKPT_STORE",
    "server": "CKPT_SERVER",
    "token": "CKPT_TOKEN",
    "every_steps": "CKPT_EVERY_STEPS",
    "every_seconds": "CKPT_EVERY_SECONDS",
    "every": "CKPT_EVERY",
    "auto_min_seconds": "CKPT_AUTO_MIN_SECONDS",
    "auto_max_seconds": "CKPT_AUTO_MAX_SECONDS",
    "mtbf_seconds": "CKPT_MTBF_SECONDS",
    "blob_bytes": "CKPT_BLOB_BYTES",
    "in_flight": "CKPT_IN_FLIGHT",
    "skip_unchanged": "CKPT_SKIP_UNCHANGED",
    "overlap": "CKPT_OVERLAP",
    "staging_bytes": "CKPT_STAGING_BYTES",
    "grace_seconds": "CKPT_GRACE_SECONDS",
    "handle_signals": "CKPT_HANDLE_SIGNALS",
    "heartbeat_seconds": "CKPT_HEARTBEAT_SECONDS",
    "server_retry_seconds": "CKPT_SERVER_RETRY_SECONDS",
    "quiet": "CKPT_QUIET",
    "rank_timeout_seconds": "CKPT_RANK_TIMEOUT_SECONDS",
    "notices": "CKPT_NOTICES",
    "notice_poll_seconds": "CKPT_NOTICE_POLL_SECONDS",
    "metadata_url": "CKPT_METADATA_URL",
    "from_run": "CKPT_FROM_RUN",
    "from_step": "CKPT_FROM_STEP",
    "verify": "CKPT_VERIFY",
    "verify_stop": "CKPT_VERIFY_STOP",
    "verify_every_steps": "CKPT_VERIFY_EVERY_STEPS",
}


class InFlight(enum.StrEnum):
    """What a save does while the previous one is still persisting."""

    WAIT = "wait"  # wait for it, then stage: every save requested is taken
    SKIP = "skip"  # return at once without saving: training never waits on the store


class Keywords(TypedDict, total=False):
    """The settings ``Checkpointer`` takes by keyword besides ``run`` and ``store``; each is
    a field of ``Config`` (where they are described) and a ``CKPT_*`` variable. None: unset."""

    server: str | None
    token: str | None
    every_steps: int | None
    every_seconds: float | None
    every: str | None
    auto_min_seconds: float | None
    auto_max_seconds: float | None
    mtbf_seconds: float | None
    blob_bytes: int | None
    in_flight: InFlight | str | None
    skip_unchanged: bool | None
    overlap: bool | None
    staging_bytes: int | None
    grace_seconds: float | None
    handle_signals: bool | None
    heartbeat_seconds: float | None
    server_retry_seconds: float | None
    quiet: bool | None
    rank_timeout_seconds: float | None
    notices: str | Iterable[str] | None
    notice_poll_seconds: float | None
    metadata_url: str | None
    verify: str | None
    verify_stop: bool | None
    verify_every_steps: int | None


@dataclass(frozen=True)
class Config:
    """Validated settings of one checkpointer.

    Attributes:
        run: the run's name, shared by every attempt of it (``CKPT_RUN``).
        store: where bundles go: a directory, ``file://`` URL or ``s3://bucket/prefix``
            (``CKPT_STORE``, default ``./.ckpt/store``).
        server: the control plane's URL (``CKPT_SERVER``); unset means store-only.
        token: the bearer token for the control plane (``CKPT_TOKEN``; else the embedded
            server's ``.ckpt/admin-token`` file, where there is one), without the whitespace
            around it; one with whitespace or control characters inside is refused.
        every_steps: save when the optimizer step reaches a multiple of this (``CKPT_EVERY_STEPS``).
        every_seconds: save when this long has passed since the last save (``CKPT_EVERY_SECONDS``).
        every: ``"auto"`` (``CKPT_EVERY=auto``): save at the interval that wastes least,
            ``sqrt(2 · cost of a save · mean time between preemptions)``, re-evaluated as both
            change (``agent.attempt.interval``); instead of ``every_steps`` and ``every_seconds``.
        auto_min_seconds, auto_max_seconds: the bounds of that interval
            (``CKPT_AUTO_MIN_SECONDS``, default 60; ``CKPT_AUTO_MAX_SECONDS``, default 21600).
        mtbf_seconds: the mean time between preemptions to size it by, instead of the
            control plane's estimate (``CKPT_MTBF_SECONDS``; store-only, default 4 h).
        blob_bytes: the largest blob a payload is cut into (``CKPT_BLOB_BYTES``, default 64 MiB).
        in_flight: ``wait`` (default) or ``skip``: what a save does while the previous one
            is still persisting (``CKPT_IN_FLIGHT``).
        skip_unchanged: neither copy nor hash again a frozen parameter that did not change
            (``CKPT_SKIP_UNCHANGED``, default true; see ``agent.save.unchanged``).
        overlap: copy parameters and optimizer state in the background while the loop runs
            forward and backward; the next optimizer step waits for what is not copied yet
            (``CKPT_OVERLAP``, default true; see ``agent.save.staging``).
        staging_bytes: the most host memory the staging buffers may take; tensors beyond it
            are read in place and the next optimizer step waits until they are written
            (``CKPT_STAGING_BYTES``; default: no limit, a copy of the whole state).
        grace_seconds: how long the process has between SIGTERM and SIGKILL
            (``CKPT_GRACE_SECONDS``, default 30: set it a little below the pod's
            ``terminationGracePeriodSeconds``).
        handle_signals: catch SIGTERM and SIGINT (``CKPT_HANDLE_SIGNALS``, default true).
        heartbeat_seconds: how often the attempt tells the control plane it is alive
            (``CKPT_HEARTBEAT_SECONDS``, default 10).
        server_retry_seconds: how long each call to the control plane is retried while it
            does not answer, and the longest ``end()`` and ``close()`` wait for commits it
            has not answered (``CKPT_SERVER_RETRY_SECONDS``, default 120).
        quiet: print no line per resume and per durable save (``CKPT_QUIET``, default
            false; see ``agent.summary``).
        rank_timeout_seconds: how long the ranks of a job wait for each other at a meeting
            (the step of a save, the commit) before the save fails: a rank that died
            (``CKPT_RANK_TIMEOUT_SECONDS``, default 300).
        notices: the clouds whose notices of a coming preemption to watch for, of ``aws``,
            ``gcp``, ``azure`` (``CKPT_NOTICES``, comma-separated; default none): a notice
            saves at the next step boundary and is recorded on the attempt (see
            ``agent.attempt.notices``).
        notice_poll_seconds: how often the metadata service is read for them
            (``CKPT_NOTICE_POLL_SECONDS``, default 5).
        metadata_url: the metadata service's address, for every cloud in ``notices``
            (``CKPT_METADATA_URL``; default: each cloud's own, such as
            ``http://169.254.169.254``).
        from_run, from_step: start a new run from another run's bundle (``CKPT_FROM_RUN``,
            ``CKPT_FROM_STEP``; the step defaults to that run's resumable bundle): ``resume()``
            takes it while this run has no resumable bundle of its own, and this run's own
            from then on (so a restarted attempt continues the new run, not the fork point).
        verify: how a resume checks the steps it replays against the interrupted attempt's
            (``CKPT_VERIFY``): ``exact`` (default, bit for bit), ``tolerance:1e-6`` (the loss
            and the parameters' sample norm within that relative difference) or ``off``
            (no fingerprints; see ``agent.verify``).
        verify_stop: raise ``ResumeDivergedError`` when a resume diverges, instead of a
            warning (``CKPT_VERIFY_STOP``, default false).
        verify_every_steps: fingerprint (the loss and the parameters' sample) the positions
            of every this-many-th optimizer step and of the first two steps after each save
            and resume, which both attempts pick alike (``CKPT_VERIFY_EVERY_STEPS``, default
            32; 1: every step; see ``agent.verify.cadence``).
    """

    run: str
    store: str = DEFAULT_STORE
    server: str | None = None
    token: str | None = None
    every_steps: int | None = None
    every_seconds: float | None = None
    every: str | None = None
    auto_min_seconds: float = 60.0
    auto_max_seconds: float = 6 * 3600.0
    mtbf_seconds: float | None = None
    blob_bytes: int = DEFAULT_BLOB_BYTES
    in_flight: InFlight = InFlight.WAIT
    skip_unchanged: bool = True
    overlap: bool = True
    staging_bytes: int | None = None
    grace_seconds: float = 30.0
    handle_signals: bool = True
    heartbeat_seconds: float = 10.0
    server_retry_seconds: float = 120.0
    quiet: bool = False
    rank_timeout_seconds: float = 300.0
    notices: tuple[str, ...] = ()
    notice_poll_seconds: float = 5.0
    metadata_url: str | None = None
    from_run: str | None = None
    from_step: int | None = None
    verify: str = "exact"
    verify_stop: bool = False
    verify_every_steps: int = 32

    def __post_init__(self) -> None:
        check_run_name(self.run)
        Mode.parse(self.verify)
        if self.from_run is not None:
            check_run_name(self.from_run)
        if self.from_step is not None and (self.from_run is None or self.from_step < 0):
            raise ValueError(
                f"from_step (CKPT_FROM_STEP={self.from_step}) needs from_run (CKPT_FROM_RUN) "
                "and a step of 0 or more"
            )
        if self.every_steps is not None and self.every_steps < 1:
            raise ValueError(f"every_steps must be at least 1, got {self.every_steps}")
        if self.verify_every_steps < 1:
            raise ValueError(
                "verify_every_steps (CKPT_VERIFY_EVERY_STEPS) must be at least 1 (every "
                f"optimizer step), got {self.verify_every_steps}"
            )
        if self.every_seconds is not None and not (
            self.every_seconds > 0 and math.isfinite(self.every_seconds)
        ):
            raise ValueError(f"every_seconds must be a positive number, got {self.every_seconds}")
        self._check_notices()
        self._check_every()
        for name in (
            "mtbf_seconds",
            "grace_seconds",
            "heartbeat_seconds",
            "server_retry_seconds",
            "rank_timeout_seconds",
            "notice_poll_seconds",
        ):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")
        if self.staging_bytes is not None and self.staging_bytes < 0:
            raise ValueError(f"staging_bytes must be 0 or more, got {self.staging_bytes}")
        if not 1 << 20 <= self.blob_bytes <= MAX_BLOB_BYTES:
            raise ValueError(f"blob_bytes must be from 1 MiB to 5 GiB, got {self.blob_bytes}")
        try:
            object.__setattr__(self, "in_flight", InFlight(str(self.in_flight).strip().lower()))
        except ValueError:
            raise ValueError(
                f"in_flight (CKPT_IN_FLIGHT) must be one of {', '.join(InFlight)}, "
                f"got {self.in_flight!r}"
            ) from None
        if self.server is not None and urlparse(self.server).scheme not in ("http", "https"):
            raise ValueError(f"server must be an http(s) URL, got {self.server!r}")
        if self.token is not None:  # a Secret made from a command's output ends with "\n"
            object.__setattr__(self, "token", clean_token(self.token, source="token (CKPT_TOKEN)"))

    def _check_notices(self) -> None:
        clouds = self.notices.split(",") if isinstance(self.notices, str) else self.notices
        clouds = tuple(dict.fromkeys(c.strip().lower() for c in clouds if c.strip()))
        if unknown := [cloud for cloud in clouds if cloud not in CLOUDS]:
            raise ValueError(
                f"notices (CKPT_NOTICES) names unknown clouds {unknown}: use {', '.join(CLOUDS)}"
            )
        object.__setattr__(self, "notices", clouds)
        if self.metadata_url is not None and urlparse(self.metadata_url).scheme != "http":
            raise ValueError(f"metadata_url must be an http URL, got {self.metadata_url!r}")
        save_niceness()  # read by the persist thread: refused here, before anything starts
        save_yield_seconds()

    def _check_every(self) -> None:
        if self.every is not None:
            if str(self.every).strip().lower() != "auto":
                raise ValueError(f"every (CKPT_EVERY) must be 'auto', got {self.every!r}")
            object.__setattr__(self, "every", "auto")
            if self.every_steps is not None or self.every_seconds is not None:
                raise ValueError(
                    "every='auto' (CKPT_EVERY) chooses the interval itself: leave out "
                    "every_steps and every_seconds (CKPT_EVERY_STEPS, CKPT_EVERY_SECONDS)"
                )
        if not 0 < self.auto_min_seconds <= self.auto_max_seconds < math.inf:
            raise ValueError(
                "auto_min_seconds and auto_max_seconds must be positive with min <= max, got "
                f"{self.auto_min_seconds} and {self.auto_max_seconds}"
            )

    @classmethod
    def resolve(
        cls, overrides: Mapping[str, object], env: Mapping[str, str] | None = None
    ) -> Config:
        """Merge keyword ``overrides`` (None means unset) over ``CKPT_*`` variables.

        Raises:
            TypeError: an override that is no setting (a misspelt keyword).
            ValueError: a value out of its range, saying which and why.
        """
        if unknown := sorted(overrides.keys() - Keywords.__optional_keys__ - {"run", "store"}):
            raise TypeError(f"Checkpointer() got unexpected keyword arguments {unknown}")
        env = os.environ if env is None else env
        values: dict[str, object] = {}
        for name, variable in ENV.items():
            value = overrides.get(name)
            if value is None and env.get(variable):
                value = _parse(name, variable, env[variable])
            if value is not None:
                values[name] = value
        if "run" not in values:
            raise ValueError("name the run: Checkpointer(run=...) or CKPT_RUN")
        return cls(**values)  # type: ignore[arg-type]


def _parse(name: str, variable: str, text: str) -> object:
    try:
        if name in (
            "every_steps",
            "blob_bytes",
            "from_step",
            "staging_bytes",
            "verify_every_steps",
        ):
            return int(text)
        if name in (
            "auto_min_seconds",
            "auto_max_seconds",
            "mtbf_seconds",
            "every_seconds",
            "grace_seconds",
            "heartbeat_seconds",
            "server_retry_seconds",
            "rank_timeout_seconds",
            "notice_poll_seconds",
        ):
            return float(text)
    except ValueError:
        raise ValueError(f"{variable}={text!r} is not a number") from None
    if name in ("skip_unchanged", "overlap", "handle_signals", "quiet", "verify_stop"):
        flag = text.strip().lower()
        if flag not in _FLAGS:
            raise ValueError(f"{variable}={text!r}: use 1 or 0 (true or false)")
        return _FLAGS[flag]
    return text


_FLAGS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
