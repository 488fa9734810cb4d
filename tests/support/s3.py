"""A real S3 API on loopback for the tests: moto's standalone server, started and stopped by PID.

``start_s3()`` runs ``moto_server -H 127.0.0.1 -p PORT`` (the one next to this Python), waits
for it to answer, and creates a bucket. ``S3Server.env`` is what a driver and Ray workers
need to reach it (pyarrow and boto honour ``AWS_ENDPOINT_URL``); ``S3Server.uri("a", "b")``
is ``s3://<bucket>/a/b``. Nothing leaves 127.0.0.1: the EC2 metadata lookup is disabled.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MOTO = Path(sys.executable).parent / "moto_server"
START_TIMEOUT_S = 60.0


@dataclass
class S3Server:
    endpoint: str
    bucket: str
    proc: subprocess.Popen
    log: Path

    @property
    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "cascade-test-key",
            "AWS_SECRET_ACCESS_KEY": "cascade-test-secret-do-not-log",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def uri(self, *parts: str) -> str:
        return "/".join([f"s3://{self.bucket}", *(p.strip("/") for p in parts)])

    def filesystem(self):
        import pyarrow.fs as pafs

        return pafs.S3FileSystem(
            endpoint_override=self.endpoint,
            scheme="http",
            access_key=self.env["AWS_ACCESS_KEY_ID"],
            secret_key=self.env["AWS_SECRET_ACCESS_KEY"],
            region="us-east-1",
            allow_bucket_creation=True,
        )

    def keys(self, prefix: str = "") -> list[str]:
        """Every object key under ``<bucket>/<prefix>``."""
        import pyarrow.fs as pafs

        base = f"{self.bucket}/{prefix.strip('/')}".rstrip("/")
        infos = self.filesystem().get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
        return sorted(i.path[len(self.bucket) + 1 :] for i in infos if i.type == pafs.FileType.File)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_s3(log_dir: Path, bucket: str = "cascade", port: int | None = None) -> S3Server:
    """moto's S3 server on a free loopback port (or `port`, e.g. to restart one) with `bucket` created."""
    if not MOTO.exists():
        raise RuntimeError(f"{MOTO} is missing: pip install 'moto[server]' (the test extra has it)")
    port = port or _free_port()
    log = log_dir / "moto.log"
    proc = subprocess.Popen(
        [str(MOTO), "-H", "127.0.0.1", "-p", str(port)],
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "AWS_EC2_METADATA_DISABLED": "true"},
    )
    server = S3Server(f"http://127.0.0.1:{port}", bucket, proc, log)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"moto_server exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            urllib.request.urlopen(f"{server.endpoint}/", timeout=2).close()
            break
        except urllib.error.HTTPError:
            break  # it answers
        except OSError:
            if time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(
                    f"moto_server did not answer on {server.endpoint} within {START_TIMEOUT_S:.0f} s"
                ) from None
            time.sleep(0.2)
    server.filesystem().create_dir(bucket)
    return server


@contextlib.contextmanager
def s3_in_env(log_dir: Path) -> Iterator[S3Server]:
    """A started server whose endpoint and keys are in this process's environment while the block
    runs (restored afterwards), where pyarrow, boto and Ray sessions started inside pick them up."""
    server = start_s3(log_dir)
    saved = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)
    try:
        yield server
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.stop()
