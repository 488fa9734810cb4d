"""The run lock (cascade_ray/storage_lock/) on a local folder, on S3 (the moto fixture) and on a
fake GCS bucket: exclusive create, holder named, stale takeover, --break-lock, owner-checked release."""

from __future__ import annotations

import json
import os
import pickle
import re
import socket
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone

import pytest

from cascade_ray.errors import ConfigError, RunLockedError
from cascade_ray.storage import parse_uri
from cascade_ray.storage_lock import (
    LOCK_NAME,
    GcsLockStore,
    LocalLockStore,
    S3LockStore,
    acquire_run_lock,
    display,
    hold_run_lock,
    s3_client,
)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _foreign(host: str, pid: int) -> bytes:
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    record = {"host": host, "pid": pid, "user": "someone", "started": stamp, "heartbeat": stamp, "token": "f" * 32}
    return json.dumps(record).encode()


def _age(path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


# --- local folder ----------------------------------------------------------------------------


def test_the_lock_file_names_its_holder_and_is_removed_on_release(tmp_path):
    run = tmp_path / "runs" / "debug"
    lock = acquire_run_lock(run, log=pytest.fail)
    record = json.loads((run / LOCK_NAME).read_text())
    assert set(record) == {"host", "pid", "user", "started", "heartbeat", "token"}
    assert (record["host"], record["pid"]) == (socket.gethostname(), os.getpid())
    assert lock.release() is True
    assert not (run / LOCK_NAME).exists()
    assert not run.exists(), "a run folder the lock created and nothing filled is removed again"
    assert lock.release() is False


def test_a_second_driver_fails_at_once_naming_the_holder_and_break_lock(tmp_path):
    with hold_run_lock(tmp_path, log=pytest.fail):
        with pytest.raises(RunLockedError) as info:
            acquire_run_lock(tmp_path, log=pytest.fail)
        record = json.loads((tmp_path / LOCK_NAME).read_text())
    text = str(info.value)
    for part in (str(tmp_path), f"host {record['host']}", f"pid {os.getpid()}", f"started {record['started']}"):
        assert part in text
    assert "heartbeat " in text and "pid is alive on this host" in text and "--break-lock" in text
    assert record["token"] not in text
    again = pickle.loads(pickle.dumps(info.value))  # raised in drivers, shown by the CLI: picklable like every error
    assert str(again) == text and again.holder["pid"] == os.getpid() and again.exit_code == 2
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_dead_holder_on_this_host_is_taken_over_with_a_log_line(tmp_path):
    pid = _dead_pid()
    (tmp_path / LOCK_NAME).write_bytes(_foreign(socket.gethostname(), pid))
    lines: list[str] = []
    lock = acquire_run_lock(tmp_path, log=lines.append)
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert len(lines) == 1 and f"pid {pid} on this host, is dead" in lines[0] and not lines[0].startswith("WARNING")
    lock.release()


def test_a_lock_this_process_could_not_remove_is_taken_over_by_its_next_run_with_a_warning(tmp_path, monkeypatch):
    ended: list[str] = []
    first = acquire_run_lock(tmp_path, log=ended.append)
    record = (tmp_path / LOCK_NAME).read_bytes()

    def store_down(version):
        raise OSError("store down")

    monkeypatch.setattr(first.store, "delete", store_down)
    assert first.release() is False  # the store was down as the run ended
    assert "could not remove it (OSError)" in ended[0]
    outage: list[str] = []
    assert (tmp_path / LOCK_NAME).read_bytes() == record, "the lock is still there, naming this very pid"
    with hold_run_lock(tmp_path, log=outage.append), pytest.raises(RunLockedError, match="pid is alive on this host"):
        acquire_run_lock(tmp_path, log=pytest.fail)  # a lock this process holds now still excludes
    assert outage[0].startswith("WARNING: run lock: taking over") and "earlier run in this process" in outage[0]
    assert not (tmp_path / LOCK_NAME).exists()


def test_another_hosts_lock_is_held_until_its_heartbeat_is_stale_then_taken_over_with_a_warning(tmp_path):
    lock_file = tmp_path / LOCK_NAME
    lock_file.write_bytes(_foreign("elsewhere", 1))
    _age(lock_file, 60)
    with pytest.raises(RunLockedError, match=r"host elsewhere, pid 1, user someone.*last heartbeat 6\d s ago"):
        acquire_run_lock(tmp_path, stale_s=90, log=pytest.fail)
    _age(lock_file, 91)
    lines: list[str] = []
    lock = acquire_run_lock(tmp_path, stale_s=90, log=lines.append)
    assert lines[0].startswith("WARNING: run lock: taking over")
    assert re.search(r"no heartbeat for 9\d s \(stale after 90 s\)", lines[0]), lines
    assert json.loads(lock_file.read_text())["host"] == socket.gethostname()
    lock.release()


def test_an_unreadable_lock_counts_as_held_until_stale(tmp_path):
    (tmp_path / LOCK_NAME).write_bytes(b"{half a rec")
    with pytest.raises(RunLockedError, match="holder unreadable"):
        acquire_run_lock(tmp_path, log=pytest.fail)
    _age(tmp_path / LOCK_NAME, 1000)
    acquire_run_lock(tmp_path, log=lambda _: None).release()


def test_break_lock_takes_a_live_lock_and_the_old_holder_notices_and_leaves_it(tmp_path):
    old_lines: list[str] = []
    old = acquire_run_lock(tmp_path, heartbeat_s=0.05, log=old_lines.append)
    new_lines: list[str] = []
    new = acquire_run_lock(tmp_path, break_lock=True, log=new_lines.append)
    assert new_lines[0].startswith(f"WARNING: --break-lock: taking {tmp_path / LOCK_NAME} from host ")
    deadline = time.monotonic() + 10

    def noticed() -> bool:  # the heartbeat thread disowns the lock, then reads who holds it and logs that
        return not old.owned and any("is no longer ours" in line for line in old_lines)

    while not noticed() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert noticed(), old_lines
    assert old.release() is False  # owner check: the new holder's lock stays
    assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == new.record["token"]
    assert new.release() is True


def test_the_heartbeat_rewrites_the_lock(tmp_path):
    lock = acquire_run_lock(tmp_path, heartbeat_s=0.1, log=pytest.fail)
    first = json.loads((tmp_path / LOCK_NAME).read_text())
    time.sleep(1.3)  # heartbeat stamps have 1 s resolution
    beat = json.loads((tmp_path / LOCK_NAME).read_text())
    assert beat["heartbeat"] > first["heartbeat"] and beat["started"] == first["started"]
    assert beat["token"] == first["token"] and lock.owned
    lock.release()


@pytest.mark.parametrize("exc", [ValueError, KeyboardInterrupt])
def test_the_lock_is_released_when_the_run_fails_or_is_interrupted(tmp_path, exc):
    with pytest.raises(exc), hold_run_lock(tmp_path, log=pytest.fail):
        assert (tmp_path / LOCK_NAME).exists()
        raise exc()
    assert not (tmp_path / LOCK_NAME).exists()


def test_release_leaves_a_lock_that_is_no_longer_ours(tmp_path):
    lock = acquire_run_lock(tmp_path, log=pytest.fail)
    (tmp_path / LOCK_NAME).write_bytes(_foreign("elsewhere", 1))  # taken over behind our back
    assert lock.release() is False
    assert json.loads((tmp_path / LOCK_NAME).read_text())["host"] == "elsewhere"


def test_file_uris_lock_the_local_folder(tmp_path):
    with hold_run_lock(parse_uri(f"file://{tmp_path}/run"), log=pytest.fail):
        assert (tmp_path / "run" / LOCK_NAME).is_file()
        with pytest.raises(RunLockedError, match=f"^{tmp_path}/run is locked"):  # the same lock as the plain path
            acquire_run_lock(tmp_path / "run", log=pytest.fail)


def test_schemes_without_a_primitive_run_unlocked_with_a_warning():
    lines: list[str] = []
    assert acquire_run_lock(parse_uri("hdfs://user:pw@namenode/runs/x"), log=lines.append) is None
    assert "NOT locked" in lines[0] and "hdfs://namenode/runs/x" in lines[0] and "pw" not in lines[0]


def test_messages_show_uris_without_credentials():
    assert display(parse_uri("s3://AKIA:SeCrEt@bucket/runs/x?secret_key=k&region=eu")) == "s3://bucket/runs/x"
    assert display(parse_uri("gs://bucket/runs")) == "gs://bucket/runs"


def test_s3_without_boto3_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "boto3", None)  # import boto3 -> ImportError
    with pytest.raises(
        ConfigError, match=r"(?s)storage_path: the run lock on s3:// .*needs boto3.*pip install 'cascade-ray\[s3\]'"
    ):
        acquire_run_lock(parse_uri("s3://bucket/runs/x"), log=pytest.fail)


