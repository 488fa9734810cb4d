"""Unit tests of cascade_ray.data: loaders, splits, validation, object-store round trip.

Run: PYTHONPATH=. python -m pytest -q tests/unit/test_data.py
"""

from __future__ import annotations

import dataclasses
import gzip
import pickle
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cascade_ray.data import (
    DEFAULT_FASHION_MNIST_ROOT,
    DataSplits,
    load_digits,
    load_fashion_mnist,
    load_parquet,
    stratified_subset_and_val,
    validate_splits,
    write_parquet,
)
from cascade_ray.errors import DataError

FMNIST_NAMES = [
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
]
needs_fmnist = pytest.mark.skipif(
    not Path(DEFAULT_FASHION_MNIST_ROOT).is_dir(),
    reason="Fashion-MNIST not installed: apt-get install dataset-fashion-mnist",
)


# --------------------------------------------------------------------------- helpers
def _idx_bytes(arr: np.ndarray) -> bytes:
    magic = 2051 if arr.ndim == 3 else 2049
    header = np.array([magic, *arr.shape], dtype=">i4").tobytes()
    return header + arr.astype(np.uint8).tobytes()


def _write_fake_fmnist(root: Path, *, gz: bool, n_train: int = 200, n_test: int = 50) -> dict:
    """A tiny, valid Fashion-MNIST folder; returns the arrays written."""
    rng = np.random.default_rng(0)
    arrays = {
        FMNIST_NAMES[0]: rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        FMNIST_NAMES[1]: np.arange(n_train, dtype=np.uint8) % 10,
        FMNIST_NAMES[2]: rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        FMNIST_NAMES[3]: np.arange(n_test, dtype=np.uint8) % 10,
    }
    root.mkdir(parents=True, exist_ok=True)
    for name, arr in arrays.items():
        data = _idx_bytes(arr)
        if gz:
            (root / f"{name}.gz").write_bytes(gzip.compress(data, compresslevel=1))
        else:
            (root / name).write_bytes(data)
    return arrays


def _tiny_splits(rng_seed: int = 0) -> DataSplits:
    rng = np.random.default_rng(rng_seed)

    def part(n: int) -> tuple[np.ndarray, np.ndarray]:
        return rng.normal(size=(n, 1, 4, 4)).astype(np.float32), np.arange(n, dtype=np.int64) % 3

    (xt, yt), (xv, yv), (xs, ys) = part(12), part(6), part(6)
    return DataSplits(xt, yt, xv, yv, xs, ys, num_classes=3, mean=0.0, std=1.0, source="tiny")


# --------------------------------------------------------------------- Fashion-MNIST
@pytest.fixture(scope="module")
def fmnist_full() -> DataSplits:
    return load_fashion_mnist(train_size=None, val_fraction=0.1, seed=0)


@needs_fmnist
def test_fashion_mnist_full_shapes_dtypes_and_stats(fmnist_full):
    s = fmnist_full
    assert s.x_train.shape == (54000, 1, 28, 28) and s.x_val.shape == (6000, 1, 28, 28)
    assert s.x_test.shape == (10000, 1, 28, 28)  # the official t10k set
    assert s.input_shape == (1, 28, 28) and s.num_classes == 10
    for x, y in [(s.x_train, s.y_train), (s.x_val, s.y_val), (s.x_test, s.y_test)]:
        assert x.dtype == np.uint8 and y.dtype == np.int64
        assert set(np.unique(y).tolist()) == set(range(10))
    # The official test set is balanced: 1000 per class.
    assert np.bincount(s.y_test).tolist() == [1000] * 10
    ref = s.x_train.astype(np.float64)
    # one channel: per-channel statistics are one value each, shaped (C, 1, 1); float32
    assert s.mean.shape == s.std.shape == (1, 1, 1) and s.mean.dtype == np.float32
    assert float(s.mean.item()) == pytest.approx(ref.mean(), rel=1e-7)
    assert float(s.std.item()) == pytest.approx(ref.std(), rel=1e-7)


@needs_fmnist
def test_fashion_mnist_stratified_subset_counts():
    s = load_fashion_mnist(train_size=1000, val_fraction=0.2, seed=3)
    assert len(s.y_train) == 800 and len(s.y_val) == 200 and len(s.y_test) == 10000
    before_val = np.bincount(np.concatenate([s.y_train, s.y_val]), minlength=10)
    assert np.abs(before_val - 100).max() <= 1
    assert np.abs(np.bincount(s.y_val, minlength=10) - 20).max() <= 1


