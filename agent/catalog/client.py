"""The agent's client of the control plane: the REST calls of the commit protocol.

Every call is retried with backoff on connection errors and 5xx answers (they are all
idempotent on the server, except registration, where a retry at worst registers one more
attempt, which fences the first). 409 ``fenced`` raises ``FencedError``; any other refusal
raises ``ControlPlaneError`` with the server's message.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from agent.attempt.notices import Notice
from ckpt.core.contract import (
    BlobRef,
    Imported,
    Layer,
    LayerRecord,
    Manifest,
    SaveFigures,
    Versions,
)
from ckpt.core.errors import ControlPlaneError, FencedError
from ckpt.core.redact import redact
from ckpt.core.tokens import bearer

log = logging.getLogger("ckpt.client")

_RETRY_STATUSES = (500, 502, 503, 504)
BLOBS_PER_QUERY = 10_000  # the most blobs the control plane takes in one query


@dataclass(frozen=True)
class Registration:
    """An attempt the control plane registered, and what it should resume from."""

    attempt_id: int
    epoch: int
    resume_from: Manifest | None
    resume_bundle_id: int | None
    store: str | None  # the URL of the store the control plane reads


class IncompleteCommitError(ControlPlaneError):
    """The commit found parts missing; ``missing`` is the server's list."""

    def __init__(self, message: str, *, missing: dict[str, Any]) -> None:
        super().__init__(message, status=409)
        self.missing = missing

    @property
    def blobs(self) -> set[str]:
        return {blob["sha256"] for blob in self.missing.get("blobs", [])}


# The least one try waits for its answer, however short the caller's patience: a save's calls
# retry for half a second a control plane that does not answer at all (down, dropping
# connections), but a busy one that answers in a few seconds is not taken for an outage (the
# save waits less for it: ``agent.catalog.late``).
TRY_SECONDS = 5.0


class UnansweredError(ControlPlaneError):
    """The control plane did not answer (down, restarting, unreachable, or overloaded through
    the retries), as opposed to refusing the request or this process finding it wrong."""


def no_answer(err: ControlPlaneError) -> bool:
    """Whether ``err`` says the control plane did not answer, rather than refused; an error
    this process raised itself (status None too) is not one."""
    return isinstance(err, UnansweredError)


class IntactBlobError(ControlPlaneError):
    """Quarantine refused: the control plane reads the blob named damaged back intact."""