def test_s3_client_takes_endpoint_and_region_from_the_uri(monkeypatch):
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    client = s3_client(parse_uri("s3://bucket/runs?endpoint_override=minio:9000&scheme=http&region=eu-west-1"))
    assert client.meta.endpoint_url == "http://minio:9000" and client.meta.region_name == "eu-west-1"


# --- S3 (moto's server on loopback) ------------------------------------------------------------


def test_s3_conditional_create_refuses_a_second_lock_and_release_deletes_it(s3):
    run = parse_uri(s3.uri("locks", "run1"))
    lines: list[str] = []
    lock = acquire_run_lock(run, log=lines.append)
    assert s3.keys("locks/run1") == ["locks/run1/.lock"]
    store = S3LockStore(run)
    assert store.create(b"{}") is None, "If-None-Match: * must refuse an existing object"
    assert store.replace(b"{}", '"0123456789abcdef"') is None, "If-Match must refuse a stale ETag"
    with pytest.raises(RunLockedError) as info:
        acquire_run_lock(run, log=lines.append)
    assert f"{s3.uri('locks', 'run1')} is locked" in str(info.value) and f"pid {os.getpid()}" in str(info.value)
    body = store.read().body.decode()
    for secret in (s3.env["AWS_SECRET_ACCESS_KEY"], s3.env["AWS_ACCESS_KEY_ID"]):
        assert secret not in body + str(info.value) + "".join(lines)
    assert lock.release() is True
    assert s3.keys("locks/run1") == []


