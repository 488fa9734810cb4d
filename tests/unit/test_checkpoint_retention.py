"""``train.checkpoint``: its checks before Ray, its place in the fingerprint, and which kept
checkpoints rank best (real ``ray.train`` Checkpoint and Result objects on local folders, no Ray)."""

from __future__ import annotations

import json
import uuid

import pytest
import ray.train

from cascade_ray.checks import validate_config
from cascade_ray.config.metrics import retention_metric
from cascade_ray.errors import ConfigError
from cascade_ray.pipeline.fit import best_checkpoints, drop_last_checkpoint, kept_checkpoints
from cascade_ray.pipeline.stages import stage_fingerprint


def issues_of(raw) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        validate_config(raw)
    return {issue.path: issue.render() for issue in info.value.issues}


def _with(raw, **checkpoint):
    raw["stages"][0]["train"]["checkpoint"] = checkpoint
    return raw


def test_the_default_keeps_todays_single_best_by_train_metric(debug_raw):
    cfg = validate_config(debug_raw)
    retention = cfg.stages[0].train.checkpoint
    assert (retention.top_k, retention.metric, retention.mode, retention.save_last) == (1, "auto", "auto", True)
    assert retention_metric(cfg, cfg.stages[0]) == ("val_accuracy", "max")  # class data: train.metric auto
    debug_raw["stages"][0]["train"]["metric"] = "val_loss"
    cfg = validate_config(debug_raw)
    assert retention_metric(cfg, cfg.stages[0]) == ("val_loss", "min")


def test_an_explicit_metric_and_mode_rank_the_checkpoints(debug_raw):
    cfg = validate_config(_with(debug_raw, top_k=2, metric="val_loss", mode="min", save_last=False))
    assert retention_metric(cfg, cfg.stages[0]) == ("val_loss", "min")


@pytest.mark.parametrize(
    ("checkpoint", "key", "text"),
    [
        ({"metric": "val_los"}, "stages[0].train.checkpoint.metric", "did you mean 'val_loss'"),
        ({"metric": "train_loss"}, "stages[0].train.checkpoint.metric", "use one of: val_loss, val_accuracy"),
        ({"metric": "val_map"}, "stages[0].train.checkpoint.metric", "data.target.kind 'class'"),
        (
            {"metric": "val_loss", "mode": "max"},
            "stages[0].train.checkpoint.mode",
            "set stages[0].train.checkpoint.mode: min",
        ),
        ({"mode": "min"}, "stages[0].train.checkpoint.mode", "val_accuracy improves as it gets larger"),
        ({"top_k": 3}, "stages[0].train.checkpoint.top_k", "set stages[0].train.checkpoint.top_k: 2 or less"),
        ({"top_k": 0}, "stages[0].train.checkpoint.top_k", "greater than or equal to 1"),
        ({"mode": "maximum"}, "stages[0].train.checkpoint.mode", "auto"),
        ({"topk": 2}, "stages[0].train.checkpoint.topk", "top_k"),
        ({"save_last": "no"}, "stages[0].train.checkpoint.save_last", "bool"),
    ],
)
def test_a_bad_retention_names_its_key_and_the_fix(debug_raw, checkpoint, key, text):
    found = issues_of(_with(debug_raw, **checkpoint))  # the debug stage trains 2 epochs
    assert key in found, found
    assert text in found[key], found[key]


def test_how_many_are_kept_is_not_in_the_fingerprint_which_one_is_the_artifact_is(debug_raw):
    def fingerprint(**checkpoint):
        raw = json.loads(json.dumps(debug_raw))
        return stage_fingerprint(validate_config(_with(raw, **checkpoint)), 0, "", "data")

    today = stage_fingerprint(validate_config(debug_raw), 0, "", "data")
    assert fingerprint() == today  # the defaults leave every existing fingerprint as it was
    assert fingerprint(top_k=2, save_last=False) == today  # the same weights are trained and picked
    assert fingerprint(metric="val_loss") != today  # another checkpoint may become the artifact
    assert fingerprint(metric="val_loss") == fingerprint(metric="val_loss", top_k=2)


