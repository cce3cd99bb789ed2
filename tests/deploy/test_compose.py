"""docker-compose.yml and the Dockerfiles, checked without a Docker engine: the compose
file parses, its services are the ones the READMEs list, its settings are real; and the same
configuration runs with the services started directly (a throwaway PostgreSQL database for
``postgres``, a moto S3 server for ``minio``, then the control plane's and the trainer's
commands and environments exactly as the compose file gives them)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest
import yaml  # type: ignore[import-untyped, unused-ignore]

from tests.deploy.common import PORT, ROOT, UID, unknown
from tests.server_process import TRAINER_HANG_GUARD, serving

COMPOSE: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
DOCKER = ROOT / "deploy" / "docker"


def services_listed_in(markdown: str) -> list[str]:
    """The services that the ``docker compose`` section of a README lists, one bullet each:
    ``- `name` — what it is``."""
    lines = markdown.splitlines()
    starts = [i for i, line in enumerate(lines) if re.match(r"#+ .*docker compose", line, re.I)]
    assert starts, "no section whose heading names docker compose"
    names: list[str] = []
    for line in lines[starts[0] + 1 :]:
        if line.startswith("#"):
            break
        if match := re.match(r"- `([a-z0-9-]+)`", line):
            names.append(match.group(1))
    return names


@pytest.mark.parametrize("readme", ["README.md", "deploy/README.md"])
def test_the_services_are_the_ones_the_readme_lists(readme: str) -> None:
    assert services_listed_in((ROOT / readme).read_text()) == list(SERVICES)


def test_the_services_start_in_order() -> None:
    assert list(SERVICES) == ["postgres", "minio", "minio-init", "control-plane", "trainer"]
    assert SERVICES["minio-init"]["depends_on"] == {"minio": {"condition": "service_healthy"}}
    assert SERVICES["control-plane"]["depends_on"] == {
        "postgres": {"condition": "service_healthy"},
        "minio-init": {"condition": "service_completed_successfully"},
    }
    assert SERVICES["trainer"]["depends_on"] == {"control-plane": {"condition": "service_healthy"}}
    # service_healthy needs a health check: in the compose file or in the image.
    for service in SERVICES.values():
        for name, condition in service.get("depends_on", {}).items():
            if condition["condition"] == "service_healthy":
                assert "healthcheck" in SERVICES[name] or "HEALTHCHECK" in dockerfile(name), name
    assert SERVICES["postgres"]["image"] == "postgres:16"
    assert "pg_isready" in " ".join(SERVICES["postgres"]["healthcheck"]["test"])
    assert SERVICES["minio"]["command"] == "server /data --console-address :9001"
    # Migrations at start, then the server in the shell's place (it gets the signals).
    assert SERVICES["control-plane"]["command"] == ["sh", "-c", "ckpt migrate && exec ckpt server"]


def dockerfile(service: str) -> str:
    build = SERVICES[service].get("build")
    return (ROOT / build["context"] / build["dockerfile"]).read_text() if build else ""


def test_the_settings_are_real_and_agree() -> None:
    plane = SERVICES["control-plane"]["environment"]
    trainer = SERVICES["trainer"]["environment"]
    for name, service in SERVICES.items():
        environment = service.get("environment", {})
        assert not unknown(set(environment)), name
        assert all(isinstance(value, str) for value in environment.values()), name
    assert plane["CKPT_DATABASE_URL"].startswith("postgresql+psycopg://")
    assert urlparse(plane["CKPT_DATABASE_URL"]).hostname == "postgres"
    assert urlparse(plane["CKPT_S3_ENDPOINT"]).hostname == "minio"
    assert plane["CKPT_HOST"] == "0.0.0.0"
    assert plane["CKPT_ADMIN_TOKEN"] == trainer["CKPT_TOKEN"]
    assert plane["CKPT_STORE"] == trainer["CKPT_STORE"]
    assert plane["CKPT_S3_ENDPOINT"] == trainer["CKPT_S3_ENDPOINT"]
    server = urlparse(trainer["CKPT_SERVER"])
    assert (server.hostname, server.port) == ("control-plane", int(plane["CKPT_PORT"]))
    assert urlparse(plane["CKPT_STORE"]).netloc == bucket_created_by_minio_init()
    assert trainer["CKPT_RUN"] == "compose-demo"


def bucket_created_by_minio_init() -> str:
    (command,) = SERVICES["minio-init"]["command"]
    buckets: list[str] = re.findall(r"mc mb --ignore-existing local/([a-z0-9.-]+)", command)
    (bucket,) = buckets
    return bucket


def test_the_trainer_command_is_one_the_demo_accepts() -> None:
    from agent.demo.train import parse_args

    env = SERVICES["trainer"]["environment"]
    argv = shell_words(SERVICES["trainer"]["command"], env)
    assert argv[:4] == ["exec", "python", "-m", "agent.demo.train"]
    args = parse_args(argv[4:])
    assert (args.run, args.store, args.every) == (env["CKPT_RUN"], env["CKPT_STORE"], 10)


def shell_words(command: list[str], env: dict[str, str]) -> list[str]:
    """What ``sh -c`` runs for a compose command, with ``$$NAME`` expanded from ``env``."""
    assert command[:2] == ["sh", "-c"]
    (script,) = command[2:]
    expanded = re.sub(r"\$\$(\w+)", lambda match: env[match.group(1)], script)
    return shlex.split(expanded)


# --- the images ----------------------------------------------------------------------------


def test_the_service_image_runs_the_server_as_a_user() -> None:
    text = (DOCKER / "service.Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim$", text, re.M)
    assert "pip install '.[server]'" in text
    assert re.search(rf"^USER {UID}:{UID}$", text, re.M)
    assert re.search(rf"^EXPOSE {PORT}$", text, re.M)
    assert re.search(r"^HEALTHCHECK .*\n.*/readyz", text, re.M)
    assert re.search(r'^CMD \["ckpt", "server"\]$', text, re.M)


def test_the_trainer_image_installs_the_cpu_torch_by_default() -> None:
    text = (DOCKER / "trainer.Dockerfile").read_text()
    assert re.search(r"^ARG TORCH_INDEX=https://download\.pytorch\.org/whl/cpu$", text, re.M)
    assert '--index-url "${TORCH_INDEX}"' in text
    assert "pip install '.[agent,s3]'" in text
    assert text.index("TORCH_INDEX}") < text.index(".[agent,s3]"), "torch first, then the project"
    assert re.search(rf"^USER {UID}:{UID}$", text, re.M)


def test_the_images_install_extras_that_exist_from_files_in_the_context() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert {"server", "agent", "s3"} <= set(extras["optional-dependencies"])
    allowed = {
        line[1:].strip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    assert (ROOT / ".dockerignore").read_text().splitlines().count("*") == 1
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    packages = {pattern.rstrip("*") for pattern in find["find"]["include"]}
    for name in ("service.Dockerfile", "trainer.Dockerfile"):
        copied = set()
        for sources in re.findall(r"^COPY (.+) \S+$", (DOCKER / name).read_text(), re.M):
            for source in sources.split():
                assert source.strip("/") in allowed, (
                    f"{name} copies {source}: .dockerignore drops it"
                )
                assert (ROOT / source).exists(), source
                copied.add(source.strip("/"))
        assert packages <= copied, f"{name} leaves out {sorted(packages - copied)}"


# --- the same configuration, run directly --------------------------------------------------


@pytest.fixture
def database() -> Iterator[str]:
    from tests.service.conftest import create_pg_database, drop_pg_database

    url = create_pg_database()
    yield url
    drop_pg_database(url)


def directly(service: str, real: dict[str, str], overrides: dict[str, str]) -> dict[str, str]:
    """A compose service's environment for a process on this machine: each URL that names a
    service of the compose network (``//minio:9000``) names the address in ``real`` instead,
    then ``overrides`` apply."""
    env = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for name, compose_value in SERVICES[service]["environment"].items():
        value = compose_value
        for compose_address, address in real.items():
            value = value.replace(f"//{compose_address}", f"//{address}")
        env[name] = value
    env |= overrides
    left = {n: v for n, v in env.items() if urlparse(v).hostname in SERVICES}
    assert not left, f"{service}: compose addresses left: {left}"
    return env


@pytest.mark.slow
def test_the_compose_configuration_trains_through_the_control_plane(
    tmp_path: Path, database: str
) -> None:
    from tests.s3_server import moto_server
    from tests.server_process import free_port

    port = free_port()
    run = SERVICES["trainer"]["environment"]["CKPT_RUN"]
    with moto_server(tmp_path / "moto.log") as s3:
        s3.client().create_bucket(Bucket=bucket_created_by_minio_init())  # what minio-init does
        real = {
            "minio:9000": urlparse(s3.endpoint).netloc,
            f"control-plane:{PORT}": f"127.0.0.1:{port}",
        }
        plane = directly(
            "control-plane",
            real,
            {
                "CKPT_DATABASE_URL": database,  # postgres: a throwaway database on 127.0.0.1
                "CKPT_HOST": "127.0.0.1",
                "CKPT_PORT": str(port),
                "HOME": str(tmp_path),
            },
        )
        with started(SERVICES["control-plane"]["command"], plane, tmp_path / "plane.log") as url:
            trainer = directly("trainer", real, {"HOME": str(tmp_path)})
            _, flag, script = SERVICES["trainer"]["command"]
            script = re.sub(r"--steps \d+", "--steps 20", script.replace("$$", "$"))
            script = script.replace("/tmp/final.pt", str(tmp_path / "final.pt"))
            done = subprocess.run(
                ["sh", flag, script],
                env=trainer,
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=TRAINER_HANG_GUARD,
                check=False,
            )
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
            token = SERVICES["control-plane"]["environment"]["CKPT_ADMIN_TOKEN"]
            answer = httpx.get(
                f"{url}/v1/runs/{run}/resumable",
                headers={"Authorization": f"Bearer {token}"},
                timeout=30,
            )
    assert answer.status_code == 200, answer.text
    assert answer.json()["step"] == 20
    assert answer.json()["manifest"]["run"] == run


@contextmanager
def started(command: list[str], env: dict[str, str], log: Path) -> Iterator[str]:
    """A compose service's command as a process; yields its URL once ``/readyz`` is 200."""
    url = f"http://{env['CKPT_HOST']}:{env['CKPT_PORT']}"
    with serving(command, env=env, cwd=log.parent, log=log, url=url):
        yield url


def test_every_image_is_pinned_to_a_tag() -> None:
    """An untagged image (``minio/minio``) is whatever ``latest`` is on the day it is pulled."""
    images = [spec["image"] for spec in SERVICES.values() if "image" in spec]
    overlay = (ROOT / "deploy" / "overlays" / "dev" / "minio.yaml").read_text()
    images += re.findall(r"^\s*image:\s*(\S+)", overlay, re.M)
    assert len(images) >= 6
    untagged = [image for image in images if ":" not in image.rsplit("/", 1)[-1]]
    assert untagged == []
    assert not [image for image in images if image.endswith(":latest")]


def test_the_header_restarts_the_trainer_as_the_docs_do() -> None:
    """The compose file's header and the docs give one command for "preempt and resume"."""
    command = "docker compose kill -s SIGTERM trainer && docker compose start trainer"
    header = "\n".join(
        line for line in (ROOT / "docker-compose.yml").read_text().splitlines() if line[:1] == "#"
    )
    assert command in header
    assert "compose up trainer" not in header
    for doc in ("docs/deploying.md", "deploy/README.md"):
        assert command in (ROOT / doc).read_text(), doc
