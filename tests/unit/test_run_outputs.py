"""Outputs as the run goes, without Ray: summary.json and metrics/<stage>.parquet after each stage,
a failed summary when a stage crashes, `report` (and its self-contained HTML) on a partial run."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from chromium import dump_dom, screenshot
from paths import CONFIGS
from run_records import run_summary, stage_record

from cascade_ray.checks import load_config
from cascade_ray.errors import ArtifactError, CascadeError
from cascade_ray.pipeline.outputs import METRICS_DIR, RunOutputs, read_metrics
from cascade_ray.pipeline.records import ERROR_CHARS, read_summary, summary_status, summary_text
from cascade_ray.tools.inference import run_summary as finished_summary
from cascade_ray.tools.report import build_report


def _history(epochs: int = 2) -> list[dict]:
    """Epoch metrics, each with its step rows, as a stage records them."""
    return [
        {
            "epoch": e,
            "step": 4 * e,
            "train_loss": 1.0 / e,
            "val_loss": 1.2 / e,
            "val_accuracy": 0.4 + 0.2 * e,
            "lr": 0.01,
            "grad_norm": 0.5,
            "health_warnings": 1.0 if e == 2 else 0.0,
            "steps": [{"epoch": e, "step": 4 * (e - 1) + s, "train_loss": 1.0 / s, "lr": 0.01} for s in (2, 4)],
        }
        for e in range(1, epochs + 1)
    ]


def _record(name: str) -> dict:
    history = _history()
    return stage_record(
        name, metrics={k: v for k, v in history[-1].items() if k != "steps"}, history=history
    ).model_dump()


@pytest.fixture
def debug_cfg(tmp_path):
    return load_config(CONFIGS / "debug.yaml", [f"storage_path={tmp_path}"])


def _crash_in_stage_3(cfg, run, log=print):
    """features and encoder done, classifier crashes: what the driver's calls leave."""
    outputs = RunOutputs(run, cfg, "class", log)
    for index, name in enumerate(["features", "encoder"]):
        outputs.stage_started(index)
        outputs.stage_done(_record(name), cfg)
    outputs.stage_started(2)
    assert [s.status for s in read_summary(run / "summary.json").stages] == ["trained", "trained", "running"]
    outputs.failed(ValueError("classifier exploded " + "x" * 5000))
    return outputs


def test_a_crash_in_stage_3_leaves_stages_1_2_metrics_and_a_failed_summary(debug_cfg, tmp_path):
    run = tmp_path / "debug"
    _crash_in_stage_3(debug_cfg, run)
    assert sorted(p.name for p in (run / METRICS_DIR).iterdir()) == ["encoder.parquet", "features.parquet"]
    assert [r["kind"] for r in read_metrics(run)["features"]] == ["step", "step", "epoch"] * 2
    summary = read_summary(run / "summary.json")
    assert summary.status == "failed" and summary.test_loss is None
    assert [(s.name, s.status) for s in summary.stages] == [
        ("features", "trained"),
        ("encoder", "trained"),
        ("classifier", "failed"),
    ]
    failed = summary.stages[2]
    assert failed.error.startswith("ValueError: classifier exploded") and len(failed.error) <= ERROR_CHARS
    assert summary.error == failed.error
    assert summary.describe().startswith("failed in stage 'classifier' (ValueError: classifier exploded")
    assert summary_status(run / "summary.json") == "failed"  # not finished: a rerun trains it, --resume reuses
    assert (run / "config.yaml").is_file()
    with pytest.raises(
        CascadeError,
        match=r"(?s)not a finished run \(summary.json: failed in stage 'classifier'.*--resume.*done: features, encoder",
    ):
        finished_summary(run)


def test_a_stage_running_now_and_stages_not_started_are_in_the_summary(debug_cfg, tmp_path):
    run = tmp_path / "debug"
    outputs = RunOutputs(run, debug_cfg, "class", print)
    outputs.stage_started(0)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "running" and "test_loss" not in summary
    assert [s["status"] for s in summary["stages"]] == ["running", "pending", "pending"]
    assert summary_status(run / "summary.json") == "running"


def test_a_failure_before_the_first_stage_writes_no_summary(debug_cfg, tmp_path):
    RunOutputs(tmp_path / "debug", debug_cfg, "class", print).failed(RuntimeError("no cluster"))
    assert not (tmp_path / "debug").exists()


def test_a_summary_that_cannot_be_written_is_a_warning_and_never_hides_the_error(debug_cfg, tmp_path):
    (tmp_path / "file").write_text("not a folder")
    lines = []
    outputs = RunOutputs(tmp_path / "file" / "debug", debug_cfg, "class", lines.append)
    outputs.stage_started(0)
    outputs.failed(ValueError("the original error"))  # does not raise
    assert len(lines) == 2 and all(line.startswith("warning: could not update the run's outputs") for line in lines)


