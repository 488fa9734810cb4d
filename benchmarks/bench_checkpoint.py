"""Per-epoch checkpoints of a stage on a large frozen upstream: ``train.checkpoint.frozen: copy``
(every checkpoint the whole composed state, as before) vs ``reference`` (the stage's own tensors
and the upstream's digests).

    flock /tmp/cascade-cpu.lock .venv/bin/python benchmarks/bench_checkpoint.py [--width 10000] [--epochs 6] [--repeats 3] [--storage local|s3]

The pipeline: scikit-learn's digits, a ``backbone`` MLP stage (64 -> W -> W, flattening the 8x8
images; W = 10000: ~100M parameters, ~400 MB) trained for one optimizer step, untimed, then a
small ``head`` MLP stage (W -> 64 -> 10 classes) for ``--epochs`` epochs on the backbone's cached
features (``freeze.cache_features: auto`` caches them: the frozen backbone's forward is not in
the timing). One embedded Ray (``ray.init(num_cpus=2)``); each run is ``run_pipeline(...,
resume=True)`` in one run folder: the backbone's artifact and the feature cache are reused, and
the head trains again because every run gives it another seed (the frozen mode is not part of
its fingerprint). A first head run (copy) warms the Train job's imports, untimed; then the two
modes alternate (copy, reference, reference, copy, ...).

Timed: the head stage's wall time as the driver records it (Train job start, epochs with their
checkpoints, the artifact). Printed per mode: the median wall, the bytes of one checkpoint
directory and of everything the head's Ray run folder holds at the end (``top_k: 1`` and the
newest), and the ratio copy / reference. Both modes' artifacts are checked to hold the same keys,
and the reference artifact's frozen tensors to be the backbone's, bit for bit.
``--storage s3`` puts the run on moto's S3 server on loopback (``tests/support/s3.py``): every
checkpoint is then an upload (moto is far slower than a real object store: a smaller ``--width``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))


def _config(storage: str, width: int, epochs: int) -> dict:
    return {
        "name": "bench-checkpoint",
        "seed": 0,
        "storage_path": storage,
        "data": {"source": "digits", "val_fraction": 0.2},
        "stages": [
            {
                "name": "backbone",
                "model": {"type": "mlp", "in_features": 64, "hidden": [width, width], "pool": "flatten"},
                "solver": {"type": "SGD", "lr": 1e-3},
                "train": {"epochs": 1, "max_steps": 1, "batch_size": 32},
            },
            {
                "name": "head",
                "model": {"type": "mlp", "in_features": width, "hidden": [64]},
                "solver": {"type": "Adam", "lr": 1e-3},
                "train": {"epochs": epochs, "batch_size": 32, "checkpoint": {"top_k": 1}},
            },
        ],
    }


def _folder_bytes(path) -> tuple[int, list[int]]:
    """Bytes under `path` (a storage path) in all, and of each checkpoint directory in it."""
    total, per_checkpoint = 0, []
    for child in path.iterdir():
        if child.is_dir():
            size = sum(_size(f) for f in _files(child))
            total += size
            if child.name.startswith("checkpoint_"):
                per_checkpoint.append(size)
        else:
            total += _size(child)
    return total, per_checkpoint


def _size(file) -> int:
    """A file's bytes: a local Path, or a UriPath on object storage."""
    return file.stat().st_size if hasattr(file, "stat") else file.fs.get_file_info(file.path).size


