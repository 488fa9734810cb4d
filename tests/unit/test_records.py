"""Typed records: manifest.json and summary.json written from models, validated on read."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import ray
from paths import CONFIGS
from run_records import manifest_fields, run_summary, stage_record

from cascade_ray.checks import load_config
from cascade_ray.cli import main as cli_main
from cascade_ray.data.source import load_data
from cascade_ray.errors import ArtifactError
from cascade_ray.models.weights import save_safetensors, to_numpy_state
from cascade_ray.pipeline.artifacts import MANIFEST, manifest_text, read_artifact, write_artifact
from cascade_ray.pipeline.outputs import write_run_outputs
from cascade_ray.pipeline.records import (
    FeatureCacheRecord,
    Manifest,
    RunSummary,
    StageRecord,
    SweepRecord,
    read_manifest,
    read_summary,
    seal_manifest,
    summary_text,
)
from cascade_ray.pipeline.stages import StageSession, fingerprint_of, stage_fingerprint
from cascade_ray.stage.setup import build_stage_model
from cascade_ray.stage.worker import CHECKPOINT_NODES, CHECKPOINT_STATE, CHECKPOINT_WEIGHTS


def _state():
    return {"blocks.a.w": np.arange(6, dtype=np.float32).reshape(2, 3), "n": np.array(3, np.int64)}


def test_manifest_round_trips_through_the_artifact(tmp_path):
    art = write_artifact(tmp_path / "a", _state(), manifest_fields("a", index=2, parent_fingerprint="p" * 64))
    read = read_manifest(tmp_path / "a" / MANIFEST)
    assert read == art.manifest == read_artifact(tmp_path / "a")[0].manifest
    assert (read.stage, read.index, read.parent_fingerprint) == ("a", 2, "p" * 64)
    assert set(read.tensor_digests) == set(_state()) and len(read.weights_sha256) == 64


def test_summary_round_trips_and_leaves_unset_blocks_out(tmp_path):
    cache = FeatureCacheRecord(status="computed", shape=[16, 4, 4], path="/x.parquet", seconds=0.2)
    sweep = SweepRecord(results="/r.parquet", best="/best.yaml", trials=4)
    summary = run_summary(
        [
            stage_record("a"),
            stage_record("b", status="reused", feature_cache=cache),
            stage_record("c", status="tuned", sweep=sweep, metrics={"val_accuracy": 1, "val_loss": float("nan")}),
        ]
    )
    (tmp_path / "summary.json").write_text(summary_text(summary))
    raw = json.loads((tmp_path / "summary.json").read_text())
    assert "feature_cache" not in raw["stages"][0] and "sweep" not in raw["stages"][0]
    assert raw["stages"][1]["feature_cache"]["shape"] == [16, 4, 4] and raw["stages"][2]["sweep"]["trials"] == 4
    read = read_summary(tmp_path / "summary.json")
    assert read.stages[1].feature_cache == cache and read.stages[2].sweep == sweep
    assert np.isnan(read.stages[2].metrics["val_loss"])  # NaN metrics survive, as json.dumps writes them
    assert read.model_dump(exclude={"stages"}) == summary.model_dump(exclude={"stages"})
    assert [s.name for s in read.stages] == ["a", "b", "c"]


def _manifest_file(tmp_path: Path) -> Path:
    write_artifact(tmp_path / "a", _state(), manifest_fields("a"))
    return tmp_path / "a" / MANIFEST


def _edit(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (lambda p: _edit(p, lambda d: d.pop("fingerprint")), "'fingerprint' missing"),
        (lambda p: _edit(p, lambda d: d.update(index="one")), "'index': Input should be a valid integer"),
        (lambda p: _edit(p, lambda d: d.update(num_workers="2")), "'num_workers': Input should be a valid integer"),
        (lambda p: _edit(p, lambda d: d["metrics"].pop("val_loss")), "'metrics': Value error, 'val_loss' missing"),
        (lambda p: _edit(p, lambda d: d.update(surprise=1)), "unexpected key 'surprise'"),
        (lambda p: _edit(p, lambda d: d["tensor_digests"].update(x=1)), "'tensor_digests.x': Input should be"),
        (lambda p: p.write_text('{"stage": "a", '), "not JSON"),
        (lambda p: p.write_text("[1, 2]"), "expected a JSON object, found list"),
        (lambda p: p.write_bytes(b"\xff\xfe\x00"), "manifest.json: "),
    ],
    ids=["missing", "wrong-type", "string-int", "metric", "extra", "nested", "not-json", "list", "binary"],
)
def test_malformed_manifest_is_an_artifact_error_naming_file_and_key(tmp_path, damage, says):
    path = _manifest_file(tmp_path)
    damage(path)
    for read in (lambda: read_manifest(path), lambda: read_artifact(tmp_path / "a")):
        with pytest.raises(ArtifactError) as info:
            read()
        message = str(info.value)
        assert message.startswith(f"{path}: ") and says in message, message
        assert "re-run the stage (without --resume)" in message


def test_missing_manifest_is_an_artifact_error(tmp_path):
    with pytest.raises(ArtifactError, match=r"manifest.json: unreadable"):
        read_manifest(tmp_path / MANIFEST)


def test_summary_errors_name_the_stage_entry(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text(summary_text(run_summary([stage_record("a"), stage_record("b")])))
    _edit(path, lambda d: d["stages"][1].update(status="skipped"))
    with pytest.raises(
        ArtifactError, match=r"'stages\[1\]\.status': 'skipped' is not one of 'trained', 'reused', .*'pending'"
    ):
        read_summary(path)
    _edit(path, lambda d: d.update(stages=[]))
    with pytest.raises(ArtifactError, match=r"summary.json: 'stages': List should have at least 1 item"):
        read_summary(path)


def _finished_run(tmp_path: Path) -> Path:
    """A run folder as the pipeline leaves it (config, metrics, predictions, summary, one artifact)."""
    cfg = load_config(CONFIGS / "debug.yaml")
    run = tmp_path / "debug"
    labels = np.arange(10) % 10
    write_run_outputs(run, cfg, [], labels, labels, log=lambda _: None)
    artifact = write_artifact(run / "stages" / "classifier", _state(), manifest_fields("classifier", index=2))
    record = stage_record("classifier", artifact=str(artifact.path), digest=artifact.manifest.weights_sha256)
    (run / "summary.json").write_text(summary_text(run_summary([record], storage=str(run))))
    return run


@pytest.mark.parametrize("command", ["report", "export"])
def test_report_and_export_on_a_damaged_summary_exit_with_the_artifact_error(tmp_path, capsys, command):
    run = _finished_run(tmp_path)
    _edit(run / "summary.json", lambda d: d.pop("test_loss"))
    assert cli_main([command, str(run)]) == ArtifactError.exit_code == 2
    err = capsys.readouterr().err
    assert f"{run / 'summary.json'}: 'test_loss' missing" in err and "re-run the pipeline" in err


def test_export_on_a_damaged_manifest_exits_with_the_artifact_error(tmp_path, capsys):
    run = _finished_run(tmp_path)
    manifest = run / "stages" / "classifier" / MANIFEST
    _edit(manifest, lambda d: d.pop("weights_sha256"))
    assert cli_main(["export", str(run)]) == ArtifactError.exit_code
    assert f"{manifest}: 'weights_sha256' missing" in capsys.readouterr().err


class _Result:
    """What StageSession.finish reads of a ray.train.Result: the best checkpoint and rank 0's return value."""

    def __init__(self, folder: Path, history: list[dict]):
        self.folder, self.return_value = folder, {"history": history, "world_size": 1}

    def get_best_checkpoint(self, metric, mode):
        return self

    @contextmanager
    def as_directory(self):
        yield str(self.folder)


