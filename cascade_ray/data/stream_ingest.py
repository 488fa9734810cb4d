"""The Ray side of streaming (see :mod:`cascade_ray.data.stream` for the scan and the split).

- :func:`streaming_datasets` builds ``{"train", "val"[, "test"]}`` Ray Datasets the driver
  passes to ``TorchTrainer(datasets=..., dataset_config=StreamingDataConfig())``.
- :class:`StreamSource` is built in the train loop from ``ray.train.get_dataset_shard(name)``
  and the scan's row count and statistics, and yields normalised ``(x, y)`` batches.
- :func:`streaming_resource_issue` and :func:`decide_streaming` are the driver-side rules.

Steps per epoch: ``StreamingDataConfig`` splits train with ``equal=True``; Ray's
``OutputSplitter`` then gives every rank ``rows // world`` rows and drops the remainder
(``ray/data/_internal/execution/operators/output_splitter.py``, ``all_inputs_done``), so each
rank yields ``ceil((rows // world) / batch_size)`` batches: :meth:`StreamSource.num_train_batches`.
With ``world > 1`` up to ``world - 1`` train rows sit out each epoch (not always the same ones).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import ray
import torch
from ray.data import DataIterator, Dataset, ExecutionOptions, FileShuffleConfig, RandomSeedConfig
from ray.train import DataConfig

from cascade_ray.config.schema import PipelineConfig
from cascade_ray.data.parquet import _resolve_files
from cascade_ray.data.splits import DataInfo
from cascade_ray.data.stream import (
    AUTO_STORE_SHARE,
    DATA_CPUS_KEY,
    input_array,
    is_val_row,
    target_array,
)
from cascade_ray.errors import DataError

STREAM_MODES = ("false", "true", "auto")
DEFAULT_SHUFFLE_BUFFER_ROWS = 4096


def _keep_split(
    table: pa.Table, *, column: str, shape: tuple[int, ...], val_fraction: float, seed: int, keep_val: bool
) -> pa.Table:
    """Ray Data ``map_batches`` fn: the rows of one part of the content-hash split (the scan's function)."""

    def where(row: int) -> str:
        return f"data.path: a streamed block, row {row} (the scan did not see this row: did the files change?)"

    val = is_val_row(input_array(table[column], shape, column, where), val_fraction, seed)
    return table.filter(pa.array(val if keep_val else ~val))


def streaming_datasets(
    path: str | os.PathLike,
    *,
    test_path: str | os.PathLike | None = None,
    input_column: str,
    input_shape: Sequence[int],
    target_column: str,
    val_fraction: float,
    seed: int,
    shuffle_blocks: bool = False,
    read_cpus: float = 1.0,
) -> dict[str, Dataset]:
    """Lazy Ray Datasets of the train and val parts (and test, if given) of Parquet data.

    Train reshuffles every epoch, seeded: the file order through ``FileShuffleConfig(seed,
    reseed_after_execution=True)`` (seed combined with the dataset's execution index, which
    Ray increments after each complete epoch), plus the local shuffle buffer of
    :meth:`StreamSource.train_epoch`. ``shuffle_blocks=True`` adds ``randomize_block_order``
    with a ``RandomSeedConfig`` of the same kind; Ray 2.60 plans it as an all-to-all step that
    waits for every block of the epoch before the first one comes out, so it holds the whole
    train part in the object store (spilling to disk beyond it): off by default.

    Args:
        path, test_path: Parquet file / folder / prefix / glob, local or object storage.
        input_column, input_shape, target_column: as given to :func:`~cascade_ray.data.stream.scan_parquet`
            (``input_shape``: the scan's ``ScanResult.input_shape``).
        val_fraction, seed: the split; the same values as the scan, so row counts match exactly.
        shuffle_blocks: also shuffle blocks across the whole epoch (see above).
        read_cpus: CPUs per read task (Ray Data's default is 1).
    """
    files, fs = _resolve_files(path, "data.path")
    columns = [input_column, target_column]
    shape = tuple(int(d) for d in input_shape)

    def read(paths: list[str], shuffle: FileShuffleConfig | None) -> Dataset:
        ds = ray.data.read_parquet(paths, filesystem=fs, shuffle=shuffle, num_cpus=read_cpus)
        return ds.select_columns(columns)  # pushed into the read (columns= is deprecated in Ray 2.60)

    def part(ds: Dataset, keep_val: bool) -> Dataset:
        kwargs = {
            "column": input_column,
            "shape": shape,
            "val_fraction": val_fraction,
            "seed": seed,
            "keep_val": keep_val,
        }
        return ds.map_batches(
            _keep_split, fn_kwargs=kwargs, batch_format="pyarrow", batch_size=None, zero_copy_batch=True
        )

    train = part(read(files, FileShuffleConfig(seed=seed, reseed_after_execution=True)), keep_val=False)
    if shuffle_blocks:
        train = train.randomize_block_order(seed=RandomSeedConfig(seed=seed, reseed_after_execution=True))
    out = {"train": train}
    if val_fraction > 0:
        out["val"] = part(read(files, None), keep_val=True)
    if test_path is not None:
        test_files, test_fs = _resolve_files(test_path, "data.test_path")
        out["test"] = ray.data.read_parquet(test_files, filesystem=test_fs, num_cpus=read_cpus).select_columns(columns)
    return out


class StreamingDataConfig(DataConfig):
    """``DataConfig`` for :func:`streaming_datasets`: ``train`` split ``equal=True``, every other
    dataset split ``equal=False``.

    Ray's default ``DataConfig`` splits every dataset with ``equal=True``, which drops up to
    ``world - 1`` val rows; an eval split must hold each row exactly once across ranks (the
    ranks then step unequally often, so eval must not run a collective per batch: sum the
    metrics and all-reduce once after the loop).

    Args:
        execution_options: Ray Data options for every dataset; None: Ray's
            ``DataConfig.default_ingest_options()``. ``preserve_order=True`` makes the row order
            reproducible for a seed (tests); it costs throughput.
    """

    def __init__(self, execution_options: ExecutionOptions | None = None, *, equal_split: Sequence[str] = ("train",)):
        super().__init__(datasets_to_split=list(equal_split), execution_options=execution_options)
        self._equal, self._options = tuple(equal_split), execution_options

    def configure(
        self,
        datasets: dict[str, Dataset],
        world_size: int,
        worker_handles: Any,
        worker_node_ids: Any,
        **kwargs: Any,
    ) -> list[dict[str, DataIterator]]:
        equal = {k: v for k, v in datasets.items() if k in self._equal}
        output = super().configure(equal, world_size, worker_handles, worker_node_ids, **kwargs)
        for name, ds in datasets.items():
            if name in equal:
                continue
            if ds.name is None:
                ds.set_name(name)
            ds.context.execution_options = self._options or DataConfig.default_ingest_options()
            for i, split in enumerate(ds.streaming_split(world_size, equal=False, locality_hints=worker_node_ids)):
                output[i][name] = split
        return output


def epoch_seed(seed: int, epoch: int) -> int:
    """A 32-bit seed for the local shuffle buffer of one epoch, from (seed, epoch)."""
    return int(np.random.SeedSequence([seed % 2**32, epoch]).generate_state(1)[0])


class StreamSource:
    """A :class:`~cascade_ray.data.batches.BatchSource` over one rank's Ray Data shard.

    Built in the train loop::

        source = StreamSource(ray.train.get_dataset_shard("train"), rows=scan.train_rows, ...)

    Every batch is checked (NaN/Inf inputs, null or out-of-range targets, wrong lengths) and a
    bad one is a :class:`DataError` naming the split, epoch and batch; the file and row group
    are not known there (the scan names them).

    Args:
        shard: ``ray.train.get_dataset_shard(split)``.
        rows: rows of this split over all ranks (``ScanResult.train_rows`` / ``val_rows``).
        input_column, input_shape, target_column, target_kind, num_classes, target_dim: as scanned.
        mean, std: float32 arrays broadcastable to one sample (``ScanResult.mean`` / ``std``).
        device: where batches go.
        split: the split's name, for messages.
        shuffle_buffer_rows: rows in the local shuffle buffer of :meth:`train_epoch`.
    """

    def __init__(
        self,
        shard: DataIterator,
        *,
        rows: int,
        input_column: str,
        input_shape: Sequence[int],
        target_column: str,
        target_kind: str,
        num_classes: int | None,
        target_dim: int | None = None,
        mean: np.ndarray,
        std: np.ndarray,
        device: torch.device | str = "cpu",
        split: str = "train",
        shuffle_buffer_rows: int = DEFAULT_SHUFFLE_BUFFER_ROWS,
    ):
        self.shard, self.rows, self.split = shard, int(rows), split
        self.input_column, self.shape = input_column, tuple(int(d) for d in input_shape)
        self.target_column, self.kind = target_column, target_kind
        self.num_classes, self.target_dim = num_classes, target_dim
        self.device = torch.device(device)
        self.mean = torch.from_numpy(np.asarray(mean, np.float32)).to(self.device)
        self.std = torch.from_numpy(np.asarray(std, np.float32)).to(self.device)
        self.shuffle_buffer_rows = int(shuffle_buffer_rows)

    def __len__(self) -> int:
        return self.rows

    def num_train_batches(self, batch_size: int, world: int) -> int:
        """Batches per rank per epoch: ``ceil((rows // world) / batch_size)`` (equal split drops the remainder)."""
        return math.ceil((self.rows // world) / batch_size)

    def _convert(self, table: pa.Table, epoch: int | None, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        at = f"{self.split} split, epoch {epoch}" if epoch is not None else f"{self.split} split"

        def where(row: int) -> str:
            return f"{at}, batch {index}, row {row} ({_BATCH_NOTE})"

        x = input_array(table[self.input_column], self.shape, self.input_column, where)
        y = target_array(
            table[self.target_column], self.kind, self.num_classes, self.target_dim, self.target_column, where
        )
        xt = torch.from_numpy(x).to(self.device, non_blocking=True)
        xt = (xt.float() - self.mean) / self.std
        yt = torch.from_numpy(y if self.kind == "class" else np.ascontiguousarray(y, np.float32))
        return xt, yt.to(self.device, non_blocking=True)

    def train_epoch(
        self, batch_size: int, *, rank: int, world: int, seed: int, epoch: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One shuffled pass over this rank's shard: exactly :meth:`num_train_batches` batches.

        ``rank``/``world`` must be the trainer's (the shard is already this rank's); the local
        shuffle buffer is seeded from (seed, epoch); the file order by the dataset's seed.

        Raises:
            DataError: a bad batch, or a shard whose length disagrees with ``rows`` (stale scan).
        """
        expected = self.num_train_batches(batch_size, world)
        count = 0
        batches = self.shard.iter_batches(
            batch_size=batch_size,
            batch_format="pyarrow",
            local_shuffle_buffer_size=self.shuffle_buffer_rows or None,
            local_shuffle_seed=epoch_seed(seed, epoch),
        )
        for count, table in enumerate(batches, start=1):
            yield self._convert(table, epoch, count - 1)
        if count != expected:
            raise DataError(
                f"{self.split} split, epoch {epoch}, rank {rank}: the shard gave {count} batches, the scan's "
                f"{self.rows} rows over {world} rank(s) make {expected}; the files changed since the scan "
                "(rerun so it scans again)"
            )

    def eval_epoch(self, batch_size: int, *, rank: int, world: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's share of an eval split, in stored order; each row once across ranks
        (with :class:`StreamingDataConfig`); ranks may get different batch counts."""
        for index, table in enumerate(self.shard.iter_batches(batch_size=batch_size, batch_format="pyarrow")):
            yield self._convert(table, None, index)


_BATCH_NOTE = "file and row group are not known in a streamed batch; a scan_parquet of the data names them"


def streaming_resource_issue(
    cluster_cpus: float,
    workers: int,
    cpus_per_worker: float,
    data_cpus: float,
    *,
    stage_index: int = 0,
    read_cpus: float = 1.0,
) -> str | None:
    """Why a streaming stage would starve Ray Data of CPUs, or None when it fits.

    Ray Train v2 registers its workers' resources with Ray Data's autoscaling coordinator at
    HIGH priority and Ray Data's executor gets what is left; with no CPU left the read tasks
    never run and the first batch never comes (the 2 workers x 1 CPU on 2 CPUs hang).
    """
    scaling = f"stages[{stage_index}].scaling"
    train = workers * cpus_per_worker
    if data_cpus < read_cpus:
        return (
            f"{DATA_CPUS_KEY}: {data_cpus} CPU is less than one read task's {read_cpus}; Ray Data could never start "
            f"a read\n    fix: set {DATA_CPUS_KEY} >= {read_cpus}"
        )
    if train + data_cpus > cluster_cpus:
        return (
            f"{scaling}.num_workers / {scaling}.resources_per_worker: {workers} worker(s) x {cpus_per_worker} CPU "
            f"= {train:g} CPU for training plus {DATA_CPUS_KEY}={data_cpus:g} for Ray Data's read tasks is more "
            f"than the cluster's {cluster_cpus:g} CPU; Ray Train reserves its CPUs first and streaming would hang "
            f"waiting for data\n    fix: lower {scaling}.num_workers or the CPU in {scaling}.resources_per_worker "
            f"so that at most {max(cluster_cpus - data_cpus, 0):g} CPU go to training, add CPUs, or set "
            "data.streaming: false"
        )
    return None


def decide_streaming(
    mode: str, train_nbytes: int, object_store_bytes: float, share: float = AUTO_STORE_SHARE
) -> tuple[bool, str]:
    """``data.streaming``: whether to stream, and the sentence to log.

    ``auto`` streams when the train inputs (``ScanResult.train_nbytes``) would take more than
    ``share`` of the object store (``ray.cluster_resources()["object_store_memory"]``).
    """
    if mode not in STREAM_MODES:
        raise DataError(f"data.streaming: {mode!r} is not one of {list(STREAM_MODES)}")
    if mode != "auto":
        return mode == "true", f"data.streaming={mode}"
    ratio = train_nbytes / max(object_store_bytes, 1.0)
    stream = ratio > share
    return stream, (
        f"data.streaming=auto: the train inputs take {train_nbytes / 2**20:.1f} MiB, {ratio:.0%} of the "
        f"{object_store_bytes / 2**20:.0f} MiB object store ({'over' if stream else 'within'} the "
        f"{share:.0%} share): {'streaming with Ray Data' if stream else 'in memory'}"
    )


def worker_sources(
    stream: dict[str, Any], cfg: PipelineConfig, device: torch.device
) -> tuple[DataInfo, tuple[StreamSource, StreamSource]]:
    """In a Ray Train worker: the stage's data info and (train, val) stream sources from its shards.

    `stream` is what the driver put in the loop config (``StreamedData.loop_config()``).
    """
    import ray.train

    shape = tuple(stream["stats_shape"])
    mean = np.asarray(stream["mean"], dtype=np.float32).reshape(shape)
    std = np.asarray(stream["std"], dtype=np.float32).reshape(shape)
    data = cfg.data
    common = {
        "input_column": stream["input_column"],  # `x` when the stage streams its cached features
        "input_shape": tuple(stream["source_shape"]),
        "target_column": stream["target_column"],
        "target_kind": data.target.kind,
        "num_classes": data.target.num_classes,
        "target_dim": data.target.dim,
        "mean": mean,
        "std": std,
        "device": device,
    }
    train = StreamSource(ray.train.get_dataset_shard("train"), rows=stream["train_rows"], split="train", **common)
    val = StreamSource(ray.train.get_dataset_shard("val"), rows=stream["val_rows"], split="val", **common)
    info = DataInfo(
        tuple(stream["input_shape"]), int(stream["out_width"]), data.target.kind, int(stream["train_rows"]), mean, std
    )
    return info, (train, val)
