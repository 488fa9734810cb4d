"""The run lock: one driver at a time writes ``{storage_path}/{name}``.

``run_pipeline`` takes it once the config and data checks pass, before Ray starts, and holds
it for the whole run; it is released on success, on failure and on Ctrl-C, and only while
this driver still owns it (the owner token in the lock matches). A second driver fails at
once with :class:`~cascade_ray.errors.RunLockedError` naming the holder.

The lock is ``{run}/.lock``, a small JSON record: ``host``, ``pid``, ``user``, ``started``,
``heartbeat`` (UTC) and a random ``token``; never credentials or the command line. The
holder rewrites it every ``RUN_LOCK_HEARTBEAT_S``. A lock counts as abandoned (stale) when

- its host is this host and its pid is dead: taken over, with a log line; or
- its host and pid are this process's, but this process holds no lock with its token (an
  earlier run in this process could not remove it, e.g. the store was down when it ended):
  taken over, with a warning; or
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
import getpass
import json
import os
import secrets
import socket
import threading
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from typing import Any

from cascade_ray.constants import RUN_LOCK_HEARTBEAT_S, RUN_LOCK_STALE_S
from cascade_ray.errors import RunLockedError
from cascade_ray.storage import StorageDir, UriPath, local_path
from cascade_ray.storage_lock.stores import (
    LOCK_NAME,
    GcsLockStore,
    LocalLockStore,
    LockStore,
    S3LockStore,
    Seen,
    s3_client,
)

__all__ = [
    "LOCK_NAME",
    "GcsLockStore",
    "LocalLockStore",
    "LockStore",
    "RunLock",
    "S3LockStore",
    "Seen",
    "acquire_run_lock",
    "display",
    "hold_run_lock",
    "s3_client",
    "stale_reason",
]

HOLDER_KEYS = ("host", "pid", "user", "started", "heartbeat")
_ATTEMPTS = 5  # create / take over rounds before giving up on a lock that keeps changing
_HELD_TOKENS: set[str] = set()  # tokens of the RunLocks this process holds now


def display(run: StorageDir) -> str:
    """`run` for messages: a URI without user info or query options (they may hold keys)."""
    # user info never reaches run.path (parse_uri keeps it in run.auth)
    return f"{run.scheme}://{run.path}" if isinstance(run, UriPath) else str(run)


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
    here = holder.get("host") == socket.gethostname() and isinstance(pid, int) and pid > 0
    if here and pid == os.getpid() and holder.get("token") not in _HELD_TOKENS:
        return "it was left by an earlier run in this process (its release could not remove it)", True
    if here and not _pid_alive(pid):
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
        _HELD_TOKENS.add(record["token"])
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
                    self._disown()
                    seen = self.store.read()
                    who = _holder(seen) if seen else {}
                    by = ", ".join(f"{k} {who[k]}" for k in HOLDER_KEYS if k in who) or "nobody"
                    self.log(
                        f"WARNING: run lock {self.store.where} is no longer ours (now: {by}); "
                        "another driver may be writing this run folder"
                    )
                    return
                self.record, self.version = record, version

    def _disown(self) -> None:
        self.owned = False
        _HELD_TOKENS.discard(self.record["token"])

    def release(self) -> bool:
        """Stop the heartbeat and remove the lock if it is still ours; True if it was removed."""
        self._stop.set()
        self._thread.join(timeout=30)
        with self._lock:
            if not self.owned:
                return False
            self._disown()
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
