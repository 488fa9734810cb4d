"""scan_parquet in-process (no Ray): the content-hash split, exact train statistics, and every
bad-row kind as a DataError naming file, row group and row."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cascade_ray.data.parquet import write_parquet
from cascade_ray.data.stream import content_hash, is_val_row, scan_parquet
from cascade_ray.errors import DataError

CLASS = {"input_column": "x", "target_column": "y", "input_shape": None, "val_fraction": 0.25, "seed": 3}


def _images(n: int = 400, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(n, 3, 4, 5)) * [[[2.0]], [[1.0]], [[0.5]]] + [[[1.0]], [[-3.0]], [[0.0]]]).astype(np.float32)
    return x, rng.integers(0, 4, n)


def _write_parts(root, x, y, parts: int, row_group: int = 50) -> None:
    for i, idx in enumerate(np.array_split(np.arange(len(y)), parts)):
        write_parquet(root / f"part-{i}.parquet", x[idx], y[idx], image_column="x", label_column="y")
        table = pq.read_table(root / f"part-{i}.parquet")
        pq.write_table(table, root / f"part-{i}.parquet", row_group_size=row_group)


def _scan(path, **kw):
    return scan_parquet(path, **(CLASS | {"target_kind": "class", "num_classes": 4} | kw))


def test_stats_equal_numpy_on_the_train_part(tmp_path):
    x, y = _images()
    _write_parts(tmp_path, x, y, parts=3)
    r = _scan(tmp_path)
    val = is_val_row(x, 0.25, 3)
    train = x[~val].astype(np.float64)
    assert (r.train_rows, r.val_rows) == (int((~val).sum()), int(val.sum()))
    assert 0 < r.val_rows < r.train_rows
    assert r.input_shape == (3, 4, 5) and r.mean.shape == r.std.shape == (3, 1, 1)
    np.testing.assert_allclose(r.mean.ravel(), train.mean(axis=(0, 2, 3)), rtol=1e-6)
    np.testing.assert_allclose(r.std.ravel(), train.std(axis=(0, 2, 3)), rtol=1e-6)
    np.testing.assert_array_equal(r.train_counts, np.bincount(y[~val], minlength=4))
    np.testing.assert_array_equal(r.val_counts, np.bincount(y[val], minlength=4))
    assert r.row_groups == 9  # 3 files of 133-134 rows in groups of 50


def test_split_is_independent_of_file_order_and_layout(tmp_path):
    x, y = _images()
    a, b = tmp_path / "a", tmp_path / "b"
    _write_parts(a, x, y, parts=2, row_group=100)
    perm = np.random.default_rng(1).permutation(len(y))
    _write_parts(b, x[perm], y[perm], parts=5, row_group=17)
    ra, rb = _scan(a), _scan(b)
    assert (ra.train_rows, ra.val_rows) == (rb.train_rows, rb.val_rows)
    np.testing.assert_array_equal(ra.val_counts, rb.val_counts)
    np.testing.assert_allclose(ra.mean, rb.mean, rtol=1e-6)
    np.testing.assert_allclose(ra.std, rb.std, rtol=1e-6)
    # the same rows, whatever the order; another seed moves them
    np.testing.assert_array_equal(np.sort(content_hash(x, 3)), np.sort(content_hash(x[perm], 3)))
    assert (is_val_row(x, 0.25, 3) != is_val_row(x, 0.25, 4)).any()


def test_vectors_and_sequences_are_per_feature(tmp_path):
    rng = np.random.default_rng(0)
    seqs = rng.normal(size=(200, 6, 3)).astype(np.float32) + np.arange(3)
    target = rng.normal(size=(200, 2)).astype(np.float32)
    flat = pa.FixedSizeListArray.from_arrays(pa.array(seqs.reshape(-1)), 18)
    tgt = pa.FixedSizeListArray.from_arrays(pa.array(target.reshape(-1)), 2)
    pq.write_table(pa.table({"x": flat, "y": tgt}), tmp_path / "seq.parquet")
    r = scan_parquet(
        tmp_path, **(CLASS | {"input_shape": [6, 3]}), target_kind="regression", num_classes=None, target_dim=2
    )
    train = seqs[~is_val_row(seqs, 0.25, 3)].astype(np.float64)
    assert r.mean.shape == (3,) and r.train_counts is None
    np.testing.assert_allclose(r.mean, train.mean(axis=(0, 1)), rtol=1e-6)
    np.testing.assert_allclose(r.std, train.std(axis=(0, 1)), rtol=1e-6)


def _bad_file(tmp_path, x_col: pa.Array, y_col: pa.Array, row_group: int = 4) -> str:
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"x": x_col, "y": y_col}), path, row_group_size=row_group)
    return str(path)


def _fixed(values: np.ndarray, size: int) -> pa.Array:
    return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), size)


GOOD = np.arange(40, dtype=np.float32).reshape(10, 4)


@pytest.mark.parametrize(
    ("x", "y", "kind", "message"),
    [
        ("nan", np.zeros(10, np.int64), "class", "NaN/Inf"),
        ("inf", np.zeros(10, np.int64), "class", "NaN/Inf"),
        ("null_value", np.zeros(10, np.int64), "class", "null value"),
        ("null_row", np.zeros(10, np.int64), "class", "is null"),
        ("short", np.zeros(10, np.int64), "class", "holds 3 values"),
        ("good", np.array([0] * 6 + [4] + [0] * 3), "class", r"class label 4 is outside \[0, 4\)"),
        ("good", np.array([0] * 6 + [-1] + [0] * 3), "class", "outside"),
        ("good", "multilabel", "multilabel", "other than 0/1"),
        ("good", "regression", "regression", "regression target 'y' is NaN/Inf"),
    ],
)
def test_each_bad_row_names_file_row_group_and_row(tmp_path, x, y, kind, message):
    values = GOOD.copy()
    if x in ("nan", "inf"):
        values[6, 2] = np.nan if x == "nan" else np.inf
    x_col = _fixed(values, 4)
    if x == "null_value":
        x_col = pa.FixedSizeListArray.from_arrays(pa.array([None if i == 26 else float(i) for i in range(40)]), 4)
    elif x == "null_row":
        x_col = pa.array(
            [None if i == 6 else list(map(float, row)) for i, row in enumerate(GOOD)], pa.list_(pa.float32())
        )
    elif x == "short":
        x_col = pa.array([list(row[:3]) if i == 6 else list(row) for i, row in enumerate(GOOD)], pa.list_(pa.float32()))
    if isinstance(y, str) and y == "multilabel":
        labels = np.zeros((10, 4), np.float32)
        labels[6, 1] = 2
        y_col, extra = _fixed(labels, 4), {"num_classes": 4}
    elif isinstance(y, str):
        target = np.zeros(10, np.float64)
        target[6] = np.nan
        y_col, extra = pa.array(target), {"num_classes": None}
    else:
        y_col, extra = pa.array(y), {"num_classes": 4}
    path = _bad_file(tmp_path, x_col, y_col)
    with pytest.raises(DataError, match=message) as err:
        scan_parquet(path, **(CLASS | {"input_shape": [4], "target_kind": kind} | extra))
    text = str(err.value)
    assert "bad.parquet" in text and "row group 1, row 2 (row 6 of the file)" in text, text


def test_missing_column_and_wrong_shape(tmp_path):
    path = _bad_file(tmp_path, _fixed(GOOD, 4), pa.array(np.zeros(10, np.int64)))
    with pytest.raises(DataError, match=r"no column\(s\) \['label'\].*data.target.column"):
        scan_parquet(path, **(CLASS | {"target_column": "label", "target_kind": "class", "num_classes": 2}))
    with pytest.raises(DataError, match=r"shape \[2, 3\] needs 6; fix data.inputs.shape"):
        scan_parquet(path, **(CLASS | {"input_shape": [2, 3], "target_kind": "class", "num_classes": 2}))


def test_write_parquet_row_groups_round_trip_and_scan(tmp_path):
    """write_parquet's row groups: the default size, a given one, and the same rows either way."""
    from cascade_ray.data.parquet import DEFAULT_ROW_GROUP_ROWS

    x, y = _images(n=DEFAULT_ROW_GROUP_ROWS + 5)
    write_parquet(tmp_path / "a" / "d.parquet", x, y, image_column="x", label_column="y")
    write_parquet(tmp_path / "b" / "d.parquet", x, y, image_column="x", label_column="y", row_group_rows=1000)
    assert pq.ParquetFile(tmp_path / "a" / "d.parquet").num_row_groups == 2
    assert pq.ParquetFile(tmp_path / "b" / "d.parquet").num_row_groups == 5
    back = pq.read_table(tmp_path / "b" / "d.parquet")
    np.testing.assert_array_equal(np.stack(back["x"].to_numpy(zero_copy_only=False)).reshape(x.shape), x)
    ra, rb = _scan(tmp_path / "a"), _scan(tmp_path / "b")
    assert (ra.train_rows, ra.val_rows, ra.row_groups, rb.row_groups) == (rb.train_rows, rb.val_rows, 2, 5)
    with pytest.raises(DataError, match="row_group_rows=0"):
        write_parquet(tmp_path / "c.parquet", x, y, row_group_rows=0)


def test_write_parquet_takes_lists_of_rows_and_refuses_ragged_or_text_inputs_in_its_own_words(tmp_path):
    """A Python list as x raised AttributeError ('list' object has no attribute 'ndim')."""
    from cascade_ray.data.parquet import load_parquet

    path = tmp_path / "rows.parquet"
    write_parquet(path, [[1.0, 2.0], [3.0, 4.0]] * 5, [0, 1] * 5)
    splits = load_parquet(path, test_path=path, train_size=None, val_fraction=0.2, seed=0)
    assert splits.input_shape == (2,)
    for x, said in (([[1.0, 2.0], [3.0]], "give every input row one shape"), ([["a"], ["b"]], "expected numbers")):
        with pytest.raises(DataError, match=said):
            write_parquet(path, x, [0, 1])
