"""Example Parquet data sets, one per target kind and input rank, from scikit-learn's bundled loaders.

Every set is written as ``{out}/{name}/train.parquet`` and ``{out}/{name}/test.parquet``
(a seeded 80/20 split) with :func:`cascade_ray.data.write_parquet`, so
:func:`cascade_ray.data.load_parquet` reads them back bit-exactly and needs no
``data.inputs.shape``. Nothing is downloaded: the loaders ship with scikit-learn.

- ``breast_cancer``: 569 tumours, [30] float32 feature vectors, a class target (0 malignant,
  1 benign); tabular classification. Split stratified on the class.
- ``diabetes``: 442 patients, [10] float32 feature vectors (scikit-learn's scaled
  version), a scalar float32 regression target (disease progression after one year).
- ``digits_multilabel``: the 1,797 real 8x8 digit images, each as an [8, 8] uint8
  sequence (one token per image row, 8 pixel values 0..16), with a multilabel target of 4
  flags *derived* from the digit (see :data:`DIGIT_FLAGS`): a real image set, synthetic
  labels.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cascade_ray.data.parquet import write_parquet
from cascade_ray.errors import DataError

INPUT_COLUMN = "x"
TARGET_COLUMN = "y"
TEST_FRACTION = 0.2
# digits_multilabel: flag name -> the digits for which it is 1, in column order
DIGIT_FLAGS: dict[str, tuple[int, ...]] = {
    "even": (0, 2, 4, 6, 8),
    "ge5": (5, 6, 7, 8, 9),
    "prime": (2, 3, 5, 7),
    "closed_loop": (0, 4, 6, 8, 9),
}


@dataclass(frozen=True)
class ExampleSet:
    """One example data set: its inputs and targets before the train/test split."""

    x: np.ndarray
    y: np.ndarray
    target_kind: str  # data.target.kind of a config that trains on it
    description: str


def digit_flags(digits: np.ndarray) -> np.ndarray:
    """(N,) digits 0..9 -> (N, 4) float32 0/1 flags in :data:`DIGIT_FLAGS` order."""
    return np.stack([np.isin(digits, members) for members in DIGIT_FLAGS.values()], axis=1).astype(np.float32)


def _breast_cancer() -> ExampleSet:
    from sklearn.datasets import load_breast_cancer

    bunch = load_breast_cancer()
    return ExampleSet(bunch.data.astype(np.float32), bunch.target.astype(np.int64), "class", "[30] vectors, class (2)")


def _diabetes() -> ExampleSet:
    from sklearn.datasets import load_diabetes

    bunch = load_diabetes()
    return ExampleSet(
        bunch.data.astype(np.float32), bunch.target.astype(np.float32), "regression", "[10] vectors, regression"
    )


def _digits_multilabel() -> ExampleSet:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    # images hold the integers 0..16 as float64: uint8 is exact and 8x smaller
    x = bunch.images.astype(np.uint8)  # (N, 8, 8): 8 tokens (image rows) of 8 pixels
    return ExampleSet(x, digit_flags(bunch.target), "multilabel", "[8, 8] sequences, multilabel (4)")


EXAMPLES: dict[str, Callable[[], ExampleSet]] = {
    "breast_cancer": _breast_cancer,
    "diabetes": _diabetes,
    "digits_multilabel": _digits_multilabel,
}


def example_set(name: str) -> ExampleSet:
    """The inputs and targets of one example set, unsplit.

    Raises:
        DataError: `name` is not one of :data:`EXAMPLES`.
    """
    if name not in EXAMPLES:
        raise DataError(f"example data {name!r} does not exist; use one of: {', '.join(EXAMPLES)}")
    return EXAMPLES[name]()


def write_example_data(
    out_dir: str | os.PathLike, names: list[str] | None = None, *, seed: int = 0
) -> dict[str, tuple[Path, Path]]:
    """Write each example set as ``{out_dir}/{name}/{train,test}.parquet`` (seeded 80/20 split).

    Args:
        out_dir: folder to write into (``~`` is expanded); created if missing.
        names: which sets (default all of :data:`EXAMPLES`).
        seed: random state of the split (stratified on the class for ``breast_cancer``).

    Returns:
        name -> (train file, test file).

    Raises:
        DataError: an unknown name.
    """
    from sklearn.model_selection import train_test_split  # lazy: sklearn is slow to import

    root = Path(out_dir).expanduser()
    chosen = list(EXAMPLES) if names is None else names
    sets = {name: example_set(name) for name in chosen}  # every name checked before writing
    written = {}
    for name, data in sets.items():
        x_tr, x_te, y_tr, y_te = train_test_split(
            data.x,
            data.y,
            test_size=TEST_FRACTION,
            stratify=data.y if data.target_kind == "class" else None,
            random_state=seed,
        )
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        paths = (folder / "train.parquet", folder / "test.parquet")
        for path, x, y in ((paths[0], x_tr, y_tr), (paths[1], x_te, y_te)):
            write_parquet(path, x, y, input_column=INPUT_COLUMN, target_column=TARGET_COLUMN)
        written[name] = paths
    return written