def test_s3_stale_heartbeat_is_taken_over_and_a_live_one_is_not(s3):
    run = parse_uri(s3.uri("locks", "run2"))
    store = S3LockStore(run)
    assert store.create(_foreign("elsewhere", 1)) is not None
    with pytest.raises(RunLockedError, match="host elsewhere"):
        acquire_run_lock(run, stale_s=60, log=pytest.fail)
    time.sleep(2.1)  # the server's Last-Modified and Date have 1 s resolution
    lines: list[str] = []
    lock = acquire_run_lock(run, stale_s=1, log=lines.append)
    assert lines[0].startswith("WARNING: run lock: taking over s3://cascade/locks/run2/.lock from host elsewhere")
    assert json.loads(store.read().body)["token"] == lock.record["token"]
    assert lock.release() is True and store.read() is None


def test_s3_heartbeat_and_owner_checked_release(s3):
    run = parse_uri(s3.uri("locks", "run3"))
    lock = acquire_run_lock(run, heartbeat_s=0.1, log=pytest.fail)
    first = lock.version
    time.sleep(1.3)  # the record's stamps have 1 s resolution: a new second, a new body and ETag
    assert lock.version != first and lock.owned, "the heartbeat rewrote the object (new ETag)"
    lock._stop.set()
    lock._thread.join()
    store = S3LockStore(run)
    assert store.replace(_foreign("elsewhere", 1), store.read().version)  # someone broke it
    assert lock.release() is False
    assert json.loads(store.read().body)["host"] == "elsewhere"


