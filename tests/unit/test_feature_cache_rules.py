"""The feature cache without Ray: when it may be used, training on it, and its Parquet copy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fakes import ListReporter
from paths import CONFIGS

from cascade_ray.checks import load_config
from cascade_ray.checks.semantic import cache_refusals
from cascade_ray.pipeline.features import _read_parquet, _write_parquet, cache_decision, cache_key, upstream_outputs
from cascade_ray.stage.loop import run_stage

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def trained_features(digits):
    # fp32 on every CPU kind (precision auto would be bf16 on AVX512-BF16): the cached-vs-raw
    # comparison below is about fp32 rounding of batched vs per-step upstream passes
    cfg = load_config(
        CONFIGS / "debug.yaml",
        [
            "stages.encoder.scaling.num_workers=1",
            "stages.features.solver.precision=fp32",
            "stages.encoder.solver.precision=fp32",
        ],
    )
    reporter = ListReporter()
    run_stage(cfg, 0, digits, None, reporter, CPU)
    return cfg, reporter.states[-1]


@pytest.mark.parametrize(
    ("overrides", "index", "expected"),
    [
        ([], 1, None),
        ([], 0, "the first stage has no upstream"),
        (["stages.encoder.train.augment.crop_padding=1"], 1, "stages[1].train.augment randomizes"),
        (
            ["stages.encoder.trainable_layers.features=1"],
            1,
            "stages[1].trainable_layers opens upstream layers (features)",
        ),
        (["stages.encoder.freeze.cache_features=off"], 1, "cache_features is off"),
    ],
)
def test_auto_caches_only_deterministic_inputs_of_a_frozen_upstream(overrides, index, expected):
    cfg = load_config(CONFIGS / "debug.yaml", overrides)
    wanted, reason = cache_decision(cfg, index)
    assert wanted is (expected is None)
    assert expected is None or expected in reason


def test_a_joint_stage_never_caches():
    cfg = load_config(CONFIGS / "debug_joint.yaml")
    index = next(i for i, s in enumerate(cfg.stages) if s.type == "joint")
    assert any(
        "joint stage trains its upstream" in reason
        for reason, _ in cache_refusals(cfg.stages[index], index, f"stages[{index}]")
    )


def test_training_on_cached_features_matches_training_through_the_upstream(digits, trained_features):
    cfg, upstream = trained_features
    features = upstream_outputs(cfg, 1, digits, upstream)
    assert features["train"].shape == (len(digits.y_train), 16, 4, 4)
    runs = {}
    for name, cached in (("raw", None), ("cached", {"x_train": features["train"], "x_val": features["val"]})):
        reporter = ListReporter()
        outcome = run_stage(cfg, 1, digits, upstream, reporter, CPU, features=cached)
        runs[name] = (reporter, outcome)
    (raw, raw_out), (cached, cached_out) = runs["raw"], runs["cached"]
    # same batches and weights; only float rounding differs (batched vs per-step upstream passes)
    assert cached.reports[-1]["val_loss"] == pytest.approx(raw.reports[-1]["val_loss"], rel=1e-3)
    for key, value in raw.states[-1].items():
        np.testing.assert_allclose(cached.states[-1][key], value, rtol=1e-3, atol=1e-4, err_msg=key)
    assert cached_out.frozen_digest == raw_out.frozen_digest  # the upstream is in the model, untouched


def test_cached_features_of_the_wrong_size_are_refused(digits, trained_features):
    cfg, upstream = trained_features
    features = upstream_outputs(cfg, 1, digits, upstream)
    with pytest.raises(RuntimeError, match="feature cache holds 3 train samples"):
        run_stage(
            cfg,
            1,
            digits,
            upstream,
            ListReporter(),
            CPU,
            features={"x_train": features["train"][:3], "x_val": features["val"]},
        )


def test_parquet_copy_round_trips_and_a_stale_or_damaged_one_is_recomputed(tmp_path, trained_features):
    cfg, upstream = trained_features
    key = cache_key("fp", upstream, ["features"])
    assert key != cache_key(
        "fp", {**upstream, "blocks.features.stem.0.weight": upstream["blocks.features.stem.0.weight"] + 1}, ["features"]
    )
    assert key == cache_key(
        "fp", {**upstream, "heads.features.fc.bias": upstream["heads.features.fc.bias"] + 1}, ["features"]
    )  # heads compute no features
    rng = np.random.default_rng(0)
    arrays = {
        "x_train": rng.standard_normal((5, 2, 3)).astype(np.float32),
        "x_val": rng.standard_normal((2, 2, 3)).astype(np.float32),
    }
    path = tmp_path / "cache" / "encoder" / "k.parquet"
    _write_parquet(path, key, arrays, "rows")
    lines: list[str] = []
    back = _read_parquet(path, key, {"train": 5, "val": 2}, lines.append, "encoder", rows="rows", strict=False)
    assert back is not None and all(np.array_equal(back[k], arrays[k]) for k in arrays)
    assert (
        _read_parquet(path, "other-key", {"train": 5, "val": 2}, lines.append, "encoder", rows="rows", strict=False)
        is None
    )
    assert "key does not match" in lines[-1]
    assert _read_parquet(path, key, {"train": 6, "val": 2}, lines.append, "encoder", rows="rows", strict=False) is None
    assert "holds {'train': 5, 'val': 2} samples" in lines[-1]
    path.write_bytes(b"not parquet")
    assert (
        _read_parquet(path, key, {"train": 5, "val": 2}, lines.append, "encoder", rows="rows", strict=False) is None
        and "recomputing" in lines[-1]
    )
