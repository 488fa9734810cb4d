"""Where a run lock lives and its four atomic operations, per storage (see :mod:`cascade_ray.storage_lock`).

Every write is conditional: :class:`LocalLockStore` (a hard link / ``O_EXCL`` create, then
``os.replace`` under ``flock``), :class:`S3LockStore` (``If-None-Match`` / ``If-Match``, boto3),
:class:`GcsLockStore` (``if_generation_match``, google-cloud-storage).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qsl

from cascade_ray.errors import ConfigError, ConfigIssue
from cascade_ray.storage import UriPath

LOCK_NAME = ".lock"


@dataclass(frozen=True)
class Seen:
    """A lock as read: its bytes, the version a conditional write must match, its age."""

    body: bytes
    version: str
    age_s: float  # since its last write, by the store's clock where it has one


class LockStore(Protocol):
    """The four atomic operations a lock needs; every write is conditional."""

    where: str  # the lock's location for messages (no credentials)

    def create(self, body: bytes) -> str | None:
        """Write `body` unless the lock exists; its version, or None if it exists."""

    def read(self) -> Seen | None:
        """The lock, or None if there is none."""

    def replace(self, body: bytes, version: str) -> str | None:
        """Overwrite the lock if it is still at `version`; the new version, or None."""

    def delete(self, version: str) -> bool:
        """Remove the lock if it is still at `version`."""


class LocalLockStore:
    """``{run}/.lock`` on this machine's filesystem (or a shared mount)."""

    def __init__(self, run: Path):
        self.run, self.path, self.where = run, run / LOCK_NAME, str(run / LOCK_NAME)
        self.created_dir = not run.exists()
        run.mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """Serialize check-then-write between processes of this host (flock on the run folder)."""
        fd = os.open(self.run, os.O_RDONLY)
        try:
            with contextlib.suppress(OSError):  # no flock on this mount: the check-then-write is near-atomic only
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the flock

    def _tmp(self, body: bytes) -> Path:
        tmp = self.run / f"{LOCK_NAME}.{secrets.token_hex(6)}.tmp"
        tmp.write_bytes(body)
        return tmp

    def create(self, body: bytes) -> str | None:
        tmp = self._tmp(body)
        try:
            os.link(tmp, self.path)  # atomic, and the content is complete the moment the name exists
        except FileExistsError:
            return None
        except OSError:  # no hard links on this filesystem
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return None
            with os.fdopen(fd, "wb") as f:
                f.write(body)
                os.fsync(f.fileno())
        finally:
            tmp.unlink(missing_ok=True)
        return hashlib.sha256(body).hexdigest()

    def read(self) -> Seen | None:
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as f:
            mtime = os.fstat(f.fileno()).st_mtime
            body = f.read()
        return Seen(body, hashlib.sha256(body).hexdigest(), max(0.0, time.time() - mtime))

    def replace(self, body: bytes, version: str) -> str | None:
        with self._guard():
            seen = self.read()
            if seen is None or seen.version != version:
                return None
            os.replace(self._tmp(body), self.path)
        return hashlib.sha256(body).hexdigest()

    def delete(self, version: str) -> bool:
        with self._guard():
            seen = self.read()
            if seen is None or seen.version != version:
                return False
            self.path.unlink()
        if self.created_dir:  # leave no empty run folder behind a run that failed early
            with contextlib.suppress(OSError):
                self.run.rmdir()
        return True


def _bucket_key(run: UriPath) -> tuple[str, str]:
    """(bucket, key of the lock) of an object-store run folder."""
    bucket, _, prefix = run.path.partition("/")
    return bucket, f"{prefix}/{LOCK_NAME}".lstrip("/")


def s3_client(run: UriPath) -> Any:
    """A boto3 S3 client for `run`: ``AWS_*`` env (``AWS_ENDPOINT_URL`` included, boto3 >= 1.28)
    plus the URI's ``endpoint_override``/``scheme``/``region`` options and user info keys.

    Raises:
        ConfigError: boto3 is not installed.
    """
    try:
        import boto3
    except ImportError as exc:
        raise ConfigError(
            [
                ConfigIssue(
                    "storage_path",
                    f"the run lock on {run.scheme}:// storage needs boto3 (S3 conditional writes; pyarrow has none), "
                    "which is not installed",
                    "pip install 'cascade-ray[s3]'",
                )
            ]
        ) from exc
    options = dict(parse_qsl(run.query))
    kwargs: dict[str, str] = {}
    if endpoint := options.get("endpoint_override"):
        kwargs["endpoint_url"] = endpoint if "://" in endpoint else f"{options.get('scheme', 'https')}://{endpoint}"
    if region := options.get("region"):
        kwargs["region_name"] = region
    if run.auth:  # s3://key:secret@bucket/... (parse_uri keeps user info out of run.path)
        key, _, secret = run.auth.partition(":")
        kwargs |= {"aws_access_key_id": key, "aws_secret_access_key": secret}
    return boto3.client("s3", **kwargs)