@needs_fmnist
def test_fashion_mnist_seed_determinism_and_fingerprint():
    a = load_fashion_mnist(train_size=500, val_fraction=0.2, seed=1)
    b = load_fashion_mnist(train_size=500, val_fraction=0.2, seed=1)
    c = load_fashion_mnist(train_size=500, val_fraction=0.2, seed=2)
    assert np.array_equal(a.x_train, b.x_train) and np.array_equal(a.y_val, b.y_val)
    assert a.fingerprint() == b.fingerprint() == a.fingerprint()
    assert len(a.fingerprint()) == 64
    assert c.fingerprint() != a.fingerprint()


def test_fashion_mnist_missing_root_says_how_to_fix(tmp_path):
    with pytest.raises(DataError) as exc:
        load_fashion_mnist(tmp_path / "nope", train_size=None, val_fraction=0.1, seed=0)
    msg = str(exc.value)
    assert "apt-get install dataset-fashion-mnist" in msg and "data.root" in msg
    assert str(tmp_path / "nope") in msg and "train-images-idx3-ubyte.gz" in msg


def test_fashion_mnist_missing_file_is_named(tmp_path):
    _write_fake_fmnist(tmp_path, gz=True)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte") as exc:
        load_fashion_mnist(tmp_path, train_size=None, val_fraction=0.1, seed=0)
    assert "apt-get" in str(exc.value)


@pytest.mark.parametrize("gz", [True, False])
def test_fashion_mnist_reads_gz_and_uncompressed(tmp_path, gz):
    arrays = _write_fake_fmnist(tmp_path, gz=gz)
    s = load_fashion_mnist(tmp_path, train_size=None, val_fraction=0.2, seed=0)
    assert np.array_equal(s.x_test[:, 0], arrays["t10k-images-idx3-ubyte"])
    assert np.array_equal(s.y_test, arrays["t10k-labels-idx1-ubyte"].astype(np.int64))
    assert len(s.y_train) + len(s.y_val) == 200 and s.x_train.dtype == np.uint8


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda raw: b"\x00\x00\x08\x01" + raw[4:],  # labels magic in an images file
        lambda raw: raw[:-100],  # truncated payload
        lambda raw: raw[:10],  # shorter than the header
    ],
    ids=["bad-magic", "truncated", "short-header"],
)
def test_fashion_mnist_corrupt_idx_names_the_file(tmp_path, corrupt):
    _write_fake_fmnist(tmp_path, gz=True)
    bad = tmp_path / "train-images-idx3-ubyte.gz"
    bad.write_bytes(gzip.compress(corrupt(gzip.decompress(bad.read_bytes()))))
    with pytest.raises(DataError, match=re.escape(str(bad))):
        load_fashion_mnist(tmp_path, train_size=None, val_fraction=0.1, seed=0)


def test_fashion_mnist_not_gzip_names_the_file(tmp_path):
    _write_fake_fmnist(tmp_path, gz=True)
    bad = tmp_path / "t10k-images-idx3-ubyte.gz"
    bad.write_bytes(b"this is not gzip data at all")
    with pytest.raises(DataError, match=re.escape(str(bad))):
        load_fashion_mnist(tmp_path, train_size=None, val_fraction=0.1, seed=0)


# ---------------------------------------------------------------------------- digits
def test_digits_shapes_and_split_sizes():
    s = load_digits(train_size=None, val_fraction=0.1, seed=0)
    assert s.input_shape == (1, 8, 8) and s.x_train.dtype == np.uint8 and s.num_classes == 10
    assert len(s.y_train) + len(s.y_val) + len(s.y_test) == 1797
    assert len(s.y_test) == 360  # ceil(0.2 * 1797)
    assert int(s.x_train.max()) == 16 and s.y_train.dtype == np.int64
    assert load_digits(train_size=None, val_fraction=0.1, seed=0).fingerprint() == s.fingerprint()
    small = load_digits(train_size=200, val_fraction=0.25, seed=0)
    assert (len(small.y_train), len(small.y_val)) == (150, 50)


# --------------------------------------------------------------------------- parquet
@pytest.fixture
def pq_data(tmp_path):
    rng = np.random.default_rng(0)
    # (3, 5, 7) is no square, so loading relies on the schema metadata.
    x = rng.integers(0, 256, (300, 3, 5, 7), dtype=np.uint8)
    y = np.arange(300, dtype=np.int64) % 5
    xt = rng.integers(0, 256, (40, 3, 5, 7), dtype=np.uint8)
    yt = np.arange(40, dtype=np.int64) % 5
    write_parquet(tmp_path / "train.parquet", x, y)
    write_parquet(tmp_path / "test.parquet", xt, yt)
    for i, rows in enumerate(np.array_split(np.arange(300), 3)):
        write_parquet(tmp_path / "parts" / f"part-{i}.parquet", x[rows], y[rows])
    return tmp_path, x, y, xt, yt


