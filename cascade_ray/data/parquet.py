"""Image classification data in Parquet: an image column and an integer label column.

The image column is a (fixed-size) list of numbers, or an ``arrow.fixed_shape_tensor``.
:func:`write_parquet` stores the image shape in the schema metadata so that
:func:`load_parquet` needs no ``image_shape`` for its own files.
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

from cascade_ray.data.splits import (
    DataSplits,
    image_stats,
    stratified_subset_and_val,
    validate_splits,
)
from cascade_ray.errors import DataError
from cascade_ray.storage import STORAGE_ACCESS_FIX, UriPath, as_storage, redact, resolve_files, write_table

SHAPE_METADATA_KEY = b"cascade_ray.image_shape"
_SHAPE_KEY_TEXT = SHAPE_METADATA_KEY.decode()
_LIST_TYPES = (pa.types.is_fixed_size_list, pa.types.is_list, pa.types.is_large_list)


def _resolve_files(path: str | os.PathLike, knob: str) -> tuple[list[str], pafs.FileSystem | None]:
    """A file, every ``*.parquet`` under a folder or prefix, or the files a glob matches, local
    or on a URI (``s3://``, ``gs://``, ``file://``: :func:`cascade_ray.storage.resolve_files`);
    sorted so the row order (and with it every seeded split) is reproducible. Returns the
    paths and their filesystem (None: local)."""
    try:
        files = resolve_files(path)
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


def _check_shape(shape: Sequence[int], flat_size: int, where: str) -> tuple[int, int, int]:
    dims = tuple(shape)
    if len(dims) != 3 or not all(isinstance(d, (int, np.integer)) and d > 0 for d in dims):
        raise DataError(
            f"{where}: image shape {list(dims)} is not 3 positive ints (C, H, W); "
            "use e.g. [1, 28, 28] for single-channel images"
        )
    if math.prod(dims) != flat_size:
        raise DataError(
            f"{where}: image shape {list(dims)} holds {math.prod(dims)} values "
            f"but each image has {flat_size}; fix data.image_shape"
        )
    return int(dims[0]), int(dims[1]), int(dims[2])


def _list_images(arr: pa.Array, image_shape: Sequence[int] | None, meta_shape: list | None, where: str) -> np.ndarray:
    n = len(arr)
    if pa.types.is_fixed_size_list(arr.type):
        size = arr.type.list_size
    else:
        lengths = pc.list_value_length(arr).to_numpy()
        size = int(lengths[0]) if n else 0
        if n and (lengths != size).any():
            raise DataError(
                f"{where}: image lists have lengths {int(lengths.min())}..{int(lengths.max())}; "
                "every image must hold the same number of values"
            )
    values = arr.flatten()  # honours slice offsets, unlike .values
    if not (pa.types.is_integer(values.type) or pa.types.is_floating(values.type)):
        raise DataError(f"{where}: image values are {values.type}, expected numbers")
    if values.null_count:
        raise DataError(f"{where}: {values.null_count} null pixel value(s); drop or fill them")
    if image_shape is not None:
        shape = _check_shape(image_shape, size, f"data.image_shape ({where})")
    elif meta_shape is not None:
        shape = _check_shape(meta_shape, size, f"{where} schema metadata {_SHAPE_KEY_TEXT}")
    elif math.isqrt(size) ** 2 == size and size > 0:
        shape = (1, math.isqrt(size), math.isqrt(size))
    else:
        raise DataError(
            f"{where}: images hold {size} values, not a perfect square, so the "
            "shape is ambiguous; set data.image_shape to [C, H, W]"
        )
    return values.to_numpy(zero_copy_only=False).reshape(n, *shape)


def _tensor_images(arr: pa.ExtensionArray, image_shape: Sequence[int] | None, where: str) -> np.ndarray:
    shape = tuple(arr.type.shape)
    x = arr.to_numpy_ndarray()
    if len(shape) == 2:  # (H, W) tensors are single-channel images
        x = x[:, None, :, :]
    elif len(shape) != 3:
        raise DataError(f"{where}: tensor shape {list(shape)} is neither (H, W) nor (C, H, W)")
    if image_shape is not None and tuple(image_shape) != x.shape[1:]:
        raise DataError(
            f"data.image_shape: {list(image_shape)} differs from the shape {list(x.shape[1:])} "
            f"stored in the tensor type of {where}; drop data.image_shape"
        )
    return x


def _labels(col: pa.Array, where: str) -> np.ndarray:
    if col.null_count:
        raise DataError(f"{where}: {col.null_count} null label(s); drop those rows")
    if not (pa.types.is_integer(col.type) or pa.types.is_floating(col.type)):
        raise DataError(f"{where}: labels are {col.type}, expected integer class indices")
    y = col.to_numpy(zero_copy_only=False)
    if pa.types.is_floating(col.type) and not np.array_equal(y, np.round(y)):
        raise DataError(f"{where}: labels are non-integral floats; labels must be class indices")
    return y.astype(np.int64)


def _read(
    path: str | os.PathLike,
    knob: str,
    image_column: str,
    label_column: str,
    image_shape: Sequence[int] | None,
) -> tuple[np.ndarray, np.ndarray]:
    files, fs = _resolve_files(path, knob)
    where = f"{knob}={redact(os.fspath(path))!r}"
    try:
        dataset = ds.dataset(files, format="parquet", filesystem=fs)
        missing = [c for c in (image_column, label_column) if c not in dataset.schema.names]
        if missing:
            raise DataError(
                f"{where}: column(s) {missing} not found (columns: {dataset.schema.names}); "
                "set data.image_column / data.label_column"
            )
        table = dataset.to_table(columns=[image_column, label_column])
        # Footers only: cheap, and catches files written with different image shapes.
        metas = {(pq.read_schema(f, filesystem=fs).metadata or {}).get(SHAPE_METADATA_KEY) for f in files}
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{where}: cannot read parquet ({exc}); the files are corrupt or their schemas differ") from exc
    if len(metas) > 1:
        raise DataError(f"{where}: files disagree on {_SHAPE_KEY_TEXT}: {sorted(map(str, metas))}")
    meta = metas.pop()
    try:
        meta_shape = json.loads(meta) if meta else None
    except ValueError as exc:
        raise DataError(f"{where}: metadata {_SHAPE_KEY_TEXT} is not JSON: {meta!r}") from exc
    if table.num_rows == 0:
        raise DataError(f"{where}: no rows")
    images = table[image_column].combine_chunks()
    if images.null_count:
        raise DataError(f"{where}: {images.null_count} null image(s); drop those rows")
    if isinstance(images.type, pa.FixedShapeTensorType):
        x = _tensor_images(images, image_shape, where)
    elif any(is_list(images.type) for is_list in _LIST_TYPES):
        x = _list_images(images, image_shape, meta_shape, where)
    else:
        raise DataError(
            f"{where}: column {image_column!r} is {images.type}; expected a list of "
            "numbers or an arrow.fixed_shape_tensor"
        )
    return x, _labels(table[label_column].combine_chunks(), where)


def load_parquet(
    path: str | os.PathLike,
    *,
    test_path: str | os.PathLike | None,
    image_column: str = "image",
    label_column: str = "label",
    image_shape: Sequence[int] | None = None,
    train_size: int | None,
    val_fraction: float,
    seed: int,
    num_classes: int | None = None,
) -> DataSplits:
    """Load train (split stratified into train/val) and test splits from Parquet.

    Args:
        path: training data: a file, a folder of ``*.parquet`` files, or a glob.
        test_path: held-out test data, same forms; required.
        image_column: column holding the images.
        label_column: column holding integer labels.
        image_shape: (C, H, W) of list-typed images; needed only when the schema
            metadata has none and the flat size is not a perfect square (then (1, s, s)).
        train_size: training samples before the validation split; None keeps all.
        val_fraction: share of those moved to validation, in (0, 1).
        seed: random state of the subset and validation split.
        num_classes: number of classes; defaults to max(label) + 1 over train and test.

    Raises:
        DataError: a path matches nothing, a column is missing or malformed, the shape is
            unknown, or the resulting splits fail :func:`validate_splits`.
    """
    if test_path is None:
        raise DataError(
            "data.test_path: not set; parquet data has no official test split, so "
            "point data.test_path at held-out rows (file, folder or glob)"
        )
    x_all, y_all = _read(path, "data.path", image_column, label_column, image_shape)
    x_test, y_test = _read(test_path, "data.test_path", image_column, label_column, image_shape)
    if num_classes is None:
        num_classes = int(max(y_all.max(), y_test.max())) + 1
    x_tr, y_tr, x_val, y_val = stratified_subset_and_val(
        x_all, y_all, train_size=train_size, val_fraction=val_fraction, seed=seed
    )
    mean, std = image_stats(x_tr)
    splits = DataSplits(
        x_train=x_tr,
        y_train=y_tr,
        x_val=x_val,
        y_val=y_val,
        x_test=x_test,
        y_test=y_test,
        num_classes=num_classes,
        mean=mean,
        std=std,
        source=f"parquet:{redact(os.fspath(path))}",
    )
    validate_splits(splits)
    return splits


def write_parquet(
    path: str | os.PathLike,
    x: np.ndarray,
    y: np.ndarray,
    *,
    image_column: str = "image",
    label_column: str = "label",
) -> None:
    """Write (N, C, H, W) images as a fixed-size list column plus int64 labels.

    The (C, H, W) shape goes into the schema metadata under ``cascade_ray.image_shape``
    (JSON), and the pixel dtype is kept, so :func:`load_parquet` round-trips bit-exactly.
    """
    y = np.asarray(y)
    if x.ndim != 4 or len(x) != len(y):
        raise DataError(
            f"write_parquet: x {x.shape} and y {y.shape}; expected x as (N, C, H, W) and one label per image"
        )
    if not np.issubdtype(y.dtype, np.integer):
        raise DataError(f"write_parquet: labels have dtype {y.dtype}, expected integers")
    flat = np.ascontiguousarray(x).reshape(-1)
    images = pa.FixedSizeListArray.from_arrays(pa.array(flat), math.prod(x.shape[1:]))
    table = pa.table({image_column: images, label_column: pa.array(y.astype(np.int64))})
    shape_json = json.dumps([int(d) for d in x.shape[1:]]).encode()
    table = table.replace_schema_metadata({SHAPE_METADATA_KEY: shape_json})
    write_table(table, as_storage(path, "path"))
