"""cluster/: the cluster-launcher YAML (checked with Ray's own schema) and the KubeRay RayJob
manifest parse, have a head and an autoscaling GPU group, turn token auth on, install the
package, and run a pipeline command whose script, config and overrides are valid here."""

from __future__ import annotations

import copy
import re
import shlex
from pathlib import Path

import pytest
import yaml
from paths import ROOT

from cascade_ray.checks import load_config

LAUNCHER = ROOT / "cluster" / "launcher-aws.yaml"
RAYJOB = ROOT / "cluster" / "kuberay-rayjob.yaml"


def _check_pipeline_command(argv: list[str]) -> None:
    """`python pipelines/three_stage.py --config X key=value...`: files exist, config + overrides validate."""
    assert argv[:2] == ["python", "pipelines/three_stage.py"], argv
    assert (ROOT / argv[1]).is_file()
    config = argv[argv.index("--config") + 1]
    assert (ROOT / config).is_file(), config
    overrides = [a for a in argv[2:] if "=" in a]
    cfg = load_config(ROOT / config, overrides)
    assert cfg.storage_path.startswith("s3://"), "a cluster run writes to shared storage"
    assert all(s.scaling.use_gpu is True for s in cfg.stages), "GPU workers start at zero: the stages ask for GPUs"


@pytest.fixture(scope="module")
def launcher():
    return yaml.safe_load(LAUNCHER.read_text())


def test_launcher_config_passes_rays_own_schema(launcher):
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(copy.deepcopy(launcher)))


def test_launcher_has_a_head_and_an_autoscaling_gpu_group(launcher):
    types = launcher["available_node_types"]
    assert launcher["head_node_type"] in types
    gpu = [
        t
        for name, t in types.items()
        if name != launcher["head_node_type"] and t["node_config"]["InstanceType"].startswith(("g", "p"))
    ]
    assert len(gpu) == 1 and gpu[0]["min_workers"] < gpu[0]["max_workers"] <= launcher["max_workers"]


