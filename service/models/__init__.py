"""The catalog's tables. Alembic migrations in ``migrations/`` create them; a test proves
that the migrations and these models agree.

    run ──< attempt ──< bundle ──< layer ──< layer_blob >── blob
             ├──< attempt_rank (each rank's last heartbeat)
             └──< fingerprint (what each rank computed at each step: resumes compare)
     │                    │ parent_id (lineage), run.head_bundle_id (the live branch's head)
     └──< rollback        ├ attempt.resumed_from_id (resume edges)
                          ├──< save (what each rank's save of it cost)
                          └──< bundle_event (the audit log: who changed its state, and why)
    token (hashed bearer tokens) ──< ui_session (the dashboard's sign-ins)
    maintenance_pass (each pass of garbage collection or the scrubber, by replica)

One module per domain, as ``service/`` has one package per domain: ``runs`` (run,
run_activity, attempt, attempt_rank, fingerprint, rollback), ``bundles`` (bundle, layer, save,
layer_blob, blob), ``events`` (bundle_event), ``auth`` (token, ui_session),
``maintenance`` (maintenance_pass); ``base`` holds what they share. Import the names from
here: importing ``service.models`` puts every table in ``Base.metadata``, which Alembic and
the tests compare with the migrations.
"""

from __future__ import annotations

from service.models.auth import Role, Token, UISession
from service.models.base import NAMING_CONVENTION, Base, UTCDateTime, utcnow
from service.models.bundles import LIVE_STATUSES, Blob, Bundle, BundleStatus, Layer, LayerBlob, Save
from service.models.events import BundleEvent
from service.models.maintenance import MaintenancePass
from service.models.runs import (
    NEW,
    TRAINING,
    Attempt,
    AttemptRank,
    EndReason,
    Fingerprint,
    Rollback,
    Run,
    RunActivity,
)

__all__ = [
    "LIVE_STATUSES",
    "NAMING_CONVENTION",
    "NEW",
    "TRAINING",
    "Attempt",
    "AttemptRank",
    "Base",
    "Blob",
    "Bundle",
    "BundleEvent",
    "BundleStatus",
    "EndReason",
    "Fingerprint",
    "Layer",
    "LayerBlob",
    "MaintenancePass",
    "Role",
    "Rollback",
    "Run",
    "RunActivity",
    "Save",
    "Token",
    "UISession",
    "UTCDateTime",
    "utcnow",
]
