"""P4 feature cache: downstream stage epoch time and an 8-trial sweep, cached vs recomputing the upstream.

    /work/venv/bin/python benchmarks/bench_cache.py [--repeats 2] [--trials 8] [--skip-sweep | --skip-epochs]

Workload: ``pipelines/configs/three_stage.yaml`` on the real Fashion-MNIST subset (9000 train /
1000 val). Prints ``figure: value (ratio vs baseline)`` lines; the baseline is always the
same stage recomputing its frozen upstream every step (``freeze.cache_features: off``).

1. **Epoch time, in-process** (no Ray, like P1; torch threads = the stage's 2 CPUs): one epoch
   of ``run_stage`` for the ``encoder`` (upstream: the ResNet) and the ``classifier``
   (upstream: ResNet + Transformer), given the upstream's outputs (``features=``) or not.
   The upstream weights are a seeded initialization, not trained ones: the work per step is
   the same, and the benchmark does not need a trained run. Timed: the whole ``run_stage``
   call (1 epoch: setup, training, validation). The one-time cost of computing the features
   (``upstream_outputs``, the function the pipeline uses) is timed too, and a third figure
   charges it to the cached epoch.
2. **Sweep wall time, under Ray** (embedded ``ray.init(num_cpus=2)``, started once, not timed):
   a `--trials`-trial FIFO sweep of the ``classifier`` stage (the shipped
   ``tune_spaces/classifier.yaml`` space, ``num_samples`` raised to `--trials`), through
   ``run_pipeline(cfg, RunOptions(spaces=..., stop_after="classifier"))`` on top of features/encoder artifacts
   trained once beforehand with ``max_steps: 20`` (not timed). With the cache, the timed call
   includes computing the features (the cache folder is deleted before each run). Each trial
   fits its own TorchTrainer (1 worker x 2 CPUs), one at a time on 2 CPUs.

Runs alternate (off, on, on, off, ...); medians are reported.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ListReporter

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "pipelines" / "configs" / "three_stage.yaml"
SPACE = ROOT / "tune_spaces" / "classifier.yaml"


def epoch_times(repeats: int) -> None:
    from cascade_ray.checks import load_config
    from cascade_ray.data.source import load_data
    from cascade_ray.pipeline.features import upstream_outputs
    from cascade_ray.stage.loop import run_stage
    from cascade_ray.stage.setup import build_stage_model

    cfg = load_config(CONFIG, ["stages.encoder.train.epochs=1", "stages.classifier.train.epochs=1"])
    data = load_data(cfg.data, cfg.seed)
    torch.set_num_threads(2)
    print(
        f"epoch time: {CONFIG.name}, {data.source}: {len(data.y_train)} train / {len(data.y_val)} val, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {repeats} repeats each (alternating)",
        flush=True,
    )
    for index in (1, 2):
        stage = cfg.stages[index]
        model, _ = build_stage_model(cfg, index - 1, data, None)  # seeded upstream weights
        upstream = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
        t0 = time.perf_counter()
        outputs = upstream_outputs(cfg, index, data, upstream)
        build_s = time.perf_counter() - t0
        features = {"x_train": outputs["train"], "x_val": outputs["val"]}
        times: dict[str, list[float]] = {"off": [], "on": []}
        for rep in range(repeats + 1):  # the first pair warms up (allocator, lazy init): not counted
            for kind in ("off", "on") if rep % 2 == 0 else ("on", "off"):
                t0 = time.perf_counter()
                with contextlib.redirect_stdout(io.StringIO()):
                    run_stage(
                        cfg,
                        index,
                        data,
                        upstream,
                        ListReporter(),
                        torch.device("cpu"),
                        features=features if kind == "on" else None,
                    )
                if rep:
                    times[kind].append(time.perf_counter() - t0)
        off, on = statistics.median(times["off"]), statistics.median(times["on"])
        shape = "x".join(map(str, features["x_train"].shape[1:]))
        print(
            f"  {stage.name} ({stage.model.type} on {shape} upstream outputs): epochs off {', '.join(f'{t:.1f}' for t in times['off'])} s; "
            f"on {', '.join(f'{t:.1f}' for t in times['on'])} s; features computed once in {build_s:.1f} s",
            flush=True,
        )
        print(f"{stage.name} epoch, recomputing the upstream: {off:.2f} s (1.000 vs baseline)")
        print(f"{stage.name} epoch, on cached features: {on:.2f} s ({off / on:.2f}x faster)")
        print(
            f"{stage.name} first epoch incl. computing the cache: {on + build_s:.2f} s ({off / (on + build_s):.2f}x faster)",
            flush=True,
        )


def sweep_times(repeats: int, trials: int) -> None:
    os.environ.pop("RAY_ADDRESS", None)
    import ray
    import yaml

    from cascade_ray.api import RunOptions, run_pipeline
    from cascade_ray.checks import load_config
    from cascade_ray.constants import apply_ray_env_defaults

    root = Path(tempfile.mkdtemp(prefix="bench-cache-")).resolve()
    space = yaml.safe_load(SPACE.read_text()) | {"num_samples": trials, "scheduler": {"type": "fifo"}}
    space_file = root / "classifier.yaml"
    space_file.write_text(yaml.safe_dump(space))
    base = [f"storage_path={root}", "stages.features.train.max_steps=20", "stages.encoder.train.max_steps=20"]
    ray.init(
        num_cpus=2, runtime_env={"env_vars": apply_ray_env_defaults()}, log_to_driver=False, include_dashboard=False
    )
    try:
        t0 = time.perf_counter()
        run_pipeline(load_config(CONFIG, base), RunOptions(stop_after="encoder"), log=lambda _: None)
        print(
            f"sweep: {trials}-trial FIFO sweep of classifier ({SPACE.name} space), upstream artifacts trained in {time.perf_counter() - t0:.1f} s (not timed); "
            f"ray {ray.__version__}, {repeats} runs each, alternating",
            flush=True,
        )
        times: dict[str, list[float]] = {"off": [], "on": []}
        for rep in range(repeats):
            for kind in ("off", "on") if rep % 2 == 0 else ("on", "off"):
                shutil.rmtree(root / "three-stage" / "tune", ignore_errors=True)
                shutil.rmtree(root / "three-stage" / "cache", ignore_errors=True)
                cfg = load_config(CONFIG, [*base, f"stages.classifier.freeze.cache_features={kind}"])
                t0 = time.perf_counter()
                with contextlib.redirect_stdout(io.StringIO()):
                    summary = run_pipeline(
                        cfg,
                        RunOptions(spaces=(("classifier", str(space_file)),), stop_after="classifier"),
                        log=lambda _: None,
                    )
                times[kind].append(time.perf_counter() - t0)
                record = summary["stages"][2]
                assert record["sweep"]["trials"] == trials and ("feature_cache" in record) == (kind == "on")
                print(
                    f"  run {rep + 1} cache {kind}: {times[kind][-1]:.1f} s (best val_accuracy {record['metrics']['val_accuracy']:.4f})",
                    flush=True,
                )
    finally:
        ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    print(f"{trials}-trial classifier sweep, recomputing the upstream: {off:.1f} s (1.000 vs baseline)")
    print(
        f"{trials}-trial classifier sweep, cached features (computed once, incl.): {on:.1f} s ({off / on:.2f}x faster)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--skip-sweep", action="store_true", help="only the in-process epoch times")
    parser.add_argument("--skip-epochs", action="store_true", help="only the sweep")
    args = parser.parse_args(argv)
    from cascade_ray.hardware import hardware_line

    print(hardware_line(), flush=True)  # first line: the hardware these figures come from
    if not args.skip_epochs:
        epoch_times(args.repeats)
    if not args.skip_sweep:
        sweep_times(args.repeats, args.trials)
    return 0


if __name__ == "__main__":
    sys.exit(main())
