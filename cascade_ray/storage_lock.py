"""The run lock: one driver at a time writes ``{storage_path}/{name}``.

``run_pipeline`` takes it once the config and data checks pass, before Ray starts, and holds
it for the whole run; it is released on success, on failure and on Ctrl-C, and only while
this driver still owns it (the owner token in the lock matches). A second driver fails at
once with :class:`~cascade_ray.errors.RunLockedError` naming the holder.

The lock is ``{run}/.lock``, a small JSON record: ``host``, ``pid``, ``user``, ``started``,
``heartbeat`` (UTC) and a random ``token``; never credentials or the command line. The
holder rewrites it every ``RUN_LOCK_HEARTBEAT_S``. A lock counts as abandoned (stale) when

- its host is this host and its pid is dead: taken over, with a log line; or
- its last write is older than ``RUN_LOCK_STALE_S`` (3 missed beats; a holder on another
  host, or a pid reused on this one): taken over, with a warning.

``break_lock`` (``--break-lock``) takes it from any holder; a live holder finds out at its
next heartbeat and warns that it no longer holds the lock.

The atomic primitive per storage (pyarrow.fs has no conditional write):

- local path, ``file://``: the record is written to a temporary file and hard-linked to
  ``.lock`` (``link`` fails if the name exists; content is complete when it appears), or
  created with ``O_CREAT|O_EXCL`` where the filesystem has no hard links. Heartbeat,
  takeover and release check the record and ``os.replace``/``unlink`` it under ``flock`` on
  the run folder, which serializes them between processes of one host.
- ``s3://``: boto3 ``PutObject`` with ``If-None-Match: *`` (create), ``If-Match: <ETag>``
  (heartbeat, takeover) and ``DeleteObject`` with ``If-Match`` (release). Staleness is
  judged by the server's clock (``Last-Modified`` against the response ``Date``). boto3
  honours ``AWS_ENDPOINT_URL``; the URI's ``endpoint_override``, ``scheme`` and ``region``
  options are passed on. Needs ``pip install 'cascade-ray[s3]'`` and a store that honours
  conditional writes (AWS S3, MinIO, moto do; a store that ignores the headers gives no
  exclusion).
- ``gs://``: google-cloud-storage uploads with ``if_generation_match=0`` (create) or
  ``=generation`` (heartbeat, takeover, delete).
- other schemes (``hdfs://``, ``viewfs://``, ``abfs://``): no primitive is used; the run
  goes ahead unlocked, with a warning saying so.
"""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import hashlib
import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qsl

from cascade_ray.constants import RUN_LOCK_HEARTBEAT_S, RUN_LOCK_STALE_S
from cascade_ray.errors import ConfigError, ConfigIssue, RunLockedError
from cascade_ray.storage import StorageDir, UriPath, local_path

LOCK_NAME = ".lock"
HOLDER_KEYS = ("host", "pid", "user", "started", "heartbeat")
_ATTEMPTS = 5  # create / take over rounds before giving up on a lock that keeps changing


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


def display(run: StorageDir) -> str:
    """`run` for messages: a URI without user info or query options (they may hold keys)."""
    if not isinstance(run, UriPath):
        return str(run)
    head, sep, rest = run.path.partition("/")
    return f"{run.scheme}://{head.rpartition('@')[2]}{sep}{rest}"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


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


def _bucket_key(run: UriPath) -> tuple[str, str, str]:
    """(bucket, key of the lock, user info) of an object-store run folder."""
    bucket, _, prefix = run.path.partition("/")
    userinfo, _, bucket = bucket.rpartition("@")
    return bucket, f"{prefix}/{LOCK_NAME}".lstrip("/"), userinfo


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
    userinfo = _bucket_key(run)[2]
    if userinfo:
        key, _, secret = userinfo.partition(":")
        kwargs |= {"aws_access_key_id": key, "aws_secret_access_key": secret}
    return boto3.client("s3", **kwargs)


def _s3_code(exc: Exception) -> str:
    response = getattr(exc, "response", None) or {}
    return str(response.get("Error", {}).get("Code") or response.get("ResponseMetadata", {}).get("HTTPStatusCode"))


_S3_CHANGED = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409", "NoSuchKey", "404"}


class S3LockStore:
    """The ``{run}/.lock`` object on S3 (or an S3-compatible store), by conditional requests."""

    def __init__(self, run: UriPath, client: Any = None):
        self.bucket, self.key, _ = _bucket_key(run)
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
        name, self.key, _ = _bucket_key(run)
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


def lock_store(run: StorageDir) -> LockStore | None:
    """The store of `run`'s lock; None for schemes without a primitive (see the module docstring)."""
    local = local_path(run)
    if local is not None:
        return LocalLockStore(local)
    assert isinstance(run, UriPath)  # local_path is None only for a URI
    if run.scheme == "s3":
        return S3LockStore(run)
    if run.scheme in ("gs", "gcs"):
        return GcsLockStore(run)
    return None


def _holder(seen: Seen) -> dict[str, Any]:
    try:
        record = json.loads(seen.body)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def stale_reason(holder: dict[str, Any], age_s: float, stale_s: float) -> tuple[str, bool] | None:
    """Why a lock counts as abandoned and whether that deserves a warning; None while it looks held."""
    pid = holder.get("pid")
    if holder.get("host") == socket.gethostname() and isinstance(pid, int) and not _pid_alive(pid):
        return f"its holder, pid {pid} on this host, is dead", False
    if age_s > stale_s:
        return f"no heartbeat for {age_s:.0f} s (stale after {stale_s:.0f} s)", True
    return None


