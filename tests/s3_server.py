"""A real S3-compatible server for tests: ``moto_server`` over HTTP on 127.0.0.1."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import httpx
from botocore.config import Config

from tests.server_process import ANSWER_HANG_GUARD, STARTUP_HANG_GUARD, free_port

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass(frozen=True)
class S3Server:
    endpoint: str

    def env(self) -> dict[str, str]:
        """What a process needs to reach this server through the AWS credential chain."""
        return {**CREDENTIALS, "CKPT_S3_ENDPOINT": self.endpoint}

    def client(self) -> Any:
        return boto3.session.Session(
            aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
        ).client("s3", endpoint_url=self.endpoint, config=Config(s3={"addressing_style": "path"}))

    def bucket(self) -> str:
        """A new, empty bucket."""
        name = f"ckpt-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name


@contextmanager
def moto_server(log: Path) -> Iterator[S3Server]:
    port = free_port()
    executable = shutil.which("moto_server", path=str(Path(sys.executable).parent))
    assert executable, "moto_server is not installed: pip install 'moto[server]'"
    with log.open("w") as out:
        process = subprocess.Popen(
            [executable, "-H", "127.0.0.1", "-p", str(port)], stdout=out, stderr=subprocess.STDOUT
        )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_HANG_GUARD  # it answers, or exits, or hangs
        while True:
            try:
                httpx.get(endpoint, timeout=ANSWER_HANG_GUARD)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError(f"moto_server did not start:\n{log.read_text()}") from None
                time.sleep(0.1)
        yield S3Server(endpoint)
    finally:
        process.terminate()
        process.wait(10)


@contextmanager
def aws_environment() -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
