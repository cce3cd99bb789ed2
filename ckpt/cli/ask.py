"""The people's CLI over the REST API: pure ``format_*`` functions and one ``get``."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

DEFAULT_SERVER = "http://127.0.0.1:8470"


def resolve(server: str | None, token: str | None) -> tuple[str, str | None]:
    """The server URL and token: arguments, then CKPT_SERVER / CKPT_TOKEN, then the
    embedded server's admin token file."""
    from ckpt.core.tokens import default_token

    server = server or os.environ.get("CKPT_SERVER") or DEFAULT_SERVER
    return server.rstrip("/"), token or default_token()


def get(
    *, server: str | None, token: str | None, path: str, params: dict[str, object]
) -> tuple[int, dict[str, Any]]:
    import httpx

    url, secret = resolve(server, token)
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    try:
        response = httpx.get(url + path, params=params, headers=headers, timeout=30)  # type: ignore[arg-type]
    except httpx.HTTPError as err:
        raise SystemExit(f"ckpt: cannot reach the control plane at {url}: {err}") from None
    try:
        body: dict[str, Any] = response.json()
    except ValueError:
        body = {"message": response.text}
    return response.status_code, body


def format_runs(body: dict[str, Any]) -> str:
    rows: list[tuple[str, ...]] = [("RUN", "EPOCH", "HEAD", "RESUMABLE", "BUNDLES")]
    for run in body["runs"]:
        rows.append(
            (
                run["name"],
                str(run["epoch"]),
                _ref(run["head"]),
                _ref(run["resumable"]),
                " ".join(f"{k}={v}" for k, v in sorted(run["num_bundles"].items())) or "-",
            )
        )
    text = _table(rows)
    if body.get("next"):
        text += f"\n(more: --after {body['next']})"
    return text


def format_resumable(body: dict[str, Any]) -> str:
    manifest = body["manifest"]
    size = sum(
        record["payload_bytes"] for rank in manifest["ranks"] for record in rank["layers"].values()
    )
    return (
        f"run {manifest['run']}: resume from bundle {body['bundle_id']} at step {body['step']} "
        f"({manifest['world_size']} rank(s), {size} bytes, saved {manifest['created_at']})"
    )


def format_bundle(body: dict[str, Any]) -> str:
    lines = [
        f"bundle {body['id']} of run {body['run']}: step {body['step']}, {body['status']}"
        + (f" ({body['reason']})" if body.get("reason") else "")
        + (", pinned" if body["pinned"] else ""),
        f"  world size {body['world_size']}, attempt {body['attempt_id']}, parent {body['parent_id']}",
        f"  created {body['created_at']}, committed {body['committed_at'] or '-'}",
    ]
    rows: list[tuple[str, ...]] = [("RANK", "LAYER", "BYTES", "BLOBS")]
    rows += [
        (str(x["rank"]), x["layer"], str(x["payload_bytes"]), str(x["num_blobs"]))
        for x in body["recorded"]
    ]
    lines.append(_table(rows))
    if body["missing_layers"]:
        missing = ", ".join(f"{x['rank']}/{x['layer']}" for x in body["missing_layers"])
        lines.append(f"  missing: {missing}")
    return "\n".join(lines)


def _ref(ref: dict[str, Any] | None) -> str:
    return f"{ref['id']}@{ref['step']}" if ref else "-"


def _table(rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )
