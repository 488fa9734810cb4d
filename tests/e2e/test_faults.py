"""Faults from outside the training code, each run and its outcome asserted.

Every case asserts one of "the error names the stage/file/URI (and the fix)" or "recovered with
equal results", and "nothing lost": the earlier stage's artifact is byte-identical afterwards
and a resume finishes. ``FAULT_CASES`` holds the cases of this module; the faults covered
elsewhere are listed here so the whole matrix can be counted:

=========================================  ===================================================================
fault                                      test
=========================================  ===================================================================
worker killed mid-stage (restart)          tests/integration/test_pipeline.py::test_a_crashed_worker_resumes_from_its_checkpoint_bit_identically
worker node killed mid-stage               tests/e2e/test_multinode.py::test_a_worker_node_killed_mid_stage_restarts_the_stage_on_a_new_node_with_the_same_weights
driver killed mid-stage                    tests/e2e/test_resume.py::test_a_driver_killed_mid_stage_resumes_that_stage_and_ends_bit_identical
driver killed between stages               tests/e2e/test_scripts.py::test_driver_killed_after_stage_one_resumes_to_the_same_result
Tune trial's worker killed mid-sweep       test_fault[tune_trial_worker_killed]
object-store server restarted mid-run      test_fault[object_store_restarted]
storage full (a 32 MB tmpfs)               test_fault[storage_full]
stage OOM-killed (SIGKILL)                 test_fault[stage_oom_killed]
=========================================  ===================================================================

How the faults are made: one Ray (2 CPUs) for the module; a two-stage cascade on digits, one
epoch per stage; the second stage is ``user_models:fault_probe``, which at its 5th training step
either SIGKILLs its own worker process (``kill_flag``: what the kernel's OOM killer does; no real
allocation, so the test is fast and cannot take the CI machine down) or writes its pid and waits
(``pause_flag``) while the test does the fault: SIGKILLs that process by pid, restarts the S3
server, or fills the storage. Each case starts from a copy of the reference run's first stage
(``resume``: reused), so only the faulted stage is trained. The tmpfs needs root (``mount``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from paths import ROOT

from cascade_ray.api import RunOptions, run_pipeline
from cascade_ray.checks import load_config
from cascade_ray.errors import CascadeError

pytestmark = pytest.mark.slow

SUPPORT = str(ROOT / "tests" / "support")
WAIT_S = 120.0  # the longest any fault waits for the stage to reach its step
TMPFS_MB = 32
OUTAGE_S = 3.0  # the S3 server is down at least this long

CONFIG = """
name: faults
seed: 0
storage_path: /unused
trusted_modules: [user_models]
data: {{source: digits, val_fraction: 0.2}}
stages:
  - name: features
    model: {{type: mlp, in_features: 64, hidden: [32], pool: flatten}}
    solver: {{type: Adam, lr: 1.0e-2}}
    train: {{epochs: 1, batch_size: 64}}
  - name: head
    model: {{type: "user_models:fault_probe", in_features: 32, width: 16, kill_flag: "{kill}", pause_flag: "{pause}"}}
    solver: {{type: Adam, lr: 1.0e-2}}
    train: {{epochs: 1, batch_size: 64}}
"""

SPACE = """
stage: head
metric: val_accuracy
mode: max
num_samples: 1
scheduler: {type: fifo}
space:
  solver.lr: {choice: [1.0e-2]}
"""


class Flags:
    """The probe's flag files (fixed paths: they are in the config, so every run has one fingerprint)."""

    def __init__(self, folder: Path):
        self.kill, self.pause = folder / "kill", folder / "pause"
        self.pid, self.go = folder / "pause.pid", folder / "pause.go"

    def clear(self) -> None:
        for path in (self.kill, self.pause, self.pid, self.go):
            path.unlink(missing_ok=True)


class OnPause(threading.Thread):
    """Once the probe pauses: run `fault(pid)`, then let the probe go on. Bounded by ``WAIT_S``."""

    def __init__(self, flags: Flags, fault: Callable[[int], None]):
        super().__init__(daemon=True)
        self.flags, self.fault, self.error, self.done_at = flags, fault, None, None
        flags.pause.write_text("armed\n")
        self.start()

    def run(self) -> None:
        deadline = time.monotonic() + WAIT_S
        while not self.flags.pid.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        try:
            if not self.flags.pid.exists():
                raise TimeoutError(f"the probe never paused within {WAIT_S:.0f} s")
            time.sleep(0.1)  # the pid is written in one call; let it land
            self.fault(int(self.flags.pid.read_text()))
            self.done_at = time.monotonic()
        except BaseException as exc:  # noqa: BLE001 - reported by finish()
            self.error = exc
        finally:
            self.flags.go.write_text("go\n")

    def finish(self) -> float:
        self.join(timeout=WAIT_S)
        assert not self.is_alive(), "the fault thread did not end"
        if self.error is not None:
            raise self.error
        assert self.done_at is not None, "the fault was not done"
        return self.done_at


