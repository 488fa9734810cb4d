"""Batch prediction with Ray Data on a trained debug run: local and S3, row order, the input check."""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cascade_ray.api import load_cascade, predict
from cascade_ray.data.digits import load_digits
from cascade_ray.data.parquet import SHAPE_METADATA_KEY, write_parquet
from cascade_ray.tools.inference import InputError


@pytest.fixture(scope="module")
def digits_x():
    """The digits test images (uint8, (N, 1, 8, 8)), as the run was trained on."""
    return load_digits(train_size=None, val_fraction=0.2, seed=0).x_test


@pytest.fixture(scope="module")
def ray_s3(s3, ray_session):
    """The module's Ray, started after the S3 fixture set its endpoint and keys (workers read S3)."""
    return ray_session


def _write_parts(folder, x, parts=3, row_group_rows=50):
    """`x` over `parts` files (several row groups each) with an ``id`` column of the global row number."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, rows in enumerate(np.array_split(np.arange(len(x)), parts)):
        inputs = pa.FixedSizeListArray.from_arrays(pa.array(x[rows].reshape(-1)), 64)
        table = pa.table({"image": inputs, "id": pa.array(rows)})
        table = table.replace_schema_metadata({SHAPE_METADATA_KEY: b"[1, 8, 8]"})
        pq.write_table(table, folder / f"part-{i:02d}.parquet", row_group_size=row_group_rows)
    return folder


def _read(out):
    files = sorted(out.glob("*.parquet"))
    assert files, f"no Parquet files in {out}"
    return pa.concat_tables(pq.read_table(f) for f in files)


def test_local_predictions_match_the_cascade_in_input_order(ray_s3, trained_run, digits_x, tmp_path):
    data = _write_parts(tmp_path / "data", digits_x, parts=3)
    report = predict(trained_run, data, tmp_path / "out", batch_rows=40, actors=1, keep_columns=["id"])
    table = _read(tmp_path / "out")
    assert table.column_names == ["id", "prediction", "probabilities"]
    assert report.rows == len(digits_x) == table.num_rows and report.actors == 1 and report.rows_per_s > 0
    # row order kept over 3 files x several row groups x batches of 40
    np.testing.assert_array_equal(table["id"].to_numpy(), np.arange(len(digits_x)))
    expected = load_cascade(trained_run).predict(digits_x)
    np.testing.assert_array_equal(table["prediction"].to_numpy(), expected["prediction"])
    probs = np.stack(table["probabilities"].to_numpy(zero_copy_only=False))
    assert probs.dtype == np.float32 and probs.shape == (len(digits_x), 10)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-5)
    # the actor's batches (40 rows, cut at file and row-group ends) are not load_cascade's one
    # batch: fp32 kernels then sum in another order, ~20 ulp apart at most (measured 1.2e-6 once)
    np.testing.assert_allclose(probs, expected["probabilities"], rtol=1e-5, atol=1e-5)
    assert pa.types.is_fixed_size_list(table.schema.field("probabilities").type)


def test_refuses_a_filled_out_folder_unless_overwrite(ray_s3, trained_run, digits_x, tmp_path):
    from cascade_ray.errors import CascadeError

    data = tmp_path / "one.parquet"
    write_parquet(data, digits_x[:64], np.zeros(64, np.int64))
    predict(trained_run, data, tmp_path / "out", actors=1)
    with pytest.raises(CascadeError, match="not empty"):
        predict(trained_run, data, tmp_path / "out", actors=1)
    report = predict(trained_run, data, tmp_path / "out", actors=1, overwrite=True)
    assert report.rows == 64 == _read(tmp_path / "out").num_rows
    assert _read(tmp_path / "out").column_names == ["prediction", "probabilities"]


def _actors_started() -> int:
    from ray.util.state import list_actors

    return sum(1 for a in list_actors(limit=1000) if "CascadePredictor" in (a.class_name or ""))


def test_wrong_column_or_shape_fails_before_any_actor(ray_s3, trained_run, digits_x, tmp_path):
    before = _actors_started()
    wrong_shape = tmp_path / "wide.parquet"
    write_parquet(wrong_shape, np.zeros((8, 1, 4, 16), np.uint8), np.zeros(8, np.int64))
    t0 = time.perf_counter()
    with pytest.raises(InputError, match=r"wide\.parquet: input column 'image' rows are shaped \(1, 4, 16\)"):
        predict(trained_run, wrong_shape, tmp_path / "o1")
    wrong_len = tmp_path / "small.parquet"
    write_parquet(wrong_len, np.zeros((8, 1, 4, 4), np.uint8), np.zeros(8, np.int64))
    with pytest.raises(InputError, match=r"rows hold \(1, 4, 4\) \(16 values\); the run takes \(1, 8, 8\)"):
        predict(trained_run, wrong_len, tmp_path / "o2")
    with pytest.raises(InputError, match="no input column 'pixels'.*columns: image, label.*--input-column"):
        predict(trained_run, wrong_len, tmp_path / "o3", input_column="pixels")
    assert time.perf_counter() - t0 < 30  # no actor pool was waited for
    assert _actors_started() == before
    assert not any((tmp_path / o).exists() for o in ("o1", "o2", "o3"))


def test_s3_run_data_and_output(s3, ray_s3, trained_run_s3, digits_x, tmp_path):
    import pyarrow.fs as pafs

    local = _write_parts(tmp_path / "data", digits_x[:300], parts=2)
    pafs.copy_files(str(local), s3.uri("new").removeprefix("s3://"), destination_filesystem=s3.filesystem())
    out = s3.uri("predictions", "debug")
    report = predict(trained_run_s3, s3.uri("new"), out, actors=1, batch_rows=64, keep_columns=["id"])
    assert report.rows == 300 and report.output == out
    keys = [k for k in s3.keys("predictions/debug") if k.endswith(".parquet")]
    assert keys and report.files == len(keys)
    fs = s3.filesystem()
    table = pa.concat_tables(pq.read_table(f"{s3.bucket}/{k}", filesystem=fs) for k in keys)
    np.testing.assert_array_equal(table["id"].to_numpy(), np.arange(300))
    expected = load_cascade(trained_run_s3).predict(digits_x[:300])
    np.testing.assert_array_equal(table["prediction"].to_numpy(), expected["prediction"])
    assert "cascade-test-secret" not in report.to_json()


def test_a_bad_row_an_actor_finds_is_raised_as_its_own_error_naming_the_row(
    ray_s3, trained_run, digits_x, tmp_path, capfd
):
    """A NaN past the first row group is found only when an actor reads it: the DataError (file, row
    group, row, fix) is what predict raises, not Ray Data's UserCodeException with the message buried
    in its text, and Ray Data's own ~50-line log of it stays out of the output."""
    from cascade_ray.errors import DataError

    x = digits_x[:150].astype(np.float32)
    x[105, 0, 0, 0] = np.nan  # row group 2 of 50-row groups, row 5 in it
    data = _write_parts(tmp_path / "data", x, parts=1)
    capfd.readouterr()
    with pytest.raises(DataError, match=r"part-00\.parquet row group 2, row 5, input column 'image'.*NaN/Inf") as bad:
        predict(trained_run, data, tmp_path / "out", actors=1)
    assert str(bad.value).startswith("--data: ") and "\n" not in str(bad.value)  # the error itself, not Ray's text
    assert "never skips" in str(bad.value)
    printed = capfd.readouterr()
    assert "UserCodeException" not in printed.out + printed.err and "Traceback" not in printed.err, printed.err[-2000:]


def test_inputs_off_the_training_scale_are_predicted_with_a_warning(ray_s3, trained_run, digits_x, tmp_path):
    """Digits divided by 16: the run normalizes raw pixels itself, so these are predicted nearly all alike;
    the report says why, from the first row group, before any actor starts."""
    data = tmp_path / "scaled.parquet"
    write_parquet(data, digits_x[:64].astype(np.float32) / 16, np.zeros(64, np.int64))
    report = predict(trained_run, data, tmp_path / "out", actors=1)
    assert report.rows == 64 and report.warning and "look rescaled (e.g. divided by 255)" in report.warning
    assert "scaled.parquet row group 0" in report.warning
    raw = tmp_path / "raw.parquet"
    write_parquet(raw, digits_x[:64], np.zeros(64, np.int64))
    assert predict(trained_run, raw, tmp_path / "out2", actors=1).warning is None