@pytest.mark.parametrize("form", ["file", "dir", "glob"])
def test_parquet_round_trip_is_bit_exact(pq_data, form):
    root, x, y, xt, yt = pq_data
    path = {
        "file": root / "train.parquet",
        "dir": root / "parts",
        "glob": str(root / "parts" / "part-*.parquet"),
    }[form]
    s = load_parquet(path, test_path=root / "test.parquet", train_size=None, val_fraction=0.2, seed=7)
    assert s.input_shape == (3, 5, 7) and s.num_classes == 5 and s.x_train.dtype == np.uint8
    assert np.array_equal(s.x_test, xt) and np.array_equal(s.y_test, yt)
    # Same rows in the same order as the arrays written, so the seeded split matches too.
    ref = stratified_subset_and_val(x, y, train_size=None, val_fraction=0.2, seed=7)
    for got, want in zip((s.x_train, s.y_train, s.x_val, s.y_val), ref):
        assert got.dtype == want.dtype and np.array_equal(got, want)


def test_parquet_flat_list_is_a_vector_unless_a_shape_is_given(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(60, 3, 4, 4)).astype(np.float32)
    y = np.arange(60) % 3
    flat = pa.array(list(x.reshape(60, -1)), type=pa.list_(pa.float32()))  # variable-size list
    pq.write_table(pa.table({"image": flat, "label": y}), tmp_path / "a.parquet")
    kw = {"test_path": tmp_path / "a.parquet", "train_size": None, "val_fraction": 0.2, "seed": 0}
    s = load_parquet(tmp_path / "a.parquet", **kw)  # no shape stored: a 48-feature vector per row
    assert s.input_shape == (48,) and np.array_equal(s.x_test, x.reshape(60, 48))
    assert s.mean.shape == (48,)  # per-feature statistics
    s = load_parquet(tmp_path / "a.parquet", input_shape=(3, 4, 4), **kw)
    assert np.array_equal(s.x_test, x) and s.x_test.dtype == np.float32
    assert s.mean.shape == (3, 1, 1)  # per-channel statistics
    per_channel = s.x_train.transpose(1, 0, 2, 3).reshape(3, -1).astype(np.float64)
    assert np.allclose(s.mean.reshape(3), per_channel.mean(1), rtol=1e-5)
    assert np.allclose(s.std.reshape(3), per_channel.std(1), rtol=1e-5)
    with pytest.raises(
        DataError, match=r"input shape \[5, 5\] holds 25 values but each row has 48; fix data.inputs.shape"
    ):
        load_parquet(tmp_path / "a.parquet", input_shape=(5, 5), **kw)
    # a sequence: (T, D) rows, statistics per feature D
    s = load_parquet(tmp_path / "a.parquet", input_shape=(12, 4), **kw)
    assert s.input_shape == (12, 4) and s.mean.shape == (4,)
    want = s.x_train.reshape(-1, 4).astype(np.float64)
    assert np.allclose(s.mean, want.mean(0), rtol=1e-5) and np.allclose(s.std, want.std(0), rtol=1e-5)


def test_parquet_fixed_shape_tensor_column(tmp_path):
    x = np.random.default_rng(2).integers(0, 9, (30, 2, 3, 3), dtype=np.uint8)
    storage = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), 18)
    tensors = pa.ExtensionArray.from_storage(pa.fixed_shape_tensor(pa.uint8(), (2, 3, 3)), storage)
    pq.write_table(pa.table({"image": tensors, "label": np.arange(30) % 3}), tmp_path / "t.parquet")
    s = load_parquet(
        tmp_path / "t.parquet", test_path=tmp_path / "t.parquet", train_size=None, val_fraction=0.2, seed=0
    )
    assert s.input_shape == (2, 3, 3) and np.array_equal(s.x_test, x)


def test_parquet_errors(pq_data, tmp_path):
    root = pq_data[0]
    kw = {"train_size": None, "val_fraction": 0.2, "seed": 0}
    with pytest.raises(DataError, match=r"pixels.*\['image', 'label'\]"):
        load_parquet(root / "train.parquet", test_path=root / "test.parquet", input_column="pixels", **kw)
    with pytest.raises(DataError, match="data.test_path"):
        load_parquet(root / "train.parquet", test_path=None, **kw)
    with pytest.raises(DataError, match="data.path.*nothing-here"):
        load_parquet(root / "nothing-here-*.parquet", test_path=root / "test.parquet", **kw)
    with pytest.raises(DataError, match="data.test_path.*missing.parquet"):
        load_parquet(root / "train.parquet", test_path=root / "missing.parquet", **kw)


