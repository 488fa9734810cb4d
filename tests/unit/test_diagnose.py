"""``cascade-ray diagnose``: the in-process stage report on the shipped configs, sick and healthy."""

from __future__ import annotations

import json

import pytest
from paths import CONFIGS, example_data_overrides
from run_records import manifest_fields

from cascade_ray.checks import load_config
from cascade_ray.cli import main as cli_main
from cascade_ray.data.source import load_data
from cascade_ray.hardware import detect_hardware
from cascade_ray.models.weights import to_numpy_state
from cascade_ray.pipeline.artifacts import write_artifact
from cascade_ray.solver.precision import resolve_precision
from cascade_ray.stage.setup import build_stage_model
from cascade_ray.tools.diagnose import diagnose, format_report

AUTO_ON_THIS_CPU = resolve_precision("auto", detect_hardware("cpu")).resolved


@pytest.fixture(scope="module")
def example_data(tmp_path_factory):
    """pipelines/make_example_data.py's files, for the configs whose data.path points there."""
    from cascade_ray.data.examples import write_example_data

    out = tmp_path_factory.mktemp("example-data")
    write_example_data(out)
    return out


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_stage_of_every_shipped_config_diagnoses_healthy(path, example_data):
    cfg = load_config(path, example_data_overrides(path, example_data))
    data = load_data(cfg.data, cfg.seed)
    for index, stage in enumerate(cfg.stages):
        report = diagnose(cfg, index, data, steps=3)
        assert report["verdict"] == {"ok": True, "alarms": []}, (stage.name, report["verdict"])
        assert report["steps_run"] == 3 and report["optimizer"]["class"] == stage.solver.type
        assert sum(g["params"] for g in report["optimizer"]["groups"]) == sum(r["params"] for r in report["gradients"])
        assert not any(r["none"] or r["nonfinite"] for r in report["gradients"])
        assert all(r["update_ratio"] > 0 for r in report["updates"])


def test_cli_json_report_of_a_downstream_stage(capsys):
    assert cli_main(["diagnose", str(CONFIGS / "debug.yaml"), "--stage", "encoder", "--steps", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (
        "freshly initialized, NOT trained" in report["upstream"]
        and "--upstream RUN_DIR/stages/features" in report["upstream"]
    )
    assert report["solver"]["type"] == "AdamW" and report["solver"]["lr"] == 0.01
    groups = report["optimizer"]["groups"]
    assert [g["name"] for g in groups] == ["default", "default (no decay)"] and groups[1]["weight_decay"] == 0.0
    # encoder runs on 2 workers: 18 micro-batches of 32 per rank and epoch, 2 epochs
    assert report["schedule"]["workers"] == 2 and report["schedule"]["total_optimizer_steps"] == 36
    assert {r["module"] for r in report["gradients"]} >= {"heads.encoder.fc", "blocks.encoder.norm"}
    assert not any(r["module"].startswith("blocks.features") for r in report["gradients"])  # frozen: not in any group
    # precision auto, resolved on this machine's CPU (fp32 on AVX2, bf16 where bf16 is native)
    assert report["precision"] == {"precision": AUTO_ON_THIS_CPU, "loss_scale": None, "skipped_steps": 0}
    # like the pipeline, the encoder trains on the frozen features' cached outputs
    assert report["feature_cache"] == "on: trains on the upstream's 16x4x4 outputs, computed once"


def test_text_report_of_a_stalled_stage_exits_1(capsys):
    code = cli_main(
        ["diagnose", str(CONFIGS / "debug.yaml"), "stages[0].solver.lr=1e-12", "--stage", "features", "--steps", "12"]
    )
    out = capsys.readouterr().out
    assert code == 1
    for heading in (
        "solver (as loaded):",
        "  lr: 1e-12",
        "optimizer built: AdamW",
        "lr plan on 1 worker(s): constant, 72 optimizer steps",
        "gradients after the first backward, per module:",
        "parameter updates over 12 step(s)",
        f"precision: {AUTO_ON_THIS_CPU}",
        "verdict: 1 alarm(s)",
    ):
        assert heading in out, heading
    assert "stall:" in out and "key: stages[0].solver.lr" in out


def test_upstream_artifact_is_loaded_and_checked(tmp_path, capsys):
    cfg = load_config(CONFIGS / "debug.yaml")
    data = load_data(cfg.data, cfg.seed)
    model, _ = build_stage_model(cfg, 0, data, None)
    good = write_artifact(
        tmp_path / "stages" / "features", to_numpy_state(model.state_dict()), manifest_fields("features")
    ).path
    report = diagnose(cfg, 1, data, steps=2, upstream=to_numpy_state(model.state_dict()), upstream_source=str(good))
    assert report["upstream"] == f"features: loaded from {good}" and report["verdict"]["ok"]
    assert "features: loaded from" in format_report(report)
    assert (
        cli_main(
            ["diagnose", str(CONFIGS / "debug.yaml"), "--stage", "encoder", "--steps", "2", "--upstream", str(good)]
        )
        == 0
    )
    assert cli_main(["diagnose", str(CONFIGS / "debug.yaml"), "--stage", "classifier", "--upstream", str(good)]) == 2
    assert "pass RUN_DIR/stages/encoder" in capsys.readouterr().err
