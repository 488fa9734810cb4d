"""A real multi-node Ray cluster on this machine: ``cluster/local_head.sh start --num-cpus 0`` and
two ``add-node --num-cpus 1`` worker nodes (loopback, token auth), every run submitted with
``ray job submit`` and all storage on the S3 fixture (its endpoint and keys reach the job only
through ``--runtime-env-json``; the nodes are started without them).

- the debug pipeline with the encoder on 2 workers and ``placement_strategy: STRICT_SPREAD``:
  ``summary.json`` shows one worker on each worker node, and the feature caches computed by Ray
  tasks on the worker nodes (``feature_cache.nodes``);
- the same config again, one worker node SIGKILLed (all its processes, by PID) once the encoder
  has reported an epoch, a fresh node added: the stage restarts (``max_failures: 1``) and every
  stage ends with the digests of the uninterrupted run;
- a 2-trial Tune sweep of the encoder whose trials' workers ran on the two different nodes.

About 5 minutes on 2 cores (slow: run it with ``pytest -m slow tests/e2e/test_multinode.py``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from paths import ROOT

pytestmark = pytest.mark.slow

HEAD_SCRIPT = ROOT / "cluster" / "local_head.sh"
BIN = Path(sys.executable).parent
ENCODER_EPOCHS = 10  # long enough (~1 s an epoch) to kill a node in the middle of the stage
# one config for the reference run and the node-kill run: the stage fingerprints match
OVERRIDES = [
    "stages.encoder.scaling.placement_strategy=STRICT_SPREAD",
    "stages.encoder.max_failures=1",
    f"stages.encoder.train.epochs={ENCODER_EPOCHS}",
    "stages.encoder.train.batch_size=8",
]
JOB_TIMEOUT_S = 420


@dataclass
class Cluster:
    state_dir: Path
    env: dict[str, str]  # a client's environment: the head's exports, no AWS keys
    runtime_env: str  # --runtime-env-json: the S3 endpoint and keys for the job's processes

    def node_ids(self) -> dict[str, str]:
        """name -> Ray node id of every node added and still recorded."""
        return {f.stem: _env_file(f)["NODE_ID"] for f in sorted((self.state_dir / "nodes").glob("*.env"))}

    def script(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        return _run(["bash", HEAD_SCRIPT, *args, "--state-dir", self.state_dir], self.env, timeout)


def _env_file(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


def _run(args, env, timeout, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd)


def _sessions_alive(sessions: set[int]) -> list[int]:
    """PIDs of live (not zombie) processes in any of `sessions`."""
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) in sessions:
            alive.append(int(pid))
    return alive


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, s3):
    state_dir = Path(tmp_path_factory.mktemp("multinode-head"))
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE")
        and not k.startswith("AWS_")
    }
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    sessions: set[int] = set()
    temp_dirs: list[str] = []
    try:
        started = _run(["bash", HEAD_SCRIPT, "start", "--num-cpus", "0", "--state-dir", state_dir], env, timeout=180)
        assert started.returncode == 0, started.stderr[-3000:]
        exports = dict(re.findall(r"^export (\w+)=(\S+)$", started.stdout, re.M))
        head = _env_file(state_dir / "head.env")
        sessions.add(int(head["SESSION_ID"]))
        temp_dirs.append(head["TEMP_DIR"])
        made = Cluster(state_dir, env | exports, json.dumps({"env_vars": s3.env}))
        for expected in ("node-1", "node-2"):
            added = made.script("add-node", "--num-cpus", "1")
            assert added.returncode == 0 and added.stdout.strip() == expected, added.stderr[-3000:]
        for record in (state_dir / "nodes").glob("*.env"):
            node = _env_file(record)
            assert re.fullmatch(r"[0-9a-f]{56}", node["NODE_ID"]), node
            sessions.add(int(node["NODE_SESSION_ID"]))
            temp_dirs.append(node["NODE_TEMP_DIR"])
            assert node["NODE_TEMP_DIR"] != head["TEMP_DIR"]  # each node its own (short) temp dir
        status = made.script("status", timeout=60)
        assert status.returncode == 0 and len(re.findall(r"^node-\d: running: ", status.stdout, re.M)) == 2, (
            status.stdout
        )
        yield made
    finally:
        for record in (state_dir / "nodes").glob("*.env"):  # nodes added by the tests too
            node = _env_file(record)
            sessions.add(int(node["NODE_SESSION_ID"]))
            temp_dirs.append(node["NODE_TEMP_DIR"])
        stopped = _run(["bash", HEAD_SCRIPT, "stop", "--state-dir", state_dir], env, timeout=180)
        assert stopped.returncode == 0, stopped.stderr
        assert not _sessions_alive(sessions), "processes of the head or its nodes outlived `stop`"
        assert not [d for d in temp_dirs if Path(d).exists()], "stop removes the head's and nodes' temp dirs"
        assert not list((state_dir / "nodes").glob("*.env")) and not (state_dir / "head.env").exists()


def _submit(cluster: Cluster, entry: list[str], *, wait: bool = True) -> tuple[str, subprocess.CompletedProcess]:
    job_id = f"cascade-multinode-{uuid.uuid4().hex[:8]}"
    args = [BIN / "ray", "job", "submit", "--submission-id", job_id, "--working-dir", "."]
    args += ["--runtime-env-json", cluster.runtime_env, *([] if wait else ["--no-wait"]), "--", *entry]
    return job_id, _run(args, cluster.env, timeout=JOB_TIMEOUT_S + 60)


def _job_status(cluster: Cluster, job_id: str) -> str:
    """PENDING, RUNNING, SUCCEEDED, FAILED, STOPPED (as `ray job status` words them), else UNKNOWN."""
    out = _run([BIN / "ray", "job", "status", job_id], cluster.env, timeout=60)
    text = re.sub(r"\x1b\[[0-9;]*m", "", out.stdout + out.stderr)
    ended = re.search(rf"Job '{job_id}' (succeeded|failed|was stopped)", text)
    if ended:
        return {"succeeded": "SUCCEEDED", "failed": "FAILED", "was stopped": "STOPPED"}[ended.group(1)]
    found = re.search(rf"Status for job '{job_id}': (\w+)", text)
    return found.group(1) if found else "UNKNOWN"


def _job_logs(cluster: Cluster, job_id: str) -> str:
    return _run([BIN / "ray", "job", "logs", job_id], cluster.env, timeout=60).stdout


def _pipeline(storage: str) -> list[str]:
    return ["python", "pipelines/three_stage.py", "--config", "pipelines/configs/debug.yaml", f"storage_path={storage}"]


def _read(s3, key: str) -> bytes:
    with s3.filesystem().open_input_stream(f"{s3.bucket}/{key}") as f:
        return f.read()


@pytest.fixture(scope="module")
def reference(cluster, s3):
    """The uninterrupted run of the node-kill test's config (also the STRICT_SPREAD run)."""
    job_id, done = _submit(cluster, [*_pipeline(s3.uri("multinode", "reference")), *OVERRIDES])
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    logs = _job_logs(cluster, job_id)
    assert re.search(r"^test_accuracy=\d\.\d{4} summary=s3://", logs, re.M), logs[-3000:]
    return json.loads(_read(s3, "multinode/reference/debug/summary.json"))