# -------------------------------------------------------------------------- splits
def test_stratified_subset_and_val_errors():
    x, y = np.zeros((100, 1, 2, 2)), np.arange(100) % 4
    with pytest.raises(DataError, match=r"data.train_size: 500 .*100"):
        stratified_subset_and_val(x, y, train_size=500, val_fraction=0.1, seed=0)
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(DataError, match="data.val_fraction"):
            stratified_subset_and_val(x, y, train_size=None, val_fraction=bad, seed=0)
    with pytest.raises(DataError, match="data.train_size"):  # 2 validation samples < 4 classes
        stratified_subset_and_val(x, y, train_size=20, val_fraction=0.1, seed=0)


def _nan_val(s):
    x = s.x_val.copy()
    x[0, 0, 0, 0] = np.nan
    return dataclasses.replace(s, x_val=x)


def _bad_label(s):
    return dataclasses.replace(s, y_test=np.where(s.y_test == 2, 3, s.y_test))


def _empty_train(s):
    return dataclasses.replace(s, x_train=s.x_train[:0], y_train=s.y_train[:0])


def _missing_class(s):
    keep = s.y_train != 1
    return dataclasses.replace(s, x_train=s.x_train[keep], y_train=s.y_train[keep])


@pytest.mark.parametrize(
    "corrupt, where",
    [
        (_nan_val, "val: inputs hold 1 NaN/Inf"),
        (_bad_label, r"test: labels span \[0, 3\], outside \[0, 3\)"),
        (_empty_train, "train: split is empty"),
        (_missing_class, r"train: class\(es\) \[1\]"),
        (lambda s: dataclasses.replace(s, x_test=s.x_test[:, 0, 0, 0]), r"test: inputs have shape \(6,\), expected"),
        (lambda s: dataclasses.replace(s, y_val=s.y_val[:-1]), "val: 6 inputs but 5 targets"),
        (lambda s: dataclasses.replace(s, x_val=s.x_val[:, :, :2]), "input shapes differ"),
        (lambda s: dataclasses.replace(s, std=0.0), "std > 0"),
    ],
    ids=["nan", "bad-label", "empty", "missing-class", "wrong-rank", "length", "shape", "std"],
)
def test_validate_splits_catches(corrupt, where):
    good = _tiny_splits()
    validate_splits(good)
    with pytest.raises(DataError, match=where):
        validate_splits(corrupt(good))


def test_to_arrays_from_arrays_shares_memory_and_writes_nothing():
    s = load_digits(train_size=None, val_fraction=0.1, seed=0)
    d = s.to_arrays()
    for v in d.values():  # as numpy arrays come out of the Ray object store
        if isinstance(v, np.ndarray):
            v.setflags(write=False)
    back = DataSplits.from_arrays(d)
    for name in ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test"):
        assert np.shares_memory(getattr(back, name), getattr(s, name))
        assert not getattr(back, name).flags.writeable
    assert back.fingerprint() == s.fingerprint() and back.source == s.source
    assert DataSplits.from_arrays(pickle.loads(pickle.dumps(d))).fingerprint() == s.fingerprint()
    with pytest.raises(DataError, match="missing key"):
        DataSplits.from_arrays({k: v for k, v in d.items() if k != "std"})


def test_fingerprint_changes_with_each_field():
    s = _tiny_splits()
    changed = [
        dataclasses.replace(s, mean=0.5),
        dataclasses.replace(s, num_classes=4),
        dataclasses.replace(s, x_test=s.x_test.astype(np.float64)),
        dataclasses.replace(s, y_val=s.y_val[::-1].copy()),
    ]
    assert len({s.fingerprint(), *(c.fingerprint() for c in changed)}) == 5
    assert dataclasses.replace(s, source="elsewhere").fingerprint() == s.fingerprint()


def test_parquet_label_far_out_of_range_is_named_before_any_per_class_allocation(pq_data, tmp_path):
    """A label 2**40 would infer 2**40 + 1 classes (a bincount of 8 TiB): a DataError naming column and key."""
    _, x, y, xt, yt = pq_data
    y = y.copy()
    y[7] = 2**40
    write_parquet(tmp_path / "huge-label.parquet", x, y)
    kw = {"train_size": None, "val_fraction": 0.2, "seed": 0}
    with pytest.raises(
        DataError, match=r"data.path=.*huge-label.parquet.*label 1099511627776 is outside \[0, 16777215\]"
    ):
        load_parquet(tmp_path / "huge-label.parquet", test_path=pq_data[0] / "test.parquet", **kw)
