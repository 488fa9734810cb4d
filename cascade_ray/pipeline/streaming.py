"""``data.streaming``: Parquet rows streamed through Ray Data instead of loaded into the driver.

Before Ray starts, :func:`scan_data` reads every row once (:func:`~cascade_ray.data.stream.scan_parquet`:
bad rows are a ``DataError`` naming the file and row group; the content-hash train/val split's
sizes; the training statistics). Each stage fit then gets fresh lazy Ray Datasets
(:meth:`StreamedData.datasets`) and its workers build a
:class:`~cascade_ray.data.stream_ingest.StreamSource` per split from their shard
(:func:`worker_sources`). The driver evaluates the composed model on the test files batch by
batch (:meth:`StreamedData.test_batches`), so no split is ever held whole in the driver.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch

from cascade_ray.config.schema import DataConfig, PipelineConfig
from cascade_ray.data.parquet import _resolve_files
from cascade_ray.data.source import normalized_stats, parquet_columns
from cascade_ray.data.stream import ScanResult, input_array, scan_parquet, target_array
from cascade_ray.errors import ConfigError, ConfigIssue
from cascade_ray.storage import redact

TEST_BATCH_ROWS = 1024


@dataclass(frozen=True)
class StreamedData:
    """The scanned Parquet data of a streaming run: sizes, shapes, statistics; never the rows."""

    cfg: DataConfig
    seed: int
    scan: ScanResult
    out_width: int
    mean: np.ndarray
    std: np.ndarray

    @property
    def target_kind(self) -> str:
        return self.cfg.target.kind

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.scan.input_shape)

    @property
    def n_train(self) -> int:
        return self.scan.train_rows

    @property
    def source(self) -> str:
        return f"parquet (streamed):{redact(str(self.cfg.path))}"

    def spec(self) -> dict[str, Any]:
        """The manifest's ``data_spec`` (as :meth:`DataSplits.spec`)."""
        return {
            "input_shape": list(self.input_shape),
            "target_kind": self.target_kind,
            "num_classes": self.out_width,
            "mean": np.asarray(self.mean, dtype=np.float64).tolist(),
            "std": np.asarray(self.std, dtype=np.float64).tolist(),
            "stats_shape": list(np.shape(self.mean)),
            "streamed": True,
        }

    def fingerprint(self) -> str:
        """Sha256 of what the scan saw: the files, row counts, per-class counts and the exact
        float64 statistics of every training row (a changed row moves them), the split and the kind."""
        scan = self.scan
        counts = [c.tolist() if c is not None else None for c in (scan.train_counts, scan.val_counts)]
        blob = {
            "files": [f.rsplit("/", 1)[-1] for f in scan.files],
            "rows": [scan.train_rows, scan.val_rows, scan.row_groups],
            "counts": counts,
            "stats": [np.asarray(self.mean).tobytes().hex(), np.asarray(self.std).tobytes().hex()],
            "shape": list(self.input_shape),
            "target": [self.target_kind, self.out_width],
            "split": [self.cfg.val_fraction, self.seed],
        }
        return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()

    def describe(self) -> str:
        s = self.scan
        return (
            f"streamed: {len(s.files)} file(s), {s.row_groups} row group(s); train {s.train_rows}, val {s.val_rows} "
            f"(content-hash split); inputs {self.input_shape}; {self.target_kind}, {self.out_width} output(s)"
        )

    def loop_config(self) -> dict[str, Any]:
        """What a stage's workers need to build their stream sources (plain values)."""
        return {
            "train_rows": self.scan.train_rows,
            "val_rows": self.scan.val_rows,
            "input_shape": list(self.input_shape),
            "source_shape": list(self.input_shape),  # what each streamed row holds
            "out_width": self.out_width,
            "mean": np.asarray(self.mean).tolist(),
            "std": np.asarray(self.std).tolist(),
            "stats_shape": list(np.shape(self.mean)),
            "input_column": self.cfg.inputs.column,
            "target_column": self.cfg.target.column,
            "input_stage": None,
        }

    def datasets(self) -> dict[str, Any]:
        """Fresh lazy Ray Datasets of the train and val parts (one set per stage fit)."""
        from cascade_ray.data.stream_ingest import streaming_datasets

        return streaming_datasets(
            self.cfg.path,
            input_column=self.cfg.inputs.column,
            input_shape=self.input_shape,
            target_column=self.cfg.target.column,
            val_fraction=self.cfg.val_fraction,
            seed=self.seed,
        )

    def test_batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The test files, normalized, in batches of record batches (bounded driver memory)."""
        files, fs = _resolve_files(self.cfg.test_path, "data.test_path")
        cols = [self.cfg.inputs.column, self.cfg.target.column]
        mean, std = torch.as_tensor(self.mean), torch.as_tensor(self.std)
        for name in files:
            handle = pq.ParquetFile(fs.open_input_file(name) if fs is not None else name)
            for i, batch in enumerate(handle.iter_batches(batch_size=TEST_BATCH_ROWS, columns=cols)):

                def where(row: int, i: int = i, name: str = name) -> str:
                    return f"data.test_path: file {redact(name)!r}, batch {i}, row {row}"

                x = input_array(batch.column(0), self.input_shape, cols[0], where)
                y = target_array(
                    batch.column(1), self.target_kind, self.cfg.target.num_classes, self.cfg.target.dim, cols[1], where
                )
                # Arrow's buffers are read-only; the float conversion copies, the targets are small
                yield (torch.from_numpy(x.astype(np.float32)) - mean) / std, torch.from_numpy(np.array(y))


def scan_data(cfg: PipelineConfig) -> StreamedData:
    """Scan ``data.path`` once (every row checked; split sizes; statistics), before Ray starts.

    Raises:
        DataError: a bad row (naming the file and row group), a missing column, no rows.
    """
    data = cfg.data
    scan = scan_parquet(
        data.path,
        **parquet_columns(data),
        val_fraction=data.val_fraction,
        seed=cfg.seed,
    )
    width = _out_width(data, scan)
    mean, std = normalized_stats(data, scan.input_shape, scan.mean, scan.std)
    return StreamedData(data, cfg.seed, scan, width, mean, std)


def _out_width(data: DataConfig, scan: ScanResult) -> int:
    target = data.target
    if target.kind == "regression":
        return target.dim or _regression_width(data, scan)
    if target.num_classes is not None:
        return target.num_classes
    return int(len(scan.train_counts)) if scan.train_counts is not None else 2


def _regression_width(data: DataConfig, scan: ScanResult) -> int:
    """Values per regression target, from the first file (the scan checked every row has as many)."""
    import pyarrow as pa

    files, fs = _resolve_files(data.path, "data.path")
    handle = pq.ParquetFile(fs.open_input_file(files[0]) if fs is not None else files[0])
    kind = handle.schema_arrow.field(data.target.column).type
    if pa.types.is_fixed_size_list(kind):
        return int(kind.list_size)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        first = handle.read_row_group(0, columns=[data.target.column]).column(0)
        return int(len(first[0]))
    return 1


def check_streaming_resources(cfg: PipelineConfig, cluster_cpus: float) -> None:
    """Every stage must leave ``data.streaming_cpus`` CPUs to Ray Data's read tasks.

    Raises:
        ConfigError: naming the stage's scaling keys and ``data.streaming_cpus``.
    """
    from cascade_ray.data.stream_ingest import streaming_resource_issue

    issues = []
    for i, stage in enumerate(cfg.stages):
        sc = stage.scaling
        cpus = float((sc.resources_per_worker or {}).get("CPU", 1.0))
        problem = streaming_resource_issue(cluster_cpus, sc.num_workers, cpus, cfg.data.streaming_cpus, stage_index=i)
        if problem is not None:
            text, _, fix = problem.partition("\n    fix: ")
            key, _, message = text.partition(": ")
            issues.append(ConfigIssue(key, message, fix or None))
    if issues:
        raise ConfigError(issues, source=f"{cfg.name} (streaming, {cluster_cpus:g} CPU)")
