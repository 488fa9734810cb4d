"""Datasets as plain numpy splits, ready to ``ray.put`` once and share with workers.

Every loader returns a validated :class:`DataSplits`; a worker rebuilds it from the
object-store dict with :meth:`DataSplits.from_arrays` (no copy).
"""

import importlib
import typing

if typing.TYPE_CHECKING:
    from cascade_ray.data.digits import load_digits
    from cascade_ray.data.fashion_mnist import DEFAULT_FASHION_MNIST_ROOT, load_fashion_mnist
    from cascade_ray.data.parquet import load_parquet, write_parquet
    from cascade_ray.data.splits import DataSplits, stratified_subset_and_val, validate_splits

# Imported on first use (PEP 562), so that a submodule such as ``data.batches`` does not pull in
# pyarrow's dataset layer for callers (config checks) that never read a file.
_HOMES = {
    "load_digits": "digits",
    "DEFAULT_FASHION_MNIST_ROOT": "fashion_mnist",
    "load_fashion_mnist": "fashion_mnist",
    "load_parquet": "parquet",
    "write_parquet": "parquet",
    "DataSplits": "splits",
    "stratified_subset_and_val": "splits",
    "validate_splits": "splits",
}


def __getattr__(name: str) -> typing.Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)


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
