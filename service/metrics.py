"""Prometheus metrics of one control-plane process (``GET /metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram


class Metrics:
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
        self.attempts = Counter(
            "ckpt_attempts_registered", "attempts registered", registry=self.registry
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
            "ckpt_gc_deleted_bundles", "bundles retention deleted", registry=self.registry
        )
