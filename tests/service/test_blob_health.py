"""Blob health (issue 11, item 1): a blob that rots or disappears after its bundle was
committed is marked damaged, every complete bundle using it is quarantined, ``/resumable``
moves back, ``/v1/blobs/missing`` reports the blob until a save writes it again, and a
commit reads it again rather than trusting it."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from torch import nn

from ckpt import Checkpointer, StoreError
from ckpt.core.contract import RESTORE_ORDER, Layer, LayerRecord, Manifest
from ckpt.core.storage import DirectoryStore, keys
from service.bundles import damage
from service.completeness import BlobProblem
from service.models import Blob, utcnow
from tests.service.conftest import Server
from tests.service.helpers import commit, make_layer, open_bundle, record, register


def save_records(
    client: httpx.Client,
    run: str,
    attempt: dict[str, Any],
    *,
    step: int,
    records: dict[Layer, LayerRecord],
) -> tuple[int, httpx.Response]:
    """Open a bundle at ``step``, record these layers of rank 0, and commit it: the
    bundle's id and the commit's answer."""
    opened = open_bundle(client, run, attempt, step=step)
    assert opened.status_code == 201, opened.text
    bundle_id: int = opened.json()["id"]
    for layer in RESTORE_ORDER:
        answer = record(client, bundle_id, 0, layer, attempt["epoch"], records[layer])
        assert answer.status_code == 200, answer.text
    return bundle_id, commit(client, bundle_id, attempt["epoch"])


def saved(answer: tuple[int, httpx.Response]) -> int:
    """The id of a bundle ``save_records`` committed."""
    bundle_id, response = answer
    assert response.status_code == 200, response.text
    return bundle_id


def fresh(store: DirectoryStore, **given: LayerRecord) -> dict[Layer, LayerRecord]:
    """A record of every layer, new blobs uploaded, except those ``given`` by layer name."""
    return {layer: given.get(str(layer)) or make_layer(store)[0] for layer in RESTORE_ORDER}


def flip_byte(path: Path) -> bytes:
    """Overwrite the file with bytes of the same size, one bit flipped; the original bytes."""
    original = path.read_bytes()
    damaged = bytearray(original)
    damaged[len(damaged) // 2] ^= 0x01
    path.write_bytes(bytes(damaged))
    return original


def blob_row(server: Server, sha: str) -> Blob:
    with server.context.transaction() as session:
        row = session.get(Blob, sha)
        assert row is not None
        session.expunge(row)
        return row


def missing(client: httpx.Client, blobs: Iterable[tuple[str, int]]) -> list[str]:
    answer = client.post(
        "/v1/blobs/missing", json={"blobs": [{"sha256": s, "size": n} for s, n in blobs]}
    )
    assert answer.status_code == 200, answer.text
    found: list[str] = answer.json()["missing"]
    return found


def test_a_damaged_blob_is_missing_and_read_again_until_it_is_written_again(
    server: Server, run_name: str
) -> None:
    store = server.store
    with server.client() as client:
        attempt = register(client, run_name)
        older = saved(save_records(client, run_name, attempt, step=10, records=fresh(store)))
        weights, pieces = make_layer(store, size=4096)
        newer = saved(
            save_records(client, run_name, attempt, step=20, records=fresh(store, weights=weights))
        )
        data = weights.blobs[1]
        flip_byte(store.root / keys.blob_key(data.sha256))
        assert missing(client, [(data.sha256, data.size)]) == []  # the same size: held, for now

        reported = client.post(
            f"/v1/bundles/{newer}/quarantine",
            json={"reason": "restore: blob does not match", "blob": data.sha256},
        )
        assert reported.status_code == 200, reported.text
        assert reported.json()["status"] == "quarantined"
        assert client.get(f"/v1/runs/{run_name}/resumable").json()["bundle_id"] == older
        assert missing(client, [(data.sha256, data.size)]) == [data.sha256]
        assert blob_row(server, data.sha256).damage == "wrong_hash"

        # A commit that uses the damaged blob without writing it again is refused...
        pending, refused = save_records(
            client, run_name, attempt, step=30, records=fresh(store, weights=weights)
        )
        assert refused.status_code == 409, refused.text
        assert [(b["sha256"], b["problem"]) for b in refused.json()["missing"]["blobs"]] == [
            (data.sha256, "wrong_hash")
        ]
        # ...until the blob is written again: the commit reads it back and clears the damage.
        store.put(keys.blob_key(data.sha256), [pieces[1]])
        done = commit(client, pending, attempt["epoch"])
        assert done.status_code == 200, done.text
        assert missing(client, [(data.sha256, data.size)]) == []
    row = blob_row(server, data.sha256)
    assert (row.damaged_at, row.damage) == (None, None)
    assert row.verified_at is not None


def test_a_damaged_blob_quarantines_every_complete_bundle_using_it_in_any_run(
    server: Server, run_name: str
) -> None:
    store, other = server.store, f"{run_name}-other"
    with server.client() as client:
        attempt = register(client, run_name)
        whole = saved(save_records(client, run_name, attempt, step=10, records=fresh(store)))
        shared, _ = make_layer(store, size=2048)
        user = saved(
            save_records(client, run_name, attempt, step=20, records=fresh(store, weights=shared))
        )
        elsewhere = saved(
            save_records(
                client, other, register(client, other), step=5, records=fresh(store, weights=shared)
            )
        )
        sha = shared.blobs[1].sha256
        (store.root / keys.blob_key(sha)).unlink()
        reported = client.post(
            f"/v1/bundles/{user}/quarantine", json={"reason": "restore: no such blob", "blob": sha}
        )
        assert reported.status_code == 200, reported.text
        bundles = {
            bundle_id: client.get(f"/v1/bundles/{bundle_id}").json()
            for bundle_id in (whole, user, elsewhere)
        }
        assert client.get(f"/v1/runs/{run_name}/resumable").json()["bundle_id"] == whole
        assert client.get(f"/v1/runs/{other}/resumable").status_code == 404
        events = client.get(f"/v1/bundles/{elsewhere}/events").json()["events"]
    assert bundles[whole]["status"] == "complete"
    for bundle_id in (user, elsewhere):
        assert bundles[bundle_id]["status"] == "quarantined"
        assert f"blob {sha} is absent from the store" in bundles[bundle_id]["reason"]
        assert "restore: no such blob" in bundles[bundle_id]["reason"]
    last = events[-1]
    assert (last["action"], last["actor"], last["status"]) == (
        "quarantined",
        "admin",
        "quarantined",
    )
    assert last["reason"] == bundles[elsewhere]["reason"]


def test_a_commit_that_finds_a_used_blob_gone_quarantines_the_bundles_using_it(
    server: Server, run_name: str
) -> None:
    store = server.store
    with server.client() as client:
        attempt = register(client, run_name)
        first = saved(save_records(client, run_name, attempt, step=5, records=fresh(store)))
        shared, _ = make_layer(store, size=2048)
        user = saved(
            save_records(client, run_name, attempt, step=10, records=fresh(store, weights=shared))
        )
        assert client.get(f"/v1/runs/{run_name}/resumable").json()["bundle_id"] == user
        (store.root / keys.blob_key(shared.blobs[1].sha256)).unlink()
        _, refused = save_records(
            client, run_name, attempt, step=20, records=fresh(store, weights=shared)
        )
        assert refused.status_code == 409, refused.text
        assert refused.json()["missing"]["blobs"][0]["problem"] == "absent"
        after = client.get(f"/v1/bundles/{user}").json()
        assert after["status"] == "quarantined"
        assert "(the commit of bundle" in after["reason"]
        assert client.get(f"/v1/runs/{run_name}/resumable").json()["bundle_id"] == first


def test_damage_read_before_the_blob_was_written_again_quarantines_nothing(
    server: Server, run_name: str
) -> None:
    # A scrubber (or restore) reads a blob as absent; before it marks the damage, a save
    # writes the blob again and a commit reads it back intact. The stale finding must not
    # quarantine the bundles that use the blob, which is whole now.
    store = server.store
    read_at = utcnow()  # the stale read began before the commit's (however slow the save)
    with server.client() as client:
        attempt = register(client, run_name)
        shared, _ = make_layer(store, size=2048)
        user = saved(
            save_records(client, run_name, attempt, step=10, records=fresh(store, weights=shared))
        )
    sha = shared.blobs[1].sha256
    with server.context.transaction() as session:
        quarantined = damage.mark_damaged(
            session, {sha: BlobProblem.ABSENT}, read_at=read_at, actor="test", found_by="a test"
        )
    assert quarantined == []
    assert blob_row(server, sha).damaged_at is None
    with server.client() as client:
        assert client.get(f"/v1/bundles/{user}").json()["status"] == "complete"
    with server.context.transaction() as session:  # a read that began after it: marked
        found = damage.mark_damaged(
            session, {sha: BlobProblem.ABSENT}, read_at=utcnow(), actor="test", found_by="a test"
        )
    assert [bundle.id for bundle in found] == [user]


# -- through the agent -------------------------------------------------------------------


def checkpointer(
    server: Server, run: str, model: nn.Module, *, store: DirectoryStore | None = None
) -> Checkpointer:
    return Checkpointer(
        run=run,
        models=model,
        store=store or server.store,
        server=server.url,
        token=server.admin_token,
        handle_signals=False,
        quiet=True,
    )


def counters_blob(server: Server, run: str, step: int) -> str:
    manifest = Manifest.model_validate_json(server.store.get(keys.manifest_key(run, step)))
    return manifest.ranks[0].layers[Layer.COUNTERS].blobs[-1].sha256


def save_steps(server: Server, run: str, steps: Iterable[int]) -> dict[str, torch.Tensor]:
    """Save the model at each step, changing it in between; the state at the last step."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    ckpt = checkpointer(server, run, model)
    ckpt.resume()
    for step in steps:
        with torch.no_grad():
            model.weight.add_(1.0)
        ckpt.counters.step = step
        ckpt.save().wait()
    ckpt.close()
    return {name: t.clone() for name, t in model.state_dict().items()}


