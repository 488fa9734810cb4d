"""Object storage cost: the debug pipeline with ``storage_path`` on S3 vs on the local disk.

    .venv/bin/python benchmarks/bench_storage.py [--repeats 2] [--config pipelines/configs/debug.yaml]

The S3 side is moto's standalone server on loopback (``tests/support/s3.py``: a real S3 API,
``AWS_ENDPOINT_URL``), so the ratio measures what going through ``pyarrow.fs``'s S3 client
costs (requests, no local rename, uploads of checkpoints / artifacts / the feature cache), not
a real network. Both sides run in one embedded Ray session (``ray.init(num_cpus=2)``, the
endpoint and keys in its ``runtime_env``), warmed by one untimed run; then the runs alternate
(local, s3, s3, local, ...), each in a fresh folder / prefix, and medians are reported.

Printed: median wall time per side and the ratio s3 / local; the bytes each stage wrote to
storage (its Ray run folder with checkpoints, its artifact, its feature cache) and the run's
other files, from the S3 listing of the last run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))
DEFAULT_CONFIG = ROOT / "pipelines" / "configs" / "debug.yaml"


def _stage_bytes(server, run_key: str, stages: list[str]) -> dict[str, int]:
    import pyarrow.fs as pafs

    fs = server.filesystem()
    infos = fs.get_file_info(pafs.FileSelector(f"{server.bucket}/{run_key}", recursive=True))
    sizes: dict[str, int] = dict.fromkeys(stages, 0) | {"other": 0}
    for info in infos:
        if info.type != pafs.FileType.File:
            continue
        rel = info.path[len(server.bucket) + len(run_key) + 2 :].split("/")
        owner = "other"
        if rel[0] in ("stages", "cache") and len(rel) > 1:
            owner = rel[1]
        elif rel[0] == "ray" and len(rel) > 1:
            owner = next((s for s in stages if rel[1].split("-")[1:2] == [s]), "other")
        sizes[owner if owner in sizes else "other"] += info.size
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    args = parser.parse_args()
    os.environ.pop("RAY_ADDRESS", None)

    from s3 import start_s3

    work = Path(tempfile.mkdtemp(prefix="bench-storage-"))
    server = start_s3(work)
    os.environ.update(server.env)
    try:
        import ray

        from cascade_ray.api import RunOptions, run_pipeline
        from cascade_ray.checks import load_config
        from cascade_ray.constants import apply_ray_env_defaults
        from cascade_ray.hardware import cpu_model

        env = apply_ray_env_defaults() | server.env
        ray.init(num_cpus=2, runtime_env={"env_vars": env}, logging_level="ERROR")

        def one(kind: str) -> tuple[float, str]:
            tag = uuid.uuid4().hex[:8]
            storage = server.uri("bench", tag) if kind == "s3" else str(work / tag)
            cfg = load_config(args.config, [f"storage_path={storage}"])
            t0 = time.perf_counter()
            run_pipeline(cfg, RunOptions(log_level="warning"), log=lambda _: None)
            return time.perf_counter() - t0, f"bench/{tag}/{cfg.name}"

        one("local")  # warm-up: Ray Train's controller and worker imports, untimed
        times: dict[str, list[float]] = {"local": [], "s3": []}
        last_key = ""
        for i in range(args.repeats):
            for kind in ("local", "s3") if i % 2 == 0 else ("s3", "local"):
                wall, key = one(kind)
                times[kind].append(wall)
                last_key = key if kind == "s3" else last_key
                print(f"run {i + 1} {kind}: {wall:.1f} s", flush=True)
        import torch

        print(f"CPU: {cpu_model()}; torch.backends.cpu.get_cpu_capability(): {torch.backends.cpu.get_cpu_capability()}")
        local, s3 = statistics.median(times["local"]), statistics.median(times["s3"])
        print(f"debug pipeline, local disk: {local:.1f} s (median of {len(times['local'])})")
        print(
            f"debug pipeline, S3 (moto on loopback): {s3:.1f} s (median of {len(times['s3'])}); ratio s3/local {s3 / local:.2f}"
        )
        stages = [s.name for s in load_config(args.config).stages]
        for owner, size in _stage_bytes(server, last_key, stages).items():
            print(f"bytes written, {owner}: {size:,}")
        ray.shutdown()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
