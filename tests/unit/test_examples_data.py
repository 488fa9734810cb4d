"""Example data (cascade_ray.data.examples, pipelines/make_example_data.py) and the example
configs' errors: no Ray."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from paths import CONFIGS, ROOT
from sklearn.model_selection import train_test_split

from cascade_ray.checks import load_config
from cascade_ray.config.schema import DataConfig
from cascade_ray.data import load_parquet, write_parquet
from cascade_ray.data.examples import (
    DIGIT_FLAGS,
    EXAMPLES,
    INPUT_COLUMN,
    TARGET_COLUMN,
    TEST_FRACTION,
    digit_flags,
    example_set,
    write_example_data,
)
from cascade_ray.data.source import load_data
from cascade_ray.errors import ConfigError, DataError

SHAPES = {"breast_cancer": (30,), "diabetes": (10,), "digits_multilabel": (8, 8)}
DTYPES = {"breast_cancer": np.float32, "diabetes": np.float32, "digits_multilabel": np.uint8}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    return write_example_data(tmp_path_factory.mktemp("examples"))


def _sorted_rows(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Rows of inputs and targets side by side, in a canonical order (the loader shuffles train/val)."""
    rows = np.concatenate([x.reshape(len(x), -1).astype(np.float64), y.reshape(len(y), -1).astype(np.float64)], 1)
    return rows[np.lexsort(rows.T[::-1])]


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_round_trip_is_bit_exact(written, name):
    data = example_set(name)
    assert data.x.shape[1:] == SHAPES[name] and data.x.dtype == DTYPES[name]
    stratify = data.y if data.target_kind == "class" else None
    x_tr, x_te, y_tr, y_te = train_test_split(
        data.x, data.y, test_size=TEST_FRACTION, stratify=stratify, random_state=0
    )
    train, test = written[name]
    assert (train.parent.name, train.name, test.name) == (name, "train.parquet", "test.parquet")
    splits = load_parquet(
        train,
        test_path=test,
        input_column=INPUT_COLUMN,
        target_column=TARGET_COLUMN,
        target_kind=data.target_kind,
        train_size=None,
        val_fraction=0.2,
        seed=0,
    )
    assert splits.input_shape == SHAPES[name] and splits.x_test.dtype == DTYPES[name]
    np.testing.assert_array_equal(splits.x_test, x_te, strict=True)
    # targets come back in the loader's layout: (N,) int64 classes, (N, K) float32 otherwise
    np.testing.assert_array_equal(splits.y_test.reshape(y_te.shape), y_te, strict=False)
    assert splits.y_test.dtype == (np.int64 if data.target_kind == "class" else np.float32)
    loaded = (np.concatenate([splits.x_train, splits.x_val]), np.concatenate([splits.y_train, splits.y_val]))
    np.testing.assert_array_equal(_sorted_rows(*loaded), _sorted_rows(x_tr, y_tr))


def test_breast_cancer_split_is_stratified(written):
    y = example_set("breast_cancer").y
    train, test = written["breast_cancer"]
    splits = load_parquet(
        train, test_path=test, input_column="x", target_column="y", train_size=None, val_fraction=0.2, seed=0
    )
    assert splits.num_classes == 2 and len(splits.y_test) == round(len(y) * TEST_FRACTION)
    assert abs(splits.y_test.mean() - y.mean()) < 1 / len(splits.y_test)


def test_digit_flags_follow_their_definition():
    flags = digit_flags(np.arange(10))
    assert list(DIGIT_FLAGS) == ["even", "ge5", "prime", "closed_loop"]
    assert flags.dtype == np.float32 and flags.shape == (10, 4)
    np.testing.assert_array_equal(flags[:, 0], [1, 0, 1, 0, 1, 0, 1, 0, 1, 0])
    np.testing.assert_array_equal(flags[:, 1], [0, 0, 0, 0, 0, 1, 1, 1, 1, 1])
    np.testing.assert_array_equal(flags[:, 2], [0, 0, 1, 1, 0, 1, 0, 1, 0, 0])
    np.testing.assert_array_equal(flags[:, 3], [1, 0, 0, 0, 1, 0, 1, 0, 1, 1])


def test_unknown_example_names_the_valid_ones(tmp_path):
    with pytest.raises(DataError, match="'iris' does not exist; use one of: breast_cancer, diabetes"):
        write_example_data(tmp_path, ["diabetes", "iris"])
    assert not list(tmp_path.iterdir())  # nothing written before every name is checked


def test_script_writes_only_what_is_asked(tmp_path):
    script = ROOT / "pipelines" / "make_example_data.py"
    done = subprocess.run([sys.executable, script, tmp_path, "--only", "diabetes"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["diabetes"]
    assert "diabetes: 353 train + 89 test rows, input [10], regression" in done.stdout
    bad = subprocess.run([sys.executable, script, tmp_path, "--only", "iris"], capture_output=True, text=True)
    assert bad.returncode == 2 and "'iris' does not exist" in bad.stderr


def test_a_constant_feature_normalizes_to_zero(tmp_path):
    """std 0 (a pixel that is always 0, a fixed column) is divided by 1, not a DataError."""
    rng = np.random.default_rng(0)
    x = rng.random((50, 3), dtype=np.float32)
    x[:, 1] = 5.0
    y = rng.random(50, dtype=np.float32)
    write_parquet(tmp_path / "train.parquet", x, y)
    write_parquet(tmp_path / "test.parquet", x[:10], y[:10])
    paths = {"path": str(tmp_path / "train.parquet"), "test_path": str(tmp_path / "test.parquet")}
    for normalize in ("auto", "none"):
        cfg = DataConfig(source="parquet", target={"kind": "regression"}, normalize=normalize, **paths)
        splits = load_data(cfg, seed=0)
        assert np.all(splits.std > 0)
    assert splits.std.tolist() == 1.0  # none: one value for all
    auto = load_data(DataConfig(source="parquet", target={"kind": "regression"}, **paths), seed=0)
    assert auto.std[1] == 1.0 and auto.mean[1] == 5.0


@pytest.mark.parametrize(
    ("config", "overrides", "paths", "words"),
    [
        (
            "regression",
            ["stages[0].loss.type=cross_entropy"],
            {"stages[0].loss.type"},
            ["'cross_entropy' is a loss for class targets", "data.target.kind is 'regression'", "mse"],
        ),
        (
            "regression",
            ["stages[1].train.metric=val_accuracy"],
            {"stages[1].train.metric"},
            ["'val_accuracy' is not reported", "val_loss, val_mae, val_rmse, val_r2"],
        ),
        # one mistake each: the loss against the targets is checked by the shape preflight, which
        # runs once the cross-field rules (the metric) pass
        (
            "multilabel",
            ["stages[1].loss.type=mse"],
            {"stages[1].loss.type"},
            ["'mse' is a loss for regression targets", "use loss.type: bce"],
        ),
        (
            "multilabel",
            ["stages[0].train.metric=val_r2"],
            {"stages[0].train.metric"},
            ["val_loss, val_micro_f1, val_map"],
        ),
        (
            "tabular",
            ["stages[0].train.metric=val_top5_accuracy"],  # 2 classes: no top-5
            {"stages[0].train.metric"},
            ["not reported", "val_accuracy"],
        ),
    ],
)
def test_example_configs_refuse_a_loss_or_metric_of_another_kind(config, overrides, paths, words):
    with pytest.raises(ConfigError) as info:
        load_config(CONFIGS / f"{config}.yaml", overrides)
    assert {issue.path for issue in info.value.issues} == paths
    for word in words:
        assert word in str(info.value)
