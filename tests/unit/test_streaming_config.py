"""The streaming knobs before any Ray: config rules, the `auto` decision, the CPU rule, loss auto."""

from __future__ import annotations

import pytest
from paths import CONFIGS

from cascade_ray.checks import load_config
from cascade_ray.config.schema import LossConfig
from cascade_ray.data.stream_ingest import decide_streaming
from cascade_ray.errors import ConfigError
from cascade_ray.models.losses import build_loss, loss_type
from cascade_ray.pipeline.streaming import check_streaming_resources

PARQUET = ["data.source=parquet", "data.path=/nowhere/train.parquet", "data.test_path=/nowhere/test.parquet"]


def _issues(overrides: list[str]) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_config(CONFIGS / "debug.yaml", overrides, preflight=False)
    return {i.path: i.render() for i in info.value.issues}


def test_streaming_needs_parquet_and_the_class_count():
    found = _issues(["data.streaming=true"])
    assert "data.streaming" in found and "data.source is 'digits'" in found["data.streaming"]
    found = _issues([*PARQUET, "data.streaming=true", "data.train_size=100"])
    assert "data.target.num_classes" in found and "required with data.streaming" in found["data.target.num_classes"]
    assert "data.train_size" in found


def test_auto_streams_only_over_its_share_of_the_object_store():
    small, line = decide_streaming("auto", 100 * 2**20, 1000 * 2**20)
    assert not small and "10%" in line and "in memory" in line
    big, line = decide_streaming("auto", 400 * 2**20, 1000 * 2**20)
    assert big and "40%" in line and "streaming with Ray Data" in line
    assert decide_streaming("true", 0, 1) == (True, "data.streaming=true")


def test_a_stage_that_leaves_no_cpu_to_ray_data_names_its_keys():
    cfg = load_config(
        CONFIGS / "debug.yaml", [*PARQUET, "data.streaming=true", "data.target.num_classes=10"], preflight=False
    )
    check_streaming_resources(cfg.model_copy(update={"stages": cfg.stages[:1]}), cluster_cpus=2.0)  # 1 + 1 fits
    with pytest.raises(ConfigError) as info:
        check_streaming_resources(cfg, cluster_cpus=2.0)  # the encoder runs 2 workers x 1 CPU
    paths = [i.path for i in info.value.issues]
    assert paths == ["stages[1].scaling.num_workers / stages[1].scaling.resources_per_worker"], paths
    assert "data.streaming_cpus" in info.value.issues[0].render()


@pytest.mark.parametrize("kind, expected", [("class", "cross_entropy"), ("multilabel", "bce"), ("regression", "mse")])
def test_loss_auto_is_the_target_kinds_own_loss(kind, expected):
    assert loss_type(LossConfig(), kind) == expected
    assert (
        type(build_loss(LossConfig(), kind)).__name__
        == {
            "cross_entropy": "CrossEntropyLoss",
            "bce": "BCEWithLogitsLoss",
            "mse": "MSELoss",
        }[expected]
    )
