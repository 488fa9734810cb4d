"""Dispatch from the ``data`` config section to a loader."""

from __future__ import annotations

from pathlib import Path

from cascade_ray.config.schema import DataConfig
from cascade_ray.data.digits import load_digits
from cascade_ray.data.fashion_mnist import load_fashion_mnist
from cascade_ray.data.parquet import load_parquet
from cascade_ray.data.splits import DataSplits, validate_splits


def load_data(cfg: DataConfig, seed: int) -> DataSplits:
    """Load and validate the splits a data section describes.

    Raises:
        DataError: the data is missing or malformed (before any Ray resource starts).
    """
    common = {"train_size": cfg.train_size, "val_fraction": cfg.val_fraction, "seed": seed}
    if cfg.source == "fashion_mnist":
        splits = load_fashion_mnist(Path(cfg.root).expanduser(), **common)
    elif cfg.source == "digits":
        splits = load_digits(**common)
    else:
        assert cfg.path is not None  # checked by config.checks
        splits = load_parquet(
            cfg.path,
            test_path=cfg.test_path,
            image_column=cfg.image_column,
            label_column=cfg.label_column,
            image_shape=cfg.image_shape,
            **common,
        )
    validate_splits(splits)
    return splits