def _tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


def _same_result(summary, reference) -> None:
    """Same config, seed, data and upstream on CPU: the same weights and test accuracy."""
    assert summary["test_accuracy"] == reference["test_accuracy"]
    assert [s["digest"] for s in summary["stages"]] == [s["digest"] for s in reference["stages"]]


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    """This module's own moto server (it is restarted here, so not the session's), env set before Ray."""
    from s3 import s3_in_env

    with s3_in_env(tmp_path_factory.mktemp("moto")) as server:
        yield server


@pytest.fixture(scope="module")
def cluster(s3_server):
    """One Ray for every case; workers import tests/support and reach the S3 server."""
    import ray

    from cascade_ray.constants import apply_ray_env_defaults
    from cascade_ray.pipeline.ray_token import ensure_private_token

    env = apply_ray_env_defaults()
    path = os.pathsep.join(filter(None, [SUPPORT, os.environ.get("PYTHONPATH")]))
    ensure_private_token()
    ray.init(num_cpus=2, runtime_env={"env_vars": env | s3_server.env | {"PYTHONPATH": path}})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def setup(cluster, tmp_path_factory):
    """The flags, a config maker and the reference run (uninterrupted) with its first stage's files."""
    tmp = tmp_path_factory.mktemp("faults")
    flags = Flags(tmp)
    config = tmp / "faults.yaml"
    config.write_text(CONFIG.format(kill=flags.kill, pause=flags.pause))

    def make(storage: str, *overrides: str):
        return load_config(config, [f"storage_path={storage}", *overrides])

    started = time.perf_counter()
    reference = run_pipeline(make(str(tmp / "reference")), log=lambda _: None).summary
    print(f"reference run: {time.perf_counter() - started:.1f} s")
    features = tmp / "reference" / "faults" / "stages" / "features"
    return flags, make, reference, features, tmp


def _seed_local(features: Path, storage: Path) -> Path:
    """`storage` holding a copy of the reference's first stage; its stage folder."""
    target = storage / "faults" / "stages" / "features"
    shutil.copytree(features, target)
    return target


def _quiet(_: str) -> None:
    pass


def _case_stage_oom_killed(setup, request) -> None:
    flags, make, reference, features, tmp = setup
    storage = tmp / "oom"
    kept = _seed_local(features, storage)
    flags.kill.write_text("armed\n")
    cfg = make(str(storage))
    with pytest.raises(CascadeError) as err:
        run_pipeline(cfg, RunOptions(resume=True), log=_quiet)
    message = str(err.value)
    assert not flags.kill.exists(), "the probe SIGKILLed its worker"
    assert "stage 'head'" in message and "out-of-memory" in message, message
    assert "stages[1].train.batch_size" in message and "memory" in message, message
    assert _tree_digest(kept) == _tree_digest(features), "the first stage's artifact is untouched"
    resumed = run_pipeline(cfg, RunOptions(resume=True), log=_quiet).summary
    assert [s["status"] for s in resumed["stages"]] == ["reused", "trained"]
    _same_result(resumed, reference)


def _case_storage_full(setup, request) -> None:
    flags, make, reference, features, tmp = setup
    mount = tmp / "full"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_MB}m", "tmpfs", str(mount)], check=True, timeout=30)
    request.addfinalizer(lambda: subprocess.run(["umount", "-l", str(mount)], check=False, timeout=30))
    kept = _seed_local(features, mount)
    ballast = mount / "ballast"

    def fill(_pid: int) -> None:
        with ballast.open("wb") as f:
            for _ in range(TMPFS_MB + 8):  # bounded: the tmpfs is TMPFS_MB large
                try:
                    f.write(b"\0" * 2**20)
                    f.flush()
                except OSError:
                    break
        assert shutil.disk_usage(mount).free < 2**16, "the tmpfs is full"

    cfg = make(str(mount))
    fault = OnPause(flags, fill)
    with pytest.raises(CascadeError) as err:
        run_pipeline(cfg, RunOptions(resume=True), log=_quiet)
    fault.finish()
    message = str(err.value)
    assert "stage 'head'" in message and "no space left" in message.lower(), message
    assert str(mount) in message, message
    assert _tree_digest(kept) == _tree_digest(features), "the first stage's artifact is untouched"
    ballast.unlink()  # space freed: the run resumes
    resumed = run_pipeline(cfg, RunOptions(resume=True), log=_quiet).summary
    assert [s["status"] for s in resumed["stages"]] == ["reused", "trained"]
    _same_result(resumed, reference)