class RunLock:
    """A held run lock. A daemon thread rewrites it every `heartbeat_s`; :meth:`release` ends it."""

    def __init__(self, store: LockStore, record: dict[str, Any], version: str, heartbeat_s: float, log):
        self.store, self.record, self.version, self.log = store, record, version, log
        self._lock = threading.Lock()  # version and owned, between the heartbeat thread and release
        self.owned = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(heartbeat_s,), name="cascade-run-lock", daemon=True)
        self._thread.start()

    def _beat(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            with self._lock:
                if not self.owned:
                    return
                record = {**self.record, "heartbeat": _now()}
                try:
                    version = self.store.replace(json.dumps(record).encode(), self.version)
                except Exception as exc:  # noqa: BLE001 - a failed beat (network blip) must not end the thread; the next one retries
                    self.log(f"WARNING: run lock {self.store.where}: heartbeat failed ({type(exc).__name__}); retrying")
                    continue
                if version is None:
                    self.owned = False
                    seen = self.store.read()
                    who = _holder(seen) if seen else {}
                    by = ", ".join(f"{k} {who[k]}" for k in HOLDER_KEYS if k in who) or "nobody"
                    self.log(
                        f"WARNING: run lock {self.store.where} is no longer ours (now: {by}); "
                        "another driver may be writing this run folder"
                    )
                    return
                self.record, self.version = record, version

    def release(self) -> bool:
        """Stop the heartbeat and remove the lock if it is still ours; True if it was removed."""
        self._stop.set()
        self._thread.join(timeout=30)
        with self._lock:
            if not self.owned:
                return False
            self.owned = False
            try:
                return self.store.delete(self.version)
            except Exception as exc:  # noqa: BLE001 - a failed release must not hide how the run ended; the lock goes stale
                self.log(
                    f"WARNING: run lock {self.store.where}: could not remove it ({type(exc).__name__}); "
                    "the next driver takes it over once it is stale, or pass --break-lock"
                )
                return False


def acquire_run_lock(
    run: StorageDir,
    *,
    break_lock: bool = False,
    log: Callable[[str], None] = print,
    heartbeat_s: float = RUN_LOCK_HEARTBEAT_S,
    stale_s: float = RUN_LOCK_STALE_S,
    store: LockStore | None = None,
) -> RunLock | None:
    """Take the lock of run folder `run`, taking over a stale one; None where no primitive exists.

    Raises:
        RunLockedError: a live driver holds it (and `break_lock` is off).
        ConfigError: the client library the storage's primitive needs is not installed.
    """
    store = store if store is not None else lock_store(run)
    if store is None:
        log(
            f"WARNING: run lock: {display(run)} is on {run.scheme}://, which offers cascade-ray no atomic create; "
            "this run is NOT locked: make sure no other driver writes the same run folder"
        )
        return None
    started = _now()
    record = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "user": _user(),
        "started": started,
        "heartbeat": started,
        "token": secrets.token_hex(16),
    }
    body = json.dumps(record).encode()
    holder: dict[str, Any] = {}
    for _ in range(_ATTEMPTS):
        version = store.create(body)
        if version is None:
            seen = store.read()
            if seen is None:
                continue  # released in between: create again
            holder = _holder(seen)
            who = {k: holder[k] for k in HOLDER_KEYS if k in holder}
            stale = stale_reason(holder, seen.age_s, stale_s)
            if break_lock:
                log(f"WARNING: --break-lock: taking {store.where} from {_describe(who, seen.age_s)}")
            elif stale is None:
                alive = " (its pid is alive on this host)" if holder.get("host") == socket.gethostname() else ""
                raise RunLockedError(
                    display(run), who, f"last heartbeat {seen.age_s:.0f} s ago{alive}, stale after {stale_s:.0f} s"
                )
            else:
                reason, warn = stale
                log(
                    f"{'WARNING: ' if warn else ''}run lock: taking over {store.where} from {_describe(who, seen.age_s)}: {reason}"
                )
            version = store.replace(body, seen.version)
        if version is not None:
            return RunLock(store, record, version, heartbeat_s, log)
    raise RunLockedError(
        display(run),
        {k: holder[k] for k in HOLDER_KEYS if k in holder},
        "the lock kept changing while being taken: another driver is starting",
    )


def _describe(who: dict[str, Any], age_s: float) -> str:
    return f"{', '.join(f'{k} {v}' for k, v in who.items()) or 'an unreadable lock'} (written {age_s:.0f} s ago)"


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (some containers)
        return "?"


@contextlib.contextmanager
def hold_run_lock(
    run: StorageDir, *, break_lock: bool = False, log: Callable[[str], None] = print, **kwargs: Any
) -> Iterator[RunLock | None]:
    """:func:`acquire_run_lock` for the block; released however it ends (Ctrl-C included)."""
    lock = acquire_run_lock(run, break_lock=break_lock, log=log, **kwargs)
    try:
        yield lock
    finally:
        if lock is not None:
            lock.release()