def test_finished_means_status_finished_and_older_summaries_are_finished(tmp_path):
    path = tmp_path / "summary.json"
    assert summary_status(path) == "absent"
    old = run_summary([stage_record("a")]).to_json()
    old.pop("status")  # a summary written before the status existed
    path.write_text(json.dumps(old))
    assert read_summary(path).status == "finished" and summary_status(path) == "finished"
    path.write_text("{}")  # damaged: never trained over without --resume / --overwrite
    assert summary_status(path) == "finished"
    path.write_text(summary_text(run_summary([stage_record("a")])).replace('"finished"', '"failed"'))
    assert summary_status(path) == "failed"
    finished_without_test = run_summary([stage_record("a")]).to_json()
    finished_without_test.pop("test_loss")
    path.write_text(json.dumps(finished_without_test))
    with pytest.raises(ArtifactError, match=r"summary.json: 'test_loss' missing \(a finished summary"):
        read_summary(path)


def test_report_md_and_html_of_a_crashed_run_show_the_done_stages_and_the_error(debug_cfg, tmp_path):
    run = tmp_path / "debug"
    _crash_in_stage_3(debug_cfg, run)
    md = build_report(run).read_text()
    assert "Status: **failed in stage 'classifier'" in md and "| classifier | failed |" in md
    assert "![features curves](features.png)" in md and "confusion" not in md
    assert "stage features, epoch 2: 1 health warning(s)" in md
    page = build_report(run, html=True)
    assert page == run / "report" / "report.html"
    html = page.read_text()
    assert "ValueError: classifier exploded" in html and 'id="stage-classifier"' in html
    assert html.count("data:image/png;base64,") == 2  # features and encoder curves; no test figure yet


def _self_contained(html: str) -> None:
    """No URL the page would fetch: every src / href is a data: URI or a fragment; no script."""
    refs = re.findall(r"""(?:src|href)\s*=\s*["']([^"']*)""", html, flags=re.I)
    assert refs and all(r.startswith(("data:", "#")) for r in refs), refs
    assert "<script" not in html.lower() and "@import" not in html and "url(" not in html


def test_the_html_report_of_a_finished_run_renders_offline_in_chromium(debug_cfg, tmp_path):
    from PIL import Image, ImageStat

    run = tmp_path / "debug"
    outputs = RunOutputs(run, debug_cfg, "class", lambda _: None)
    for index, name in enumerate(["features", "encoder", "classifier"]):
        outputs.stage_started(index)
        outputs.stage_done(_record(name), debug_cfg)
    labels = np.arange(40) % 10
    predictions = np.where(np.arange(40) % 4 == 0, (labels + 1) % 10, labels)
    metrics = {"loss": 0.5, "accuracy": float((labels == predictions).mean())}
    outputs.finish(debug_cfg, {"metrics": metrics, "labels": labels, "predictions": predictions})
    page = build_report(run, html=True)
    _self_contained(page.read_text())
    png = screenshot(page, tmp_path / "shot.png")
    image = Image.open(png).convert("L")
    assert image.size == (1280, 2000)
    assert max(ImageStat.Stat(image).stddev) > 20, "the screenshot is blank"  # text and figures, not one colour
    dom = dump_dom(page, tmp_path)
    text = re.sub(r"<[^>]+>", " ", dom)
    for stage in ("features", "encoder", "classifier"):
        assert f"Stage {stage} (trained)" in text
    assert 'id="stage-table"' in dom and "val loss" in text and "accuracy <b>0.7500</b>" in dom
    assert dom.count('src="data:image/png;base64,') == 4  # three stages' curves and the confusion matrix
    assert "status: finished" in text


def test_outputs_as_the_run_goes_land_on_object_storage_too(s3, tmp_path):
    """The same crash with storage_path on S3 (moto on loopback): metrics, config and the failed summary in the bucket."""
    import uuid

    from cascade_ray.storage import as_storage

    prefix = f"outputs-{uuid.uuid4().hex[:8]}"
    cfg = load_config(CONFIGS / "debug.yaml", [f"storage_path={s3.uri(prefix)}"])
    run = as_storage(s3.uri(prefix, "debug"))
    _crash_in_stage_3(cfg, run, log=lambda _: None)
    keys = set(s3.keys(f"{prefix}/debug"))
    assert {
        f"{prefix}/debug/{k}"
        for k in ("summary.json", "config.yaml", "metrics/features.parquet", "metrics/encoder.parquet")
    } <= keys
    assert any(k.startswith(f"{prefix}/debug/tensorboard/encoder/events.out") for k in keys)
    summary = read_summary(run / "summary.json")
    assert [s.status for s in summary.stages] == ["trained", "trained", "failed"]
    assert str(build_report(run, html=True)) == f"{run}/report/report.html"
    assert f"{prefix}/debug/report/report.html" in set(s3.keys(f"{prefix}/debug"))