def test_strict_spread_stage_runs_on_both_worker_nodes_and_tasks_compute_the_feature_cache_there(
    cluster, reference, s3
):
    workers = set(cluster.node_ids().values())
    assert len(workers) == 2
    features, encoder, classifier = reference["stages"]
    # one entry per rank; STRICT_SPREAD: the two ranks on the two worker nodes
    assert encoder["num_workers"] == 2 and sorted(encoder["nodes"]) == sorted(workers), encoder["nodes"]
    assert len(features["nodes"]) == 1 and set(features["nodes"]) <= workers  # the head has no CPU
    assert len(classifier["nodes"]) == 1 and set(classifier["nodes"]) <= workers
    # more than one node: the caches are computed by Ray tasks (one per worker of the stage), not
    # the driver (on the head), and the tasks ran on the worker nodes
    for stage in (encoder, classifier):
        cache = stage["feature_cache"]
        assert cache["status"] == "computed" and cache["path"].startswith("s3://"), cache
        assert len(cache["nodes"]) == stage["num_workers"] and set(cache["nodes"]) <= workers, cache
    # everything in the bucket: artifacts, Ray Train checkpoints, the feature cache, the summary
    keys = s3.keys("multinode/reference/debug")
    for stage in ("features", "encoder", "classifier"):
        assert f"multinode/reference/debug/stages/{stage}/weights.safetensors" in keys
    assert any(k.endswith(".parquet") and "/cache/encoder/" in k for k in keys)
    assert any(re.search(r"/ray/01-encoder-[0-9a-f]{12}-a1/checkpoint_[^/]+/nodes\.json$", k) for k in keys)
    assert reference["storage"] == s3.uri("multinode", "reference", "debug")


def test_resume_report_and_export_of_the_cluster_run_on_s3(cluster, reference, s3):
    """The rest of a user's day with that run: `--resume` as a job reuses every stage from the
    bucket; `cascade-ray report` / `export` take its URI (they run here, reading the bucket)."""
    job_id, done = _submit(cluster, [*_pipeline(s3.uri("multinode", "reference")), *OVERRIDES, "--resume"])
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    summary = json.loads(_read(s3, "multinode/reference/debug/summary.json"))
    assert [st["status"] for st in summary["stages"]] == ["reused"] * 3
    assert summary["test_accuracy"] == reference["test_accuracy"]
    run = s3.uri("multinode", "reference", "debug")
    tool_env = cluster.env | s3.env  # the user's shell: the bucket's endpoint and keys
    report = _run([BIN / "cascade-ray", "report", run], tool_env, timeout=300)
    assert report.returncode == 0 and report.stdout.strip() == f"{run}/report/report.md", report.stderr[-3000:]
    export = _run([BIN / "cascade-ray", "export", run], tool_env, timeout=300)
    assert export.returncode == 0, export.stderr[-3000:]
    assert json.loads(export.stdout)["path"] == f"{run}/export/model.pt2"
    keys = s3.keys("multinode/reference/debug")
    assert {"multinode/reference/debug/report/confusion.png", "multinode/reference/debug/export/model.pt2"} <= set(keys)


