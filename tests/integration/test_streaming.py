"""Streaming Parquet through Ray Data into a real TorchTrainer (1 worker x 1 CPU on 2 CPUs):
every train row once per epoch, a seeded order that changes between epochs and repeats for
the same seed, every val row exactly once, counts equal to the scan's, and the CPU rule.
"""

from __future__ import annotations

import numpy as np
import pytest
from stream_loop import stream_loop

from cascade_ray.data.parquet import write_parquet
from cascade_ray.data.stream import scan_parquet
from cascade_ray.errors import DataError
from cascade_ray.ray_compat import LeanTorchTrainer, train_callback_classes

pytestmark = pytest.mark.slow

ROWS, SHAPE = 300, (1, 4, 4)
SPEC = {"input_column": "image", "target_column": "label"}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Three files of 100 rows in row groups of 25; pixel [0, 0, 0] holds the row id."""
    root = tmp_path_factory.mktemp("stream")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, *SHAPE)).astype(np.float32)
    x[:, 0, 0, 0] = np.arange(ROWS)
    y = rng.integers(0, 3, ROWS)
    import pyarrow.parquet as pq

    for i in range(3):
        write_parquet(root / f"part-{i}.parquet", x[i * 100 : (i + 1) * 100], y[i * 100 : (i + 1) * 100])
        table = pq.read_table(root / f"part-{i}.parquet")
        pq.write_table(table, root / f"part-{i}.parquet", row_group_size=25)
    return root


def _fit(data, ray_session, tmp_path, seed: int, name: str):
    import ray.train
    from ray.data import ExecutionOptions

    from cascade_ray.data.stream_ingest import StreamingDataConfig, streaming_datasets

    scan = scan_parquet(data, input_shape=None, target_kind="class", num_classes=3, val_fraction=0.2, seed=seed, **SPEC)
    datasets = streaming_datasets(data, input_shape=scan.input_shape, val_fraction=0.2, seed=seed, **SPEC)
    trainer = LeanTorchTrainer(
        stream_loop,
        train_loop_config={
            "shape": scan.input_shape,
            "train_rows": scan.train_rows,
            "val_rows": scan.val_rows,
            "seed": seed,
        },
        scaling_config=ray.train.ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1}),
        run_config=ray.train.RunConfig(storage_path=str(tmp_path), name=name),
        datasets=datasets,
        # preserve_order: the seeded order is then reproducible (parallel reads may finish in any order)
        dataset_config=StreamingDataConfig(ExecutionOptions(preserve_order=True)),
    )
    # with datasets, the lean trainer must keep Ray's DatasetsCallback (it feeds the shards)
    datasets_cls, _ = train_callback_classes()
    assert any(isinstance(cb, datasets_cls) for cb in trainer._create_default_callbacks())
    result = trainer.fit()
    return scan, result.return_value


@pytest.fixture(scope="module")
def runs(data, ray_session, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("runs")
    a = _fit(data, ray_session, tmp, seed=7, name="stream-a")
    b = _fit(data, ray_session, tmp, seed=7, name="stream-b")
    return a, b


def test_every_train_row_once_per_epoch_and_val_once(runs):
    (scan, m), _ = runs
    val = set(m["val"])
    for ids in m["epochs"]:
        assert len(ids) == len(set(ids)) == scan.train_rows
        assert not val & set(ids)
    assert len(m["val"]) == len(val) == scan.val_rows
    assert set(m["val"]) | set(m["epochs"][0]) == set(range(ROWS))
    assert m["batches"] == -(-scan.train_rows // 16)


def test_order_changes_between_epochs_and_repeats_for_a_seed(runs):
    (_, a), (_, b) = runs
    assert a["epochs"][0] != a["epochs"][1]
    assert a["epochs"] == b["epochs"]


def test_cpu_rule_refuses_two_workers_on_two_cpus():
    from cascade_ray.data.stream_ingest import streaming_resource_issue

    assert streaming_resource_issue(2, 1, 1, 1) is None
    issue = streaming_resource_issue(2, 2, 1, 1, stage_index=1)
    assert "stages[1].scaling.num_workers" in issue and "stages[1].scaling.resources_per_worker" in issue
    assert "data.streaming_cpus" in issue


def test_bad_row_in_streamed_batch_names_the_batch(tmp_path, ray_session):
    from cascade_ray.data.stream_ingest import StreamSource

    x = np.zeros((10, 1, 2, 2), np.float32)
    x[7, 0, 1, 1] = np.nan
    write_parquet(tmp_path / "bad.parquet", x, np.zeros(10, np.int64))
    ds = ray_session.data.read_parquet(str(tmp_path / "bad.parquet"))
    source = StreamSource(
        ds.iterator(),
        rows=10,
        input_shape=(1, 2, 2),
        target_kind="class",
        num_classes=2,
        mean=np.zeros((1, 1, 1), np.float32),
        std=np.ones((1, 1, 1), np.float32),
        shuffle_buffer_rows=0,
        **SPEC,
    )
    with pytest.raises(DataError, match=r"train split, epoch 0, batch 1, row 3 .*NaN/Inf"):
        list(source.train_epoch(4, rank=0, world=1, seed=0, epoch=0))