def _case_object_store_restarted(setup, request) -> None:
    import pyarrow.fs as pafs
    from s3 import start_s3

    flags, make, reference, features, tmp = setup
    server = request.getfixturevalue("s3_server")
    prefix = "restart"
    pafs.copy_files(
        str(features), f"{server.bucket}/{prefix}/faults/stages/features", destination_filesystem=server.filesystem()
    )
    kept = {k: v for k, v in _objects(server).items() if "/stages/features/" in k}
    outage = {}

    def restart(_pid: int) -> None:
        # moto keeps objects in memory: copied out and back, so this is a restart of a durable server
        objects = _objects(server)
        started, outage["down"] = time.monotonic(), time.strftime("%H:%M:%S")
        server.stop()
        flags.go.write_text("go\n")  # the stage runs on into the outage: its checkpoint upload meets it
        time.sleep(OUTAGE_S)
        fresh = start_s3(server.log.parent, bucket=server.bucket, port=int(server.endpoint.rsplit(":", 1)[1]))
        server.proc = fresh.proc
        fs = server.filesystem()
        for key, data in objects.items():
            with fs.open_output_stream(f"{server.bucket}/{key}") as out:
                out.write(data)
        outage["s"], outage["up"] = time.monotonic() - started, time.strftime("%H:%M:%S")

    uri = server.uri(prefix)
    cfg = make(uri)
    fault = OnPause(flags, restart)
    try:
        summary = run_pipeline(cfg, RunOptions(resume=True), log=_quiet).summary
        outcome = "finished"
    except CascadeError as exc:  # the other honest outcome: the error names the run's URI
        assert uri in str(exc), str(exc)
        outcome = f"failed: {str(exc)[:200]}"
        summary = None
    fault.finish()
    print(f"object-store restart: down {outage['down']}-{outage['up']} ({outage['s']:.1f} s), run {outcome}")
    assert {k: v for k, v in _objects(server).items() if k in kept} == kept, "the first stage's objects are intact"
    if summary is None:
        summary = run_pipeline(cfg, RunOptions(resume=True), log=_quiet).summary
    assert [s["status"] for s in summary["stages"]] == ["reused", "trained"]
    _same_result(summary, reference)


def _objects(server) -> dict[str, bytes]:
    fs = server.filesystem()
    out = {}
    for key in server.keys():  # noqa: SIM118 - S3Server.keys() lists the bucket, it is no dict
        with fs.open_input_stream(f"{server.bucket}/{key}") as f:
            out[key] = f.read()
    return out


def _case_tune_trial_worker_killed(setup, request) -> None:
    flags, make, reference, features, tmp = setup
    storage = tmp / "tune"
    kept = _seed_local(features, storage)
    space = tmp / "head.yaml"
    space.write_text(SPACE)
    killed = {}

    def kill(pid: int) -> None:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert cmdline.startswith(b"ray::"), f"{pid} is a Ray worker: {cmdline[:80]!r}"
        os.kill(pid, signal.SIGKILL)
        killed["pid"] = pid

    # max_failures=1: Ray Train restarts the trial's worker group (from its last checkpoint)
    cfg = make(str(storage), "stages.head.max_failures=1")
    fault = OnPause(flags, kill)
    summary = run_pipeline(
        cfg, RunOptions(resume=True, spaces=(("head", str(space)),), stop_after="head"), log=_quiet
    ).summary
    fault.finish()
    assert not Path(f"/proc/{killed['pid']}").exists(), "the trial's worker was killed"
    head = summary["stages"][1]
    assert [s["status"] for s in summary["stages"]][0] == "reused"
    assert head["name"] == "head" and head["metrics"]["epoch"] == 1, head
    assert _tree_digest(kept) == _tree_digest(features), "the first stage's artifact is untouched"
    assert (storage / "faults" / "stages" / "head" / "manifest.json").is_file(), "the tuned stage was adopted"


FAULT_CASES: dict[str, Callable] = {
    "tune_trial_worker_killed": _case_tune_trial_worker_killed,
    "object_store_restarted": _case_object_store_restarted,
    "storage_full": _case_storage_full,
    "stage_oom_killed": _case_stage_oom_killed,
}


@pytest.mark.parametrize("case", FAULT_CASES)
def test_fault(case, setup, request):
    flags = setup[0]
    flags.clear()
    started = time.perf_counter()
    try:
        FAULT_CASES[case](setup, request)
    finally:
        flags.clear()
        print(f"{case}: {time.perf_counter() - started:.1f} s")