@pytest.mark.parametrize("damage", ["overwritten", "deleted"])
def test_after_falling_back_the_agent_writes_the_damaged_blob_again(
    server: Server, run_name: str, damage: str
) -> None:
    # The reproduction: with a control plane, re-saving the step of a bundle the
    # agent fell back from never rewrote its damaged blob, so every later resume fell back.
    final = save_steps(server, run_name, [1, 2])
    sha = counters_blob(server, run_name, 2)
    assert sha != counters_blob(server, run_name, 1)  # only the bundle at step 2 has it
    path = server.store.root / keys.blob_key(sha)
    if damage == "overwritten":
        flip_byte(path)
    else:
        path.unlink()

    torch.manual_seed(1)
    model = nn.Linear(8, 4)
    again = checkpointer(server, run_name, model)
    assert again.resume().step == 1  # fell back
    with server.client() as client:
        assert missing(client, [(sha, blob_row(server, sha).size)]) == [sha]
    with torch.no_grad():
        model.weight.add_(1.0)
    again.counters.step = 2
    again.save().wait()
    again.close()
    assert counters_blob(server, run_name, 2) == sha  # the same counters, the same blob
    assert hashlib.sha256(path.read_bytes()).hexdigest() == sha  # written again

    torch.manual_seed(2)
    model = nn.Linear(8, 4)
    last = checkpointer(server, run_name, model)
    assert last.resume().step == 2  # no fall back any more
    last.close()
    assert all(torch.equal(final[name], t) for name, t in model.state_dict().items())


