"""An S3 store without credentials, with incomplete ones, or with ones the store refuses
fails at once with ``StoreAccessError``, naming the bucket, the endpoint and what to fix:
no request is retried that no retry can mend. Against a real S3 server over HTTP (moto);
the refusals from one that checks signatures and IAM policies."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import boto3
import httpx
import pytest

from ckpt.cli import main
from ckpt.core.errors import StoreAccessError
from ckpt.core.storage.s3 import S3ObjectStore
from tests.s3_server import S3Server, moto_server

# Every provider of botocore's chain but the one a test sets: no environment, no files, no
# instance metadata (a test never reaches for 169.254.169.254).
AWS_VARIABLES = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
)


@dataclass(frozen=True)
class Guarded:
    """A moto server that authenticates every request and applies IAM policies, with a
    bucket and the key pair of a user no policy allows anything."""

    server: S3Server
    log: Path  # moto's, a line per request
    bucket: str
    key_id: str
    secret: str


@pytest.fixture(scope="module")
def moto_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("moto") / "moto.log"


@pytest.fixture(scope="module")
def s3(moto_log: Path) -> Iterator[S3Server]:
    with moto_server(moto_log) as server:
        yield server


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Guarded]:
    log = tmp_path_factory.mktemp("moto-auth") / "moto.log"
    with moto_server(log) as server:
        bucket = server.bucket()
        iam = boto3.session.Session(
            aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
        ).client("iam", endpoint_url=server.endpoint)
        iam.create_user(UserName="nobody")
        pair = iam.create_access_key(UserName="nobody")["AccessKey"]
        # From now on moto authenticates every request (INITIAL_NO_AUTH_ACTION_COUNT = 0).
        answer = httpx.post(f"{server.endpoint}/moto-api/reset-auth", content=b"0", timeout=30)
        assert answer.status_code == 200, answer.text
        yield Guarded(server, log, bucket, pair["AccessKeyId"], pair["SecretAccessKey"])


@pytest.fixture
def no_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """No AWS credentials anywhere botocore looks; returns the environment for a process."""
    for name in AWS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    settings = {
        "HOME": str(tmp_path),  # no ~/.aws
        "AWS_CONFIG_FILE": str(tmp_path / "no-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-credentials"),
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    return settings


def requests_sent(store: S3ObjectStore) -> list[str]:
    """The requests the store's client sends from now on, retries included."""
    sent: list[str] = []
    store._client.meta.events.register(
        "before-send.s3.*", lambda request, **_: sent.append(request.method)
    )
    return sent


def every_call(store: S3ObjectStore) -> dict[str, Callable[[], object]]:
    return {
        "put": lambda: store.put("blobs/a", [b"bytes"]),
        "get": lambda: store.get("blobs/a"),
        "read_into": lambda: store.read_into("blobs/a", memoryview(bytearray(8))),
        "stat": lambda: store.stat("blobs/a"),
        "list": lambda: list(store.list_keys("blobs/")),
        "delete": lambda: store.delete("blobs/a"),
        "delete_many": lambda: store.delete_many(["blobs/a", "blobs/b"]),
    }


@pytest.mark.usefixtures("no_credentials")
def test_no_credentials_fail_every_call_at_once_naming_what_is_missing(s3: S3Server) -> None:
    bucket = s3.bucket()
    store = S3ObjectStore(f"s3://{bucket}/ckpt", endpoint_url=s3.endpoint)
    sent = requests_sent(store)
    for name, call in every_call(store).items():
        with pytest.raises(StoreAccessError) as caught:
            call()
        message = str(caught.value)
        assert f"bucket {bucket} at {s3.endpoint}" in message, name
        assert "no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in (
            message
        )
        assert message.endswith("not retried")
    assert sent == [], "a request that cannot be signed is never sent"


