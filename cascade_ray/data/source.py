"""Dispatch from the ``data`` config section to a loader, then the normalization it asks for."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cascade_ray.config.schema import DataConfig
from cascade_ray.data.digits import load_digits
from cascade_ray.data.fashion_mnist import load_fashion_mnist
from cascade_ray.data.parquet import load_parquet
from cascade_ray.data.splits import DataSplits, stats_shape, validate_splits
from cascade_ray.errors import DataError


def load_data(cfg: DataConfig, seed: int) -> DataSplits:
    """Load and validate the splits a data section describes, normalized as `cfg.normalize` says.

    Raises:
        DataError: the data is missing or malformed, or does not fit `data.target` /
            `data.normalize` (before any Ray resource starts).
    """
    common = {"train_size": cfg.train_size, "val_fraction": cfg.val_fraction, "seed": seed}
    if cfg.source == "parquet":
        assert cfg.path is not None  # checked by config.checks
        splits = load_parquet(
            cfg.path,
            test_path=cfg.test_path,
            **parquet_columns(cfg),
            **common,
        )
    elif cfg.source == "fashion_mnist":
        splits = load_fashion_mnist(Path(cfg.root).expanduser(), **common)
    else:
        splits = load_digits(**common)
    splits = normalized(splits, cfg)
    validate_splits(splits)
    return splits


def parquet_columns(cfg: DataConfig) -> dict[str, object]:
    """What `data.inputs` / `data.target` tell a Parquet reader (:func:`load_parquet`, the streaming scan)."""
    return {
        "input_column": cfg.inputs.column,
        "target_column": cfg.target.column,
        "input_shape": cfg.inputs.shape,
        "target_kind": cfg.target.kind,
        "num_classes": cfg.target.num_classes,
        "target_dim": cfg.target.dim,
    }


def normalized(splits: DataSplits, cfg: DataConfig) -> DataSplits:
    """`splits` with the statistics of ``data.normalize`` (see :func:`normalized_stats`)."""
    return splits.with_stats(*normalized_stats(cfg, splits.input_shape, splits.mean, splits.std))


def normalized_stats(
    cfg: DataConfig, input_shape: tuple[int, ...], mean: np.ndarray, std: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The (mean, std) ``data.normalize`` asks for, given the training statistics `mean` / `std`.

    ``auto`` keeps the per-channel / per-feature training statistics; ``none`` is mean 0, std 1;
    explicit ``{mean, std}`` lists hold one value per channel / feature (or one for all).

    Raises:
        DataError: explicit statistics of the wrong length.
    """
    norm = cfg.normalize
    if norm == "auto":  # a constant feature already has std 1 (input_stats, the streaming scan)
        return np.asarray(mean, dtype=np.float32), np.asarray(std, dtype=np.float32)
    if norm == "none":
        return np.zeros((), np.float32), np.ones((), np.float32)
    shape = stats_shape(input_shape)
    want = shape[0] if len(input_shape) == 3 else shape[-1]
    arrays = []
    for key, values in (("mean", norm.mean), ("std", norm.std)):
        if len(values) not in (1, want):
            what = "channels" if len(input_shape) == 3 else "features"
            raise DataError(
                f"data.normalize.{key}: {len(values)} values, but the inputs {list(input_shape)} have "
                f"{want} {what}; give {want} values (one per {what[:-1]}) or one for all"
            )
        arr = np.asarray(values, dtype=np.float32)
        arrays.append(arr.reshape(shape) if len(values) == want else arr.reshape(()))
    return arrays[0], arrays[1]


def describe_stats(splits: DataSplits) -> str:
    """One log line's worth of the statistics in use (first values, and constant features)."""
    mean, std = np.asarray(splits.mean).reshape(-1), np.asarray(splits.std).reshape(-1)

    def show(a: np.ndarray) -> str:
        head = ", ".join(f"{v:.4g}" for v in a[:4])
        return f"[{head}{', ...' if len(a) > 4 else ''}]"

    return f"normalize mean {show(mean)} std {show(std)}"