def _result(tmp_path, history: list[dict[str, float]], kept_epochs: list[int]) -> ray.train.Result:
    """A finished fit's Result as Ray builds it: every kept checkpoint (the newest among them)."""
    kept = []
    for epoch in kept_epochs:
        folder = tmp_path / f"checkpoint_{epoch}"
        folder.mkdir()
        (folder / "weights").write_text(str(epoch))
        kept.append((ray.train.Checkpoint(str(folder)), history[epoch - 1]))
    latest = kept[-1] if kept_epochs[-1] == len(history) else (None, history[-1])
    return ray.train.Result(
        metrics=latest[1], checkpoint=latest[0], error=None, path=str(tmp_path), best_checkpoints=kept[::-1]
    )


HISTORY = [{"epoch": e, "val_loss": loss} for e, loss in enumerate([0.9, 0.4, 0.6, 0.5], start=1)]


def test_the_best_are_ranked_by_the_metric_and_the_newest_is_dropped_when_not_among_them(tmp_path):
    result = _result(tmp_path, HISTORY, [2, 4])  # top_k 1: the best (epoch 2) and the newest (epoch 4)
    assert [m["epoch"] for _, m in kept_checkpoints(result)] == [2, 4]
    assert [m["epoch"] for _, m in best_checkpoints(result, "val_loss", "min", 1)] == [2]
    assert [m["epoch"] for _, m in best_checkpoints(result, "val_loss", "max", 1)] == [4]
    assert drop_last_checkpoint(result, "val_loss", "min", 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_2"]


def test_the_newest_stays_when_it_is_one_of_the_best(tmp_path):
    result = _result(tmp_path, HISTORY, [2, 4])
    assert not drop_last_checkpoint(result, "val_loss", "min", 2)  # epochs 2 and 4 are the two best
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_2", "checkpoint_4"]


def test_the_newest_is_dropped_on_object_storage_too(s3):
    """The same on the moto S3 bucket: the Checkpoint's own filesystem deletes its prefix."""
    fs, base = s3.filesystem(), f"{s3.bucket}/retention-{uuid.uuid4().hex[:8]}"
    kept = []
    for epoch in (2, 4):
        with fs.open_output_stream(f"{base}/checkpoint_{epoch}/weights") as out:
            out.write(str(epoch).encode())
        kept.append((ray.train.Checkpoint(f"{base}/checkpoint_{epoch}", filesystem=fs), HISTORY[epoch - 1]))
    result = ray.train.Result(
        metrics=HISTORY[-1], checkpoint=kept[-1][0], error=None, path=base, best_checkpoints=kept[::-1]
    )
    assert drop_last_checkpoint(result, "val_loss", "min", 1)
    assert s3.keys(base.split("/", 1)[1]) == [f"{base.split('/', 1)[1]}/checkpoint_2/weights"]


@pytest.mark.parametrize(
    ("snapshot", "reason"),
    [
        (
            "",
            "its checkpoint snapshot is empty or cut short: the driver was most likely killed while Ray Train rewrote it",
        ),
        ('{"checkpoint_results": [', "its checkpoint snapshot is empty or cut short"),
        (None, "Ray cannot read it back: "),
    ],
    ids=["empty", "cut-short", "none"],
)
def test_a_run_that_cannot_be_continued_is_said_so_not_skipped_silently(debug_raw, tmp_path, snapshot, reason):
    """--resume's look at an interrupted stage: a Ray run folder Ray cannot read back (here, as a driver
    SIGKILLed while Ray Train truncated and rewrote its snapshot leaves it) means training from the first
    epoch, and the user is told which run and why."""
    from cascade_ray.pipeline.fit import resumable_run

    cfg = validate_config(debug_raw)
    fp = "f" * 64
    run = tmp_path / "ray" / f"01-encoder-{fp[:12]}-a1"
    (run / "checkpoint_2026-12-07_05-45-49.457409").mkdir(parents=True)
    if snapshot is not None:
        (run / "checkpoint_manager_snapshot.json").write_text(snapshot)
    said: list[str] = []
    assert resumable_run(tmp_path / "ray", cfg.stages[1], 1, fp, on_skip=said.append) is None
    assert len(said) == 1 and said[0].startswith(
        f"  stage encoder: its interrupted Ray run {run.name} cannot be continued ("
    )
    assert reason in said[0] and said[0].endswith("it trains from its first epoch in a new attempt")
    assert resumable_run(tmp_path / "ray", cfg.stages[1], 1, "0" * 64, on_skip=said.append) is None
    assert len(said) == 1  # no earlier run of that fingerprint: nothing to say
