"""Every transaction that updates many blob rows locks them in one order (by SHA-256): a
rank's batched layer record, whose layers' blobs interleave in hash order, and a scrub
marking the same blobs hashed never deadlock on PostgreSQL. The test holds one blob row in
a third transaction so that the record stops halfway, lets the scrub start, then lets the
record go on: locking layer by layer, the record took the union out of hash order and the
two deadlocked."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from sqlalchemy import insert, select, text

from ckpt.core.contract import RESTORE_ORDER, BlobRef, LayerRecord, TensorEntry
from service.auth.principal import Principal
from service.bundles import repository, service
from service.bundles.schemas import LayersPut
from service.context import Context
from service.models import Blob
from service.models.auth import Role
from service.models.base import utcnow
from tests.service.conftest import MakeServer
from tests.service.helpers import open_bundle, register

BLOBS_PER_LAYER = 20
ROUNDS = 3
ADMIN = Principal(name="admin", role=Role.ADMIN)
LAYERS = len(RESTORE_ORDER)


def layer(blobs: list[str]) -> LayerRecord:
    """One U8 tensor spread over ``blobs`` of one byte each, after a one-byte header."""
    size = len(blobs) - 1
    return LayerRecord(
        payload_bytes=len(blobs),
        header_bytes=1,
        blobs=tuple(BlobRef(sha256=sha, size=1) for sha in blobs),
        tensors={"t": TensorEntry(dtype="U8", shape=(size,), data_offsets=(0, size))},
    )


def interleaved() -> tuple[list[str], dict[str, LayerRecord]]:
    """Blobs in hash order, dealt to the layers in turn from the last: the first layer holds
    the last blob, the last layer the first; each layer's blobs sorted, their union not."""
    shas = sorted(os.urandom(32).hex() for _ in range(BLOBS_PER_LAYER * LAYERS))
    last_first = shas[::-1]
    layers = {
        name.value: layer(sorted(last_first[index::LAYERS]))
        for index, name in enumerate(RESTORE_ORDER)
    }
    return shas, layers


def test_a_batched_record_and_a_scrub_never_deadlock(
    make_server: MakeServer, run_name: str
) -> None:
    server = make_server("postgres")
    with server.client() as client:
        attempt = register(client, run_name)
        bundles = [
            open_bundle(client, run_name, attempt, step=step).json()["id"]
            for step in range(1, ROUNDS + 1)
        ]
    failures = [
        failure
        for bundle_id in bundles
        for failure in record_while_scrubbing(server.context, bundle_id, epoch=attempt["epoch"])
    ]
    assert not failures, failures[0]


def record_while_scrubbing(context: Context, bundle_id: int, *, epoch: int) -> list[BaseException]:
    """Record a rank's layers and mark their blobs hashed (a scrub) at once, the record held
    halfway by a third transaction; what either raised."""
    shas, layers = interleaved()
    with context.transaction() as session:  # the rows laid out in hash order
        now = utcnow()
        rows = [{"sha256": s, "size": 1, "created_at": now, "claimed_at": now} for s in shas]
        session.execute(insert(Blob).values(rows))
    put = LayersPut.model_validate({"epoch": epoch, "layers": layers})
    # The second layer's second blob: layer by layer, the record waits there holding the
    # first layer's blobs and the second's first; in hash order, the blobs before it.
    held = sorted(layers[RESTORE_ORDER[1].value].blobs, key=lambda b: b.sha256)[1].sha256
    raised: list[BaseException] = []

    def record() -> None:
        service.record_layers(context, ADMIN, bundle_id=bundle_id, rank=0, put=put)

    def scrub() -> None:
        with context.transaction() as session:
            repository.mark_hashed(session, shas=shas, at=utcnow())

    with context.engine.connect() as other:
        other.execute(select(Blob.sha256).where(Blob.sha256 == held).with_for_update())
        threads = [_started(record, raised)]
        _waiting(context, 1)
        threads.append(_started(scrub, raised))
        _waiting(context, 2)
        other.rollback()  # the record goes on
    for thread in threads:
        thread.join()
    return raised


def _started(action: Callable[[], None], raised: list[BaseException]) -> threading.Thread:
    def run() -> None:
        try:
            action()
        except BaseException as err:  # the test reports it
            raised.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _waiting(context: Context, count: int) -> None:
    """Until ``count`` of this database's sessions wait for a lock (a state, polled)."""
    query = text(
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE datname = current_database() AND wait_event_type = 'Lock'"
    )
    deadline = time.monotonic() + 120  # a guard against a hang, not a timing assertion
    with context.engine.connect() as probe:
        while probe.execute(query).scalar_one() < count:
            assert time.monotonic() < deadline, f"{count} sessions never waited for a lock"
            probe.rollback()
            time.sleep(0.01)
