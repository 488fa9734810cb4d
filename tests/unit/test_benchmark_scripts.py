"""The Ray-free benchmark scripts still run against the code they measure (tiny settings).

`bench_step.py`, its bare baseline and `bench_precision.py` had stopped running once the data
statistics became per-channel arrays, and nothing noticed until a re-measure. These run each
for a few steps (bench_step on its own config, the demo's first stage on Fashion-MNIST;
bench_precision, bench_batched_resume, profile_batched and bench_stacked on the digits): the figures are not
checked (they are benchmarks, not timed tests), the work is: both loops of bench_step must end
bit-identical, and so must bench_batched_resume's two ways.
"""

from __future__ import annotations

import subprocess
import sys

from paths import CONFIGS, ROOT

TIMEOUT_S = 300


def _bench(script: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done.stdout


def test_bench_step_runs_both_loops_to_the_same_loss():
    out = _bench("bench_step.py", "--max-steps", "3", "--repeats", "1")
    assert "(bit-identical)" in out, out[-2000:]
    assert "P1 target: run_stage step throughput" in out


def test_bench_precision_times_every_variant():
    out = _bench(
        "bench_precision.py",
        "--config",
        str(CONFIGS / "debug.yaml"),
        "--steps",
        "2",
        "--warmup",
        "1",
        "--repeats",
        "1",
        "--threads",
        "1",
    )
    for variant in ("fp32 contiguous", "fp32 channels_last", "bf16 contiguous", "bf16 channels_last"):
        assert f"{variant}: " in out, out[-2000:]


def test_bench_batched_resume_ends_both_ways_with_the_same_weights():
    out = _bench(
        "bench_batched_resume.py",
        "--config",
        str(CONFIGS / "debug.yaml"),
        "--configs",
        "2",
        "--epochs",
        "1",
        "--repeats",
        "1",
    )
    assert "both ways' weights identical" in out, out[-2000:]


def test_profile_batched_groups_an_epoch():
    out = _bench("profile_batched.py", "--config", str(CONFIGS / "debug.yaml"), "--configs", "2")
    for group in ("dropout: random draw", "backward (autograd engine)", "forward: linear"):
        assert f"  {group}" in out, out[-2000:]


def test_bench_stacked_times_every_way_and_whole_epochs_per_group_size():
    out = _bench(
        "bench_stacked.py",
        "--config",
        str(CONFIGS / "debug.yaml"),
        "--configs",
        "4",
        "--steps",
        "1",
        "--repeats",
        "1",
        "--groups",
        "2",
        "--epochs",
        "1",
    )
    for way in ("loop: ", "vmap: ", "grouped by 2: ", "group size 1: ", "group size 2: "):
        assert f"\n{way}" in out, out[-2000:]
    epochs = [line for line in out.splitlines() if line.startswith("group size ")]
    assert all("; best replica " in line for line in epochs), out[-2000:]
