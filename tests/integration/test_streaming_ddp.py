"""A streamed stage on 2 DDP workers: the train stream split equally (both ranks step together,
``rows // 2`` rows each), val rows once across ranks. Its own Ray with 3 logical CPUs on this
2-core machine: 2 workers x 1 CPU plus the one ``data.streaming_cpus`` leaves to Ray Data."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import yaml

from cascade_ray.api import RunOptions, run_pipeline
from cascade_ray.checks import load_config
from cascade_ray.data.parquet import write_parquet
from cascade_ray.data.stream import is_val_row

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray3():
    import ray

    from cascade_ray.constants import apply_ray_env_defaults

    env = apply_ray_env_defaults()
    ray.init(num_cpus=3, runtime_env={"env_vars": env | {k: v for k, v in os.environ.items() if k == "PYTHONPATH"}})
    yield ray
    ray.shutdown()


def test_two_streamed_ddp_workers_step_together_over_an_equal_split(ray3, tmp_path):
    from sklearn.datasets import load_digits

    d = load_digits()
    x, y = d.images.astype(np.uint8)[:, None], d.target.astype(np.int64)
    write_parquet(tmp_path / "train.parquet", x[:1500], y[:1500])
    write_parquet(tmp_path / "test.parquet", x[1500:], y[1500:])
    config = {
        "name": "ddp-stream",
        "seed": 0,
        "data": {"source": "parquet", "streaming": True, "val_fraction": 0.2, "target": {"num_classes": 10}},
        "stages": [
            {
                "name": "features",
                "model": {"type": "resnet", "in_channels": 1, "widths": [8, 16], "blocks": [1, 1]},
                "solver": {"type": "AdamW", "lr": 1e-2},
                "train": {"epochs": 2, "batch_size": 32, "log_interval": 10},
                "scaling": {"num_workers": 2},
            }
        ],
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    cfg = load_config(
        tmp_path / "c.yaml",
        [
            f"data.path={tmp_path / 'train.parquet'}",
            f"data.test_path={tmp_path / 'test.parquet'}",
            f"storage_path={tmp_path / 'runs'}",
        ],
    )
    summary = run_pipeline(cfg, RunOptions(), log=lambda _: None)
    stage = summary["stages"][0]
    assert stage["num_workers"] == 2 and len(stage["nodes"]) == 2
    train_rows = int((~is_val_row(x[:1500], 0.2, 0)).sum())
    per_epoch = math.ceil((train_rows // 2) / 32)  # each rank gets rows // world of the equal split
    assert [e["optimizer_steps"] for e in stage["history"]] == [per_epoch, per_epoch]
    assert summary["test_accuracy"] > 0.5, summary["test_metrics"]
