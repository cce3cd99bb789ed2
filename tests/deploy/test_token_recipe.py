"""docs/deploying.md's recipe for a training Job's token, run verbatim up to the point a
cluster would be needed: ``ckpt token create`` against the catalog of a real control plane
(what ``kubectl exec`` runs in its pod), the Secret built by ``kubectl create secret`` from
that output (``--dry-run=client``: no cluster), and its value given to the agent as the
Job's ``secretKeyRef`` gives it (the bytes as they are, the newline included), which then
saves through the control plane."""

from __future__ import annotations

import base64
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml  # type: ignore[import-untyped, unused-ignore]

from tests.conftest import run_trainer
from tests.deploy.common import ROOT
from tests.deploy.test_manifests import env_value, one, pod_spec, render
from tests.server_process import ckpt_server

# The command runs in the control plane's pod: here, where its catalog is.
IN_THE_POD = "kubectl -n ckpt exec deploy/ckpt-control-plane -- "


def shell_commands(markdown: str) -> list[str]:
    """The commands of the fenced ``sh`` blocks, continuation lines joined, comments dropped."""
    commands: list[str] = []
    for block in re.findall(r"^```sh\n(.*?)^```", markdown, flags=re.M | re.S):
        joined = re.sub(r"\\\n\s*", "", block)
        commands += [line for line in joined.splitlines() if line.strip()]
    return [line.split("   #")[0].strip() for line in commands]


def the_recipe() -> tuple[str, str]:
    """The documented pipeline that makes the token's Secret: what runs in the control
    plane's pod, and the kubectl command that reads its output."""
    (pipeline,) = [
        c
        for c in shell_commands((ROOT / "docs" / "deploying.md").read_text())
        if "ckpt token create" in c
    ]
    created, secret = (part.strip() for part in pipeline.split(" | "))
    assert created.startswith(IN_THE_POD), created
    assert secret.startswith("kubectl -n training create secret generic "), secret
    return created.removeprefix(IN_THE_POD), secret


def kubectl_or_skip() -> None:
    if shutil.which("kubectl") is None:
        if os.environ.get("CKPT_REQUIRE_KUBECTL"):
            pytest.fail("kubectl is not installed and CKPT_REQUIRE_KUBECTL is set")
        pytest.skip("kubectl is not installed (apt-get install kubernetes-client)")


def secret_from_the_recipe(root: Path, *, database_url: str) -> dict[str, Any]:
    created, secret = the_recipe()
    done = subprocess.run(
        ["bash", "-o", "pipefail", "-c", f"{created} | {secret} --dry-run=client -o yaml"],
        env={
            **os.environ,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # ckpt
            "CKPT_DATABASE_URL": database_url,
            "HOME": str(root),
        },
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    document: dict[str, Any] = yaml.safe_load(done.stdout)
    return document


@pytest.mark.slow
def test_the_documented_token_recipe_lets_the_agent_save(tmp_path: Path) -> None:
    kubectl_or_skip()
    job = one(render("training/aws"), "Job")
    (trainer,) = pod_spec(job)["containers"]
    reference = env_value(trainer, "CKPT_TOKEN")["valueFrom"]["secretKeyRef"]
    run = job["metadata"]["name"]
    created, _ = the_recipe()
    assert shlex.split(created)[-2:] == ["--run", run], "the token is for the Job's run"

    database_url = f"sqlite:///{tmp_path / 'catalog.db'}"
    with ckpt_server(tmp_path, database_url=database_url) as server:
        secret = secret_from_the_recipe(tmp_path, database_url=database_url)
        assert (secret["kind"], secret["metadata"]["name"]) == ("Secret", reference["name"])
        # What the kubelet puts in CKPT_TOKEN: the Secret's bytes, as they are.
        token = base64.b64decode(secret["data"][reference["key"]]).decode()
        assert token.endswith("\n"), "the recipe's Secret holds the command's newline"

        env = {"CKPT_SERVER": server.url, "CKPT_TOKEN": token}
        args = ("--run", run, "--steps", "4", "--every", "2")
        run_trainer(server.store, tmp_path / "final.pt", *args, env=env)
        with httpx.Client(
            base_url=server.url, headers={"Authorization": f"Bearer {server.token}"}
        ) as client:
            resumable = client.get(f"/v1/runs/{run}/resumable", timeout=30)
        assert resumable.status_code == 200, resumable.text
        assert resumable.json()["step"] == 4
        # The CLI reads the same variable the same way.
        asked = subprocess.run(
            [sys.executable, "-m", "ckpt", "resumable", run],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert asked.returncode == 0, asked.stderr
