"""Prometheus metrics of the control plane (``GET /metrics``).

One server process keeps them in memory. Several (``ckpt server --workers N``) keep them in
Prometheus' multiprocess mode: ``ckpt server`` names a fresh directory in
``PROMETHEUS_MULTIPROC_DIR`` before the workers start, each worker writes its values to its
own files there, and whichever worker answers ``/metrics`` adds up every worker's files
(counters and histograms summed, the gauges as each says), so the figures never depend on
the process that took the scrape. A worker that exits is marked dead: its gauges drop out,
its counts stay in the sums.
"""

from __future__ import annotations

import glob
import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

from service.names import VERDICTS
from service.settings import MULTIPROCESS_DIR

CONTENT_TYPE = CONTENT_TYPE_LATEST

# From a millisecond (a small state staged in memory) to half an hour (a slow store).
SAVE_SECONDS_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800,
)  # fmt: skip


class Metrics:
    """Every metric of the process. One flat list of definitions, over ~40 lines on purpose:
    each is a name, a help text and a registry, and one place to read them beats helpers."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "ckpt_http_requests",
            "HTTP requests by route template and status",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "ckpt_http_request_seconds",
            "HTTP request latency by route template",
            ["method", "route"],
            registry=self.registry,
        )
        self.bulk_in_flight = Gauge(
            "ckpt_bulk_in_flight",
            "bulk requests being served (by weight; CKPT_MAX_BULK_IN_FLIGHT at most per process)",
            registry=self.registry,
            multiprocess_mode="livesum",
        )
        self.bulk_waiting = Gauge(
            "ckpt_bulk_waiting",
            "bulk requests admitted and waiting their turn (CKPT_BULK_CONCURRENCY run at once)",
            registry=self.registry,
            multiprocess_mode="livesum",
        )
        self.bulk_yielding = Gauge(
            "ckpt_bulk_yielding",
            "bulk requests paused while a priority request is in flight (CKPT_BULK_YIELD_SECONDS)",
            registry=self.registry,
            multiprocess_mode="livesum",
        )
        self.bulk_process_up = Gauge(
            "ckpt_bulk_process_up",
            "bulk processes answering (CKPT_BULK_PROCESS: one beside each serving process)",
            registry=self.registry,
            multiprocess_mode="livesum",
        )
        self.bulk_process_exits = Counter(
            "ckpt_bulk_process_exits",
            "times a bulk process exited unasked and was started again",
            registry=self.registry,
        )
        self.bulk_served = Counter(
            "ckpt_bulk_served",
            "bulk requests by where they were served: bulk_process, here (the serving "
            "process, while its bulk process was not answering), or retry (answered 503: its "
            "bulk process died serving it)",
            ["where"],
            registry=self.registry,
        )
        self.bulk_yield_seconds = Counter(
            "ckpt_bulk_yield_seconds",
            "seconds bulk requests have paused for priority requests in flight",
            registry=self.registry,
        )
        self.refused = Counter(
            "ckpt_requests_refused",
            "requests the limits refused before reading them, by error and route class",
            ["error", "route_class"],
            registry=self.registry,
        )
        self.attempts = Counter(
            "ckpt_attempts_registered", "attempts registered", registry=self.registry
        )
        self.attempts_lost = Counter(
            "ckpt_attempts_lost",
            "attempts marked lost: no heartbeat for CKPT_LOST_AFTER_SECONDS",
            registry=self.registry,
        )
        self.attempt_seconds = Counter(
            "ckpt_attempt_seconds",
            "attempts' time as their agents report it, by part: restart (process start to "
            "training), stall (waiting on saves), train, and redo (of train: steps lost)",
            ["part"],
            registry=self.registry,
        )
        self.notices = Counter(
            "ckpt_preemption_notices",
            "clouds' notices of a coming preemption that attempts reported",
            ["cloud", "kind"],
            registry=self.registry,
        )
        self.steps_lost = Counter(
            "ckpt_steps_lost",
            "steps that ended attempts had trained past the bundle their successor resumed from",
            registry=self.registry,
        )
        self.committed = Counter(
            "ckpt_bundles_committed", "bundles that became complete", registry=self.registry
        )
        self.committed_bytes = Counter(
            "ckpt_bundle_committed_bytes",
            "payload bytes of bundles that became complete",
            registry=self.registry,
        )
        self.rejected = Counter(
            "ckpt_commits_rejected",
            "commits refused, by reason (incomplete, fenced)",
            ["reason"],
            registry=self.registry,
        )
        self.resume_verifications = Counter(
            "ckpt_resume_verifications",
            "resumed attempts' verdicts on the steps they replayed (verified, diverged, "
            "unverifiable), counted once per attempt",
            ["verdict"],
            registry=self.registry,
        )
        for verdict in VERDICTS:  # exported from 0
            self.resume_verifications.labels(verdict=verdict)
        self.fenced = Counter(
            "ckpt_fenced_writes", "writes refused from fenced attempts", registry=self.registry
        )
        self.gc_deleted_blobs = Counter(
            "ckpt_gc_deleted_blobs", "blobs garbage collection deleted", registry=self.registry
        )
        self.gc_deleted_bytes = Counter(
            "ckpt_gc_deleted_bytes", "bytes garbage collection deleted", registry=self.registry
        )
        self.gc_deleted_bundles = Counter(
            "ckpt_gc_deleted_bundles",
            "bundles retention deleted (counted batch by batch, as a pass goes)",
            registry=self.registry,
        )
        self.gc_backlog = Gauge(
            "ckpt_gc_backlog",
            "bundles the GC pass in progress found to delete and has not deleted yet",
            registry=self.registry,
            multiprocess_mode="livemax",  # one process at a time holds the GC pass
        )
        self.gc_batches = Counter(
            "ckpt_gc_batches",
            "GC transactions that deleted bundles (each at most CKPT_GC_BATCH_BUNDLES)",
            registry=self.registry,
        )
        self.scrub_passes = Counter(
            "ckpt_scrub_passes",
            "passes of the scrubber that ran to the end",
            registry=self.registry,
        )
        self.scrub_blobs = Counter(
            "ckpt_scrub_blobs", "blobs the scrubber read back", registry=self.registry
        )
        self.scrub_bytes = Counter(
            "ckpt_scrub_bytes", "bytes the scrubber read back", registry=self.registry
        )
        self.blob_read_bytes = Counter(
            "ckpt_blob_read_bytes",
            "bytes of blobs the control plane read back, by reader (scrubber, quarantine, and "
            "commit: only a blob found damaged before, to see it was written again)",
            ["by"],
            registry=self.registry,
        )
        self.scrub_damaged = Counter(
            "ckpt_scrub_damaged",
            "blobs the scrubber found absent or damaged (their bundles were quarantined)",
            registry=self.registry,
        )
        self.save_stall = Histogram(
            "ckpt_save_stall_seconds",
            "seconds training waited for a rank's save, as the rank reported it",
            buckets=SAVE_SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.save_tax = Histogram(
            "ckpt_save_tax_seconds",
            "the save tax: the training loop's extra wall-clock time for a rank's save, from "
            "save() until durable (the stall included), as the rank reported it; a save whose "
            "rank did not know its tax is not counted",
            buckets=SAVE_SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.save_persist = Histogram(
            "ckpt_save_persist_seconds",
            "seconds from the end of a rank's staging until its bundle was committed",
            buckets=SAVE_SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.save_payload_bytes = Counter(
            "ckpt_save_payload_bytes",
            "payload bytes of the saves ranks reported",
            registry=self.registry,
        )
        self.save_new_bytes = Counter(
            "ckpt_save_new_bytes",
            "bytes the reported saves uploaded (the rest was already in the store)",
            registry=self.registry,
        )


def exposition(metrics: Metrics) -> bytes:
    """The Prometheus text of every server process (see the module's docstring)."""
    if not os.environ.get(MULTIPROCESS_DIR):
        return generate_latest(metrics.registry)
    _forget_killed(os.environ[MULTIPROCESS_DIR])
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    return generate_latest(registry)


def _forget_killed(directory: str) -> None:
    """Mark dead the processes whose live gauges are still there: a worker killed
    (SIGKILL, out of memory) never said it exited, and its gauges would count for ever."""
    for path in glob.glob(os.path.join(directory, "gauge_live*_*.db")):
        pid = int(path.rsplit("_", 1)[1].removesuffix(".db"))
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            multiprocess.mark_process_dead(pid, directory)  # type: ignore[no-untyped-call]
        except PermissionError:  # alive, another user's (a reused pid)
            pass


def process_exited(pid: int) -> None:
    """Drop the gauges of a server process that exited (its counts stay in the sums)."""
    if os.environ.get(MULTIPROCESS_DIR):
        multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]