def _first_stage_checkpoint(tmp_path: Path, monkeypatch) -> tuple:
    """(config, data, checkpoint folder, its metrics) of the debug config's first stage as a fit leaves
    it; ``ray.put`` faked (no object store needed for the records)."""
    monkeypatch.setattr(ray, "put", lambda value: "ref")
    cfg = load_config(CONFIGS / "debug.yaml")
    data = load_data(cfg.data, cfg.seed)
    model, _ = build_stage_model(cfg, 0, data, None)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_safetensors(to_numpy_state(model.state_dict()), ckpt / CHECKPOINT_WEIGHTS)
    metrics = {"epoch": 1, "step": 9, "train_loss": 1.5, "val_loss": 1.2, "val_accuracy": 0.6}
    (ckpt / CHECKPOINT_STATE).write_text(json.dumps(metrics))
    return cfg, data, ckpt, metrics


def test_stage_records_the_pipeline_makes_validate(tmp_path, monkeypatch):
    """finish (a trained stage) and _reuse (--resume) build records that summary.json accepts."""
    cfg, data, ckpt, metrics = _first_stage_checkpoint(tmp_path, monkeypatch)
    nodes = ["a" * 56, "b" * 56]  # what rank 0 wrote: each rank's node, in rank order
    (ckpt / CHECKPOINT_NODES).write_text(json.dumps(nodes))
    session = StageSession(cfg, tmp_path / "run", "data-ref", "d" * 64, data.input_shape, data.out_width)
    fp = stage_fingerprint(cfg, 0, "", "d" * 64)
    trained, handoff = session.finish(
        0, None, _Result(ckpt, [metrics]), fp=fp, run_name="00-features-x-a1", started=0.0
    )
    reused, _ = session._reuse(0, fp, "")
    summary = RunSummary(name="debug", test_accuracy=0.5, test_loss=1.0, stages=[trained, reused], storage="x")
    first, again = summary.stages
    assert (first.status, again.status, again.wall_s) == ("trained", "reused", 0.0)
    assert first.model_dump(exclude={"status", "wall_s"}) == again.model_dump(exclude={"status", "wall_s"})
    assert first.metrics == metrics and first.history == [metrics] and first.fingerprint == fp == handoff.fingerprint
    assert first.nodes == again.nodes == nodes  # the reused record carries the nodes that trained it
    manifest = read_manifest(Path(first.artifact) / MANIFEST)
    assert (manifest.stage, manifest.index, manifest.weights_sha256) == ("features", 0, first.digest)
    assert StageRecord.model_validate(trained) == first  # the dict the driver gets is the model's JSON form


