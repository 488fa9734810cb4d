"""Batch prediction throughput: ``predict_file`` (Ray Data, actor pool) vs a plain single-process loop.

flock /tmp/cascade-cpu.lock env PYTHONPATH=. .venv/bin/python benchmarks/bench_predict.py --rows 200000 [--run RUN]

Both read the same Parquet file (the digits test images replicated to ``--rows`` rows,
4096-row groups, as ``write_parquet`` writes them) with the same run and batch size, and
write Parquet. The plain loop is what a user writes without Ray: ``load_cascade``, then
``ParquetFile.iter_batches`` -> ``cascade.predict`` -> ``ParquetWriter``, torch on every core.
``predict_file`` runs with an embedded Ray per call; its rows/s are over the Ray Data run
(read, predict, write); ``end to end`` adds loading the run and starting/stopping Ray.
Without ``--run`` the debug config is trained first (1 epoch per stage) into a temp folder.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from cascade_ray.data.digits import load_digits
from cascade_ray.data.parquet import write_parquet
from cascade_ray.data.stream import input_array
from cascade_ray.tools.inference import load_cascade
from cascade_ray.tools.predict import predict_file

ROOT = Path(__file__).resolve().parents[1]


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def train_debug(storage: Path) -> Path:
    overrides = [f"storage_path={storage}"] + [f"stages[{i}].train.epochs=1" for i in range(3)]
    cmd = [sys.executable, "-m", "cascade_ray.cli", "run", str(ROOT / "pipelines/configs/debug.yaml"), *overrides]
    subprocess.run([*cmd, "--log-level", "warning"], check=True, capture_output=True)
    return storage / "debug"


def plain_loop(run: Path, data: Path, out: Path, batch_rows: int) -> tuple[int, float]:
    """The baseline: one process, no Ray. Returns (rows, seconds) from loading the run to the closed file."""
    t0 = time.perf_counter()
    cascade = load_cascade(run)
    shape, rows, writer = cascade.spec.input_shape, 0, None
    for batch in pq.ParquetFile(data).iter_batches(batch_size=batch_rows, columns=["image"]):
        x = input_array(batch.column(0), shape, "image", lambda row: f"row {row}")
        pred = cascade.predict(x, batch_rows=batch_rows)
        probs = pred["probabilities"]
        table = pa.table(
            {
                "prediction": pa.array(pred["prediction"]),
                "probabilities": pa.FixedSizeListArray.from_arrays(pa.array(probs.reshape(-1)), probs.shape[1]),
            }
        )
        writer = writer or pq.ParquetWriter(out, table.schema)
        writer.write_table(table)
        rows += len(table)
    writer.close()
    return rows, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--batch-rows", type=int, default=1024)
    parser.add_argument("--run", default=None, help="a finished run on digits-shaped inputs (default: train debug)")
    parser.add_argument("--actors", default="default,2", help="actor counts to measure (default: the rule, and 2)")
    args = parser.parse_args()
    print(f"cpu: {cpu_model()}, torch capability {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory(prefix="bench-predict-") as tmp:
        tmp = Path(tmp)
        run = Path(args.run) if args.run else train_debug(tmp / "runs")
        x = load_digits(train_size=None, val_fraction=0.2, seed=0).x_test
        x = np.resize(x, (args.rows, *x.shape[1:]))  # the test images repeated
        data = tmp / "rows.parquet"
        write_parquet(data, x, np.zeros(len(x), np.int64))
        print(f"data: {args.rows} rows of {x.shape[1:]} {x.dtype}, {data.stat().st_size / 2**20:.1f} MiB, run {run}")
        rows, base_s = plain_loop(run, data, tmp / "plain.parquet", args.batch_rows)
        base = rows / base_s
        print(f"plain loop (1 process, {torch.get_num_threads()} torch threads): {base:,.0f} rows/s ({base_s:.2f} s)")
        for count in args.actors.split(","):
            actors = None if count == "default" else int(count)
            report = predict_file(run, data, tmp / f"out-{count}", batch_rows=args.batch_rows, actors=actors)
            assert report.rows == rows
            e2e = report.rows / report.total_s
            print(
                f"predict_file, {report.actors} actor(s) ({count}): {report.rows_per_s:,.0f} rows/s "
                f"({report.seconds:.2f} s, {report.files} files), x{report.rows_per_s / base:.2f} vs plain; "
                f"end to end {e2e:,.0f} rows/s ({report.total_s:.2f} s), x{e2e / base:.2f}"
            )


if __name__ == "__main__":
    main()