class MisreadsOnce(DirectoryStore):
    """The agent's view of the store: the first read of one blob comes back damaged (a
    fault between the store and the reader), while the store's copy is whole."""

    def __init__(self, root: Path, *, victim: str) -> None:
        super().__init__(root)
        self.victim = keys.blob_key(victim)
        self.misread = False

    def read_into(self, key: str, buffer: memoryview) -> int:
        size = super().read_into(key, buffer)
        if key == self.victim and not self.misread:
            self.misread = True
            buffer[0] ^= 0x01
        return size


def test_a_read_that_went_wrong_on_the_way_quarantines_nothing(
    server: Server, run_name: str
) -> None:
    save_steps(server, run_name, [1, 2])
    sha = counters_blob(server, run_name, 2)
    store = MisreadsOnce(server.store.root, victim=sha)
    ckpt = checkpointer(server, run_name, nn.Linear(8, 4), store=store)
    with pytest.raises(StoreError, match=r"reads blob \w+ back intact"):
        ckpt.resume()
    ckpt.close()
    assert store.misread
    with server.client() as client:
        resumable = client.get(f"/v1/runs/{run_name}/resumable").json()
        events = client.get(f"/v1/runs/{run_name}/events").json()["events"]
    assert resumable["step"] == 2
    assert "quarantined" not in {event["action"] for event in events}
    retry = checkpointer(server, run_name, nn.Linear(8, 4), store=store)
    assert retry.resume().step == 2  # the retry reads it whole
    retry.close()