def test_launcher_installs_the_package_and_turns_token_auth_on(launcher):
    assert launcher["file_mounts"]["~/cascade-ray"] == "."
    assert launcher["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    assert any("pip install" in c and "-e ~/cascade-ray" in c for c in launcher["setup_commands"])
    assert any('"ray[default' in c for c in launcher["setup_commands"]), "job submission needs ray[default]"
    head_start = " ".join(launcher["head_start_ray_commands"])
    assert "RAY_AUTH_MODE=token ray start --head" in head_start and "--dashboard-host=127.0.0.1" in head_start
    assert "RAY_AUTH_MODE=token ray start --address" in " ".join(launcher["worker_start_ray_commands"])
    fetch = " ".join(launcher["head_setup_commands"])
    assert (
        "cluster/fetch_fashion_mnist.sh ~/fashion-mnist" in fetch
        and (ROOT / "cluster" / "fetch_fashion_mnist.sh").is_file()
    )


def test_launcher_usage_comment_submits_a_valid_pipeline_command():
    header = "\n".join(line[2:] for line in LAUNCHER.read_text().splitlines() if line.startswith("# "))
    command = re.search(
        r"ray job submit --working-dir \. -- (python pipelines/.*?)\n\s*ray down", header.replace("\\\n", " "), re.S
    )
    assert command, "the header shows the ray job submit line"
    argv = shlex.split(command.group(1))
    _check_pipeline_command(argv)
    assert any(a == "data.root=/home/ubuntu/fashion-mnist" for a in argv), "the head's fetched copy (ssh_user ubuntu)"


@pytest.fixture(scope="module")
def rayjob():
    return yaml.safe_load(RAYJOB.read_text())


def test_rayjob_entrypoint_is_the_pipeline_in_this_repo(rayjob):
    assert (rayjob["apiVersion"], rayjob["kind"]) == ("ray.io/v1", "RayJob")
    steps = [shlex.split(part) for part in rayjob["spec"]["entrypoint"].split("&&")]
    assert steps[0][:2] == ["bash", "cluster/fetch_fashion_mnist.sh"] and (ROOT / steps[0][1]).is_file()
    _check_pipeline_command(steps[-1])
    assert f"data.root={steps[0][2]}" in steps[-1], "the pipeline reads the data the first step fetched"


def test_rayjob_runtime_env_and_lifecycle(rayjob):
    spec = rayjob["spec"]
    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert set(runtime_env) == {"working_dir", "pip", "env_vars"}
    assert any(p.startswith("torch") for p in runtime_env["pip"])
    from cascade_ray.constants import RAY_ENV_DEFAULTS

    assert runtime_env["env_vars"] == RAY_ENV_DEFAULTS, "the job gets the same env knobs as an embedded run"
    assert spec["shutdownAfterJobFinishes"] is True


def test_rayjob_cluster_has_token_auth_a_head_and_an_autoscaling_gpu_group(rayjob):
    cluster = rayjob["spec"]["rayClusterSpec"]
    assert cluster["authOptions"] == {"mode": "token"} and cluster["enableInTreeAutoscaling"] is True
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    images = {head["image"]}
    (gpu,) = cluster["workerGroupSpecs"]
    container = gpu["template"]["spec"]["containers"][0]
    images.add(container["image"])
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    assert gpu["minReplicas"] < gpu["maxReplicas"]
    assert images == {f"rayproject/ray:{cluster['rayVersion']}-py311-gpu"}, "one Ray version everywhere"
    import ray

    assert cluster["rayVersion"] == ray.__version__, "the version this project is tested with"


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_local_head_refuses_a_token_file_readable_by_group_or_others_before_starting_ray(tmp_path, mode):
    import os
    import subprocess
    import sys

    token = tmp_path / "token"
    token.write_text("0" * 64)
    token.chmod(mode)
    # RAY points at a stand-in that fails loudly: the refusal must come before any `ray start`
    fake_ray = tmp_path / "ray"
    fake_ray.write_text("#!/bin/sh\necho 'ray was called' >&2\nexit 99\n")
    fake_ray.chmod(0o755)
    env = {**os.environ, "RAY": str(fake_ray), "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(ROOT / "cluster" / "local_head.sh"), "start", "--state-dir", str(tmp_path / "state")]
        + ["--token-file", str(token)],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    assert proc.returncode == 1, proc.stderr
    assert f"--token-file {token} is readable by group/others; chmod 600 {token}" in proc.stderr
    assert "ray was called" not in proc.stderr
    assert not (tmp_path / "state" / "head.env").exists()


def test_local_head_stop_also_stops_a_process_that_joins_the_session_during_the_stop(tmp_path):
    """A raylet can fork a worker just as `stop` begins: the worker is not in the first scan but is
    in the session. `stop` must end it too, not leave it running and fail (a CI teardown did)."""
    import os
    import subprocess
    import sys
    import time

    late = tmp_path / "late.pid"
    # the session leader stands in for a Ray process: on SIGTERM it starts one more process in its
    # session (as a raylet forking a worker), records its pid, and exits
    leader_src = (
        "import signal, subprocess, sys, time\n"
        "def on_term(*_):\n"
        "    child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"    open({str(late)!r}, 'w').write(str(child.pid))\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, on_term)\n"
        "print('ready', flush=True)\n"
        "time.sleep(120)\n"
    )
    leader = subprocess.Popen(
        [sys.executable, "-c", leader_src], start_new_session=True, stdout=subprocess.PIPE, text=True
    )
    late_pid = None
    try:
        assert leader.stdout.readline().strip() == "ready"
        state = tmp_path / "state"
        state.mkdir()
        (state / "head.env").write_text(
            f"SESSION_ID={leader.pid}\nTEMP_DIR={tmp_path / 'not-a-ray-temp-dir'}\nOWN_TOKEN=0\n"
        )
        env = {**os.environ, "RAY": str(Path(sys.executable).with_name("ray")), "PYTHON": sys.executable}
        proc = subprocess.run(
            ["bash", str(ROOT / "cluster" / "local_head.sh"), "stop", "--state-dir", str(state)],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        late_pid = int(late.read_text())
        assert proc.returncode == 0, proc.stderr
        assert f"stopping what started during the stop: {late_pid}(python" in proc.stderr
        deadline = time.monotonic() + 5
        while _running(late_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(late_pid), "the process that joined the session during the stop is still running"
        assert not (state / "head.env").exists(), "a stopped head's record is cleared"
    finally:
        for pid in (leader.pid, late_pid):
            if pid and _running(pid):
                os.kill(pid, 9)
        leader.wait(timeout=10)


def _running(pid: int) -> bool:
    """Alive and not a zombie (a zombie is dead; its parent has just not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
