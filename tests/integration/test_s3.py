"""The debug pipeline entirely on S3 (moto's server on loopback): Parquet data read from the
bucket, every artifact written there, then resume, report, export, a sweep and its restore,
all against ``s3://cascade/<prefix>/``. Nothing is written to a local run folder.
"""

from __future__ import annotations

import json
import shlex
import uuid

import numpy as np
import pytest
from paths import CONFIGS

from cascade_ray import cli
from cascade_ray.api import RunOptions, run_pipeline
from cascade_ray.checks import load_config
from cascade_ray.data.parquet import write_parquet
from cascade_ray.storage import as_storage

pytestmark = pytest.mark.slow

SPACE = """
stage: classifier
metric: val_accuracy
mode: max
num_samples: 2
scheduler: {type: fifo}
space:
  solver.lr: {choice: [3.0e-3, 1.0e-2]}
"""


def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    return (d.images[:, None] / 16.0).astype(np.float32), d.target.astype(np.int64)


@pytest.fixture(scope="module")
def bucket(s3, ray_session):
    """Digits as Parquet in the bucket: train as a prefix of two parts, test as one file."""
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    x, y = _digits()
    order = np.random.default_rng(0).permutation(len(y))
    train, test = order[:1500], order[1500:]
    for i, part in enumerate(np.array_split(train, 2)):
        write_parquet(s3.uri(prefix, "data", "train", f"part-{i}.parquet"), x[part], y[part])
    write_parquet(s3.uri(prefix, "data", "test.parquet"), x[test], y[test])
    return s3, prefix


def _data(s3, prefix) -> list[str]:
    """The overrides that point the debug config at the bucket's Parquet data."""
    return [
        "data.source=parquet",
        f"data.path={s3.uri(prefix, 'data', 'train')}",  # a prefix: every *.parquet below it
        f"data.test_path={s3.uri(prefix, 'data', 'test.parquet')}",
    ]


def _config(s3, prefix, *extra):
    return load_config(CONFIGS / "debug.yaml", [f"storage_path={s3.uri(prefix, 'runs')}", *_data(s3, prefix), *extra])


@pytest.fixture(scope="module")
def first_run(bucket):
    s3, prefix = bucket
    lines: list[str] = []
    summary = run_pipeline(_config(s3, prefix), RunOptions(profile=frozenset({"classifier"})), log=lines.append)
    return s3, prefix, summary, lines


def test_every_artifact_of_the_run_lands_in_the_bucket(first_run):
    s3, prefix, summary, lines = first_run
    run = f"{prefix}/runs/debug"
    assert summary["storage"] == s3.uri(run)
    assert [s["status"] for s in summary["stages"]] == ["trained"] * 3
    keys = set(s3.keys(run))
    for stage in ("features", "encoder", "classifier"):
        assert {f"{run}/stages/{stage}/manifest.json", f"{run}/stages/{stage}/weights.safetensors"} <= keys
        assert f"{run}/metrics/{stage}.parquet" in keys
    assert {f"{run}/summary.json", f"{run}/config.yaml", f"{run}/test_predictions.parquet"} <= keys
    assert f"{run}/profile/classifier.trace.json" in keys, "the worker uploads its trace to the run folder"
    assert any(k.startswith(f"{run}/cache/encoder/") for k in keys), "the feature cache lives in the bucket too"
    assert any(k.startswith(f"{run}/tensorboard/classifier/events.out") for k in keys)
    assert not any(".cascade-probe-" in k for k in keys), "the storage probe cleans up after itself"
    assert summary["test_accuracy"] > 0.5
    run_uri = summary["storage"]
    assert lines[-1].splitlines()[0] == "next:", "the driver's last lines: what to run on the finished run"
    assert f"cascade-ray report {run_uri}" in lines[-1] and f"tensorboard --logdir {run_uri}/tensorboard" in lines[-1]


def test_the_parquet_prefix_and_file_on_s3_are_the_data(first_run):
    s3, prefix, summary, lines = first_run
    data_line = next(line for line in lines if line.startswith("data: parquet:"))
    assert s3.uri(prefix, "data", "train") in data_line and "train 1200, val 300, test 297" in data_line


