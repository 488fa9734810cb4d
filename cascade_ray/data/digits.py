"""scikit-learn's bundled 8x8 digits: 1,797 images, offline, for fast tests.

Accuracy sits near the ceiling (~0.98), so use it to exercise the machinery, not to
make claims about models.
"""

from __future__ import annotations

import numpy as np

from cascade_ray.data.splits import (
    DataSplits,
    input_stats,
    stratified_subset_and_val,
    validate_splits,
)
from cascade_ray.errors import DataError

NUM_CLASSES = 10


def load_digits(*, train_size: int | None, val_fraction: float, seed: int, test_fraction: float = 0.2) -> DataSplits:
    """Load the digits as (N, 1, 8, 8) uint8 images with stratified train/val/test splits.

    Args:
        train_size: training samples (before the validation split) drawn from what the
            test split leaves; None keeps all.
        val_fraction: share of those moved to validation, in (0, 1).
        seed: random state of every split.
        test_fraction: share of all samples held out as test, in (0, 1).

    Returns:
        Splits with uint8 pixel values 0..16, int64 labels and 10 classes.

    Raises:
        DataError: a size or fraction is out of range.
    """
    if not 0.0 < test_fraction < 1.0:
        raise DataError(f"data.test_fraction: {test_fraction!r} is outside (0, 1); use e.g. 0.2")
    # imported here: scikit-learn costs ~0.9 s to import in every Ray worker that never loads data
    from sklearn import datasets
    from sklearn.model_selection import train_test_split

    bunch = datasets.load_digits()
    images = bunch.images  # float64 holding the integers 0..16
    # uint8 keeps the object store small; the values are exact integers, so no loss.
    x = images.astype(np.uint8)[:, None, :, :]
    y = bunch.target.astype(np.int64)
    x_rest, x_test, y_rest, y_test = train_test_split(x, y, test_size=test_fraction, stratify=y, random_state=seed)
    x_tr, y_tr, x_val, y_val = stratified_subset_and_val(
        x_rest, y_rest, train_size=train_size, val_fraction=val_fraction, seed=seed
    )
    mean, std = input_stats(x_tr)
    splits = DataSplits(
        x_train=x_tr,
        y_train=y_tr,
        x_val=x_val,
        y_val=y_val,
        x_test=x_test,
        y_test=y_test,
        num_classes=NUM_CLASSES,
        mean=mean,
        std=std,
        source="sklearn:digits",
        class_names=tuple(str(d) for d in range(NUM_CLASSES)),
    )
    validate_splits(splits)
    return splits
