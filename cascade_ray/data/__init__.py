"""Datasets as plain numpy splits, ready to ``ray.put`` once and share with workers.

Every loader returns a validated :class:`DataSplits`; a worker rebuilds it from the
object-store dict with :meth:`DataSplits.from_arrays` (no copy).
"""

from cascade_ray.data.digits import load_digits
from cascade_ray.data.fashion_mnist import DEFAULT_FASHION_MNIST_ROOT, load_fashion_mnist
from cascade_ray.data.parquet import load_parquet, write_parquet
from cascade_ray.data.splits import DataSplits, stratified_subset_and_val, validate_splits

__all__ = [
    "DEFAULT_FASHION_MNIST_ROOT",
    "DataSplits",
    "load_digits",
    "load_fashion_mnist",
    "load_parquet",
    "stratified_subset_and_val",
    "validate_splits",
    "write_parquet",
]
