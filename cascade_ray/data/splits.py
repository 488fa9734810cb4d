"""Train/val/test splits as plain numpy arrays, and the checks every loader shares.

A :class:`DataSplits` is what the driver loads once and ``ray.put``s (through
:meth:`DataSplits.to_arrays`) so every worker maps the same read-only buffers.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields, replace

import numpy as np

from cascade_ray.errors import DataError

_ARRAY_FIELDS = ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test", "mean", "std")
_SCALAR_FIELDS = ("num_classes", "target_kind", "source")
_SPLITS = ("train", "val", "test")
TARGET_KINDS = ("class", "multilabel", "regression")
# Rows per chunk when computing statistics: a float64 copy of a few thousand rows, never of the split.
_STATS_CHUNK_ROWS = 4096

ArrayDict = dict[str, np.ndarray | int | float | str | tuple[str, ...] | None]


# eq=False: comparing numpy arrays with == is ambiguous, and identity is what matters.
@dataclass(frozen=True, eq=False)
class DataSplits:
    """Inputs and targets of the train, validation and test splits.

    Attributes:
        x_train: training inputs, shaped (N, *input_shape) for any per-row shape: (C, H, W)
            images, (T, D) sequences, (D,) vectors; any numeric dtype (uint8 kept as uint8 so
            the object store holds 1 byte per pixel).
        y_train: training targets: int64 (N,) class indices in [0, num_classes) for
            ``target_kind`` class; float32 (N, num_classes) 0/1 flags for multilabel;
            float32 (N, num_classes) values for regression (``num_classes`` is then the
            number of regression outputs).
        x_val, y_val, x_test, y_test: the other splits, same layouts.
        mean: float32 statistics broadcastable to one row: (C, 1, 1) per channel for images,
            (D,) per feature for vectors and sequences, () for a single value; raw units.
        std: same shape as `mean`, every value > 0; a worker normalizes with
            ``(x.float() - mean) / std``.
        num_classes: the output width: classes (class, multilabel) or regression outputs.
        target_kind: ``class``, ``multilabel`` or ``regression``.
        source: where the data came from, for logs; not part of the fingerprint.
        class_names: names of the classes in index order (class targets of a named data set),
            for predictions and reports; not part of the fingerprint.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    mean: np.ndarray
    std: np.ndarray
    source: str
    target_kind: str = "class"
    class_names: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        # statistics are float32 arrays whatever they were given as (a float is a () array)
        for name in ("mean", "std"):
            value = getattr(self, name)
            if not (isinstance(value, np.ndarray) and value.dtype == np.float32):
                object.__setattr__(self, name, np.asarray(value, dtype=np.float32))

    @property
    def input_shape(self) -> tuple[int, ...]:
        """The shape of one input row, e.g. (C, H, W), (T, D) or (D,)."""
        return tuple(int(d) for d in self.x_train.shape[1:])

    @property
    def n_train(self) -> int:
        """Rows of the training split."""
        return len(self.y_train)

    @property
    def out_width(self) -> int:
        """Outputs of the model's last head: classes, or regression values."""
        return int(self.num_classes)

    def spec(self) -> dict[str, object]:
        """What a finished run needs to be used without its training data (stage manifests)."""
        return {
            "input_shape": list(self.input_shape),
            "input_dtype": self.x_train.dtype.str,
            "target_kind": self.target_kind,
            "num_classes": self.out_width,
            "mean": np.asarray(self.mean, dtype=np.float64).tolist(),
            "std": np.asarray(self.std, dtype=np.float64).tolist(),
            "stats_shape": list(np.shape(self.mean)),
            "class_names": list(self.class_names) if self.class_names else None,
        }

    def fingerprint(self) -> str:
        """Sha256 hex digest of every array (dtype, shape, bytes), the statistics and the target kind.

        Two runs that see the same fingerprint trained on the same data; ``source`` is
        left out so moving the files does not change it.
        """
        h = hashlib.sha256()
        for name in _ARRAY_FIELDS:
            arr = np.asarray(getattr(self, name))
            h.update(f"{name}|{arr.dtype.str}|{arr.shape}|".encode())
            # memoryview avoids a copy for contiguous (the usual) arrays.
            h.update(memoryview(np.ascontiguousarray(arr)).cast("B"))
        h.update(f"{self.num_classes}|{self.target_kind}".encode())
        return h.hexdigest()

    def with_stats(self, mean: np.ndarray, std: np.ndarray) -> DataSplits:
        """The same splits normalized with other statistics (shapes checked by :func:`validate_splits`)."""
        return replace(self, mean=np.asarray(mean, dtype=np.float32), std=np.asarray(std, dtype=np.float32))

    def to_arrays(self) -> ArrayDict:
        """Plain dict of the arrays (not copied) and scalars, ready for ``ray.put``."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_arrays(cls, d: ArrayDict) -> DataSplits:
        """Rebuild from :meth:`to_arrays` output without copying or writing the arrays.

        Raises:
            DataError: a key is missing or an array entry is not a numpy array.
        """
        missing = [k for k in _ARRAY_FIELDS + _SCALAR_FIELDS if k not in d]
        if missing:
            raise DataError(
                f"DataSplits.from_arrays: missing key(s) {missing} (found {sorted(d)}); "
                "pass the dict produced by DataSplits.to_arrays()"
            )
        for k in _ARRAY_FIELDS:
            if not isinstance(d[k], np.ndarray):
                raise DataError(f"DataSplits.from_arrays: {k} is {type(d[k]).__name__}, expected numpy.ndarray")
        return cls(
            **{k: d[k] for k in _ARRAY_FIELDS},
            num_classes=int(d["num_classes"]),
            target_kind=str(d["target_kind"]),
            source=str(d["source"]),
            class_names=tuple(d["class_names"]) if d.get("class_names") else None,
        )


@dataclass(frozen=True)
class DataInfo:
    """What a stage needs to know of its data when the rows are streamed, not in memory
    (:class:`DataSplits` has the same attributes): shapes, target, size, statistics."""

    input_shape: tuple[int, ...]
    out_width: int
    target_kind: str
    n_train: int
    mean: np.ndarray
    std: np.ndarray


def stats_axis(input_shape: tuple[int, ...]) -> int:
    """The axis of one row that statistics are kept per: channels of (C, H, W), else the last."""
    return 0 if len(input_shape) == 3 else len(input_shape) - 1


def stats_shape(input_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of per-channel / per-feature statistics, broadcastable to a row: (C, 1, 1) or (D,)."""
    if len(input_shape) == 3:
        return (input_shape[0], 1, 1)
    return (input_shape[-1],)


