"""The control plane's settings, from ``CKPT_*`` environment variables.

With none set, ``ckpt server`` is the embedded default: a SQLite catalog and a directory
store under ``./.ckpt/``, bound to 127.0.0.1.
"""

from __future__ import annotations

import math
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

DEFAULT_PORT = 8470
TOKEN_PREFIX = "ckpt_"
# How long an idle connection is kept open: longer than any client keeps one to reuse, so
# the close is the client's. Uvicorn's 5 s is httpx's (the agent's) too: a request sent on
# a connection the server was closing at that moment got no answer (1 heartbeat of 290 in
# bench/fleet.py); a load balancer keeps its connections to a backend 60 s (AWS ALB, nginx).
KEEP_ALIVE_SECONDS = 75
# Set by ``ckpt server`` for its processes (service.metrics); read by prometheus_client when
# it is imported.
MULTIPROCESS_DIR = "PROMETHEUS_MULTIPROC_DIR"


@dataclass(frozen=True)
class Settings:
    """Validated settings of one control-plane process.

    Attributes:
        database_url: SQLAlchemy URL of the catalog (``CKPT_DATABASE_URL``); default
            ``sqlite:///.ckpt/catalog.db``; production: ``postgresql+psycopg://...``.
        store: the object store holding the blobs (``CKPT_STORE``), as the agent names it.
        host, port: where ``ckpt server`` listens (``CKPT_HOST``, ``CKPT_PORT``).
        workers: processes ``ckpt server`` serves the API with (``CKPT_WORKERS``, default
            1; more only on PostgreSQL: one process owns an SQLite catalog).
        admin_token: the bootstrap admin bearer token (``CKPT_ADMIN_TOKEN``); several, separated
            by commas, are all valid (to rotate it without downtime). Unset on the embedded
            SQLite default: one is generated into ``admin_token_file``.
        admin_token_file: where the embedded server keeps its generated admin token
            (``CKPT_ADMIN_TOKEN_FILE``, default ``.ckpt/admin-token``).
        auto_migrate: upgrade the schema at start (``CKPT_AUTO_MIGRATE``; default on for
            SQLite, off for a shared database, where the migrations Job does it).
        maintenance: where the periodic tasks (lost attempts, GC, the scrubber) run:
            ``inline`` in each server (the default) or ``worker``: in ``ckpt worker``, a
            process of their own, the servers running none (``CKPT_MAINTENANCE``).
        gc_interval_seconds: how often the server runs retention and GC (``CKPT_GC_INTERVAL_SECONDS``,
            default 600; 0 turns the periodic task off).
        scrub_interval_seconds: the pause between two passes of the scrubber, which re-reads
            and re-hashes the blobs of complete bundles, each run's resumable bundle first
            (``CKPT_SCRUB_INTERVAL_SECONDS``, default 3600; 0 turns it off).
        scrub_bytes_per_second: how fast the scrubber reads the store
            (``CKPT_SCRUB_BYTES_PER_SECOND``, default 64 MiB/s; 0: as fast as it answers).
        pending_ttl_seconds: a bundle still pending after this long fails (``CKPT_PENDING_TTL_SECONDS``).
        blob_grace_seconds: an unreferenced blob younger than this is never deleted, so an
            upload that has not been recorded yet survives (``CKPT_BLOB_GRACE_SECONDS``).
        keep_last, keep_every: the retention policy of runs that set none (``CKPT_KEEP_LAST``,
            ``CKPT_KEEP_EVERY``); unset keeps every complete bundle.
        max_body_bytes: larger request bodies get 413 (``CKPT_MAX_BODY_BYTES``, default 16 MiB).
        mtbf_prior_seconds: the mean time between preemptions assumed of a capacity pool
            with no history (``CKPT_MTBF_PRIOR_SECONDS``, default 4 h), worth one preemption
            of evidence: history outweighs it as it grows (``ckpt.core.interval``).
        lost_after_seconds: an attempt that has not ended and sent no heartbeat for this long
            (since it registered, if it never did) is marked lost (``CKPT_LOST_AFTER_SECONDS``,
            default 60; agents heartbeat every 10 s). The server checks every
            ``lost_check_seconds``.
        max_step_advance: a heartbeat or end report may name a step at most this far ahead of
            the attempt's last reported step, or of the step it resumed from
            (``CKPT_MAX_STEP_ADVANCE``, default 10,000,000).
        rate_limit_per_second, rate_limit_burst: each bearer token may make this many
            requests a second on average, and this many at once after a quiet spell
            (``CKPT_RATE_LIMIT_PER_SECOND``, default 200, 0 turns it off;
            ``CKPT_RATE_LIMIT_BURST``, default 5000). Per replica.
        max_expensive_per_token: how many expensive requests (``/v1/blobs/missing`` with a
            large body, commits, lineage, gc...) one token may have in flight at once
            (``CKPT_MAX_EXPENSIVE_PER_TOKEN``, default 8, 0 turns it off). Per replica.
        max_bulk_in_flight: how many bulk requests (lineage, audit events, large pages and
            bodies..., by weight) the process serves at once, all tokens together, so that
            ``/resumable``, heartbeats and commits keep worker threads and cores
            (``CKPT_MAX_BULK_IN_FLIGHT``, default 16, 0 turns it off). Per replica.
        bulk_concurrency: how many of the admitted bulk requests run at once in the
            process; the others wait their turn on the event loop, holding no worker thread
            and no share of the CPU or of the GIL, which the priority class then finds
            free (``CKPT_BULK_CONCURRENCY``, default 1, 0: all at once). Per replica.
        bulk_yield_seconds: how long in all a bulk request that runs may pause, at points
            where it holds no lock, while a priority request (``/resumable``, a heartbeat,
            a commit) is in flight in the process
            (``CKPT_BULK_YIELD_SECONDS``, default 0.5, 0 turns it off).
        bulk_process: serve the bulk requests in a process of their own beside each
            serving process, with its own GIL, so that they never hold the GIL the priority
            class waits for (``CKPT_BULK_PROCESS``; default on for PostgreSQL under
            ``ckpt server``; PostgreSQL only). See ``service.bulk_process``.
        priority_threads: worker threads of the process kept for the priority class
            (``/resumable``, heartbeats, registering an attempt), which no other request
            takes: they are served while every other thread waits on bulk work
            (``CKPT_PRIORITY_THREADS``, default 8).
        token_cache_seconds: how long the process keeps a catalog token it authenticated,
            so that a job's heartbeats and ``/resumable`` do not read it each time; a token
            revoked through another replica or worker still works here for up to this long
            (``CKPT_TOKEN_CACHE_SECONDS``, default 2, 0 turns it off). Per process.
        gc_batch_bundles: how many bundles one GC transaction deletes at most; a pass over
            a larger backlog deletes it in as many short transactions
            (``CKPT_GC_BATCH_BUNDLES``, default 1000).
        fingerprint_ring: how many fingerprints (one per step) the catalog keeps of each rank
            of each attempt: its newest positions (``CKPT_FINGERPRINT_RING``, default 2048).
    """

    database_url: str = "sqlite:///.ckpt/catalog.db"
    store: str = ".ckpt/store"
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    workers: int = 1
    admin_token: str | None = None
    admin_token_file: str = ".ckpt/admin-token"
    auto_migrate: bool | None = None
    maintenance: str = "inline"
    gc_interval_seconds: float = 600.0
    scrub_interval_seconds: float = 3600.0
    scrub_bytes_per_second: float = float(64 << 20)
    pending_ttl_seconds: float = 6 * 3600.0
    blob_grace_seconds: float = 3600.0
    keep_last: int | None = None
    keep_every: int | None = None
    max_body_bytes: int = 16 << 20
    lost_after_seconds: float = 60.0
    mtbf_prior_seconds: float = 4 * 3600.0
    max_step_advance: int = 10_000_000
    rate_limit_per_second: float = 200.0
    rate_limit_burst: int = 5000
    max_expensive_per_token: int = 8
    max_bulk_in_flight: int = 16
    bulk_concurrency: int = 1
    bulk_yield_seconds: float = 0.5
    bulk_process: bool | None = None
    priority_threads: int = 8
    token_cache_seconds: float = 2.0
    gc_batch_bundles: int = 1000
    fingerprint_ring: int = 2048

    def __post_init__(self) -> None:
        for name in (
            "gc_interval_seconds",
            "scrub_interval_seconds",
            "pending_ttl_seconds",
            "blob_grace_seconds",
            "bulk_yield_seconds",
            "token_cache_seconds",
        ):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a non-negative number of seconds, got {value}")
        rate = self.scrub_bytes_per_second
        if not (rate >= 0 and math.isfinite(rate)):
            raise ValueError(
                f"scrub_bytes_per_second must be a number >= 0 (0: no limit), got {rate}"
            )
        if not (self.mtbf_prior_seconds > 0 and math.isfinite(self.mtbf_prior_seconds)):
            raise ValueError(
                f"mtbf_prior_seconds must be a positive number of seconds, got "
                f"{self.mtbf_prior_seconds}"
            )
        if not (self.lost_after_seconds > 0 and math.isfinite(self.lost_after_seconds)):
            raise ValueError(
                "lost_after_seconds must be a positive number of seconds (several heartbeat "
                f"intervals), got {self.lost_after_seconds}"
            )
        for name in ("keep_last", "keep_every"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1 (or unset), got {value}")
        if self.maintenance not in ("inline", "worker"):
            raise ValueError(
                f"CKPT_MAINTENANCE must be inline (in each server) or worker (in ckpt worker), "
                f"got {self.maintenance!r}"
            )
        self._check_processes()
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be 1-65535, got {self.port}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if self.admin_token is not None and any(
            len(t) < 16 for t in admin_tokens(self.admin_token)
        ):
            raise ValueError(
                "CKPT_ADMIN_TOKEN must be at least 16 characters (each of them, when several "
                "are separated by commas)"
            )
        self._check_limits()

    def _check_processes(self) -> None:
        if self.workers < 1 or (self.workers > 1 and self.embedded):
            raise ValueError(
                f"CKPT_WORKERS must be 1 on SQLite (one process owns the catalog), or at least "
                f"1 on PostgreSQL; got {self.workers}"
            )
        if self.bulk_process and self.embedded:
            raise ValueError(
                "CKPT_BULK_PROCESS needs a PostgreSQL catalog (one process owns an SQLite "
                "catalog): unset it, or set CKPT_DATABASE_URL to PostgreSQL"
            )

    def _check_limits(self) -> None:
        if self.max_step_advance < 1:
            raise ValueError(f"max_step_advance must be at least 1, got {self.max_step_advance}")
        rate = self.rate_limit_per_second
        if not (rate >= 0 and math.isfinite(rate)):
            raise ValueError(f"rate_limit_per_second must be a number >= 0 (0: off), got {rate}")
        if self.rate_limit_burst < 1:
            raise ValueError(
                f"rate_limit_burst must be at least 1 request, got {self.rate_limit_burst}"
            )
        if self.max_expensive_per_token < 0:
            raise ValueError(
                "max_expensive_per_token must be >= 0 (0: no cap), got "
                f"{self.max_expensive_per_token}"
            )
        if self.max_bulk_in_flight < 0:
            raise ValueError(
                f"max_bulk_in_flight must be >= 0 (0: no cap), got {self.max_bulk_in_flight}"
            )
        if self.bulk_concurrency < 0:
            raise ValueError(
                f"bulk_concurrency must be >= 0 (0: no gate), got {self.bulk_concurrency}"
            )
        if self.priority_threads < 1:
            raise ValueError(
                f"priority_threads must be at least 1 thread, got {self.priority_threads}"
            )
        if self.gc_batch_bundles < 1:
            raise ValueError(
                f"gc_batch_bundles must be at least 1 bundle, got {self.gc_batch_bundles}"
            )
        if self.fingerprint_ring < 1:
            raise ValueError(
                "fingerprint_ring must be at least 1 (fingerprints kept per rank of an "
                f"attempt), got {self.fingerprint_ring}"
            )

    @property
    def embedded(self) -> bool:
        """Whether the catalog is a SQLite file (one process owns it)."""
        return self.database_url.startswith("sqlite")

    @property
    def lost_check_seconds(self) -> float:
        """How often the server looks for lost attempts: often enough that one is marked
        at most half a ``lost_after_seconds`` late, and at least every 30 s."""
        return min(30.0, self.lost_after_seconds / 2)

    @property
    def bulk_in_own_process(self) -> bool:
        """Whether bulk requests go to a process of their own (``bulk_process``)."""
        return not self.embedded if self.bulk_process is None else self.bulk_process

    @property
    def migrate_at_start(self) -> bool:
        return self.embedded if self.auto_migrate is None else self.auto_migrate

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, /, **overrides: object) -> Settings:
        """Settings from ``CKPT_<NAME>`` variables; keyword ``overrides`` win."""
        env = os.environ if env is None else env
        values: dict[str, object] = {}
        for field in fields(cls):
            variable = f"CKPT_{field.name.upper()}"
            if overrides.get(field.name) is not None:
                values[field.name] = overrides[field.name]
            elif env.get(variable):
                values[field.name] = _parse(field.name, variable, env[variable])
        return cls(**values)  # type: ignore[arg-type]


def _parse(name: str, variable: str, text: str) -> object:
    kind = {field.name: field.type for field in fields(Settings)}[name]
    try:
        if "bool" in str(kind):
            if text.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(text)
            return text.lower() in ("1", "true", "yes")
        if "int" in str(kind):
            return int(text)
        if "float" in str(kind):
            return float(text)
    except ValueError:
        raise ValueError(f"{variable}={text!r} is not a valid {kind}") from None
    return text


def admin_tokens(text: str | None) -> tuple[str, ...]:
    """The admin tokens in ``CKPT_ADMIN_TOKEN`` (or the embedded token file): one, or several
    separated by commas while the admin token is rotated."""
    return tuple(token.strip() for token in (text or "").split(",") if token.strip())


def new_token() -> str:
    """A fresh bearer token: the prefix makes it recognisable in logs and secret scanners."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def embedded_admin_token(settings: Settings) -> str:
    """The admin token: configured, or read from (created in) the embedded token file."""
    if settings.admin_token:
        return settings.admin_token
    path = Path(settings.admin_token_file)
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    token = new_token()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(token + "\n")
    return token