def test_resume_names_what_changed_since_the_stored_artifact(tmp_path, monkeypatch):
    """A --resume that trains a stage again says why, by config key: the manifest keeps what its
    fingerprint hashed. An artifact written before that field existed still reads, with the
    parent / data told apart and a general reason otherwise."""
    cfg, data, ckpt, metrics = _first_stage_checkpoint(tmp_path, monkeypatch)
    session = StageSession(cfg, tmp_path / "run", "data-ref", "d" * 64, data.input_shape, data.out_width)
    fp = stage_fingerprint(cfg, 0, "", "d" * 64)
    session.finish(0, None, _Result(ckpt, [metrics]), fp=fp, run_name="r", started=0.0)
    manifest = read_manifest(session.artifact_dir(0) / MANIFEST)
    assert fingerprint_of(manifest.fingerprint_inputs) == manifest.fingerprint == fp

    def why(changed_cfg, data_fp="d" * 64):
        lines: list[str] = []
        again = StageSession(
            changed_cfg, session.out, "data-ref", data_fp, data.input_shape, data.out_width, log=lines.append
        )
        assert again._reuse(0, stage_fingerprint(changed_cfg, 0, "", data_fp), "") is None
        (line,) = lines
        return line

    name = cfg.stages[0].name
    lr = cfg.stages[0].solver.lr
    changed = load_config(CONFIGS / "debug.yaml", [f"stages[0].solver.lr={lr * 3}", "seed=99"])
    assert why(changed) == (
        f"  {name}: changed since the stored artifact (stages.{name}.solver.lr: {json.dumps(lr)} -> "
        f"{json.dumps(lr * 3)}; seed: {json.dumps(cfg.seed)} -> 99), training"
    )
    assert "(the data changed), training" in why(cfg, data_fp="e" * 64)
    # an artifact from before the field: the manifest still verifies, the reason is general
    raw = json.loads((session.artifact_dir(0) / MANIFEST).read_text())
    del raw["fingerprint_inputs"]
    (session.artifact_dir(0) / MANIFEST).write_text(manifest_text(seal_manifest(Manifest.model_validate(raw))))
    assert "(the config, the seed or the package version changed (the artifact records no more))" in why(changed)
    assert "(the data changed)" in why(cfg, data_fp="e" * 64)


def test_device_decisions_ride_in_manifest_and_record_and_older_artifacts_still_read():
    """precision / memory_format / compile are optional shared fields: set, they reach the record;
    absent (an artifact written before precision auto), the manifest still validates."""
    from cascade_ray.pipeline.records import Manifest, StageRecord

    base = {
        "metrics": {"val_accuracy": 0.9, "val_loss": 0.3},
        "history": [],
        "num_workers": 1,
        "trainable_params": 10,
        "frozen_params": 0,
        "fingerprint": "f",
        "ray_run": "r",
        "stage": "features",
        "index": 0,
        "parent_fingerprint": "",
        "data_fingerprint": "d",
        "frozen_digest": {},
        "cascade_ray_version": "0.1.0",
        "weights_sha256": "w",
        "tensor_digests": {},
        "manifest_sha256": "s",  # required since manifests vouch for their own fields (test_abuse_artifacts)
    }
    old = Manifest.model_validate(base)
    assert old.precision is None and "precision" not in old.to_json()
    assert old.nodes is None and "nodes" not in old.to_json()  # written before nodes were recorded
    choice = {"requested": "auto", "resolved": "fp32", "reason": "CPU AVX2: bf16 would be emulated"}
    new = Manifest.model_validate({**base, "precision": choice, "memory_format": "contiguous"})
    record = StageRecord.from_manifest(new, name="features", type="module", status="reused", wall_s=0.0, artifact="a")
    assert record.to_json()["precision"] == choice and record.memory_format == "contiguous"