def input_stats(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel (images) or per-feature (vectors, sequences) mean and population std of `x`.

    `x` is (N, *row_shape). Rows are read in chunks (no float copy of the split), and chunks
    merge with Chan's parallel update, which stays accurate when values are large relative
    to their spread. Returns float32 arrays shaped :func:`stats_shape`; a constant channel or
    feature gets std 1 (as in the streaming scan), so it normalizes to 0.
    """
    if len(x) == 0:
        raise DataError("cannot compute input statistics of an empty training split")
    row = tuple(int(d) for d in x.shape[1:])
    axis = 1 + stats_axis(row)
    n, mean, m2 = 0, None, None
    for start in range(0, len(x), _STATS_CHUNK_ROWS):
        chunk = np.moveaxis(x[start : start + _STATS_CHUNK_ROWS].astype(np.float64), axis, -1)
        chunk = chunk.reshape(-1, chunk.shape[-1])
        cn, cmean = len(chunk), chunk.mean(0)
        cm2 = np.square(chunk - cmean).sum(0)
        if mean is None:
            n, mean, m2 = cn, cmean, cm2
            continue
        delta, total = cmean - mean, n + cn
        mean = mean + delta * cn / total
        m2 = m2 + cm2 + delta * delta * n * cn / total
        n = total
    assert mean is not None and m2 is not None
    shape = stats_shape(row)
    std = np.sqrt(m2 / n).astype(np.float32)
    std[std == 0] = 1.0  # a constant feature (an always-0 pixel, a fixed column) normalizes to 0
    return mean.astype(np.float32).reshape(shape), std.reshape(shape)


def _check_fraction(name: str, value: float) -> None:
    if not 0.0 < value < 1.0:
        raise DataError(f"{name}: {value!r} is outside (0, 1); use e.g. 0.1")


def stratified_subset_and_val(
    x: np.ndarray,
    y: np.ndarray,
    *,
    train_size: int | None,
    val_fraction: float,
    seed: int,
    stratify: bool = True,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Take a subset of ``train_size`` samples, then split off validation.

    Both steps keep the class proportions of ``y`` when `stratify` (class targets; other
    kinds split uniformly at random) and are deterministic in ``seed``.

    Args:
        x: inputs, first axis indexes samples.
        y: targets, one per sample.
        train_size: samples to keep before the validation split; None keeps all.
        val_fraction: share of the kept samples moved to validation, in (0, 1).
        seed: random state of both splits.
        stratify: keep the proportions of the (class index) targets.

    Returns:
        ``(x_train, y_train, x_val, y_val)``.

    Raises:
        DataError: ``train_size`` or ``val_fraction`` is out of range, or too small to
            give every class a sample.
    """
    _check_fraction("data.val_fraction", val_fraction)
    available = len(y)
    if train_size is not None and not 0 < train_size <= available:
        raise DataError(
            f"data.train_size: {train_size} is outside 1..{available} "
            f"({available} training samples are available); lower it or set it to null for all"
        )
    # Split indices, not samples, so the inputs are gathered (copied) once.
    idx = np.arange(available)
    from sklearn.model_selection import train_test_split  # lazy: workers never split data

    try:
        if train_size is not None and train_size < available:
            idx, _ = train_test_split(idx, train_size=train_size, stratify=y if stratify else None, random_state=seed)
        tr, va = train_test_split(idx, test_size=val_fraction, stratify=y[idx] if stratify else None, random_state=seed)
    except ValueError as exc:  # sklearn: too few samples for a class or for the split
        how = "stratified " if stratify else ""
        raise DataError(
            f"data.train_size={train_size}, data.val_fraction={val_fraction}: cannot split {how}"
            f"({exc}); raise train_size or val_fraction so every split gets a sample"
        ) from exc
    return x[tr], y[tr], x[va], y[va]


def _target_problems(name: str, y: np.ndarray, kind: str, width: int) -> list[str]:
    if kind == "class":
        if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
            return [f"{name}: labels are {y.dtype} shaped {y.shape}, expected 1-D integers"]
        lo, hi = int(y.min()), int(y.max())
        if lo < 0 or hi >= width:
            return [
                f"{name}: labels span [{lo}, {hi}], outside [0, {width}); fix the labels or data.target.num_classes"
            ]
        return []
    if y.ndim != 2 or y.shape[1] != width or not np.issubdtype(y.dtype, np.floating):
        return [f"{name}: {kind} targets are {y.dtype} shaped {y.shape}, expected float (N, {width})"]
    if not np.isfinite(y).all():
        return [f"{name}: targets hold {int(np.count_nonzero(~np.isfinite(y)))} NaN/Inf value(s); clean those rows"]
    if kind == "multilabel" and not np.isin(y, (0.0, 1.0)).all():
        return [f"{name}: multilabel targets hold values other than 0 and 1; each row needs one 0/1 flag per class"]
    return []


def _absent_fix(absent: list[int], counts: np.ndarray, elsewhere: np.ndarray) -> str:
    """Why classes of [0, num_classes) have no training sample, from where they are: past the largest label
    (num_classes too high), below the smallest (labels not 0-based), or between (too few rows). `elsewhere`:
    the val and test labels; a class they hold is one the training rows missed, not a wrong count."""
    present = np.flatnonzero(counts).tolist()
    if len(present) == 1:
        return f"every training label is {present[0]}: a classifier needs samples of at least 2 classes"
    if set(absent) & {int(v) for v in np.unique(elsewhere)}:
        return "the training split holds none of them: raise data.train_size (when set), or use data with every class"
    if present and absent == list(range(present[-1] + 1, len(counts))):
        return (
            f"the labels go up to {present[-1]}: set data.target.num_classes: {present[-1] + 1} "
            "(or leave it out to take it from the labels)"
        )
    if present and absent == list(range(present[0])):
        return f"the labels start at {present[0]}, but classes count from 0: shift the labels down by {present[0]}"
    return "the training split holds none of them: raise data.train_size (when set), or use data with every class"


def _split_problems(name: str, x: np.ndarray, y: np.ndarray, kind: str, width: int) -> list[str]:
    problems = []
    if x.ndim not in (2, 3, 4):
        problems.append(f"{name}: inputs have shape {x.shape}, expected (N, D), (N, T, D) or (N, C, H, W)")
    if len(x) != len(y):
        problems.append(f"{name}: {len(x)} inputs but {len(y)} targets")
    if len(y) == 0:
        problems.append(f"{name}: split is empty")
        return problems
    if not (np.issubdtype(x.dtype, np.integer) or np.issubdtype(x.dtype, np.floating)):
        problems.append(f"{name}: inputs are {x.dtype}, expected numbers")
    elif np.issubdtype(x.dtype, np.inexact) and not np.isfinite(x).all():
        bad = int(np.count_nonzero(~np.isfinite(x)))
        problems.append(f"{name}: inputs hold {bad} NaN/Inf value(s); clean or drop those samples")
    return problems + _target_problems(name, y, kind, width)


def validate_splits(splits: DataSplits) -> None:
    """Check the splits are usable for training; collect every problem and raise once.

    Raises:
        DataError: naming each split that is empty, has NaN/Inf inputs or targets, targets
            that do not fit the kind (labels outside [0, num_classes), non-0/1 multilabel
            flags, a wrong target width), an input of unsupported rank, shapes that differ
            between splits, x/y of different length; a class absent from train; or
            statistics that are non-finite, not positive or do not broadcast to a row.
    """
    s = splits
    problems: list[str] = []
    if s.target_kind not in TARGET_KINDS:
        problems.append(f"target_kind: {s.target_kind!r}, expected one of {', '.join(TARGET_KINDS)}")
    elif s.target_kind != "regression" and s.num_classes < 2:
        problems.append(f"num_classes: {s.num_classes}, expected at least 2")
    elif s.num_classes < 1:
        problems.append(f"regression outputs: {s.num_classes}, expected at least 1")
    for name in _SPLITS:
        x, y = getattr(s, f"x_{name}"), getattr(s, f"y_{name}")
        problems += _split_problems(name, x, y, s.target_kind, s.num_classes)
    shapes = {name: getattr(s, f"x_{name}").shape[1:] for name in _SPLITS}
    if len(set(shapes.values())) > 1:
        problems.append(f"input shapes differ between splits: {shapes}")
    y = s.y_train
    if s.target_kind == "class" and y.ndim == 1 and len(y) and np.issubdtype(y.dtype, np.integer) and y.min() >= 0:
        counts = np.bincount(y[y < s.num_classes], minlength=s.num_classes)
        absent = np.flatnonzero(counts == 0).tolist()
        if absent:
            elsewhere = np.concatenate([np.asarray(s.y_val).reshape(-1), np.asarray(s.y_test).reshape(-1)])
            problems.append(f"train: class(es) {absent} have no sample; {_absent_fix(absent, counts, elsewhere)}")
    mean, std = np.asarray(s.mean), np.asarray(s.std)
    if not (np.isfinite(mean).all() and np.isfinite(std).all() and (std > 0).all()):
        problems.append(
            f"mean={mean.reshape(-1)[:8].tolist()}, std={std.reshape(-1)[:8].tolist()}: need all finite and std > 0"
        )
    elif mean.shape != std.shape:
        problems.append(f"mean {mean.shape} and std {std.shape} differ in shape")
    else:
        try:
            np.broadcast_shapes(mean.shape, s.input_shape)
        except ValueError:
            problems.append(f"statistics of shape {mean.shape} do not broadcast to an input row {s.input_shape}")
    if problems:
        where = f" ({s.source})" if s.source else ""
        raise DataError(f"invalid data{where}:\n  - " + "\n  - ".join(problems))