def test_s3_lock_with_the_endpoint_in_the_uri_only(s3, monkeypatch):
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    host = s3.endpoint.removeprefix("http://")
    run = parse_uri(f"{s3.uri('locks', 'run4')}?endpoint_override={host}&scheme=http")
    with hold_run_lock(run, log=pytest.fail):
        assert s3.keys("locks/run4") == ["locks/run4/.lock"]
    assert s3.keys("locks/run4") == []


# --- GCS (a fake bucket with generation preconditions) --------------------------------------------


class _Precondition(Exception):
    pass


class _Missing(Exception):
    pass


class _FakeBucket:
    def __init__(self):
        self.objects: dict[str, tuple[bytes, int, datetime]] = {}
        self.generations = 0

    def blob(self, key):
        return _FakeBlob(self, key)

    def get_blob(self, key):
        if key not in self.objects:
            return None
        blob = _FakeBlob(self, key)
        _, blob.generation, blob.updated = self.objects[key]
        return blob


class _FakeBlob:
    def __init__(self, bucket, key):
        self.bucket, self.key, self.generation, self.updated = bucket, key, None, None

    def _check(self, if_generation_match):
        current = self.bucket.objects.get(self.key, (b"", 0, None))[1]
        if current != if_generation_match:
            raise _Precondition(self.key)

    def upload_from_string(self, body, content_type, if_generation_match):
        self._check(if_generation_match)
        self.bucket.generations += 1
        self.generation = self.bucket.generations
        self.bucket.objects[self.key] = (body, self.generation, datetime.now(timezone.utc))

    def download_as_bytes(self, if_generation_match):
        self._check(if_generation_match)
        return self.bucket.objects[self.key][0]

    def delete(self, if_generation_match):
        if self.key not in self.bucket.objects:
            raise _Missing(self.key)
        self._check(if_generation_match)
        del self.bucket.objects[self.key]


def test_gcs_lock_by_generation_preconditions():
    run = parse_uri("gs://bucket/runs/x")
    bucket = _FakeBucket()
    store = GcsLockStore(run, bucket=bucket, errors=(_Precondition, _Missing))
    lock = acquire_run_lock(run, store=store, log=pytest.fail)
    assert "runs/x/.lock" in bucket.objects
    with pytest.raises(RunLockedError, match="gs://bucket/runs/x is locked"):
        acquire_run_lock(run, store=store, log=pytest.fail)
    body, generation, updated = bucket.objects["runs/x/.lock"]
    bucket.objects["runs/x/.lock"] = (body, generation, updated - timedelta(seconds=500))
    lines: list[str] = []
    taker = acquire_run_lock(run, store=store, log=lines.append)  # the same pid and host, but 500 s silent
    assert "no heartbeat for 500 s" in lines[0]
    assert lock.release() is False  # its generation is gone
    assert taker.release() is True and not bucket.objects


def test_gcs_without_the_library_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "google.cloud", None)
    monkeypatch.setitem(sys.modules, "google.api_core.exceptions", None)
    with pytest.raises(ConfigError, match="pip install google-cloud-storage"):
        acquire_run_lock(parse_uri("gs://bucket/runs/x"), log=pytest.fail)


def test_local_store_falls_back_to_exclusive_create_without_hard_links(tmp_path, monkeypatch):
    def no_link(*_):
        raise PermissionError("no hard links here")

    monkeypatch.setattr(os, "link", no_link)
    store = LocalLockStore(tmp_path)
    assert store.create(b"one") is not None
    assert store.create(b"two") is None
    assert (tmp_path / LOCK_NAME).read_bytes() == b"one"
    assert not list(tmp_path.glob("*.tmp"))
