"""Fashion-MNIST from the official idx files (Debian package ``dataset-fashion-mnist``).

The idx format is parsed here with numpy so no download helper (torchvision, keras)
is needed: the cluster has no internet access, only the files on disk.
"""

from __future__ import annotations

import gzip
import os
import zlib
from pathlib import Path

import numpy as np

from cascade_ray.data.splits import (
    DataSplits,
    input_stats,
    stratified_subset_and_val,
    validate_splits,
)
from cascade_ray.errors import DataError

DEFAULT_FASHION_MNIST_ROOT = "/usr/share/datasets/fashion-mnist"
NUM_CLASSES = 10
# the data set's label names, index order (Zalando's README)
CLASS_NAMES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)

_IMAGES_MAGIC = 2051  # 0x00000803: unsigned bytes, 3 dimensions
_LABELS_MAGIC = 2049  # 0x00000801: unsigned bytes, 1 dimension
_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
_HOW_TO_FIX = (
    "install it with `apt-get install dataset-fashion-mnist` (Debian/Ubuntu) or set "
    "data.root to a folder holding "
    + ", ".join(f"{name}.gz" for pair in _FILES.values() for name in pair)
    + " (uncompressed files without .gz work too)"
)


def _resolve(root: Path, name: str) -> Path | None:
    """The ``.gz`` file if present, else the uncompressed one, else None."""
    for candidate in (root / f"{name}.gz", root / name):
        if candidate.is_file():
            return candidate
    return None


def _read_bytes(path: Path) -> bytes:
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                return f.read()
        return path.read_bytes()
    except (OSError, EOFError, zlib.error) as exc:  # BadGzipFile is an OSError
        raise DataError(f"{path}: cannot read ({exc}); the file is corrupt, reinstall it") from exc


def _parse_idx(path: Path, magic: int, ndim: int) -> np.ndarray:
    """Parse one idx file: big-endian int32 magic, ``ndim`` int32 sizes, then uint8 data."""
    raw = _read_bytes(path)
    header_len = 4 * (1 + ndim)
    if len(raw) < header_len:
        raise DataError(f"{path}: {len(raw)} bytes, too short for an idx header; reinstall it")
    header = np.frombuffer(raw, dtype=">i4", count=1 + ndim)
    if int(header[0]) != magic:
        raise DataError(
            f"{path}: magic number {int(header[0])}, expected {magic}; "
            "not an idx file of this kind (images and labels swapped?)"
        )
    shape = tuple(int(d) for d in header[1:])
    expected = header_len + int(np.prod(shape))
    if len(raw) != expected:
        raise DataError(
            f"{path}: {len(raw)} bytes, the header {shape} implies {expected}; "
            "the file is truncated or corrupt, reinstall it"
        )
    # .copy(): frombuffer over bytes is read-only; callers expect ordinary arrays.
    return np.frombuffer(raw, dtype=np.uint8, offset=header_len).reshape(shape).copy()


def _load_pair(images_path: Path, labels_path: Path) -> tuple[np.ndarray, np.ndarray]:
    x = _parse_idx(images_path, _IMAGES_MAGIC, 3)
    y = _parse_idx(labels_path, _LABELS_MAGIC, 1)
    if len(x) != len(y):
        raise DataError(f"{images_path} holds {len(x)} images but {labels_path} {len(y)} labels")
    if len(y) and y.max() >= NUM_CLASSES:
        raise DataError(f"{labels_path}: label {int(y.max())} >= {NUM_CLASSES}; reinstall it")
    return x[:, None, :, :], y.astype(np.int64)


def load_fashion_mnist(
    root: str | os.PathLike = DEFAULT_FASHION_MNIST_ROOT,
    *,
    train_size: int | None,
    val_fraction: float,
    seed: int,
) -> DataSplits:
    """Load Fashion-MNIST: a stratified train/val split of the official train set, and
    the official 10k ``t10k`` set as test.

    Args:
        root: folder holding the four idx files (``.gz`` or uncompressed).
        train_size: training samples (before the validation split) drawn stratified from
            the 60k official ones; None keeps all.
        val_fraction: share of those moved to validation, in (0, 1).
        seed: random state of the subset and validation split.

    Returns:
        Splits with (N, 1, 28, 28) uint8 images, int64 labels, 10 classes, and mean/std
        of the training images in raw 0..255 units.

    Raises:
        DataError: the folder or a file is missing, a file is corrupt, or the sizes are
            out of range.
    """
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"data.root: Fashion-MNIST folder '{root}' does not exist; {_HOW_TO_FIX}")
    paths = {name: _resolve(root, name) for pair in _FILES.values() for name in pair}
    missing = [str(root / f"{name}.gz") for name, path in paths.items() if path is None]
    if missing:
        raise DataError(f"data.root: missing Fashion-MNIST file(s) {missing}; {_HOW_TO_FIX}")
    found = {name: path for name, path in paths.items() if path is not None}
    x_all, y_all = _load_pair(*(found[name] for name in _FILES["train"]))
    x_test, y_test = _load_pair(*(found[name] for name in _FILES["test"]))
    x_tr, y_tr, x_val, y_val = stratified_subset_and_val(
        x_all, y_all, train_size=train_size, val_fraction=val_fraction, seed=seed
    )
    # Statistics over the training split only, so validation stays unseen.
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
        source=f"fashion-mnist:{root}",
        class_names=CLASS_NAMES,
    )
    validate_splits(splits)
    return splits
