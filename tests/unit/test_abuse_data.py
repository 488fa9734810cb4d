"""The malformed-data matrix (issue 18, part 6): every case is a bad Parquet input that must end in
a :class:`DataError` (exit 2) naming the file, within a second, without opening a FIFO or
allocating by a label's value.

``DATA_CASES`` is the matrix (one entry per case, counted in docs/reliability.md). Each case
writes its files under ``tmp_path`` and returns the :func:`load_parquet` keyword arguments, the
path the message must name and a phrase it must hold. ``CLI_CASES`` runs a few of them through
``cascade-ray run`` (exit 2 before Ray starts).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from cascade_ray.cli import main as cli_main
from cascade_ray.data import load_parquet, write_parquet
from cascade_ray.errors import DataError

ROWS, WIDTH = 20, 4
SHAPE_KEY = b"cascade_ray.image_shape"


def _x(n: int = ROWS) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((n, WIDTH)).astype(np.float32)


def _y(n: int = ROWS) -> np.ndarray:
    return np.arange(n, dtype=np.int64) % 2


def _good(path: Path) -> Path:
    write_parquet(path, _x(), _y())
    return path


def _table(path: Path, columns: dict[str, Any], meta: dict[bytes, bytes] | None = None) -> Path:
    """A Parquet file of the given Arrow columns, with `meta` as its schema metadata."""
    table = pa.table(columns)
    if meta is not None:
        table = table.replace_schema_metadata(meta)
    pq.write_table(table, path)
    return path


def _inputs(x: np.ndarray | None = None) -> pa.Array:
    x = _x() if x is None else x
    return pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), x.shape[1])


def _labels(y: Any) -> dict[str, Any]:
    return {"image": _inputs(), "label": pa.array(y)}


def _meta(value: bytes) -> Callable[[Path], Path]:
    return lambda p: _table(p, _labels(_y()), {SHAPE_KEY: value})


@dataclass(frozen=True)
class DataCase:
    """One malformed input: `make(tmp_path)` writes it and returns (load_parquet kwargs, named path)."""

    name: str
    make: Callable[[Path], tuple[dict[str, Any], Path]]
    needle: str


def _train(
    build: Callable[[Path], Any], test: Callable[[Path], Path] = _good, **kw: Any
) -> Callable[[Path], tuple[dict[str, Any], Path]]:
    """A case whose training file is bad: `build(path)` writes ``train.parquet`` or returns the
    path that stands for it (a folder, a glob, a device); `test` writes a good test file."""

    def make(tmp: Path) -> tuple[dict[str, Any], Path]:
        path = tmp / "train.parquet"
        named = build(path)
        named = named if isinstance(named, Path) else path
        return {"path": named, "test_path": test(tmp / "test.parquet"), **kw}, named

    return make


def _test_file(build: Callable[[Path], Path | None]) -> Callable[[Path], tuple[dict[str, Any], Path]]:
    def make(tmp: Path) -> tuple[dict[str, Any], Path]:
        path = tmp / "test.parquet"
        build(path)
        return {"path": _good(tmp / "train.parquet"), "test_path": path}, path

    return make


def _truncated(p: Path) -> None:
    data = _good(p).read_bytes()
    p.write_bytes(data[: len(data) // 2])


def _bit_flip_footer(p: Path) -> None:
    data = bytearray(_good(p).read_bytes())
    data[-6] ^= 0xFF  # the footer's length: the reader looks for the footer in the wrong place
    p.write_bytes(bytes(data))


def _ragged(p: Path) -> None:
    rows = [[0.0] * WIDTH] * (ROWS - 1) + [[0.0] * (WIDTH + 1)]
    _table(p, {"image": pa.array(rows, pa.list_(pa.float32())), "label": pa.array(_y())})


def _null_row(p: Path) -> None:
    rows: list[Any] = [[0.0] * WIDTH] * (ROWS - 1) + [None]
    _table(p, {"image": pa.array(rows, pa.list_(pa.float32())), "label": pa.array(_y())})


def _null_value(p: Path) -> None:
    rows: list[Any] = [[0.0] * WIDTH] * (ROWS - 1) + [[0.0, None, 0.0, 0.0]]
    _table(p, {"image": pa.array(rows, pa.list_(pa.float32())), "label": pa.array(_y())})


def _features(value: float) -> Callable[[Path], None]:
    def build(p: Path) -> None:
        x = _x()
        x[3, 1] = value
        write_parquet(p, x, _y())

    return build


def _mixed_schemas(p: Path) -> Path:
    folder = p.parent / "mixed"
    folder.mkdir()
    _good(folder / "a.parquet")
    labels = pa.array([str(v) for v in _y()])
    _table(folder / "b.parquet", {"image": _inputs(), "label": labels}, {SHAPE_KEY: b"[4]"})
    return folder


def _shapes_disagree(p: Path) -> Path:
    folder = p.parent / "shapes"
    folder.mkdir()
    _table(folder / "a.parquet", _labels(_y()), {SHAPE_KEY: b"[4]"})
    _table(folder / "b.parquet", _labels(_y()), {SHAPE_KEY: b"[2, 2]"})
    return folder


def _fifo(p: Path) -> None:
    os.mkfifo(p)


def _symlink_loop(p: Path) -> None:
    other = p.with_name("other.parquet")
    p.symlink_to(other)
    other.symlink_to(p)


def _dangling(p: Path) -> None:
    p.symlink_to(p.with_name("gone.parquet"))


def _empty_folder(p: Path) -> Path:
    folder = p.parent / "empty"
    folder.mkdir()
    (folder / "notes.txt").write_text("no parquet here")
    return folder


def _targets(values: np.ndarray) -> Callable[[Path], Path]:
    """A file of good inputs and the given (N, K) targets."""

    def build(p: Path) -> Path:
        write_parquet(p, _x(), values)
        return p

    return build


_FLAGS = _targets(np.eye(3, dtype=np.float32)[np.arange(ROWS) % 3])  # a good multilabel file
_VALUES = _targets(np.ones((ROWS, 2), np.float32))  # a good regression file


DATA_CASES = [
    DataCase("empty-file", _train(lambda p: p.write_bytes(b"")), "cannot read parquet"),
    DataCase("text-with-parquet-suffix", _train(lambda p: p.write_text("id,label\n1,0\n")), "cannot read parquet"),
    DataCase("truncated-file", _train(_truncated), "cannot read parquet"),
    DataCase("footer-bit-flip", _train(_bit_flip_footer), "cannot read parquet"),
    DataCase("zero-rows", _train(lambda p: write_parquet(p, _x(0), _y(0))), "no rows"),
    DataCase("shape-metadata-abc", _train(_meta(b"abc")), "cascade_ray.image_shape is not JSON"),
    DataCase("shape-metadata-string", _train(_meta(b'"abc"')), "not a list of ints"),
    DataCase("shape-metadata-floats", _train(_meta(b"[4.0]")), "not a list of ints"),
    DataCase("shape-metadata-bool", _train(_meta(b"[true, 4]")), "not a list of ints"),
    DataCase("shape-metadata-negative", _train(_meta(b"[-4]")), "not 1 to 3 positive ints"),
    DataCase("shape-metadata-rank-4", _train(_meta(b"[1, 1, 2, 2]")), "not 1 to 3 positive ints"),
    DataCase("shape-metadata-wrong-size", _train(_meta(b"[3, 3]")), "holds 9 values but each row has 4"),
    DataCase("shape-argument-wrong-size", _train(_good, input_shape=(5,)), "holds 5 values but each row has 4"),
    DataCase(
        "input-column-strings",
        _train(lambda p: _table(p, {"image": pa.array(["a"] * ROWS), "label": pa.array(_y())})),
        "expected a list of numbers",
    ),
    DataCase(
        "input-lists-of-strings",
        _train(lambda p: _table(p, {"image": pa.array([["a"]] * ROWS), "label": pa.array(_y())})),
        "input values are string, expected numbers",
    ),
    DataCase("ragged-list-column", _train(_ragged), "every row must hold the same number of values"),
    DataCase("null-input-row", _train(_null_row), "null input"),
    DataCase("null-input-value", _train(_null_value), "null input value"),
    DataCase("nan-features", _train(_features(np.nan)), "NaN/Inf value(s)"),
    DataCase("inf-features", _train(_features(np.inf)), "NaN/Inf value(s)"),
    DataCase("negative-label", _train(lambda p: write_parquet(p, _x(), _y() - 1)), "label -1 is outside"),
    DataCase("label-2-pow-40", _train(lambda p: write_parquet(p, _x(), _y() * 2**40)), "is outside [0, 16777215]"),
    DataCase("float-label-2-pow-40", _train(lambda p: write_parquet(p, _x(), _y() * 2.0**40)), "is outside"),
    DataCase(
        "label-above-num-classes",
        _train(lambda p: write_parquet(p, _x(), _y() * 5), num_classes=2),
        "outside [0, 2)",
    ),
    DataCase("float-labels-for-class", _train(lambda p: write_parquet(p, _x(), _y() + 0.5)), "non-integral floats"),
    DataCase(
        "nan-labels",
        _train(lambda p: write_parquet(p, _x(), np.where(_y() == 1, np.nan, 0.0))),
        "non-integral floats",
    ),
    DataCase(
        "string-labels",
        _train(lambda p: _table(p, {"image": _inputs(), "label": pa.array([str(v) for v in _y()])})),
        "expected integer class indices",
    ),
    DataCase(
        "null-label",
        _train(lambda p: _table(p, {"image": _inputs(), "label": pa.array([0, 1] * 9 + [1, None])})),
        "null target",
    ),
    DataCase("one-class-only", _train(lambda p: write_parquet(p, _x(), _y() * 0)), "every training label is 0"),
    DataCase(
        "one-based-labels",
        _train(lambda p: write_parquet(p, _x(), _y() + 1), test=lambda p: write_parquet(p, _x(), _y() + 1) or p),
        "the labels start at 1, but classes",
    ),
    DataCase(  # num_classes (unset) is taken from every split: class 2 is only in the test file
        "a-class-only-in-the-test-file",
        _train(_good, test=lambda p: write_parquet(p, _x(), np.arange(ROWS) % 3) or p, num_classes=None),
        "the training split holds none of them",
    ),
    DataCase(
        "num-classes-past-the-labels",
        _train(lambda p: write_parquet(p, _x(), _y()), num_classes=5),
        "set data.target.num_classes: 2",
    ),
    DataCase(
        "missing-label-column", _train(lambda p: _table(p, {"image": _inputs(), "y": pa.array(_y())})), "not found"
    ),
    DataCase(
        "missing-input-column", _train(lambda p: _table(p, {"pixels": _inputs(), "label": pa.array(_y())})), "not found"
    ),
    DataCase(
        "test-file-with-other-features",  # the load's error names the source (the training files) and the split
        _train(_good, test=lambda p: write_parquet(p, np.ascontiguousarray(_x()[:, :3]), _y()) or p),
        "input shapes differ between splits",
    ),
    DataCase("folder-of-mixed-schemas", _train(_mixed_schemas), "every file of a data path must have the same schema"),
    DataCase("folder-of-disagreeing-shapes", _train(_shapes_disagree), "files disagree on cascade_ray.image_shape"),
    DataCase("folder-without-parquet", _train(_empty_folder), "no parquet file matches"),
    DataCase("glob-matching-nothing", _train(lambda p: p.parent / "train-*.parquet"), "no parquet file matches"),
    DataCase("fifo-as-data-path", _train(_fifo), "is a FIFO, not a regular file"),
    DataCase("fifo-as-test-path", _test_file(_fifo), "is a FIFO, not a regular file"),
    DataCase("device-as-data-path", _train(lambda p: Path(os.devnull)), "is a character device"),
    DataCase("symlink-loop", _train(_symlink_loop), "cannot be inspected"),
    DataCase("dangling-symlink", _train(_dangling), "dangling symlink"),
    DataCase("truncated-test-file", _test_file(_truncated), "cannot read parquet"),
    DataCase(
        "multilabel-flags-not-0-1",
        _train(_targets(np.full((ROWS, 3), 2.0, np.float32)), _FLAGS, target_kind="multilabel"),
        "values other than 0 and 1",
    ),
    DataCase(
        "multilabel-scalar-targets",
        _train(lambda p: write_parquet(p, _x(), _y().astype(np.float32)), _FLAGS, target_kind="multilabel"),
        "must be a list of 0/1 flags",
    ),
    DataCase(
        "regression-nan-targets",
        _train(_targets(np.full((ROWS, 2), np.nan, np.float32)), _VALUES, target_kind="regression"),
        "NaN/Inf value(s)",
    ),
]


def test_the_data_matrix_is_complete():
    assert len(DATA_CASES) >= 30, f"issue 18 asks for at least 30 malformed-data cases, found {len(DATA_CASES)}"
    assert len({c.name for c in DATA_CASES}) == len(DATA_CASES)


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """Load good data and validate a config once, so the timed cases measure the checks, not the
    first import of the data and shape-preflight code (about 2 s on this machine)."""
    tmp = tmp_path_factory.mktemp("warm")
    kwargs = {"path": _good(tmp / "train.parquet"), "test_path": _good(tmp / "test.parquet")}
    load_parquet(**kwargs, train_size=None, val_fraction=0.2, seed=0)
    assert cli_main(["validate", str(_config(tmp, kwargs))]) == 0


@pytest.mark.parametrize("case", DATA_CASES, ids=lambda c: c.name)
def test_malformed_data_is_an_error_naming_the_file(case, tmp_path, warm):
    kwargs, named = case.make(tmp_path)
    started = time.perf_counter()
    with pytest.raises(DataError) as info:
        load_parquet(**{"train_size": None, "val_fraction": 0.2, "seed": 0} | kwargs)
    elapsed = time.perf_counter() - started
    message = str(info.value)
    assert info.value.exit_code == 2
    assert str(named) in message, message
    assert case.needle in message, message
    assert elapsed < 2.0, f"{case.name}: {elapsed:.2f} s"


# cases that also go through `cascade-ray run`: exit 2 and no Ray
CLI_CASES = ["fifo-as-data-path", "shape-metadata-abc", "label-2-pow-40", "nan-features", "empty-file"]


def _config(tmp: Path, kwargs: dict[str, Any]) -> Path:
    cfg = {
        "name": "abuse",
        "seed": 0,
        "storage_path": str(tmp / "runs"),
        "data": {
            "source": "parquet",
            "path": str(kwargs["path"]),
            "test_path": str(kwargs["test_path"]),
            "inputs": {"column": "image"},
            "target": {"column": "label", "kind": "class", "num_classes": 2},
        },
        "stages": [
            {
                "name": "only",
                "model": {"type": "mlp", "in_features": WIDTH, "hidden": [4]},
                "loss": {"type": "cross_entropy"},
                "solver": {"type": "SGD", "lr": 0.1},
                "train": {"epochs": 1, "batch_size": 4},
            }
        ],
    }
    path = tmp / "abuse.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    return path


@pytest.mark.parametrize("name", CLI_CASES)
def test_malformed_data_through_the_cli_exits_2_before_ray(name, tmp_path, monkeypatch, capsys, warm):
    def refuse(*args, **kwargs):
        raise AssertionError("ray.init was called for data that should have been rejected")

    monkeypatch.setattr(ray, "init", refuse)
    case = next(c for c in DATA_CASES if c.name == name)
    kwargs, named = case.make(tmp_path)
    started = time.perf_counter()
    assert cli_main(["run", str(_config(tmp_path, kwargs))]) == 2
    assert time.perf_counter() - started < 2.0
    err = capsys.readouterr().err
    assert str(named) in err, err
    assert not ray.is_initialized()


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("missing-label-column", "data.target.column"),
        ("missing-input-column", "data.inputs.column"),
        ("string-labels", "data.target.column"),
        ("test-file-with-other-features", "data.test_path"),
    ],
)
def test_what_the_files_schema_shows_fails_validate_too(name, key, tmp_path, capsys, warm):
    """`validate` read only that the first file opens, so it said OK to data `run` then refused; the
    columns, their types and a test file's width are in the footer: now both refuse, naming the key."""
    case = next(c for c in DATA_CASES if c.name == name)
    kwargs, _ = case.make(tmp_path)
    assert cli_main(["validate", str(_config(tmp_path, kwargs))]) == 2
    err = capsys.readouterr().err
    assert f"  - {key}: " in err, err
