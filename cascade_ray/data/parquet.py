"""Training data in Parquet: an input column and a target column.

The input column is a (fixed-size) list of numbers, or an ``arrow.fixed_shape_tensor``, of
any per-row shape ((C, H, W) images, (T, D) sequences, (D,) vectors). :func:`write_parquet`
stores the shape in the schema metadata (key ``cascade_ray.image_shape``, kept for files
written before other ranks existed) so that :func:`load_parquet` needs no
``data.inputs.shape`` for its own files. Targets are class indices, lists of 0/1 flags
(multilabel) or numbers / lists of numbers (regression).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from cascade_ray.config.schema import MAX_CLASSES
from cascade_ray.data.splits import (
    DataSplits,
    input_stats,
    stratified_subset_and_val,
    validate_splits,
)
from cascade_ray.errors import DataError
from cascade_ray.storage import STORAGE_ACCESS_FIX, UriPath, as_storage, redact, resolve_files, write_table

# Rows per Parquet row group in write_parquet. One 60k-row group streamed 2.3x slower through the
# local shuffle buffer than 4096-row groups (docs/benchmarks.md, streaming), and a scan task or a
# reader cannot split work below a row group.
DEFAULT_ROW_GROUP_ROWS = 4096

# The largest class index a label column may hold: the output width and the per-class counts
# are sized by the largest label, so 2**40 would be a multi-terabyte allocation, not a model.
# One bound with the schema's `data.target.num_classes`.
MAX_CLASS_INDEX = MAX_CLASSES - 1

SHAPE_METADATA_KEY = b"cascade_ray.image_shape"
_SHAPE_KEY_TEXT = SHAPE_METADATA_KEY.decode()
# the Arrow list types a row of numbers comes as
LIST_TYPES = (pa.types.is_fixed_size_list, pa.types.is_list, pa.types.is_large_list)


def _resolve_files(path: str | os.PathLike, knob: str) -> tuple[list[str], pafs.FileSystem | None]:
    """A file, every ``*.parquet`` under a folder or prefix, or the files a glob matches, local
    or on a URI (``s3://``, ``gs://``, ``file://``: :func:`cascade_ray.storage.resolve_files`);
    sorted so the row order (and with it every seeded split) is reproducible. Returns the
    paths and their filesystem (None: local)."""
    try:
        files = resolve_files(path)
    except DataError as exc:  # one named path that is a FIFO, a device, a symlink loop
        raise DataError(f"{knob}: {exc}") from None
    except OSError as exc:
        raise DataError(f"{knob}: cannot list {redact(os.fspath(path))!r} ({exc}); {STORAGE_ACCESS_FIX}") from exc
    if not files:
        raise DataError(
            f"{knob}: no parquet file matches {redact(os.fspath(path))!r}; point it at a .parquet file, a folder "
            "(or object-store prefix) holding *.parquet files, or a glob such as 'data/train-*.parquet'"
        )
    if isinstance(files[0], UriPath):
        return [f.path for f in files], files[0].fs
    return [str(f) for f in files], None


def _check_shape(shape: Sequence[int], flat_size: int, where: str, key: str) -> tuple[int, ...]:
    dims = tuple(shape)
    if not 1 <= len(dims) <= 3 or not all(isinstance(d, (int, np.integer)) and d > 0 for d in dims):
        raise DataError(
            f"{where}: input shape {list(dims)} is not 1 to 3 positive ints; use [C, H, W] for images, "
            "[T, D] for sequences or [D] for feature vectors"
        )
    if math.prod(dims) != flat_size:
        raise DataError(
            f"{where}: input shape {list(dims)} holds {math.prod(dims)} values but each row has {flat_size}; fix {key}"
        )
    return tuple(int(d) for d in dims)


def _list_values(arr: pa.Array, where: str, what: str) -> tuple[np.ndarray, int]:
    """The values of a list column as (rows, size) numpy, and the size; every row the same length."""
    n = len(arr)
    if pa.types.is_fixed_size_list(arr.type):
        size = arr.type.list_size
    else:
        lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False)
        size = int(lengths[0]) if n else 0
        if n and (lengths != size).any():
            first = int(np.flatnonzero(lengths != size)[0])
            raise DataError(
                f"{where}: {what} lists have lengths {int(lengths.min())}..{int(lengths.max())} (row {first} "
                f"has {int(lengths[first])}, row 0 has {size}); every row must hold the same number of values"
            )
    values = arr.flatten()  # honours slice offsets, unlike .values
    if not (pa.types.is_integer(values.type) or pa.types.is_floating(values.type)):
        raise DataError(f"{where}: {what} values are {values.type}, expected numbers")
    if values.null_count:
        raise DataError(f"{where}: {values.null_count} null {what} value(s); drop or fill them")
    return values.to_numpy(zero_copy_only=False).reshape(n, size), size


def _list_inputs(arr: pa.Array, shape: Sequence[int] | None, meta_shape: list | None, where: str) -> np.ndarray:
    flat, size = _list_values(arr, where, "input")
    if shape is not None:
        dims = _check_shape(shape, size, f"data.inputs.shape ({where})", "data.inputs.shape")
    elif meta_shape is not None:
        dims = _check_shape(meta_shape, size, f"{where} schema metadata {_SHAPE_KEY_TEXT}", "data.inputs.shape")
    else:
        dims = (size,)  # a flat list with no stored shape is a feature vector
    return flat.reshape(len(flat), *dims)


def _tensor_inputs(arr: pa.ExtensionArray, shape: Sequence[int] | None, where: str) -> np.ndarray:
    x = arr.to_numpy_ndarray()
    if shape is None:
        if not 1 <= x.ndim - 1 <= 3:
            raise DataError(f"{where}: tensor shape {list(x.shape[1:])} has rank {x.ndim - 1}; expected 1 to 3")
        return x
    dims = _check_shape(shape, math.prod(x.shape[1:]), f"data.inputs.shape ({where})", "data.inputs.shape")
    return x.reshape(len(x), *dims)


def _targets(col: pa.Array, kind: str, where: str) -> np.ndarray:
    """Targets of one split, shaped by kind: class (N,) int64, multilabel / regression (N, K) float32."""
    if col.null_count:
        raise DataError(f"{where}: {col.null_count} null target(s); drop those rows")
    is_list = any(is_list(col.type) for is_list in LIST_TYPES)
    if kind == "class":
        if not (pa.types.is_integer(col.type) or pa.types.is_floating(col.type)):
            raise DataError(
                f"{where}: labels are {col.type}, expected integer class indices "
                "(a list per row is data.target.kind: multilabel or regression)"
            )
        y = col.to_numpy(zero_copy_only=False)
        if pa.types.is_floating(col.type) and not np.array_equal(y, np.round(y)):
            raise DataError(
                f"{where}: labels are non-integral floats; class labels must be indices "
                "(for numeric targets set data.target.kind: regression)"
            )
        if np.issubdtype(y.dtype, np.floating) and not np.isfinite(y).all():
            raise DataError(f"{where}: labels hold NaN/Inf; drop those rows")
        # checked before anything is sized by them (the output width, a bincount of the classes)
        if len(y) and (y.min() < 0 or y.max() > MAX_CLASS_INDEX):
            bad = y.min() if y.min() < 0 else y.max()
            raise DataError(
                f"{where}: label {int(bad)} is outside [0, {MAX_CLASS_INDEX}]; class labels are indices from 0 "
                "(for numeric targets set data.target.kind: regression)"
            )
        return y.astype(np.int64)
    if is_list:
        values, _ = _list_values(col, where, "target")
    elif pa.types.is_integer(col.type) or pa.types.is_floating(col.type):
        if kind == "multilabel":
            raise DataError(f"{where}: multilabel targets must be a list of 0/1 flags per row, got {col.type}")
        values = col.to_numpy(zero_copy_only=False).reshape(-1, 1)
    else:
        raise DataError(f"{where}: {kind} targets are {col.type}, expected numbers or lists of numbers")
    return values.astype(np.float32)


def _read(
    path: str | os.PathLike, knob: str, input_column: str, target_column: str, shape: Sequence[int] | None, kind: str
) -> tuple[np.ndarray, np.ndarray]:
    files, fs = _resolve_files(path, knob)
    where = f"{knob}={redact(os.fspath(path))!r}"
    try:
        dataset = ds.dataset(files, format="parquet", filesystem=fs)
        missing = [c for c in (input_column, target_column) if c not in dataset.schema.names]
        if missing:
            raise DataError(
                f"{where}: column(s) {missing} not found (columns: {dataset.schema.names}); "
                "set data.inputs.column / data.target.column"
            )
        # Footers only: cheap, and catches files written with different input shapes or column
        # types (the dataset would silently cast every file to the first file's types).
        schemas = [pq.read_schema(f, filesystem=fs) for f in files]
        metas = {(schema.metadata or {}).get(SHAPE_METADATA_KEY) for schema in schemas}
        columns = (input_column, target_column)
        first = [dataset.schema.field(c).type for c in columns]
        for f, schema in zip(files, schemas, strict=True):
            types = [schema.field(c).type if c in schema.names else None for c in columns]
            if types != first:
                raise DataError(
                    f"{where}: {redact(f)} holds columns {columns} as {[str(t) for t in types]}, the first file as "
                    f"{[str(t) for t in first]}; every file of a data path must have the same schema"
                )
        table = dataset.to_table(columns=list(columns))
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{where}: cannot read parquet ({exc}); the files are corrupt or their schemas differ") from exc
    if len(metas) > 1:
        raise DataError(f"{where}: files disagree on {_SHAPE_KEY_TEXT}: {sorted(map(str, metas))}")
    meta = metas.pop()
    try:
        meta_shape = json.loads(meta) if meta else None
    except ValueError as exc:
        raise DataError(f"{where}: metadata {_SHAPE_KEY_TEXT} is not JSON: {meta[:80]!r}") from exc
    if meta_shape is not None and not (
        isinstance(meta_shape, list) and all(isinstance(d, int) and not isinstance(d, bool) for d in meta_shape)
    ):
        raise DataError(f"{where}: metadata {_SHAPE_KEY_TEXT} is {str(meta_shape)[:80]}, not a list of ints")
    if table.num_rows == 0:
        raise DataError(f"{where}: no rows")
    inputs = table[input_column].combine_chunks()
    if inputs.null_count:
        raise DataError(f"{where}: {inputs.null_count} null input(s); drop those rows")
    if isinstance(inputs.type, pa.FixedShapeTensorType):
        x = _tensor_inputs(inputs, shape, where)
    elif any(is_list(inputs.type) for is_list in LIST_TYPES):
        x = _list_inputs(inputs, shape, meta_shape, where)
    else:
        raise DataError(
            f"{where}: column {input_column!r} is {inputs.type}; expected a list of numbers or an arrow.fixed_shape_tensor"
        )
    return x, _targets(table[target_column].combine_chunks(), kind, where)


def load_parquet(
    path: str | os.PathLike,
    *,
    test_path: str | os.PathLike | None,
    input_column: str = "image",
    target_column: str = "label",
    input_shape: Sequence[int] | None = None,
    target_kind: str = "class",
    num_classes: int | None = None,
    target_dim: int | None = None,
    train_size: int | None,
    val_fraction: float,
    seed: int,
) -> DataSplits:
    """Load train (split into train/val) and test splits from Parquet.

    Args:
        path: training data: a file, a folder of ``*.parquet`` files, or a glob.
        test_path: held-out test data, same forms; required.
        input_column: column holding each row's input (a list of numbers, or an Arrow tensor).
        target_column: column holding each row's target.
        input_shape: per-row shape of a flat list column; default from the schema metadata,
            else a flat vector.
        target_kind: ``class`` (integer indices), ``multilabel`` (lists of 0/1 flags) or
            ``regression`` (a number or a list of numbers).
        num_classes: classes; default max(label) + 1 (class) or the list length (multilabel).
        target_dim: regression values per row; default what the column holds.
        train_size: training samples before the validation split; None keeps all.
        val_fraction: share of those moved to validation, in (0, 1).
        seed: random state of the subset and validation split.

    Raises:
        DataError: a path matches nothing, a column is missing or malformed, the shape does
            not fit, or the resulting splits fail :func:`validate_splits`.
    """
    if test_path is None:
        raise DataError(
            "data.test_path: not set; parquet data has no official test split, so "
            "point data.test_path at held-out rows (file, folder or glob)"
        )
    cols = (input_column, target_column, input_shape, target_kind)
    x_all, y_all = _read(path, "data.path", *cols)
    x_test, y_test = _read(test_path, "data.test_path", *cols)
    width = _target_width(y_all, y_test, target_kind, num_classes, target_dim, target_column)
    x_tr, y_tr, x_val, y_val = stratified_subset_and_val(
        x_all, y_all, train_size=train_size, val_fraction=val_fraction, seed=seed, stratify=target_kind == "class"
    )
    mean, std = input_stats(x_tr)
    splits = DataSplits(
        x_train=x_tr,
        y_train=y_tr,
        x_val=x_val,
        y_val=y_val,
        x_test=x_test,
        y_test=y_test,
        num_classes=width,
        mean=mean,
        std=std,
        source=f"parquet:{redact(os.fspath(path))}",
        target_kind=target_kind,
    )
    validate_splits(splits)
    return splits


def _target_width(
    y: np.ndarray, y_test: np.ndarray, kind: str, num_classes: int | None, dim: int | None, column: str = "label"
) -> int:
    """The output width the targets call for, checked against data.target.num_classes / dim.

    Class labels were range-checked when read (``_targets``: 0 .. MAX_CLASS_INDEX), so the
    inferred class count below allocates nothing unbounded.
    """
    if kind == "class":
        if num_classes is not None:
            return num_classes
        return int(max(y.max(), y_test.max())) + 1
    held = int(y.shape[1])
    key, given = ("data.target.dim", dim) if kind == "regression" else ("data.target.num_classes", num_classes)
    if given is not None and given != held:
        raise DataError(f"{key}: {given}, but each {kind} target in data.path holds {held} value(s); set {key}: {held}")
    return held


def write_parquet(
    path: str | os.PathLike,
    x: np.ndarray,
    y: np.ndarray,
    *,
    input_column: str = "image",
    target_column: str = "label",
    image_column: str | None = None,
    label_column: str | None = None,
    row_group_rows: int = DEFAULT_ROW_GROUP_ROWS,
) -> None:
    """Write (N, *shape) inputs as a fixed-size list column, and the targets.

    The per-row shape goes into the schema metadata under ``cascade_ray.image_shape``
    (JSON), and the input dtype is kept, so :func:`load_parquet` round-trips bit-exactly.
    Targets: (N,) integers (class indices) become an int64 column, (N,) floats a float
    column, (N, K) values a fixed-size list column (multilabel flags, regression values).
    `image_column` / `label_column` are the image-case spellings of the column names.
    `row_group_rows`: rows per Parquet row group (the unit a streamed read or a scan task splits on).
    """
    if row_group_rows < 1:
        raise DataError(f"write_parquet: row_group_rows={row_group_rows}; expected a positive number of rows")
    input_column, target_column = image_column or input_column, label_column or target_column
    try:
        x, y = np.asarray(x), np.asarray(y)  # a list of rows too
    except ValueError as exc:  # numpy: "inhomogeneous shape"
        raise DataError(f"write_parquet: {exc}; give every input row one shape and every target one length") from None
    if not (np.issubdtype(x.dtype, np.integer) or np.issubdtype(x.dtype, np.floating)):
        raise DataError(f"write_parquet: inputs have dtype {x.dtype}, expected numbers")
    if not 2 <= x.ndim <= 4 or len(x) != len(y) or y.ndim not in (1, 2):
        raise DataError(
            f"write_parquet: x {x.shape} and y {y.shape}; expected x as (N, D), (N, T, D) or (N, C, H, W) "
            "and one target (a value or a row of values) per input"
        )
    if not (np.issubdtype(y.dtype, np.integer) or np.issubdtype(y.dtype, np.floating)):
        raise DataError(f"write_parquet: targets have dtype {y.dtype}, expected numbers")
    flat = np.ascontiguousarray(x).reshape(-1)
    inputs = pa.FixedSizeListArray.from_arrays(pa.array(flat), math.prod(x.shape[1:]))
    if y.ndim == 2:
        targets = pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(y).reshape(-1)), y.shape[1])
    else:
        targets = pa.array(y.astype(np.int64) if np.issubdtype(y.dtype, np.integer) else y)
    table = pa.table({input_column: inputs, target_column: targets})
    shape_json = json.dumps([int(d) for d in x.shape[1:]]).encode()
    table = table.replace_schema_metadata({SHAPE_METADATA_KEY: shape_json})
    write_table(table, as_storage(path, "path"), row_group_rows)