def _files(folder):
    for child in folder.iterdir():
        if child.is_dir():
            yield from _files(child)
        else:
            yield child


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=10000, help="the backbone's hidden width W")
    parser.add_argument("--epochs", type=int, default=6, help="the head stage's epochs (one checkpoint each)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per mode")
    parser.add_argument("--storage", choices=("local", "s3"), default="local")
    args = parser.parse_args()
    os.environ.pop("RAY_ADDRESS", None)

    import numpy as np
    import ray
    import torch

    from cascade_ray.api import RunOptions, run_pipeline
    from cascade_ray.checks import validate_config
    from cascade_ray.constants import apply_ray_env_defaults
    from cascade_ray.hardware import hardware_line
    from cascade_ray.pipeline.artifacts import read_artifact
    from cascade_ray.storage import as_storage

    work = Path(tempfile.mkdtemp(prefix="bench-checkpoint-"))
    env = apply_ray_env_defaults()
    server = None
    if args.storage == "s3":
        from s3 import start_s3

        server = start_s3(work)
        os.environ.update(server.env)
        env |= server.env
        storage = server.uri("bench", uuid.uuid4().hex[:8])
    else:
        storage = str(work / "runs")
    ray.init(
        num_cpus=2, runtime_env={"env_vars": env}, logging_level="ERROR", include_dashboard=False, log_to_driver=False
    )
    seeds = iter(range(1, 1000))

    def run(mode: str) -> dict:
        raw = _config(storage, args.width, args.epochs)
        raw["stages"][1]["seed"] = next(seeds)  # a new fingerprint: the head trains again, the backbone is reused
        raw["stages"][1]["train"]["checkpoint"]["frozen"] = mode
        cfg = validate_config(raw, source="bench_checkpoint")
        with contextlib.redirect_stdout(io.StringIO()):
            summary = run_pipeline(cfg, RunOptions(resume=True, log_level="warning"), log=lambda _: None)
        return summary["stages"][1]

    try:
        t0 = time.perf_counter()
        warm = run("copy")  # trains the backbone, caches its features, warms the head's Train job
        print(hardware_line(), flush=True)
        print(f"torch {torch.__version__}, ray {ray.__version__}, 2 CPUs; storage {args.storage}", flush=True)
        print(
            f"backbone 64 -> {args.width} -> {args.width}, head {args.width} -> 64 -> 10 for {args.epochs} epochs on its "
            f"cached features (feature cache: {'feature_cache' in warm}); set-up run {time.perf_counter() - t0:.1f} s (not timed)",
            flush=True,
        )
        walls: dict[str, list[float]] = {"copy": [], "reference": []}
        sizes: dict[str, tuple[int, list[int]]] = {}
        artifacts: dict[str, str] = {}
        for i in range(args.repeats):
            for mode in ("copy", "reference") if i % 2 == 0 else ("reference", "copy"):
                record = run(mode)
                walls[mode].append(record["wall_s"])
                artifact, _ = read_artifact(record["artifact"])
                folder = as_storage(record["artifact"]).parent.parent / "ray" / artifact.manifest.ray_run
                sizes[mode], artifacts[mode] = _folder_bytes(folder), record["artifact"]
                print(f"  run {i + 1} {mode}: head stage {record['wall_s']:.2f} s", flush=True)
        backbone_state = read_artifact(str(as_storage(artifacts["copy"]).parent.parent / "stages" / "backbone"))[1]
        (_, copied), (manifest, referenced) = read_artifact(artifacts["copy"]), read_artifact(artifacts["reference"])
        assert set(copied) == set(referenced), "both modes' artifacts hold the same keys"
        frozen = manifest.manifest.frozen_digest
        assert frozen and all(np.array_equal(referenced[k], backbone_state[k]) for k in frozen)
        frozen_mb = sum(backbone_state[k].nbytes for k in frozen) / 1e6
        print(f"frozen upstream in the head stage: {len(frozen)} tensors, {frozen_mb:.1f} MB")
        for mode in ("copy", "reference"):
            total, per = sizes[mode]
            print(
                f"{mode}: one checkpoint {statistics.median(per) / 1e6:.2f} MB; the head's Ray run folder at the end "
                f"{total / 1e6:.2f} MB ({len(per)} checkpoints kept)"
            )
        copy, ref = statistics.median(walls["copy"]), statistics.median(walls["reference"])
        print(f"head stage ({args.epochs} epochs, a checkpoint each), frozen: copy: {copy:.2f} s (1.000 vs baseline)")
        print(
            f"head stage ({args.epochs} epochs, a checkpoint each), frozen: reference: {ref:.2f} s ({copy / ref:.2f}x faster)"
        )
        print(f"per epoch saved: {(copy - ref) / args.epochs:.3f} s")
    finally:
        ray.shutdown()
        if server is not None:
            server.stop()
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
