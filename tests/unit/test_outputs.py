"""Run outputs without Ray: per-step + per-epoch metric rows in Parquet, TensorBoard events, report PNGs."""

from __future__ import annotations

import math
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
from paths import CONFIGS
from run_records import run_summary, stage_record

from cascade_ray.checks import load_config
from cascade_ray.pipeline.outputs import METRICS_DIR, metric_rows, read_metrics, write_run_outputs
from cascade_ray.pipeline.records import summary_text
from cascade_ray.pipeline.tensorboard import write_tensorboard


def _history():
    """Two epochs as run_stage records them: epoch metrics carrying their step rows."""
    history = []
    for epoch in (1, 2):
        steps = [
            {
                "kind": "step",
                "epoch": epoch,
                "step": s,
                "train_loss": 2.0 / s,
                "lr": 0.01,
                "grad_norm": 1.0 if s % 20 == 0 else math.nan,
                "update_ratio": 0.01 if s % 20 == 0 else math.nan,
                "samples_per_s": 900.0,
            }
            for s in range((epoch - 1) * 40 + 10, epoch * 40 + 1, 10)
        ]
        history.append(
            {
                "epoch": epoch,
                "step": epoch * 40,
                "optimizer_steps": 40,
                "train_loss": 1.0 / epoch,
                "lr": 0.01,
                "samples_per_s": 800.0,
                "val_loss": 1.2 / epoch,
                "val_accuracy": 0.5 + 0.2 * epoch,
                "grad_norm": 1.0,
                "update_ratio": 0.01,
                "steps": steps,
            }
        )
    return history


def _write(tmp_path, log=print):
    cfg = load_config(CONFIGS / "debug.yaml")
    records = [
        {"name": "features", "history": _history()},
        {"name": "encoder", "history": [{k: v for k, v in h.items() if k != "steps"} for h in _history()]},
    ]
    labels = np.arange(20) % 10
    write_run_outputs(tmp_path, cfg, records, labels, labels, log=log)
    summary = run_summary(
        [stage_record(r["name"], metrics=r["history"][-1], history=r["history"]) for r in records],
        storage=str(tmp_path),
    )
    (tmp_path / "summary.json").write_text(summary_text(summary))


def test_metrics_parquet_has_step_rows_then_the_epoch_row_with_a_kind_column(tmp_path):
    _write(tmp_path)
    table = pq.read_table(tmp_path / METRICS_DIR / "features.parquet")
    assert {
        "kind",
        "step",
        "epoch",
        "train_loss",
        "lr",
        "grad_norm",
        "update_ratio",
        "samples_per_s",
        "val_accuracy",
    } <= set(table.column_names)
    rows = read_metrics(tmp_path)["features"]
    assert [(r["kind"], r["step"]) for r in rows[:5]] == [
        ("step", 10),
        ("step", 20),
        ("step", 30),
        ("step", 40),
        ("epoch", 40),
    ]
    assert rows[0]["val_accuracy"] is None and rows[4]["val_accuracy"] == pytest.approx(0.7)
    assert "steps" not in table.column_names
    # a stage without step rows (e.g. a Tune-swept stage) keeps one row per epoch
    assert [r["kind"] for r in read_metrics(tmp_path)["encoder"]] == ["epoch", "epoch"]
    assert metric_rows("x", []) == []


def test_tensorboard_event_files_hold_step_and_epoch_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    lines = []
    _write(tmp_path, log=lines.append)
    assert lines == []
    events = EventAccumulator(str(tmp_path / "tensorboard" / "features"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "step/train_loss",
        "step/lr",
        "step/grad_norm",
        "step/samples_per_s",
        "epoch/val_accuracy",
        "epoch/train_loss",
    } <= tags
    assert [e.step for e in events.Scalars("step/train_loss")] == list(range(10, 81, 10))
    assert [e.step for e in events.Scalars("step/grad_norm")] == [20, 40, 60, 80]  # NaN (unmeasured) steps left out
    assert [round(e.value, 4) for e in events.Scalars("epoch/val_accuracy")] == [0.7, 0.9]
    # a rerun into the same run folder replaces the events (appending would show every point twice)
    _write(tmp_path, log=lines.append)
    again = EventAccumulator(str(tmp_path / "tensorboard" / "features"))
    again.Reload()
    assert [e.step for e in again.Scalars("step/train_loss")] == list(range(10, 81, 10))


def test_without_tensorboard_one_info_line_and_no_failure(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    lines = []
    assert write_tensorboard(tmp_path, {"features": metric_rows("features", _history())}, log=lines.append) is None
    assert len(lines) == 1 and "tensorboard is not installed" in lines[0] and "cascade-ray[tensorboard]" in lines[0]
    assert not (tmp_path / "tensorboard").exists()


def test_report_draws_step_rows_and_epoch_only_runs(tmp_path):
    from cascade_ray.tools.report import build_report

    _write(tmp_path)
    report = build_report(tmp_path)
    for png in ("features.png", "encoder.png", "confusion.png"):
        assert (report.parent / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_next_steps_name_the_run_and_tensorboard_only_when_written(tmp_path, monkeypatch):
    from cascade_ray.pipeline.outputs import next_steps

    cfg = load_config(CONFIGS / "debug.yaml")
    labels = np.arange(20) % 10
    records = [{"name": "features", "history": _history()}]
    events = write_run_outputs(tmp_path / "with", cfg, records, labels, labels, log=lambda _: None)
    assert events == tmp_path / "with" / "tensorboard" and events.is_dir()
    run = str(tmp_path / "with")
    assert next_steps(run, tensorboard=str(events)) == [
        f"cascade-ray report {run}",
        f"cascade-ray predict {run} --data FILE --out DIR",
        f"cascade-ray serve {run}",
        f"cascade-ray export {run}",
        f"tensorboard --logdir {run}/tensorboard",
    ]
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    assert write_run_outputs(tmp_path / "without", cfg, records, labels, labels, log=lambda _: None) is None
    steps = next_steps("s3://bucket/runs/my run")
    assert steps[0] == "cascade-ray report 's3://bucket/runs/my run'"  # quoted: pasted into a shell as is
    assert not any("tensorboard" in step for step in steps)