class ControlPlane:
    def __init__(
        self,
        url: str,
        *,
        token: str | None,
        timeout: float = 60.0,
        retry_seconds: float = 120.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        headers = bearer(token)
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, headers=headers, transport=transport)
        self._secrets = (token,)  # cut out of every message (httpx quotes a refused header)
        self.timeout = timeout  # one try
        self.retry_seconds = retry_seconds  # one call, every try and wait included
        self._failing_since: float | None = None  # since when calls fail to get an answer

    def close(self) -> None:
        self._http.close()

    @property
    def unreachable(self) -> bool:
        """Whether the last call (from any thread) got no answer: the control plane is down,
        restarting or unreachable, and calls are being retried."""
        return self._failing_since is not None

    def register(
        self, run: str, *, pod: str | None, node: str | None, resume: bool, pool: str | None = None
    ) -> Registration:
        request = {"pod": pod, "node": node, "resume": resume}
        body = self._call("POST", f"/v1/runs/{run}/attempts", request | {"pool": pool})
        start = body["resume_from"]
        return Registration(
            attempt_id=body["attempt_id"],
            epoch=body["epoch"],
            resume_from=Manifest.model_validate(start["manifest"]) if start else None,
            resume_bundle_id=start["bundle_id"] if start else None,
            store=body.get("store"),
        )

    def resumable(self, run: str) -> Manifest | None:
        try:
            body = self._call("GET", f"/v1/runs/{run}/resumable")
        except ControlPlaneError as err:
            if err.status == 404:
                return None
            raise
        return Manifest.model_validate(body["manifest"])

    def bundle_at(self, run: str, step: int) -> Manifest | None:
        """The manifest of ``run``'s complete bundle at ``step`` (the newest, after a
        rollback saved that step twice), or None."""
        try:
            lineage = self._call("GET", f"/v1/runs/{run}/lineage")
        except ControlPlaneError as err:
            if err.status == 404:
                return None
            raise
        found = [
            bundle["id"]
            for bundle in lineage["bundles"]
            if bundle["step"] == step and bundle["status"] == "complete"
        ]
        if not found:
            return None
        body = self._call("GET", f"/v1/bundles/{max(found)}")
        return Manifest.model_validate(body["manifest"])

    def committed(self, bundle_id: int) -> bool:
        """Whether the bundle is complete (committed)."""
        return bool(self._call("GET", f"/v1/bundles/{bundle_id}")["status"] == "complete")

    def open_bundle(
        self,
        run: str,
        *,
        attempt: Registration,
        step: int,
        micro_step: int,
        world_size: int,
        versions: Versions,
        patience: float | None = None,
        imported: Imported | None = None,
    ) -> int:
        request = {
            "attempt_id": attempt.attempt_id,
            "epoch": attempt.epoch,
            "step": step,
            "micro_step": micro_step,
            "world_size": world_size,
            "versions": versions.model_dump(mode="json"),
        }
        if imported is not None:  # made by ckpt import: it may lack the layers it names
            request["imported"] = imported.model_dump(mode="json")
        body = self._call("POST", f"/v1/runs/{run}/bundles", request, patience=patience)
        bundle_id: int = body["id"]
        return bundle_id

    def missing_blobs(self, blobs: list[BlobRef], *, patience: float | None = None) -> set[str]:
        """Which of ``blobs`` the store lacks: one request per ``BLOBS_PER_QUERY`` blobs."""
        missing: set[str] = set()
        for start in range(0, len(blobs), BLOBS_PER_QUERY):
            page = blobs[start : start + BLOBS_PER_QUERY]
            body = self._call(
                "POST",
                "/v1/blobs/missing",
                {"blobs": [b.model_dump(mode="json") for b in page]},
                patience=patience,
            )
            missing.update(body["missing"])
        return missing

    def record_layers(
        self,
        bundle_id: int,
        *,
        rank: int,
        epoch: int,
        records: Mapping[Layer, LayerRecord],
        patience: float | None = None,
        saves: Sequence[tuple[int, SaveFigures]] = (),
    ) -> None:
        """Record every layer of one rank in one request (all or none), with the figures of
        this rank's earlier ``saves`` (bundle id, figures) when there are some."""
        if not records:
            return
        layers = {layer.value: record.model_dump(mode="json") for layer, record in records.items()}
        body: dict[str, Any] = {"epoch": epoch, "layers": layers}
        if saves:
            body["saves"] = [
                {"bundle": bundle, "figures": figures.model_dump(mode="json")}
                for bundle, figures in saves
            ]
        self._call("POST", f"/v1/bundles/{bundle_id}/layers/{rank}", body, patience=patience)

    def commit(self, bundle_id: int, *, epoch: int, patience: float | None = None) -> Manifest:
        body = self._call(
            "POST", f"/v1/bundles/{bundle_id}/commit", {"epoch": epoch}, patience=patience
        )
        return Manifest.model_validate(body["bundle"]["manifest"])

    def report_save(
        self, bundle_id: int, *, rank: int, figures: SaveFigures, patience: float | None = None
    ) -> None:
        path = f"/v1/bundles/{bundle_id}/saves/{rank}"
        self._call("PUT", path, figures.model_dump(mode="json"), patience=patience)

    def quarantine(self, bundle_id: int, *, reason: str, epoch: int | None, blob: str) -> None:
        """Report ``blob`` of the bundle damaged: the control plane reads it back and
        quarantines every complete bundle using it. ``epoch``: this attempt's (fencing).

        Raises:
            IntactBlobError: the control plane reads the blob back intact; nothing changed.
        """
        body = {"reason": _printable(reason)[:2000] or "failed verification", "blob": blob}
        self._call("POST", f"/v1/bundles/{bundle_id}/quarantine", body | {"epoch": epoch})

    def heartbeat(
        self,
        attempt_id: int,
        *,
        step: int,
        rank: int,
        patience: float,
        interval: tuple[float, float | None] | None = None,
        time: dict[str, float | int] | None = None,
        fingerprints: list[dict[str, Any]] | None = None,
    ) -> None:
        """``interval``: the save interval ``every="auto"`` chose and the waste per hour it
        expects there; ``time``: where the attempt's time went (``agent.attempt.goodput``);
        ``fingerprints``: the rank's steps since its last heartbeat (``agent.verify``)."""
        body: dict[str, Any] = {"step": step, "rank": rank}
        if time is not None:
            body["time"] = time
        if fingerprints:
            body["fingerprints"] = fingerprints
        if interval is not None:
            body |= {"interval_seconds": interval[0], "waste_seconds_per_hour": interval[1]}
        self._call("POST", f"/v1/attempts/{attempt_id}/heartbeat", body, patience=patience)

    def replay(
        self, attempt_id: int, *, rank: int, after: tuple[int, int]
    ) -> tuple[int | None, list[dict[str, Any]]]:
        """The fingerprints of ``rank`` after position ``after`` that the newest older attempt
        of the run kept: that attempt's id (None: no such attempt) and them."""
        query = f"rank={rank}&after_step={after[0]}&after_micro_step={after[1]}"
        answer = self._call("GET", f"/v1/attempts/{attempt_id}/replay?{query}")
        return answer.get("from_attempt_id"), list(answer.get("fingerprints") or [])

    def verification(self, attempt_id: int, verification: dict[str, Any]) -> None:
        """Record what the attempt's resume proved (replacing what it recorded before)."""
        self._call("PUT", f"/v1/attempts/{attempt_id}/verification", verification)

    def preemption_rate(self, run: str, *, patience: float | None = None) -> float:
        """The control plane's mean time between preemptions for the run, in seconds."""
        answer = self._call("GET", f"/v1/runs/{run}/preemption-rate", patience=patience)
        return float(answer["mtbf_seconds"])

    def notice(self, attempt_id: int, *, notice: Notice, step: int) -> None:
        body = {"cloud": notice.cloud, "kind": notice.kind, "step": step}
        if notice.detail:
            body["detail"] = _printable(notice.detail)[:200]
        self._call("POST", f"/v1/attempts/{attempt_id}/notice", body)

    def end(
        self,
        attempt_id: int,
        *,
        reason: str,
        final_save_committed: bool,
        step: int,
        patience: float | None = None,
        time: dict[str, float | int] | None = None,
    ) -> None:
        body: dict[str, Any] = {
            "reason": reason,
            "final_save_committed": final_save_committed,
            "step": step,
        }
        if time is not None:
            body["time"] = time
        self._call("POST", f"/v1/attempts/{attempt_id}/end", body, patience=patience)

    def _call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        patience: float | None = None,
    ) -> dict[str, Any]:
        """One request, retried on transport errors, 5xx and 429 for at most ``patience``
        seconds (default: the client's ``retry_seconds``) in all: every try is cut short at
        that deadline, though given ``TRY_SECONDS`` at least (a slow answer is an answer, not
        an outage), so a control plane that is down or hangs costs no more than the longer of
        the two. A 429 is retried after the ``Retry-After`` the control plane asks for."""
        window = self.retry_seconds if patience is None else patience
        deadline = time.monotonic() + window
        delay = 0.2
        while True:
            timeout = min(self.timeout, max(deadline - time.monotonic(), TRY_SECONDS))
            try:
                response = self._http.request(method, path, json=body, timeout=timeout)
            except httpx.TransportError as err:
                problem = redact(
                    f"cannot reach the control plane at {self.url}: {err}", secrets=self._secrets
                )
                status, pause = None, delay
            else:
                if response.status_code not in _RETRY_STATUSES:
                    self._failing_since = None  # it answered
                if response.status_code < 400:
                    result: dict[str, Any] = response.json()
                    return result
                problem = redact(_problem(response), secrets=self._secrets)
                status = response.status_code
                if status not in (*_RETRY_STATUSES, 429):
                    raise _error(response, f"{method} {path}: {problem}")
                pause = _retry_after(response) if status == 429 else delay
            if status != 429 and self._failing_since is None:
                self._failing_since = time.monotonic()
            if time.monotonic() + pause > deadline:
                raise UnansweredError(
                    f"{method} {path}: {problem} (gave up after {window:g} s of retries)",
                    status=status,
                )
            log.warning("%s %s: %s; retrying in %.1f s", method, path, problem, pause)
            time.sleep(pause)
            if status != 429:
                delay = min(delay * 2, 5.0)


def _retry_after(response: httpx.Response) -> float:
    """The pause a 429 asks for (``Retry-After`` in seconds; 1 s when it says none)."""
    try:
        return min(max(float(response.headers.get("Retry-After", "1")), 0.0), 60.0)
    except ValueError:
        return 1.0


def _problem(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return f"HTTP {response.status_code}: {response.text[:200]}"
    return f"HTTP {response.status_code}: {body.get('message', body)}"


def _error(response: httpx.Response, message: str) -> ControlPlaneError:
    try:
        body = response.json()
    except ValueError:
        body = {}
    code = body.get("error") if isinstance(body, dict) else None
    if code == "fenced":
        return FencedError(message, status=409)
    if code == "incomplete":
        return IncompleteCommitError(message, missing=body.get("missing", {}))
    if code == "intact":
        return IntactBlobError(message, status=409)
    return ControlPlaneError(message, status=response.status_code)


def _printable(text: str) -> str:
    """``text`` without control characters or line breaks (the control plane refuses them)."""
    return re.sub(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]", " ", text)
