"""``ckpt runs | attempts | resumable | bundle``: the people's CLI over the REST API, with pure
``format_*`` functions and one ``get``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

from ckpt.cli.config import Commands, add_command
from ckpt.cli.text import table

DEFAULT_SERVER = "http://127.0.0.1:8470"

CONNECTION = f"""
    Asks a running control plane: --server, else CKPT_SERVER, else {DEFAULT_SERVER}; with
    the bearer token --token, else CKPT_TOKEN, else the embedded server's
    ./.ckpt/admin-token. --json prints the API's answer as it came. Exits 1 when the
    control plane refuses (the message says why).
"""

RUNS = f"""
    List the runs, by name, with each run's epoch (its newest attempt), head bundle,
    resumable bundle and number of bundles by status; a bundle shows as ID@STEP. Pages of
    --limit runs: the last line names the --after that continues.

    {CONNECTION}
"""

ATTEMPTS = f"""
    The attempts of RUN, oldest first: each one's epoch, state, last step, the bundle it
    resumed from (ID@STEP), and its resume's verdict on the steps it replayed: verified
    over N steps, diverged at the first step that differed (what differed: got vs
    expected), unverifiable (it replayed no step), or - (none reported).

    {CONNECTION}
"""

RESUMABLE = f"""
    Where RUN resumes: the bundle, its step, world size, size and when it was saved; the
    same answer a restarted training job gets.

    {CONNECTION}
"""

BUNDLE = f"""
    One bundle by its catalog id (see 'ckpt runs' or 'ckpt resumable'): its run, step,
    status, attempt and parent, and every rank's layers with their bytes and blobs; what
    is missing when it is not complete.

    {CONNECTION}
"""


def add_commands(commands: Commands) -> None:
    """``runs``, ``attempts``, ``resumable`` and ``bundle``."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--server", help=f"control plane URL (CKPT_SERVER, default {DEFAULT_SERVER})"
    )
    common.add_argument("--token", help="bearer token (CKPT_TOKEN, else ./.ckpt/admin-token)")
    common.add_argument("--json", action="store_true", help="print the raw JSON answer")

    runs = add_command(
        commands, "runs", summary="list runs and their heads", description=RUNS, parents=[common]
    )
    runs.add_argument("--prefix", help="only runs whose name starts with this")
    runs.add_argument("--limit", type=int, default=50, help="at most this many runs (default 50)")
    runs.add_argument("--after", help="start after this run name (the previous page's end)")
    runs.set_defaults(handler=_runs)

    attempts = add_command(
        commands,
        "attempts",
        summary="a run's attempts and their resumes' verdicts",
        description=ATTEMPTS,
        parents=[common],
    )
    attempts.add_argument("run", help="the run's name")
    attempts.set_defaults(handler=_attempts)

    resumable = add_command(
        commands,
        "resumable",
        summary="the latest resumable bundle of a run",
        description=RESUMABLE,
        parents=[common],
    )
    resumable.add_argument("run", help="the run's name")
    resumable.set_defaults(handler=_resumable)

    bundle = add_command(
        commands,
        "bundle",
        summary="one bundle and its layers",
        description=BUNDLE,
        parents=[common],
    )
    bundle.add_argument("id", type=int, help="the bundle's catalog id")
    bundle.set_defaults(handler=_bundle)


def _runs(args: argparse.Namespace) -> int:
    params: dict[str, object] = {"limit": args.limit}
    for name in ("prefix", "after"):
        if getattr(args, name):
            params[name] = getattr(args, name)
    return _ask(args, "/v1/runs", params, format_runs)


def _attempts(args: argparse.Namespace) -> int:
    return _ask(args, f"/v1/runs/{args.run}/lineage", {}, format_attempts)


def _resumable(args: argparse.Namespace) -> int:
    return _ask(args, f"/v1/runs/{args.run}/resumable", {}, format_resumable)


def _bundle(args: argparse.Namespace) -> int:
    return _ask(args, f"/v1/bundles/{args.id}", {}, format_bundle)


