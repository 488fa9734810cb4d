"""Pipelines on streamed data (``data.streaming: true``): Parquet read through Ray Data by every
stage's workers from the S3 fixture's bucket, the run (artifacts, streamed feature cache) stored
there too (local Parquet streams in test_streaming and test_streaming_ddp); the scan's errors
before Ray; the CPU rule for Ray Data's read tasks."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from cascade_ray import cli
from cascade_ray.api import RunOptions, run_pipeline
from cascade_ray.checks import load_config
from cascade_ray.data.parquet import write_parquet
from cascade_ray.data.stream import is_val_row
from cascade_ray.errors import ConfigError, DataError
from cascade_ray.pipeline.records import read_manifest
from cascade_ray.storage import as_storage

pytestmark = pytest.mark.slow

CONFIG = {
    "name": "streamed",
    "seed": 0,
    "data": {"source": "parquet", "streaming": True, "val_fraction": 0.2, "target": {"num_classes": 10}},
    "stages": [
        {
            "name": "features",
            "model": {"type": "resnet", "in_channels": 1, "widths": [8, 16], "blocks": [1, 1]},
            "solver": {"type": "AdamW", "lr": 1e-2},
            "train": {"epochs": 2, "batch_size": 64, "log_interval": 10},
        },
        {
            "name": "classifier",
            "model": {"type": "mlp", "in_features": 16, "hidden": [32]},
            "solver": {"type": "Adam", "lr": 1e-2},
            "train": {"epochs": 1, "batch_size": 64, "log_interval": 10},
        },
    ],
}


def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    return d.images.astype(np.uint8)[:, None], d.target.astype(np.int64)


def _config(tmp: Path, train: str, test: str, storage: str, *overrides: str):
    path = tmp / "streamed.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    return load_config(path, [f"data.path={train}", f"data.test_path={test}", f"storage_path={storage}", *overrides])


@pytest.fixture(scope="module")
def local_data(tmp_path_factory):
    """Digits as Parquet: train as two files (row groups of 256 rows), test as one."""
    root = tmp_path_factory.mktemp("data")
    x, y = _digits()
    order = np.random.default_rng(0).permutation(len(y))
    train, test = order[:1500], order[1500:]
    (root / "train").mkdir()
    for i, part in enumerate(np.array_split(train, 2)):
        write_parquet(root / "train" / f"part-{i}.parquet", x[part], y[part])
    write_parquet(root / "test.parquet", x[test], y[test])
    return root, x[train], y[train]


@pytest.fixture(scope="module")
def bucket(s3, local_data):
    """The same Parquet files in the bucket, and the run's storage there: (train, test, storage) URIs."""
    root, _, _ = local_data
    prefix = f"stream-{uuid.uuid4().hex[:8]}"
    for path in [*sorted((root / "train").glob("*.parquet")), root / "test.parquet"]:
        key = path.relative_to(root).as_posix()
        as_storage(s3.uri(prefix, "data", key)).write_bytes(path.read_bytes())
    return s3.uri(prefix, "data", "train"), s3.uri(prefix, "data", "test.parquet"), s3.uri(prefix, "runs")


@pytest.fixture(scope="module")
def local_run(s3, ray_session, bucket, tmp_path_factory):
    """(s3 first: the module's Ray must start with the bucket's endpoint and keys in its env)"""
    tmp = tmp_path_factory.mktemp("run")
    cfg = _config(tmp, *bucket)
    lines: list[str] = []
    return run_pipeline(cfg, RunOptions(), log=lines.append), lines


def test_a_streamed_pipeline_trains_every_stage_from_parquet_in_a_bucket(local_run, local_data, bucket, s3):
    summary, lines = local_run
    _, x, _ = local_data
    assert summary["storage"] == f"{bucket[2]}/streamed"
    assert [s["status"] for s in summary["stages"]] == ["trained", "trained"]
    assert summary["test_accuracy"] > 0.7, summary["test_metrics"]  # 3 streamed epochs on digits; chance is 0.1
    assert set(summary["test_metrics"]) == {"loss", "accuracy", "top5_accuracy"}
    on_disk = json.loads(as_storage(f"{summary['storage']}/summary.json", "summary").read_text())
    assert on_disk["test_metrics"]["accuracy"] == summary["test_accuracy"]
    # the validation rows are the content-hash share, exactly as the scan counted them
    val = int(is_val_row(x, 0.2, 0).sum())
    assert any(f"train {len(x) - val}, val {val} (content-hash split)" in line for line in lines), lines[:5]
    # the classifier trains on its frozen upstream's outputs, computed by Ray Data into shards in the bucket
    cache = summary["stages"][1]["feature_cache"]
    assert cache["status"] == "computed" and cache["shape"][0] == 16 and len(cache["shape"]) == 3, cache
    folder = as_storage(cache["path"])
    assert folder.uri.startswith("s3://"), cache["path"]
    meta = json.loads((folder / "_cache.json").read_text())
    assert meta["rows"] == {"train": len(x) - val, "val": val} and meta["shape"] == cache["shape"]
    assert list((folder / "train").glob("*.parquet")) and list((folder / "val").glob("*.parquet"))
    assert not any("INFO logging_progress" in line for line in lines)
    for record in summary["stages"]:
        spec = read_manifest(as_storage(record["artifact"]) / "manifest.json").data_spec
        assert spec["streamed"] and spec["input_shape"] == [1, 8, 8] and spec["num_classes"] == 10
        train_rows = x[~is_val_row(x, 0.2, 0)].astype(np.float64)
        assert spec["stats_shape"] == [1, 1, 1]  # one channel
        assert np.ravel(spec["mean"]) == pytest.approx([train_rows.mean()], rel=1e-5)
        assert np.ravel(spec["std"]) == pytest.approx([train_rows.std()], rel=1e-5)
        history = record["history"]
        assert all(np.isfinite(e["val_loss"]) for e in history)


