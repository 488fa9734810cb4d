"""Epoch throughput of StreamSource (Ray Data) against in-memory numpy batches, in one TorchTrainer.

Both paths run in the same Ray Train worker (1 worker x 1 CPU, leaving 1 CPU of 2 to Ray
Data's read tasks) over the same Fashion-MNIST train part (Parquet written here, content-hash
split): the baseline slices shuffled batches out of the numpy arrays (``ray.put`` once),
normalises and takes a tiny MLP step; the streaming path iterates ``StreamSource.train_epoch``
and takes the same step. Each is timed without the step too (data only), and the streaming
data-only pass once more through ``iter_torch_batches`` (Ray's own numpy -> torch), so the
table shows what limits the ratio.

    flock /tmp/cascade-cpu.lock env PYTHONPATH=. .venv/bin/python benchmarks/bench_streaming.py
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def _loop(config: dict) -> dict:
    """Runs in the Ray Train worker; returns seconds per pass."""
    import ray
    import ray.train

    from cascade_ray.data.stream_ingest import StreamSource

    torch.set_num_threads(1)
    torch.manual_seed(0)
    bs, mean, std = config["batch_size"], config["mean"], config["std"]
    model = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    x_np, y_np = ray.get(config["arrays"])
    x_all, y_all = torch.from_numpy(x_np), torch.from_numpy(y_np)
    mean_t, std_t = torch.from_numpy(mean), torch.from_numpy(std)

    def memory_epoch(train: bool, epoch: int) -> float:
        t = time.perf_counter()
        order = torch.randperm(len(y_all), generator=torch.Generator().manual_seed(epoch))
        for idx in order.split(bs):
            x = (x_all[idx].float() - mean_t) / std_t
            if train:
                step(x, y_all[idx])
        return time.perf_counter() - t

    source = StreamSource(
        ray.train.get_dataset_shard("train"),
        rows=config["rows"],
        input_column="image",
        input_shape=config["shape"],
        target_column="label",
        target_kind="class",
        num_classes=10,
        mean=mean,
        std=std,
    )

    def stream_epoch(train: bool, epoch: int) -> float:
        t = time.perf_counter()
        for x, y in source.train_epoch(bs, rank=0, world=1, seed=0, epoch=epoch):
            if train:
                step(x, y)
        return time.perf_counter() - t

    def torch_batches_epoch(epoch: int) -> float:
        t = time.perf_counter()
        shard = ray.train.get_dataset_shard("train")
        for batch in shard.iter_torch_batches(batch_size=bs, local_shuffle_buffer_size=4096, local_shuffle_seed=epoch):
            x = (batch["image"].reshape(-1, *config["shape"]).float() - mean_t) / std_t
            _ = x, batch["label"]
        return time.perf_counter() - t

    out = {}
    for epoch, (name, fn) in enumerate(
        [
            ("stream_warmup", lambda e: stream_epoch(False, e)),
            ("memory_data", lambda e: memory_epoch(False, e)),
            ("stream_data", lambda e: stream_epoch(False, e)),
            ("stream_iter_torch_batches_data", torch_batches_epoch),
            ("memory_train", lambda e: memory_epoch(True, e)),
            ("stream_train", lambda e: stream_epoch(True, e)),
        ]
    ):
        try:
            out[name] = fn(epoch)
        except Exception as exc:  # noqa: BLE001 - a variant Ray cannot run is reported, not fatal
            print(f"{name} failed: {type(exc).__name__}: {str(exc)[:300]}")
            out[name] = float("nan")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--val-fraction", type=float, default=0.1)
    # one 60k-row group streamed 2.3x slower through the shuffle buffer than 4096-row groups
    parser.add_argument("--row-group-rows", type=int, default=4096, help="write_parquet's row_group_rows; 0: one group")
    args = parser.parse_args()

    import pyarrow.parquet as pq
    import ray
    import ray.train

    from cascade_ray.constants import apply_ray_env_defaults
    from cascade_ray.data import load_fashion_mnist, write_parquet
    from cascade_ray.data.stream import is_val_row, scan_parquet
    from cascade_ray.data.stream_ingest import StreamingDataConfig, streaming_datasets, streaming_resource_issue
    from cascade_ray.ray_compat import LeanTorchTrainer

    splits = load_fashion_mnist(train_size=None, val_fraction=0.1, seed=0)
    x = np.concatenate([splits.x_train, splits.x_val])
    y = np.concatenate([splits.y_train, splits.y_val])
    work = Path(tempfile.mkdtemp(prefix="bench-stream-"))
    path = work / "fashion.parquet"
    write_parquet(path, x, y, row_group_rows=args.row_group_rows or len(y))
    spec = {"input_column": "image", "target_column": "label", "val_fraction": args.val_fraction, "seed": 0}

    t = time.perf_counter()
    scan = scan_parquet(path, input_shape=None, target_kind="class", num_classes=10, **spec)
    scan_local_s = time.perf_counter() - t
    meta = pq.ParquetFile(path).metadata
    print(f"data: {len(y)} rows, {meta.num_row_groups} row group(s), {path.stat().st_size / 2**20:.1f} MiB parquet")
    print(f"scan in-process: {scan_local_s:.2f} s ({len(y) / scan_local_s:.0f} rows/s)")

    env = apply_ray_env_defaults() | {"PYTHONPATH": str(ROOT)}
    ray.init(num_cpus=2, runtime_env={"env_vars": env}, log_to_driver=False)
    t = time.perf_counter()
    scan = scan_parquet(path, input_shape=None, target_kind="class", num_classes=10, **spec)
    print(f"scan as Ray tasks: {time.perf_counter() - t:.2f} s (one file: one task)")
    assert streaming_resource_issue(2, 1, 1, 1) is None

    val = is_val_row(x, args.val_fraction, 0)
    arrays = ray.put((x[~val], y[~val]))
    datasets = streaming_datasets(path, input_shape=scan.input_shape, **spec)
    trainer = LeanTorchTrainer(
        _loop,
        train_loop_config={
            "arrays": arrays,
            "rows": scan.train_rows,
            "shape": scan.input_shape,
            "mean": scan.mean,
            "std": scan.std,
            "batch_size": args.batch_size,
        },
        scaling_config=ray.train.ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1}),
        run_config=ray.train.RunConfig(storage_path=str(work / "runs"), name="bench-stream"),
        datasets={"train": datasets["train"]},
        dataset_config=StreamingDataConfig(),
    )
    t = time.perf_counter()
    times = trainer.fit().return_value
    fit_s = time.perf_counter() - t
    ray.shutdown()

    rows = scan.train_rows
    print(f"cpu: {_cpu_model()}; torch {torch.__version__} capability {torch.backends.cpu.get_cpu_capability()}")
    print(
        f"train rows/epoch: {rows}, batch {args.batch_size}, 1 worker x 1 CPU + 1 CPU for Ray Data; fit {fit_s:.1f} s; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    for name, seconds in times.items():
        print(f"{name:32s} {seconds:7.2f} s  {rows / seconds:9.0f} samples/s")
    print(f"ratio stream/memory, data only:   {times['memory_data'] / times['stream_data']:.3f}")
    print(f"ratio stream/memory, with step:   {times['memory_train'] / times['stream_train']:.3f}")
    print(
        f"ratio iter_torch_batches/own conversion (data only): {times['stream_data'] / times['stream_iter_torch_batches_data']:.3f}"
    )


if __name__ == "__main__":
    os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
    main()
