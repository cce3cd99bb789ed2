"""The S3 object store: AWS S3, MinIO, or any S3-compatible server. The only module that
imports boto3.

``CKPT_STORE=s3://bucket/prefix`` selects it; ``CKPT_S3_ENDPOINT`` points it at MinIO or
another server; credentials come from the standard AWS chain (environment, profile, IRSA).

Objects are streamed from the caller's buffers (never joined into one bytes object): one
``PutObject`` up to ``part_bytes``, a multipart upload above, each request carrying the
SHA-256 of its bytes so that the server verifies what it receives (a blob's is the one its
key names: hashed once, by the agent, before the upload). ``part_bytes`` is S3's
largest ``PutObject`` by default, and the agent's blobs are never larger
(``CKPT_BLOB_BYTES``): each blob is one request whose SHA-256 S3 checks and keeps for the
whole object, so that a commit confirms it from a HEAD. (A multipart upload's checksum is
only a checksum of its parts' checksums; its parts went up one after another anyway, so
one request per blob loses nothing.) A failed multipart
upload is aborted, so no partial object ever becomes visible. botocore retries throttling,
5xx answers and connection errors with backoff; connect and read timeouts bound every call.
What no retry mends fails at once with ``StoreAccessError``, naming the bucket, the
endpoint and what to fix: no credentials, incomplete ones, or ones the store refuses
(unknown key id, wrong secret, access denied).
"""

from __future__ import annotations

import base64
import hashlib
import io
import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any
from urllib.parse import urlparse

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    NoCredentialsError,
    PartialCredentialsError,
)

from ckpt.core.errors import BadObjectError, StoreAccessError, StoreError
from ckpt.core.storage import keys
from ckpt.core.storage.base import StoredObject

MIN_PART_BYTES = 5 << 20  # S3's smallest part but the last
MAX_PUT_BYTES = 5 << 30  # S3's largest PutObject (and largest part)
DEFAULT_PART_BYTES = MAX_PUT_BYTES
_NOT_FOUND = ("404", "NoSuchKey", "NotFound")
_DELETE_KEYS = 1000  # the most keys one DeleteObjects takes
# Refusals of the credentials themselves, and what to check (HeadObject answers a bare 403).
_DENIED = {
    "InvalidAccessKeyId": "the store knows no such access key id",
    "SignatureDoesNotMatch": "the secret access key does not match the access key id",
    "AccessDenied": "they may not do this in the bucket: check the IAM or bucket policy",
    "403": "they may not do this in the bucket: check the IAM or bucket policy",
}
# Where botocore found the credentials (its provider's method), for the message.
_SOURCES = {
    "env": "the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)",
    "shared-credentials-file": "the shared credentials file (~/.aws/credentials)",
    "config-file": "the AWS config file (~/.aws/config)",
    "assume-role-with-web-identity": "the web identity role (IRSA: AWS_ROLE_ARN)",
    "container-role": "the container's role",
    "iam-role": "the instance's IAM role",
}
_NONE = (
    "no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
    "AWS_PROFILE, or give the pod a role (IRSA on EKS)"
)