def test_incomplete_credentials_name_the_missing_one(
    s3: S3Server, no_credentials: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLE")
    bucket = s3.bucket()
    with pytest.raises(StoreAccessError) as caught:
        S3ObjectStore(f"s3://{bucket}/ckpt", endpoint_url=s3.endpoint)
    assert f"bucket {bucket} at {s3.endpoint}" in str(caught.value)
    assert "the AWS credentials from env lack AWS_SECRET_ACCESS_KEY" in str(caught.value)


@pytest.mark.parametrize(
    ("which", "code", "hint"),
    [
        ("unknown key", "InvalidAccessKeyId", "the store knows no such access key id"),
        ("wrong secret", "SignatureDoesNotMatch", "the secret access key does not match"),
        ("no policy", "AccessDenied", "they may not do this in the bucket"),
    ],
)
@pytest.mark.usefixtures("no_credentials")
def test_refused_credentials_fail_at_once_after_one_request(
    guarded: Guarded,
    monkeypatch: pytest.MonkeyPatch,
    which: str,
    code: str,
    hint: str,
) -> None:
    key_id, secret = {
        "unknown key": ("AKIAUNKNOWNKEY000000", "some-secret"),
        "wrong secret": (guarded.key_id, "not-the-secret"),
        "no policy": (guarded.key_id, guarded.secret),
    }[which]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    store = S3ObjectStore(f"s3://{guarded.bucket}/ckpt", endpoint_url=guarded.server.endpoint)
    sent = requests_sent(store)
    with pytest.raises(StoreAccessError) as caught:
        store.put("blobs/a", [b"bytes"])
    message = str(caught.value)
    assert f"bucket {guarded.bucket} at {guarded.server.endpoint}" in message
    assert "refused the credentials from the environment (AWS_ACCESS_KEY_ID" in message
    assert f"({code}): {hint}" in message
    assert secret not in message
    assert sent == ["PUT"], "one request: a refusal is not retried"
    sent.clear()
    with pytest.raises(StoreAccessError, match="cannot stat 'blobs/a'"):
        store.stat("blobs/a")  # HeadObject: a bare 403
    assert sent == ["HEAD"]


def train(store: str, out: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            *(sys.executable, "-m", "agent.demo.train", "--store", store, "--out", str(out)),
            *("--run", "creds", "--steps", "4", "--every", "2"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def requests_logged(log: Path, bucket: str) -> list[str]:
    """The requests moto logged for ``bucket`` (a line each, after the answer was sent)."""
    return [line for line in log.read_text().splitlines() if f" /{bucket}" in line]


@pytest.mark.slow
@pytest.mark.usefixtures("no_credentials")
def test_a_training_job_without_credentials_stops_at_its_first_call(
    s3: S3Server, moto_log: Path, tmp_path: Path
) -> None:
    bucket = s3.bucket()
    before = len(requests_logged(moto_log, bucket))  # the bucket's creation
    env = {**os.environ, "CKPT_S3_ENDPOINT": s3.endpoint}
    done = train(f"s3://{bucket}/ckpt", tmp_path / "final.pt", env)
    assert done.returncode == 1
    assert "ckpt.core.errors.StoreAccessError" in done.stderr
    assert f"bucket {bucket} at {s3.endpoint}): cannot list" in done.stderr
    assert "no AWS credentials found" in done.stderr
    assert len(requests_logged(moto_log, bucket)) == before, "nothing was sent"


@pytest.mark.slow
@pytest.mark.usefixtures("no_credentials")
def test_a_training_job_with_refused_credentials_stops_after_one_request(
    guarded: Guarded, tmp_path: Path
) -> None:
    env = {
        **os.environ,
        "CKPT_S3_ENDPOINT": guarded.server.endpoint,
        "AWS_ACCESS_KEY_ID": "AKIAUNKNOWNKEY000000",
        "AWS_SECRET_ACCESS_KEY": "some-secret",
    }
    before = len(requests_logged(guarded.log, guarded.bucket))
    done = train(f"s3://{guarded.bucket}/ckpt", tmp_path / "final.pt", env)
    assert done.returncode == 1
    assert "ckpt.core.errors.StoreAccessError" in done.stderr
    assert "(InvalidAccessKeyId): the store knows no such access key id" in done.stderr
    assert len(requests_logged(guarded.log, guarded.bucket)) - before == 1  # the resume's listing


def test_the_cli_says_which_credential_is_missing(
    s3: S3Server,
    no_credentials: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("CKPT_S3_ENDPOINT", s3.endpoint)
    bucket = s3.bucket()
    assert main(["verify", "some-run", "--store", f"s3://{bucket}/ckpt"]) == 2
    assert "no AWS credentials found" in capsys.readouterr().err
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLE")
    assert main(["verify", "some-run", "--store", f"s3://{bucket}/ckpt"]) == 2
    err = capsys.readouterr().err
    assert f"ckpt verify: s3://{bucket}/ckpt (bucket {bucket} at {s3.endpoint})" in err
    assert "the AWS credentials from env lack AWS_SECRET_ACCESS_KEY" in err