def test_no_credential_reaches_a_file_or_a_log_line(first_run):
    s3, prefix, summary, lines = first_run
    secret = s3.env["AWS_SECRET_ACCESS_KEY"]
    fs = s3.filesystem()
    for key in s3.keys(f"{prefix}/runs/debug"):
        if key.endswith((".json", ".yaml")):
            with fs.open_input_stream(f"{s3.bucket}/{key}") as f:
                assert secret not in f.read().decode(), key
    assert not any(secret in line for line in lines)


def test_resume_reuses_every_stage_from_the_bucket(first_run):
    s3, prefix, summary, _ = first_run
    again = run_pipeline(_config(s3, prefix), RunOptions(resume=True), log=lambda _: None)
    assert [s["status"] for s in again["stages"]] == ["reused"] * 3
    assert again["test_accuracy"] == summary["test_accuracy"]
    assert [s["digest"] for s in again["stages"]] == [s["digest"] for s in summary["stages"]]


def test_report_and_export_take_the_run_uri(first_run, capsys):
    s3, prefix, summary, _ = first_run
    run = s3.uri(prefix, "runs", "debug")
    assert cli.main(["report", run]) == 0
    assert capsys.readouterr().out.strip() == f"{run}/report/report.md"
    assert cli.main(["export", run]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["path"] == f"{run}/export/model.pt2"
    assert report["max_abs_diff"] < 1e-4
    assert report["eager_test_accuracy"] == pytest.approx(summary["test_accuracy"])
    keys = set(s3.keys(f"{prefix}/runs/debug"))
    names = ("report/report.md", "report/confusion.png", "report/encoder.png", "export/model.pt2")
    assert {f"{prefix}/runs/debug/{name}" for name in names} <= keys


def test_a_sweep_and_its_restore_run_on_the_bucket(first_run, tmp_path, capsys):
    """On the module run's data and config; its upstream stages are copied to the sweep's run
    folder and reused (--resume), so the sweep trains its two trials and no stage before them."""
    import pyarrow.fs as pafs

    s3, prefix, summary, _ = first_run
    fs = s3.filesystem()
    for stage in ("features", "encoder"):
        src, dst = (f"{s3.bucket}/{prefix}/{runs}/debug/stages/{stage}" for runs in ("runs", "sweep"))
        pafs.copy_files(src, dst, source_filesystem=fs, destination_filesystem=fs)
    space = tmp_path / "classifier.yaml"
    space.write_text(SPACE)
    args = [
        "tune",
        str(CONFIGS / "debug.yaml"),
        "--space",
        str(space),
        f"storage_path={s3.uri(prefix, 'sweep')}",
        *_data(s3, prefix),
        "--resume",
        "--log-level",
        "warning",
    ]
    assert cli.main(args) == 0, capsys.readouterr().err[-3000:]
    exp = f"{prefix}/sweep/debug/tune/classifier"
    keys = set(s3.keys(exp))
    assert {f"{exp}/results.parquet", f"{exp}/best.yaml", f"{exp}/tune/tuner.pkl"} <= keys
    assert len({k.split("/")[6] for k in keys if k.startswith(f"{exp}/trials/trial-")}) == 2
    best = as_storage(s3.uri(exp, "best.yaml")).read_text()
    assert "stages.classifier.solver.lr" in best
    header = [line for line in best.splitlines() if line.startswith("#")]
    # what else the best trial trained with: this command line, and the command that trains its config again
    assert f"# the swept values only; the sweep ran on: {shlex.join([args[1], *args[4:-3]])}" in header, best
    assert any(line.startswith("# its config again: cascade-ray run ") for line in header), best
    for stage in ("features", "encoder"):  # reused: the copies are untouched (a fit writes a new manifest)
        kept, source = (
            as_storage(s3.uri(prefix, runs, "debug", "stages", stage, "manifest.json")) for runs in ("sweep", "runs")
        )
        assert kept.read_text() == source.read_text(), stage
    capsys.readouterr()
    assert cli.main(args) == 0, capsys.readouterr().err[-3000:]  # the restore
    assert "reused" in capsys.readouterr().out