class S3ObjectStore:
    """Objects under ``s3://bucket/prefix``."""

    def __init__(
        self,
        url: str,
        *,
        endpoint_url: str | None = None,
        part_bytes: int = DEFAULT_PART_BYTES,
        concurrency: int = 8,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        max_attempts: int = 8,
    ) -> None:
        parsed = urlparse(url)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise ValueError(f"not an S3 URL: {url!r}; use s3://bucket/prefix")
        if not MIN_PART_BYTES <= part_bytes <= MAX_PUT_BYTES:
            raise ValueError(
                f"part_bytes must be from {MIN_PART_BYTES} to {MAX_PUT_BYTES} (S3's limits)"
            )
        self.url = url.rstrip("/")
        self.bucket = parsed.netloc
        self.prefix = parsed.path.strip("/") + "/" if parsed.path.strip("/") else ""
        self.part_bytes = part_bytes
        self.endpoint_url = endpoint_url
        session = boto3.session.Session()
        try:
            credentials = session.get_credentials()
        except PartialCredentialsError as err:
            raise self._access_error("sign requests", err) from err
        self._source = _SOURCES.get(credentials.method, credentials.method) if credentials else ""
        self._client: Any = session.client(
            "s3",
            endpoint_url=endpoint_url,
            config=Config(
                retries={"max_attempts": max_attempts, "mode": "standard"},
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
                max_pool_connections=max(10, 2 * concurrency),
                s3={"addressing_style": "path"} if endpoint_url else None,
            ),
        )

    def put(self, key: str, pieces: Iterable[memoryview | bytes]) -> None:
        views = [memoryview(piece).cast("B") for piece in pieces]
        size = sum(len(view) for view in views)
        target = self.prefix + key
        try:
            if size <= self.part_bytes:
                self._client.put_object(
                    Bucket=self.bucket,
                    Key=target,
                    Body=_Reader(views),
                    ContentLength=size,
                    ChecksumSHA256=_checksum(key, views),
                )
            else:
                self._put_multipart(target, views, size)
        except (BotoCoreError, ClientError) as err:
            raise self._failure(f"write {key!r}", err) from err

    def _put_multipart(self, target: str, views: list[memoryview], size: int) -> None:
        upload = self._client.create_multipart_upload(
            Bucket=self.bucket, Key=target, ChecksumAlgorithm="SHA256"
        )["UploadId"]
        try:
            parts = []
            for number, start in enumerate(range(0, size, self.part_bytes), start=1):
                part = list(_slice(views, start, min(start + self.part_bytes, size)))
                checksum = _sha256(part)
                answer = self._client.upload_part(
                    Bucket=self.bucket,
                    Key=target,
                    UploadId=upload,
                    PartNumber=number,
                    Body=_Reader(part),
                    ContentLength=sum(len(p) for p in part),
                    ChecksumSHA256=checksum,
                )
                parts.append(
                    {"PartNumber": number, "ETag": answer["ETag"], "ChecksumSHA256": checksum}
                )
            self._client.complete_multipart_upload(
                Bucket=self.bucket,
                Key=target,
                UploadId=upload,
                MultipartUpload={"Parts": parts},
            )
        except BaseException:
            self._client.abort_multipart_upload(Bucket=self.bucket, Key=target, UploadId=upload)
            raise

    def get(self, key: str) -> bytes:
        try:
            data: bytes = self._client.get_object(Bucket=self.bucket, Key=self.prefix + key)[
                "Body"
            ].read()
        except ClientError as err:
            raise self._error("read", key, err) from err
        except BotoCoreError as err:
            raise self._failure(f"read {key!r}", err) from err
        return data

    def read_into(self, key: str, buffer: memoryview) -> int:
        try:
            answer = self._client.get_object(Bucket=self.bucket, Key=self.prefix + key)
            size = int(answer["ContentLength"])
            if size > len(buffer):
                answer["Body"].close()
                raise BadObjectError(
                    f"{self.url}: {key!r} holds {size} bytes, expected at most {len(buffer)}"
                )
            filled = 0
            body = answer["Body"]
            while filled < size:
                chunk = body.read(min(8 << 20, size - filled))
                if not chunk:
                    raise StoreError(f"{self.url}: {key!r} ended after {filled} of {size} bytes")
                buffer[filled : filled + len(chunk)] = chunk
                filled += len(chunk)
            return size
        except ClientError as err:
            raise self._error("read", key, err) from err
        except BotoCoreError as err:
            raise self._failure(f"read {key!r}", err) from err

    def size(self, key: str) -> int | None:
        found = self.stat(key)
        return None if found is None else found.size

    def stat(self, key: str) -> StoredObject | None:
        """The object's size, time and, where S3 kept one, its whole-object SHA-256."""
        try:
            answer = self._client.head_object(
                Bucket=self.bucket, Key=self.prefix + key, ChecksumMode="ENABLED"
            )
        except ClientError as err:
            if _code(err) in _NOT_FOUND:
                return None
            raise self._failure(f"stat {key!r}", err) from err
        except BotoCoreError as err:
            raise self._failure(f"stat {key!r}", err) from err
        return StoredObject(
            key,
            int(answer["ContentLength"]),
            answer["LastModified"].timestamp(),
            whole_object_sha256(answer),
        )

    def list_keys(self, prefix: str) -> Iterator[str]:
        return (item.key for item in self.list_objects(prefix))

    def list_objects(self, prefix: str) -> Iterator[StoredObject]:
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self.prefix + prefix
        )
        try:
            for page in pages:
                for item in page.get("Contents", []):
                    yield StoredObject(
                        item["Key"][len(self.prefix) :],
                        int(item["Size"]),
                        item["LastModified"].timestamp(),
                    )
        except (BotoCoreError, ClientError) as err:
            raise self._failure(f"list {prefix!r}", err) from err

    def delete(self, key: str) -> None:
        try:
            self._client.delete_object(Bucket=self.bucket, Key=self.prefix + key)
        except (BotoCoreError, ClientError) as err:
            raise self._failure(f"delete {key!r}", err) from err

    def delete_many(self, keys: Sequence[str]) -> None:
        """One ``DeleteObjects`` per 1,000 keys (quiet: S3 answers only with failures)."""
        failed: list[str] = []
        for start in range(0, len(keys), _DELETE_KEYS):
            chunk = keys[start : start + _DELETE_KEYS]
            objects = [{"Key": self.prefix + key} for key in chunk]
            try:
                answer = self._client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": objects, "Quiet": True}
                )
            except (BotoCoreError, ClientError) as err:
                raise self._failure(f"delete {len(chunk)} objects", err) from err
            failed += [
                f"{e['Key'][len(self.prefix) :]} ({e.get('Code')})"
                for e in answer.get("Errors", ())
                if e.get("Code") not in _NOT_FOUND
            ]
        if failed:
            raise StoreError(f"{self.url}: cannot delete {len(failed)} objects: {failed[:10]}")

    def _error(self, action: str, key: str, err: ClientError) -> StoreError:
        if _code(err) in _NOT_FOUND:
            return BadObjectError(f"{self.url}: no object {key!r}")
        return self._failure(f"{action} {key!r}", err)

    def _failure(self, doing: str, err: BotoCoreError | ClientError) -> StoreError:
        """A failed call's error: ``StoreAccessError`` when the credentials are at fault."""
        if isinstance(err, NoCredentialsError | PartialCredentialsError):
            return self._access_error(doing, err)
        if isinstance(err, ClientError) and _code(err) in _DENIED:
            return self._access_error(doing, err)
        return StoreError(f"{self.url}: cannot {doing}: {err}")

    def _access_error(self, doing: str, err: Exception) -> StoreAccessError:
        where = f"{self.url} (bucket {self.bucket} at {self.endpoint_url or 'AWS S3'})"
        if isinstance(err, NoCredentialsError):
            problem = _NONE
        elif isinstance(err, PartialCredentialsError):
            missing = err.kwargs.get("cred_var", "a part")
            problem = f"the AWS credentials from {err.kwargs.get('provider')} lack {missing}"
        elif isinstance(err, ClientError) and _code(err) in _DENIED:
            code = _code(err)
            problem = f"the store refused the credentials from {self._source} ({code}): "
            problem += _DENIED[code]
        else:
            problem = str(err)
        return StoreAccessError(f"{where}: cannot {doing}: {problem}; not retried")