def _ask(
    args: argparse.Namespace,
    path: str,
    params: dict[str, object],
    formatter: Callable[[dict[str, Any]], str],
) -> int:
    status, body = get(server=args.server, token=args.token, path=path, params=params)
    if status >= 400:
        print(f"ckpt: {status}: {body.get('message', body)}", file=sys.stderr)
        return 1
    if args.json:
        import json

        print(json.dumps(body, indent=2))
    else:
        print(formatter(body))
    return 0


def resolve(server: str | None, token: str | None) -> tuple[str, str | None]:
    """The server URL and token: arguments, then CKPT_SERVER / CKPT_TOKEN, then the
    embedded server's admin token file.

    Raises:
        SystemExit: the token is empty or holds whitespace or control characters inside.
    """
    from ckpt.core.tokens import clean_token, default_token

    server = server or os.environ.get("CKPT_SERVER") or DEFAULT_SERVER
    try:
        secret = clean_token(token, source="--token") if token else default_token()
    except ValueError as err:
        raise SystemExit(f"ckpt: {err}") from None
    return server.rstrip("/"), secret


def get(
    *, server: str | None, token: str | None, path: str, params: dict[str, object]
) -> tuple[int, dict[str, Any]]:
    import httpx

    from ckpt.core.tokens import bearer

    url, secret = resolve(server, token)
    headers = bearer(secret)
    try:
        response = httpx.get(url + path, params=params, headers=headers, timeout=30)  # type: ignore[arg-type]
    except httpx.HTTPError as err:
        from ckpt.core.redact import redact

        problem = redact(err, secrets=[secret])
        raise SystemExit(f"ckpt: cannot reach the control plane at {url}: {problem}") from None
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
    text = table(rows)
    if body.get("next"):
        text += f"\n(more: --after {body['next']})"
    return text


def format_attempts(lineage: dict[str, Any]) -> str:
    steps = {bundle["id"]: bundle["step"] for bundle in lineage["bundles"]}
    rows: list[tuple[str, ...]] = [("ATTEMPT", "EPOCH", "STATE", "STEP", "RESUMED", "RESUME")]
    for attempt in lineage["attempts"]:
        resumed = attempt["resumed_from_id"]
        rows.append(
            (
                str(attempt["id"]),
                str(attempt["epoch"]),
                attempt["state"],
                "-" if attempt["last_step"] is None else str(attempt["last_step"]),
                f"{resumed}@{steps.get(resumed, '?')}" if resumed is not None else "-",
                format_verification(attempt.get("verification")),
            )
        )
    return f"run {lineage['run']}\n" + table(rows)


def format_verification(verification: dict[str, Any] | None) -> str:
    """``verified 37 steps``, ``diverged at 1204: loss 2.3811 vs 2.3809`` (got vs
    expected), ``unverifiable``, or ``-``; tolerance mode adds its largest difference."""
    if verification is None:
        return "-"
    verdict, first = verification["verdict"], verification["first_difference"]
    if first is not None:
        where = f"{first['step']}" + (f".{first['micro_step']}" if first["micro_step"] else "")
        rank = f" rank {first['rank']}" if first["rank"] else ""
        text = f"diverged at {where}{rank}: {first['part']} {first['got']} vs {first['expected']}"
    elif verdict == "verified":
        text = f"verified {verification['steps_compared']} steps"
    else:
        text = verdict
    largest = verification.get("max_relative_difference")
    if verification["mode"] == "tolerance" and largest is not None:
        text += f" (tolerance, max relative difference {largest:.3g})"
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
    lines.append(table(rows))
    if body["missing_layers"]:
        missing = ", ".join(f"{x['rank']}/{x['layer']}" for x in body["missing_layers"])
        lines.append(f"  missing: {missing}")
    return "\n".join(lines)


def _ref(ref: dict[str, Any] | None) -> str:
    return f"{ref['id']}@{ref['step']}" if ref else "-"
