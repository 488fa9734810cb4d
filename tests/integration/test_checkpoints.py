"""``train.checkpoint`` on a real Ray Train fit: the features stage of the debug cascade, 4 epochs,
``top_k: 2`` by ``val_loss`` (continuous: no ties between epochs), on a local folder with the
newest checkpoint kept (``save_last``) and on the moto S3 bucket without it. Which epochs stay is
worked out from the stage's own history, and the artifact must be the best epoch's weights.
(On digits val_loss has fallen every epoch so far, so the newest is among the best here; dropping a
newest that is not is tested on local folders and the bucket in tests/unit/test_checkpoint_retention.py.)"""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest
from paths import CONFIGS

from cascade_ray.api import RunOptions, run_pipeline
from cascade_ray.checks import load_config
from cascade_ray.models.weights import load_safetensors, state_digests
from cascade_ray.pipeline.artifacts import read_artifact
from cascade_ray.pipeline.fit import resumable_run
from cascade_ray.stage.worker import CHECKPOINT_FROZEN, CHECKPOINT_STATE, CHECKPOINT_WEIGHTS
from cascade_ray.storage import as_storage, local_copy

pytestmark = pytest.mark.slow

EPOCHS, TOP_K = 4, 2


def _run(storage: str, save_last: bool):
    cfg = load_config(
        CONFIGS / "debug.yaml",
        [
            f"storage_path={storage}",
            f"stages.features.train.epochs={EPOCHS}",
            f"stages.features.train.checkpoint.top_k={TOP_K}",
            "stages.features.train.checkpoint.metric=val_loss",
            f"stages.features.train.checkpoint.save_last={str(save_last).lower()}",
        ],
    )
    summary = run_pipeline(cfg, RunOptions(stop_after="features"), log=lambda _: None)
    return cfg, summary["stages"][0]


def _kept(stage_record) -> dict[int, dict[str, np.ndarray]]:
    """epoch -> weights of every checkpoint left in the stage's Ray run folder."""
    artifact, _ = read_artifact(stage_record["artifact"])
    run = as_storage(stage_record["artifact"]).parent.parent / "ray" / artifact.manifest.ray_run
    kept = {}
    for folder in run.iterdir():
        if folder.name.startswith("checkpoint_") and folder.is_dir():
            epoch = int(json.loads((folder / CHECKPOINT_STATE).read_text())["epoch"])
            with local_copy(folder / CHECKPOINT_WEIGHTS) as weights:
                kept[epoch] = load_safetensors(weights)
    return kept


def _check(cfg, record, save_last: bool) -> None:
    losses = {int(h["epoch"]): h["val_loss"] for h in record["history"]}
    assert sorted(losses) == list(range(1, EPOCHS + 1))
    best = sorted(losses, key=losses.__getitem__)[:TOP_K]
    expected = set(best) | ({EPOCHS} if save_last else set())
    kept = _kept(record)
    assert set(kept) == expected, (losses, sorted(kept))
    _, artifact = read_artifact(record["artifact"])
    assert set(artifact) == set(kept[best[0]])
    for key, value in kept[best[0]].items():  # the artifact is the best epoch's checkpoint, bit for bit
        assert np.array_equal(artifact[key], value), key
    # --resume continues from the newest checkpoint while it is kept; with it dropped, no Ray run is resumable
    found = resumable_run(as_storage(record["artifact"]).parent.parent / "ray", cfg.stages[0], 0, record["fingerprint"])
    if EPOCHS in expected:
        assert found is not None and found[1] == EPOCHS
    else:
        assert found is None


def test_top_k_on_local_storage_keeps_the_best_and_the_newest(s3, ray_session, tmp_path):
    # `s3` first: the module's Ray starts with the bucket's endpoint in its workers' environment
    cfg, record = _run(str(tmp_path), save_last=True)
    _check(cfg, record, save_last=True)


def test_top_k_on_object_storage_without_the_newest(s3, ray_session):
    cfg, record = _run(s3.uri(f"ckpt-{uuid.uuid4().hex[:8]}", "runs"), save_last=False)
    assert record["artifact"].startswith("s3://")
    _check(cfg, record, save_last=False)


def test_a_stage_on_a_frozen_upstream_checkpoints_only_what_it_trains(s3, ray_session):
    """``train.checkpoint.frozen: reference`` (the default) on a real fit: the encoder (2 DDP workers) on
    the frozen features stage, on the bucket. Every kept checkpoint holds the encoder's own tensors and
    names the features stage's by digest; the artifact is the best one made whole from the upstream."""
    storage = s3.uri(f"frozen-{uuid.uuid4().hex[:8]}", "runs")
    cfg = load_config(
        CONFIGS / "debug.yaml",
        [f"storage_path={storage}", "stages.encoder.train.checkpoint.top_k=2", "stages.encoder.train.epochs=2"],
    )
    summary = run_pipeline(cfg, RunOptions(stop_after="encoder"), log=lambda _: None)
    features, encoder = summary["stages"]
    _, upstream = read_artifact(features["artifact"])
    artifact, weights = read_artifact(encoder["artifact"])
    frozen = artifact.manifest.frozen_digest
    assert frozen and all(k.startswith(("blocks.features.", "heads.features.")) for k in frozen)
    assert frozen == state_digests(upstream, frozen)
    run = as_storage(encoder["artifact"]).parent.parent / "ray" / artifact.manifest.ray_run
    kept = {}
    for folder in run.iterdir():
        if folder.name.startswith("checkpoint_") and folder.is_dir():
            epoch = int(json.loads((folder / CHECKPOINT_STATE).read_text())["epoch"])
            assert json.loads((folder / CHECKPOINT_FROZEN).read_text())["digests"] == frozen
            with local_copy(folder / CHECKPOINT_WEIGHTS) as file:
                kept[epoch] = load_safetensors(file)
    assert sorted(kept) == [1, 2]
    for held in kept.values():
        assert set(held) == set(weights) - set(frozen)  # no frozen tensor written
    best = min(encoder["history"], key=lambda h: h["val_loss"])["epoch"]
    for key, value in weights.items():  # the artifact: the best checkpoint's tensors and the upstream's
        assert np.array_equal(value, kept[best][key] if key in kept[best] else upstream[key]), key