def test_a_changed_downstream_stage_reads_the_stored_streamed_cache(local_run, bucket, tmp_path):
    summary, _ = local_run
    cfg = _config(tmp_path, *bucket, "stages.classifier.solver.lr=5e-3")
    lines: list[str] = []
    again = run_pipeline(cfg, RunOptions(resume=True), log=lines.append)
    assert [s["status"] for s in again["stages"]] == ["reused", "trained"]
    assert again["stages"][1]["feature_cache"]["status"] == "read", lines
    assert again["stages"][1]["feature_cache"]["path"] == summary["stages"][1]["feature_cache"]["path"]
    assert again["test_accuracy"] > 0.7


SPACE = """
stage: classifier
metric: val_accuracy
mode: max
num_samples: 2
scheduler: {type: fifo}
space:
  solver.lr: {choice: [3.0e-3, 1.0e-2]}
"""


def test_a_sweep_of_a_stage_streams_the_cached_features_in_every_trial(local_run, bucket, tmp_path, capsys):
    """On the module run's storage with --resume: its features stage is reused (no second streamed
    training of it) and both trials read the streamed cache the run computed."""
    summary, _ = local_run
    train, test, storage = bucket
    run = as_storage(summary["storage"])
    features = run / "stages" / "features" / "manifest.json"
    before = features.read_bytes()
    (tmp_path / "streamed.yaml").write_text(yaml.safe_dump(CONFIG))
    (tmp_path / "space.yaml").write_text(SPACE)
    args = [
        "tune",
        str(tmp_path / "streamed.yaml"),
        "--space",
        str(tmp_path / "space.yaml"),
        f"data.path={train}",
        f"data.test_path={test}",
        f"storage_path={storage}",
        "--resume",
        "--log-level",
        "warning",
    ]
    assert cli.main(args) == 0, capsys.readouterr().err[-3000:]
    assert features.read_bytes() == before  # reused, not trained again
    exp = run / "tune" / "classifier"
    assert (exp / "best.yaml").is_file() and (exp / "results.parquet").is_file()
    trials = sorted(p.name for p in (exp / "trials").glob("trial-*"))
    assert len(trials) == 2
    # both trials read the same streamed cache shards (no in-memory copy of the data exists)
    assert [(p / "_cache.json").is_file() for p in (run / "cache" / "classifier").iterdir()] == [True]


def test_a_bad_row_is_a_data_error_naming_the_file_and_row_group_before_ray(local_data, tmp_path):
    x = np.random.default_rng(0).normal(size=(600, 4)).astype(np.float32)
    x[517, 2] = np.nan
    table = pa.table(
        {"image": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), 4), "label": np.arange(600) % 3}
    )
    pq.write_table(table, tmp_path / "bad.parquet", row_group_size=256)
    cfg = load_config(
        Path(__file__).resolve().parents[2] / "pipelines" / "configs" / "debug.yaml",
        [
            "data.source=parquet",
            f"data.path={tmp_path / 'bad.parquet'}",
            f"data.test_path={tmp_path / 'bad.parquet'}",
            "data.streaming=true",
            "data.target.num_classes=3",
            f"storage_path={tmp_path / 'runs'}",
        ],
        preflight=False,  # the resnet stages take images; the scan fails first
    )
    with pytest.raises(DataError) as info:
        run_pipeline(cfg, RunOptions(), log=lambda _: None)
    text = str(info.value)
    assert "bad.parquet" in text and "row group 2" in text and "row 5" in text, text
    assert "NaN" in text or "nan" in text.lower()


def test_a_stage_that_leaves_ray_data_no_cpu_is_a_config_error(ray_session, local_data, tmp_path):
    root, _, _ = local_data
    cfg = _config(
        tmp_path,
        str(root / "train"),
        str(root / "test.parquet"),
        str(tmp_path / "runs"),
        "stages.features.scaling.num_workers=2",
    )
    with pytest.raises(ConfigError) as info:
        run_pipeline(cfg, RunOptions(), log=lambda _: None)
    text = str(info.value)
    assert "stages[0].scaling.num_workers" in text and "data.streaming_cpus" in text, text