def whole_object_sha256(head: Mapping[str, Any]) -> str | None:
    """The SHA-256 (hex) of the whole object from a HeadObject answer, or None when S3 did
    not keep one: a multipart upload's checksum is a checksum of its parts' checksums
    ("COMPOSITE", "...-N"), not of the object."""
    found = head.get("ChecksumSHA256")
    if not isinstance(found, str) or "-" in found:
        return None
    if head.get("ChecksumType", "FULL_OBJECT") != "FULL_OBJECT":
        return None
    try:
        raw = base64.b64decode(found, validate=True)
    except ValueError:
        return None
    return raw.hex() if len(raw) == 32 else None


def _code(err: ClientError) -> str:
    return str(err.response.get("Error", {}).get("Code", ""))


def _checksum(key: str, views: Iterable[memoryview]) -> str:
    """The SHA-256 S3 checks a put's bytes against: a blob's is the one its key names (the
    agent hashed those bytes to name it, so they are not hashed again, and bytes that
    changed since are refused), any other object's is computed here."""
    named = keys.blob_sha256(key)
    return base64.b64encode(bytes.fromhex(named)).decode() if named else _sha256(views)


def _sha256(views: Iterable[memoryview]) -> str:
    digest = hashlib.sha256()
    for view in views:
        digest.update(view)
    return base64.b64encode(digest.digest()).decode()


def _slice(views: list[memoryview], start: int, end: int) -> Iterator[memoryview]:
    """The bytes [start, end) of the concatenation of ``views``, as views (no copy)."""
    offsets = itertools.accumulate((len(v) for v in views), initial=0)
    for view, first in zip(views, offsets, strict=False):
        last = first + len(view)
        if last <= start or first >= end:
            continue
        yield view[max(start - first, 0) : min(end, last) - first]


class _Reader(io.RawIOBase):
    """A seekable, read-only stream over views, so botocore can send (and resend on a
    retry) a body without it being joined into one bytes object."""

    def __init__(self, views: list[memoryview]) -> None:
        self._views = views
        self._size = sum(len(v) for v in views)
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._size}[whence]
        self._position = max(0, min(base + offset, self._size))
        return self._position

    def readinto(self, buffer: Any) -> int:
        target = memoryview(buffer).cast("B")
        end = min(self._position + len(target), self._size)
        filled = 0
        for piece in _slice(self._views, self._position, end):
            target[filled : filled + len(piece)] = piece
            filled += len(piece)
        self._position = end
        return filled
