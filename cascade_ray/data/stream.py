"""Streaming Parquet data through Ray Data (issue 16 item 4): scan, split, shard, check.

Public names (stable; the integrator wires them to ``data.streaming``):

- :func:`scan_parquet` - one pass over every (file, row group) before training: row counts of
  the train and val parts, the input shape, per-channel / per-feature mean and std of the train
  part (float64 partial sums merged exactly), label counts, and a :class:`DataError` naming file,
  row group and row for every bad-row kind. Ray tasks when Ray is up, in-process otherwise.
- :func:`is_val_row` / :func:`content_hash` - the train/val split. **Streaming val is a
  content-hash split, not a stratified one**: a row is val when a seeded 64-bit hash of its input
  bytes falls below ``val_fraction``, so the split does not depend on file order, block layout or
  worker count, and duplicate inputs always land in the same part.
In :mod:`cascade_ray.data.stream_ingest` (it imports Ray Data; this module needs no Ray):

- :func:`streaming_datasets` - ``{"train", "val"[, "test"]}`` Ray Datasets (``ray.data.read_parquet``
  + the same hash filter, so row counts equal the scan's), for ``TorchTrainer(datasets=...)``.
- :class:`StreamingDataConfig` - the ``DataConfig`` to pass with them: train is split with
  ``equal=True`` (every rank the same rows, so DDP steps in lock-step), eval splits with
  ``equal=False`` (each row exactly once across ranks).
- :class:`StreamSource` - the worker-side :class:`~cascade_ray.data.batches.BatchSource` over
  ``ray.train.get_dataset_shard(name)``.
- :func:`streaming_resource_issue` / :func:`decide_streaming` - the CPU rule and ``auto``.

Ray 2.60 facts this relies on (checked in the installed source):
Train v2 registers its workers' resources with Ray Data's autoscaling coordinator at HIGH
priority and Ray Data's executor gets only what is left, so Ray Data needs CPUs that no
training worker holds; ``streaming_split(n, equal=True)`` gives each split ``N // n`` rows and
drops the remainder; ``FileShuffleConfig`` / ``RandomSeedConfig`` with ``reseed_after_execution``
reshuffle per execution (= per epoch) from ``(seed, execution index)``.

Local check: ``PYTHONPATH=. python -m pytest tests/unit/test_stream_scan.py tests/integration/test_streaming.py``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from cascade_ray.data.parquet import SHAPE_METADATA_KEY, _resolve_files
from cascade_ray.data.splits import TARGET_KINDS, stats_axis, stats_shape
from cascade_ray.errors import DataError
from cascade_ray.storage import redact

DATA_CPUS_KEY = "data.streaming_cpus"
# `data.streaming: auto` streams when the train inputs would take more than this share of the
# object store (in-memory data is ray.put once and must leave room for weights and Ray Data).
AUTO_STORE_SHARE = 0.3
SCAN_TASK_CPUS = 0.5  # scan tasks are I/O + numpy: two per core keep a core busy while one waits
_ROW_GROUPS_PER_TASK = 8
_NO_SKIP = "cascade-ray never skips bad rows: drop or repair it and rerun"


# --- the content-hash split ----------------------------------------------------------------


def content_hash(x: np.ndarray, seed: int) -> np.ndarray:
    """Seeded 64-bit hash of each row's bytes (row = ``x[i]``): (N,) uint64.

    ``blake2b`` (8-byte digest, keyed by the seed) per row. Measured on this 2-core EPYC:
    0.27 s for 60k float32 rows of 784 values (~700 MB/s), 0.09-0.14 s for 60k uint8 rows; a
    vectorised multiply-xorshift over the rows' uint64 words was 5x slower on the wide float
    rows (1.4 s, numpy temporaries) and only faster on very narrow rows (13 vs 55 ms for 16
    values), where both are negligible. Depends on the stored dtype (uint8 and float32 of the
    same picture hash differently); the scan and the stream convert Arrow to numpy the same way.
    """
    key = int(seed % 2**64).to_bytes(8, "little")
    rows = np.ascontiguousarray(x).reshape(len(x), -1)
    digests = (hashlib.blake2b(row, digest_size=8, key=key).digest() for row in rows)
    return np.frombuffer(b"".join(digests), dtype="<u8").astype(np.uint64, copy=False)


def is_val_row(x: np.ndarray, val_fraction: float, seed: int) -> np.ndarray:
    """(N,) bool: rows whose seeded content hash, as a number in [0, 1), is below ``val_fraction``."""
    return (content_hash(x, seed) >> np.uint64(11)).astype(np.float64) * 2.0**-53 < val_fraction


# --- Arrow -> numpy, with the row checks shared by the scan and the stream ------------------

Where = Callable[[int], str]  # row index in the chunk -> "file 'a.parquet' row group 2, row 17"


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def input_array(
    col: pa.Array | pa.ChunkedArray,
    shape: Sequence[int],
    column: str,
    where: Where,
    fix: str = "fix data.inputs.shape",
) -> np.ndarray:
    """(N, *shape) numpy of a fixed-size list, list or ``arrow.fixed_shape_tensor`` column. `fix`: what to do
    about rows of another length (the config key in training; predict's rows must fit the run).

    Raises:
        DataError: a null row or value, a row of the wrong length, a non-numeric type, NaN/Inf.
    """
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if isinstance(col.type, pa.FixedShapeTensorType):
        col = col.storage
    n, size = len(col), math.prod(shape)
    if col.null_count:
        raise DataError(
            f"{where(_first(col.is_null().to_numpy(zero_copy_only=False)))}: input {column!r} is null; {_NO_SKIP}"
        )
    if pa.types.is_fixed_size_list(col.type):
        if col.type.list_size != size:
            raise DataError(
                f"{where(0)}: input {column!r} rows hold {col.type.list_size} values, shape {list(shape)} "
                f"needs {size}; {fix}"
            )
    elif pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
        lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
        if (lengths != size).any():
            row = _first(lengths != size)
            raise DataError(
                f"{where(row)}: input {column!r} holds {int(lengths[row])} values, shape {list(shape)} needs "
                f"{size}; {_NO_SKIP}, or {fix}"
            )
    else:
        raise DataError(
            f"{where(0)}: input {column!r} is {col.type}; expected a (fixed-size) list of numbers or an "
            "arrow.fixed_shape_tensor; fix data.inputs.column"
        )
    values = col.flatten()  # honours slice offsets, unlike .values
    if not (pa.types.is_integer(values.type) or pa.types.is_floating(values.type)):
        raise DataError(f"{where(0)}: input {column!r} values are {values.type}, expected numbers")
    if values.null_count:
        flat = _first(values.is_null().to_numpy(zero_copy_only=False))
        raise DataError(f"{where(flat // size)}: input {column!r} holds a null value; {_NO_SKIP}")
    x = values.to_numpy(zero_copy_only=False).reshape(n, *shape)
    if x.dtype.kind == "f":
        bad = ~np.isfinite(x.reshape(n, -1)).all(axis=1)
        if bad.any():
            raise DataError(f"{where(_first(bad))}: input {column!r} holds NaN/Inf; {_NO_SKIP}")
    return x


def target_array(
    col: pa.Array | pa.ChunkedArray,
    kind: str,
    num_classes: int | None,
    dim: int | None,
    column: str,
    where: Where,
) -> np.ndarray:
    """Targets as numpy: int64 (N,) for ``class``, float32 (N, K) for ``multilabel``, float32
    (N, dim) for ``regression``.

    Raises:
        DataError: null, out-of-range class, non-0/1 multilabel value, wrong length, NaN/Inf regression.
    """
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    n = len(col)
    if col.null_count:
        raise DataError(
            f"{where(_first(col.is_null().to_numpy(zero_copy_only=False)))}: target {column!r} is null; {_NO_SKIP}"
        )
    if kind == "class":
        if not (pa.types.is_integer(col.type) or pa.types.is_floating(col.type)):
            raise DataError(f"{where(0)}: target {column!r} is {col.type}, expected integer class indices")
        y = col.to_numpy(zero_copy_only=False)
        if y.dtype.kind == "f":
            off = ~np.isfinite(y) | (y != np.round(y))
            if off.any():
                raise DataError(f"{where(_first(off))}: class label {y[_first(off)]} is not an integer; {_NO_SKIP}")
        out = (y < 0) | (y >= num_classes)
        if out.any():
            row = _first(out)
            raise DataError(
                f"{where(row)}: class label {y[row]} is outside [0, {num_classes}); {_NO_SKIP}, or fix data.target.num_classes"
            )
        return y.astype(np.int64)
    width = num_classes if kind == "multilabel" else (dim or 1)
    if pa.types.is_integer(col.type) or pa.types.is_floating(col.type):
        if width != 1:
            raise DataError(f"{where(0)}: target {column!r} is one number per row, {kind} needs {width}")
        y = col.to_numpy(zero_copy_only=False).reshape(n, 1)
    else:
        y = input_array(col, (width,), column, where) if n else np.zeros((0, width))
    if kind == "multilabel":
        off = ~np.isin(y, (0, 1)).all(axis=1)
        if off.any():
            raise DataError(
                f"{where(_first(off))}: multilabel target {column!r} holds a value other than 0/1; {_NO_SKIP}"
            )
    else:
        bad = ~np.isfinite(y).all(axis=1)
        if bad.any():
            raise DataError(f"{where(_first(bad))}: regression target {column!r} is NaN/Inf; {_NO_SKIP}")
    return y.astype(np.float32)


# --- statistics: per-channel moments merged exactly (Chan et al.) ----------------------------


@dataclass
class Moments:
    """Count, mean and sum of squared deviations per channel, float64."""

    n: int
    mean: np.ndarray
    m2: np.ndarray

    @classmethod
    def of(cls, x: np.ndarray, shape: Sequence[int]) -> Moments:
        axis = 1 + stats_axis(tuple(shape))
        c = x.shape[axis]
        v = np.moveaxis(x, axis, -1).reshape(-1, c).astype(np.float64)
        mean = v.mean(axis=0) if len(v) else np.zeros(c)
        return cls(len(v), mean, ((v - mean) ** 2).sum(axis=0))

    def merge(self, other: Moments) -> Moments:
        n = self.n + other.n
        if not n:
            return self
        delta = other.mean - self.mean
        mean = self.mean + delta * (other.n / n)
        return Moments(n, mean, self.m2 + other.m2 + delta**2 * (self.n * other.n / n))


# --- the scan -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Spec:
    input_column: str
    input_shape: tuple[int, ...]
    target_column: str
    target_kind: str
    num_classes: int | None
    target_dim: int | None
    val_fraction: float
    seed: int
    knob: str


@dataclass
class _Partial:
    train_rows: int = 0
    val_rows: int = 0
    moments: Moments | None = None
    train_counts: np.ndarray | None = None
    val_counts: np.ndarray | None = None
    nbytes: int = 0


@dataclass(frozen=True)
class ScanResult:
    """What one pass over the training Parquet found.

    Attributes:
        files: the files read, in sorted order (credentials redacted).
        row_groups: row groups read, all files together.
        train_rows, val_rows: rows in each part of the content-hash split.
        input_shape: per-sample shape.
        mean, std: float32 of shape :func:`stats_shape` over the train part; population std.
        constant_channels: channels whose std is 0; their std is set to 1 (so they normalise to 0).
        train_counts, val_counts: class: rows per class; multilabel: positives per class; regression: None.
        train_nbytes: bytes the train inputs take as numpy (the ``auto`` rule compares it to the store).
    """

    files: tuple[str, ...]
    row_groups: int
    train_rows: int
    val_rows: int
    input_shape: tuple[int, ...]
    mean: np.ndarray
    std: np.ndarray
    constant_channels: tuple[int, ...]
    train_counts: np.ndarray | None
    val_counts: np.ndarray | None
    train_nbytes: int
    extra: dict[str, Any] = field(default_factory=dict)


def _counts(y: np.ndarray, spec: _Spec) -> np.ndarray | None:
    if spec.target_kind == "class":
        return np.bincount(y, minlength=spec.num_classes).astype(np.int64)
    if spec.target_kind == "multilabel":
        return y.sum(axis=0).astype(np.int64)
    return None


def _add(a: np.ndarray | None, b: np.ndarray | None) -> np.ndarray | None:
    return b if a is None else a + b


def _scan_chunk(path: str, fs: Any, row_groups: Sequence[int], spec: _Spec) -> _Partial | DataError:
    """Scan some row groups of one file; a DataError is returned (not raised) so Ray hands it back whole."""
    shown = redact(path)
    try:
        pf = pq.ParquetFile(path, filesystem=fs) if fs is not None else pq.ParquetFile(path)
        starts = np.concatenate([[0], np.cumsum([pf.metadata.row_group(i).num_rows for i in range(pf.num_row_groups)])])
        part = _Partial()
        for rg in row_groups:
            table = pf.read_row_group(rg, columns=[spec.input_column, spec.target_column])

            def where(row: int, rg: int = rg) -> str:
                return (
                    f"{spec.knob}: file {shown!r} row group {rg}, row {row} (row {int(starts[rg]) + row} of the file)"
                )

            x = input_array(table[spec.input_column], spec.input_shape, spec.input_column, where)
            y = target_array(
                table[spec.target_column],
                spec.target_kind,
                spec.num_classes,
                spec.target_dim,
                spec.target_column,
                where,
            )
            val = is_val_row(x, spec.val_fraction, spec.seed)
            x_tr = x[~val]
            moments = Moments.of(x_tr, spec.input_shape)
            part.moments = moments if part.moments is None else part.moments.merge(moments)
            part.train_rows += len(x_tr)
            part.val_rows += int(val.sum())
            part.train_counts = _add(part.train_counts, _counts(y[~val], spec))
            part.val_counts = _add(part.val_counts, _counts(y[val], spec))
            part.nbytes += x_tr.nbytes
        return part
    except DataError as exc:
        return exc
    except (pa.ArrowException, OSError) as exc:
        return DataError(f"{spec.knob}: cannot read {shown!r} ({exc}); the file is corrupt or unreachable")


def _infer_shape(files: list[str], fs: Any, column: str, knob: str) -> tuple[int, ...]:
    pf = pq.ParquetFile(files[0], filesystem=fs) if fs is not None else pq.ParquetFile(files[0])
    meta = (pf.schema_arrow.metadata or {}).get(SHAPE_METADATA_KEY)
    if meta:
        try:
            return tuple(int(d) for d in json.loads(meta))
        except (ValueError, TypeError) as exc:
            raise DataError(
                f"{knob}: schema metadata {SHAPE_METADATA_KEY.decode()} is not a JSON list: {meta!r}"
            ) from exc
    typ = pf.schema_arrow.field(column).type
    if isinstance(typ, pa.FixedShapeTensorType):
        return tuple(typ.shape)
    if pa.types.is_fixed_size_list(typ):
        return (typ.list_size,)
    if pf.metadata.num_rows:  # a variable list: the first row's length, checked on every row by the scan
        first = pf.read_row_group(0, columns=[column])[column].combine_chunks()
        return (int(pc.list_value_length(first[:1]).to_numpy(zero_copy_only=False)[0]),)
    raise DataError(f"{knob}: cannot tell the input shape of an empty file; set data.inputs.shape")


def _check_spec(files: list[str], fs: Any, spec: _Spec) -> list[tuple[str, list[int]]]:
    """Footers only: columns present, row groups per file; returns the scan chunks."""
    if spec.target_kind not in TARGET_KINDS:
        raise DataError(f"data.target.kind: {spec.target_kind!r} is not one of {list(TARGET_KINDS)}")
    if spec.target_kind in ("class", "multilabel") and not (spec.num_classes and spec.num_classes > 0):
        raise DataError(f"data.target.num_classes: {spec.num_classes!r}; a {spec.target_kind} target needs it (> 0)")
    if not 0.0 <= spec.val_fraction < 1.0:
        raise DataError(f"data.val_fraction: {spec.val_fraction} is not in [0, 1)")
    chunks = []
    for f in files:
        pf = pq.ParquetFile(f, filesystem=fs) if fs is not None else pq.ParquetFile(f)
        missing = [c for c in (spec.input_column, spec.target_column) if c not in pf.schema_arrow.names]
        if missing:
            raise DataError(
                f"{spec.knob}: file {redact(f)!r} has no column(s) {missing} (columns: {pf.schema_arrow.names}); "
                "set data.inputs.column / data.target.column"
            )
        groups = list(range(pf.num_row_groups))
        chunks += [(f, groups[i : i + _ROW_GROUPS_PER_TASK]) for i in range(0, len(groups), _ROW_GROUPS_PER_TASK)]
    return chunks


def _run_chunks(chunks: list[tuple[str, list[int]]], fs: Any, spec: _Spec, max_in_flight: int | None) -> list:
    import ray

    if not ray.is_initialized():
        return [_scan_chunk(f, fs, groups, spec) for f, groups in chunks]
    task = ray.remote(num_cpus=SCAN_TASK_CPUS, max_retries=0)(_scan_chunk)
    limit = max_in_flight or max(1, int(ray.cluster_resources().get("CPU", 1) / SCAN_TASK_CPUS))
    refs: dict[Any, int] = {}
    results: list = [None] * len(chunks)
    for i, (f, groups) in enumerate(chunks):
        if len(refs) >= limit:  # bounded: a scan of 10k files must not queue 10k tasks at once
            done, _ = ray.wait(list(refs), num_returns=1)
            results[refs.pop(done[0])] = ray.get(done[0])
        refs[task.remote(f, fs, groups, spec)] = i
    for ref, i in refs.items():
        results[i] = ray.get(ref)
    return results


def scan_parquet(
    path: str | os.PathLike,
    *,
    input_column: str,
    input_shape: Sequence[int] | None,
    target_column: str,
    target_kind: str,
    num_classes: int | None,
    target_dim: int | None = None,
    val_fraction: float,
    seed: int,
    knob: str = "data.path",
    max_in_flight: int | None = None,
) -> ScanResult:
    """Check every row and compute the split sizes and train statistics in one pass.

    Runs one Ray task (``SCAN_TASK_CPUS``, at most ``max_in_flight`` at a time, default: the
    cluster's CPUs / task CPUs) per file or per 8 row groups when Ray is initialised, in-process
    otherwise. Partial moments are merged in file order, so the result does not depend on
    which task finishes first.

    Args:
        path: a Parquet file, a folder / object-store prefix of ``*.parquet``, or a glob (local, s3://, gs://).
        input_column: the input column (list / fixed-size list of numbers or fixed_shape_tensor).
        input_shape: per-sample shape; None reads ``cascade_ray.image_shape`` from the schema
            metadata, else the tensor type's shape, else ``(list length,)``.
        target_column: the target column.
        target_kind: ``class`` | ``multilabel`` | ``regression``.
        num_classes: classes of a class / multilabel target.
        target_dim: values per regression target (None: 1).
        val_fraction: share of rows (by content hash) in val, in [0, 1).
        seed: the hash seed (the same as :func:`streaming_datasets` gets).
        knob: the config key the path came from, for messages.
        max_in_flight: scan tasks running at once.

    Raises:
        DataError: no file, a missing column, an unreadable file, or a bad row (file, row group, row named).
    """
    files, fs = _resolve_files(path, knob)
    try:
        shape = tuple(int(d) for d in input_shape) if input_shape is not None else None
        shape = shape or _infer_shape(files, fs, input_column, knob)
        spec = _Spec(
            input_column,
            shape,
            target_column,
            target_kind,
            num_classes,
            target_dim,
            float(val_fraction),
            int(seed),
            knob,
        )
        chunks = _check_spec(files, fs, spec)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(
            f"{knob}: cannot read the parquet footers ({exc}); the files are corrupt or unreachable"
        ) from exc
    if not all(d > 0 for d in shape):
        raise DataError(f"data.inputs.shape: {list(shape)} is not a list of positive ints")
    total = _Partial()
    for part in _run_chunks(chunks, fs, spec, max_in_flight):
        if isinstance(part, DataError):
            raise part
        total.train_rows += part.train_rows
        total.val_rows += part.val_rows
        if part.moments is not None:
            total.moments = part.moments if total.moments is None else total.moments.merge(part.moments)
        total.train_counts = _add(total.train_counts, part.train_counts)
        total.val_counts = _add(total.val_counts, part.val_counts)
        total.nbytes += part.nbytes
    if not total.train_rows:
        raise DataError(
            f"{knob}: no training rows (after moving {total.val_rows} to val); add data or lower data.val_fraction"
        )
    std = np.sqrt(total.moments.m2 / total.moments.n)
    constant = tuple(int(i) for i in np.flatnonzero(std == 0))
    std[std == 0] = 1.0
    return ScanResult(
        files=tuple(redact(f) for f in files),
        row_groups=sum(len(g) for _, g in chunks),
        train_rows=total.train_rows,
        val_rows=total.val_rows,
        input_shape=shape,
        mean=total.moments.mean.astype(np.float32).reshape(stats_shape(shape)),
        std=std.astype(np.float32).reshape(stats_shape(shape)),
        constant_channels=constant,
        train_counts=total.train_counts,
        val_counts=total.val_counts,
        train_nbytes=total.nbytes,
    )