def _s3_code(exc: Exception) -> str:
    response = getattr(exc, "response", None) or {}
    return str(response.get("Error", {}).get("Code") or response.get("ResponseMetadata", {}).get("HTTPStatusCode"))


_S3_CHANGED = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409", "NoSuchKey", "404"}


class S3LockStore:
    """The ``{run}/.lock`` object on S3 (or an S3-compatible store), by conditional requests."""

    def __init__(self, run: UriPath, client: Any = None):
        self.bucket, self.key = _bucket_key(run)
        self.where = f"s3://{self.bucket}/{self.key}"
        self.client = client if client is not None else s3_client(run)  # ConfigError without boto3
        from botocore.exceptions import ClientError

        self._error = ClientError

    def _put(self, body: bytes, **condition: str) -> str | None:
        try:
            r = self.client.put_object(
                Bucket=self.bucket, Key=self.key, Body=body, ContentType="application/json", **condition
            )
        except self._error as exc:
            if _s3_code(exc) in _S3_CHANGED:
                return None
            raise
        return r["ETag"]

    def create(self, body: bytes) -> str | None:
        return self._put(body, IfNoneMatch="*")

    def read(self) -> Seen | None:
        try:
            r = self.client.get_object(Bucket=self.bucket, Key=self.key)
        except self._error as exc:
            if _s3_code(exc) in ("NoSuchKey", "404", "NotFound"):
                return None
            raise
        body = r["Body"].read()
        date = r.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
        now = parsedate_to_datetime(date) if date else datetime.now(timezone.utc)  # the server's clock
        return Seen(body, r["ETag"], max(0.0, (now - r["LastModified"]).total_seconds()))

    def replace(self, body: bytes, version: str) -> str | None:
        return self._put(body, IfMatch=version)

    def delete(self, version: str) -> bool:
        seen = self.read()  # also guards stores that ignore If-Match on DeleteObject
        if seen is None or seen.version != version:
            return False
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=version)
        except self._error as exc:
            if _s3_code(exc) in _S3_CHANGED:
                return False
            if _s3_code(exc) not in ("NotImplemented", "501", "InvalidArgument", "400"):
                raise
            self.client.delete_object(Bucket=self.bucket, Key=self.key)  # no conditional delete: checked above
        return True


class GcsLockStore:
    """The ``{run}/.lock`` object on Google Cloud Storage, by generation preconditions."""

    def __init__(self, run: UriPath, bucket: Any = None, errors: tuple[type, type] | None = None):
        name, self.key = _bucket_key(run)
        self.where = f"{run.scheme}://{name}/{self.key}"
        if bucket is None:
            try:
                from google.api_core.exceptions import NotFound, PreconditionFailed
                from google.cloud import storage
            except ImportError as exc:
                raise ConfigError(
                    [
                        ConfigIssue(
                            "storage_path",
                            f"the run lock on {run.scheme}:// storage needs google-cloud-storage "
                            "(generation preconditions; pyarrow has none), which is not installed",
                            "pip install google-cloud-storage",
                        )
                    ]
                ) from exc
            bucket, errors = storage.Client().bucket(name), (PreconditionFailed, NotFound)
        self.bucket = bucket
        self._errors = errors  # (precondition failed, not found)

    def _upload(self, body: bytes, generation: int) -> str | None:
        blob = self.bucket.blob(self.key)
        try:
            blob.upload_from_string(body, content_type="application/json", if_generation_match=generation)
        except self._errors:
            return None
        return str(blob.generation)

    def create(self, body: bytes) -> str | None:
        return self._upload(body, 0)

    def read(self) -> Seen | None:
        blob = self.bucket.get_blob(self.key)
        if blob is None:
            return None
        try:
            body = blob.download_as_bytes(if_generation_match=blob.generation)
        except self._errors:
            return None  # changed or gone since get_blob: the caller tries again
        return Seen(body, str(blob.generation), max(0.0, (datetime.now(timezone.utc) - blob.updated).total_seconds()))

    def replace(self, body: bytes, version: str) -> str | None:
        return self._upload(body, int(version))

    def delete(self, version: str) -> bool:
        try:
            self.bucket.blob(self.key).delete(if_generation_match=int(version))
        except self._errors:
            return False
        return True
