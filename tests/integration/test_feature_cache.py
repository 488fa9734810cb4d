"""The frozen-feature cache on the debug cascade under Ray: computed once in Ray tasks, equal to
the frozen upstream's outputs, keyed by the upstream, read back instead of recomputed, and
turned off (with the reason logged) when the stage's inputs are not deterministic."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from paths import CONFIGS

from cascade_ray.api import RunOptions, run_pipeline
from cascade_ray.checks import load_config
from cascade_ray.data.source import load_data
from cascade_ray.errors import ArtifactError
from cascade_ray.pipeline.artifacts import read_artifact
from cascade_ray.pipeline.features import compute_features, upstream_outputs

# The encoder pinned to fp32: the cache is computed in fp32, while without the cache the upstream
# runs inside the stage's autocast; under precision auto that is bf16 on a CPU with AVX512-BF16,
# and the cached-vs-uncached comparison below would measure bf16 rounding, not the cache.
PINNED = ["stages.encoder.solver.precision=fp32"]


def _run(storage: Path, overrides: list[str] = (), **kwargs):
    cfg = load_config(CONFIGS / "debug.yaml", [f"storage_path={storage}", *PINNED, *overrides])
    lines: list[str] = []
    summary = run_pipeline(cfg, RunOptions(**kwargs), log=lines.append)
    return cfg, summary, lines


@pytest.fixture(scope="module")
def first(ray_session, tmp_path_factory):
    """The debug pipeline with the default cache_features: auto (encoder and classifier cache)."""
    storage = tmp_path_factory.mktemp("cache")
    return (storage, *_run(storage))


def _stage(summary, name):
    return next(s for s in summary["stages"] if s["name"] == name)


def _stored(record) -> tuple[np.ndarray, np.ndarray]:
    table = pq.read_table(record["feature_cache"]["path"])
    shape = record["feature_cache"]["shape"]
    x = table.column("x").combine_chunks().flatten().to_numpy().reshape(-1, *shape)
    split = table.column("split").to_numpy(zero_copy_only=False)
    return x[split == "train"], x[split == "val"]


def test_downstream_stages_train_on_cached_features_equal_to_the_frozen_upstream(first):
    _, cfg, summary, lines = first
    data = load_data(cfg.data, cfg.seed)
    for index, name in ((1, "encoder"), (2, "classifier")):
        record = _stage(summary, name)
        assert record["feature_cache"]["status"] == "computed", lines
        x_train, x_val = _stored(record)
        assert (len(x_train), len(x_val)) == (len(data.y_train), len(data.y_val))
        # the classifier's cache was computed from the encoder's (one module), yet equals the whole chain
        upstream = read_artifact(_stage(summary, cfg.stages[index - 1].name)["artifact"])[1]
        expected = upstream_outputs(cfg, index, data, upstream)  # in-process, the whole chain from raw images
        np.testing.assert_allclose(x_train, expected["train"], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(x_val, expected["val"], rtol=1e-4, atol=1e-5)
    assert any("encoder: feature cache computed" in line for line in lines)
    # the composed model (raw images through every stage) is what the test split measured
    assert summary["test_accuracy"] > 0.8


def test_ray_tasks_compute_the_same_features_in_one_shard_per_worker(first, ray_session):
    _, cfg, summary, _ = first
    data = load_data(cfg.data, cfg.seed)
    upstream = read_artifact(_stage(summary, "features")["artifact"])[1]
    sizes = {"train": len(data.y_train), "val": len(data.y_val)}
    refs = [ray_session.put(data.to_arrays()), ray_session.put(upstream)]
    # the encoder has 2 workers: two tasks, each with the stage's per-worker resources (on one node
    # the pipeline computes in the driver; multi-node and GPU clusters use these tasks)
    shards, nodes, devices = compute_features(cfg, 1, *refs, None, None, sizes, where="tasks")
    assert len(nodes) == 2 and nodes[0] == ray_session.get_runtime_context().get_node_id()  # one node here
    assert devices == ["cpu", "cpu"]  # no GPU here: each task computed on its CPUs
    expected = upstream_outputs(cfg, 1, data, upstream)
    for split in ("train", "val"):
        np.testing.assert_allclose(shards[f"x_{split}"], expected[split], rtol=1e-4, atol=1e-5)


def test_a_retrained_stage_reads_the_stored_features_and_trains_bit_identically(first):
    storage, _, summary, _ = first
    before = _stage(summary, "encoder")
    shutil.rmtree(before["artifact"])  # features reused (same weights -> same cache key), encoder retrains
    _, again, lines = _run(storage, resume=True, stop_after="encoder")
    record = _stage(again, "encoder")
    assert _stage(again, "features")["status"] == "reused" and record["status"] == "trained"
    assert record["feature_cache"]["status"] == "read", lines
    assert record["digest"] == before["digest"]  # read cache == computed cache, to the bit


def test_a_damaged_stored_cache_is_an_error_under_on_and_recomputed_under_auto(first):
    storage, _, summary, _ = first
    before = _stage(summary, "encoder")
    path = Path(before["feature_cache"]["path"])
    table = pq.read_table(path)
    x = table.column("x").combine_chunks()
    values = x.flatten().to_numpy().copy()
    values.view(np.uint32)[7] ^= 1 << 4  # one bit of one feature, the metadata (and its digest) kept
    flipped = pa.FixedSizeListArray.from_arrays(pa.array(values), x.type.list_size)
    pq.write_table(
        pa.table({"split": table.column("split"), "x": flipped}).replace_schema_metadata(table.schema.metadata), path
    )
    shutil.rmtree(before["artifact"])
    with pytest.raises(ArtifactError, match=re.escape(f"stored feature cache {path} of stage 'encoder' is damaged")):
        _run(storage, ["stages.encoder.freeze.cache_features=on"], resume=True, stop_after="encoder")
    _, again, lines = _run(storage, resume=True, stop_after="encoder")
    record = _stage(again, "encoder")
    assert record["feature_cache"]["status"] == "computed", lines
    assert any(f"WARNING: encoder: stored feature cache {path} is damaged" in line for line in lines), lines
    assert record["digest"] == before["digest"]  # recomputed features == the original ones, to the bit


def test_cache_off_trains_the_same_stage_through_the_upstream(first):
    storage, _, summary, _ = first
    cached = _stage(summary, "encoder")
    shutil.rmtree(cached["artifact"])
    _, plain, lines = _run(storage, ["stages.encoder.freeze.cache_features=off"], resume=True, stop_after="encoder")
    record = _stage(plain, "encoder")
    assert record["status"] == "trained" and "feature_cache" not in record
    assert not any("encoder: feature cache" in line for line in lines)  # off by request: nothing to explain
    # same data, batches and weights; only float rounding of batched vs per-step upstream passes differs
    assert record["metrics"]["val_loss"] == pytest.approx(cached["metrics"]["val_loss"], rel=1e-3)
    assert abs(record["metrics"]["val_accuracy"] - cached["metrics"]["val_accuracy"]) <= 2 / 288


def test_auto_turns_the_cache_off_for_augmented_inputs_and_says_why(first):
    storage = first[0]
    _, summary, lines = _run(storage, ["stages.encoder.train.augment.hflip=true"], resume=True, stop_after="encoder")
    assert "feature_cache" not in _stage(summary, "encoder")
    assert any("encoder: feature cache off: stages[1].train.augment randomizes" in line for line in lines), lines