def _latest_encoder_epoch(s3, prefix: str) -> tuple[int, list[str]]:
    """(epoch of the encoder's newest stored checkpoint, its ranks' nodes); (0, []) before the first."""
    states = [k for k in s3.keys(prefix) if re.search(r"/ray/01-encoder-[^/]+/checkpoint_[^/]+/train_state\.json$", k)]
    if not states:
        return 0, []
    newest = max(states)  # checkpoint_<timestamp>: the newest sorts last
    try:
        epoch = int(json.loads(_read(s3, newest))["epoch"])
        nodes = json.loads(_read(s3, newest.replace("train_state.json", "nodes.json")))
    except (OSError, ValueError, KeyError):
        return 0, []  # written while we read
    return epoch, nodes


def test_a_worker_node_killed_mid_stage_restarts_the_stage_on_a_new_node_with_the_same_weights(cluster, reference, s3):
    prefix = "multinode/node-kill/debug"
    job_id, submitted = _submit(cluster, [*_pipeline(s3.uri("multinode", "node-kill")), *OVERRIDES], wait=False)
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    before = cluster.node_ids()
    # wait (bounded) for the encoder's first reported epoch in storage
    deadline = time.monotonic() + JOB_TIMEOUT_S
    epoch, nodes = 0, []
    while time.monotonic() < deadline:
        epoch, nodes = _latest_encoder_epoch(s3, prefix)
        if epoch >= 1:
            break
        assert _job_status(cluster, job_id) in ("PENDING", "RUNNING"), _job_logs(cluster, job_id)[-4000:]
        time.sleep(0.3)
    assert 1 <= epoch < ENCODER_EPOCHS, f"no encoder epoch seen before the end (epoch {epoch}); lengthen the stage"
    assert f"{prefix}/stages/encoder/manifest.json" not in s3.keys(prefix)
    assert sorted(nodes) == sorted(before.values())  # a rank on each worker node: either kill hits one

    killed = cluster.script("stop-node", "node-1", "--kill", timeout=60)  # SIGKILL every process of the node
    assert killed.returncode == 0, killed.stderr
    assert "killing node node-1" in killed.stderr
    added = cluster.script("add-node", "--num-cpus", "1")  # a replacement joins, as an autoscaler would add one
    assert added.returncode == 0, added.stderr[-3000:]
    after = cluster.node_ids()
    assert before["node-1"] not in after.values() and len(after) == 2

    while time.monotonic() < deadline and (state := _job_status(cluster, job_id)) in ("PENDING", "RUNNING"):
        time.sleep(2)
    logs = _job_logs(cluster, job_id)
    assert state == "SUCCEEDED", logs[-5000:]
    summary = json.loads(_read(s3, f"{prefix}/summary.json"))
    # the killed rank's epochs were trained again by the restarted group, to the same bits
    assert [s["digest"] for s in summary["stages"]] == [s["digest"] for s in reference["stages"]]
    assert summary["test_accuracy"] == reference["test_accuracy"]
    encoder = summary["stages"][1]
    assert len(encoder["history"]) == ENCODER_EPOCHS
    # the stages after the kill ran on the nodes alive then
    assert set(summary["stages"][2]["nodes"]) <= set(after.values())
    assert set(summary["stages"][2]["feature_cache"]["nodes"]) <= set(after.values())


def test_tune_trials_of_one_sweep_run_on_different_nodes(cluster, s3, tmp_path):
    space = tmp_path / "encoder.yaml"
    space.write_text(
        "stage: encoder\nmetric: val_accuracy\nmode: max\nnum_samples: 1\nsearch: grid\n"
        "scheduler: {type: fifo}\nspace:\n  solver.lr: {grid: [1.0e-2, 3.0e-3]}\n"
    )
    storage = s3.uri("multinode", "tune")
    entry = ["python", "-m", "cascade_ray.cli", "tune", "pipelines/configs/debug.yaml", "--space", str(space)]
    # one worker per trial: the two trials (one per CPU) run at once, one on each 1-CPU node
    job_id, done = _submit(cluster, [*entry, f"storage_path={storage}", "stages.encoder.scaling.num_workers=1"])
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    found = [k for k in s3.keys("multinode/tune/debug/tune/encoder/trials") if k.endswith("/nodes.json")]
    per_trial = {k.split("/trials/")[1].split("/")[0]: json.loads(_read(s3, k)) for k in found}
    assert len(per_trial) == 2, found
    assert all(len(nodes) == 1 for nodes in per_trial.values())
    assert sorted(n for nodes in per_trial.values() for n in nodes) == sorted(cluster.node_ids().values()), per_trial
