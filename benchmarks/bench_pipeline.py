"""P2 pipeline overhead: ``run_pipeline`` wall time vs plain TorchTrainer jobs chained through directories.

    /work/venv/bin/python benchmarks/bench_pipeline.py [--repeats 2] [--config pipelines/configs/debug.yaml]

Both run in one embedded Ray session, started once with ``ray.init(num_cpus=2)`` and
cascade-ray's Ray env knobs (``cascade_ray.constants``: 0.1 s Train report polling, no
preemption watcher / metrics / print patch) in its ``runtime_env``, so both sides get the
same Ray tuning; ``RAY_ADDRESS`` is unset first (never another engineer's cluster).

- **candidate**: ``cascade_ray.pipeline.driver.run_pipeline(cfg)``: data, resource and storage
  checks, per stage one TorchTrainer fit, best checkpoint, frozen hand-off check, artifact
  (safetensors + manifest with digests), one ``ray.put`` of the weights for the next stage;
  then the composed model on the test split, ``summary.json`` and the report files.
- **baseline**: ``benchmarks/baselines/plain_chain.py``: one plain TorchTrainer per stage,
  plain PyTorch loop, a checkpoint (safetensors) per epoch keeping the best, the next
  stage's workers reading the previous best checkpoint from its directory; then the same
  test evaluation. Same models (``build_stage_model``), data, epochs, batch sizes,
  optimizers and worker counts.

Timed: wall time of the whole call (config already loaded, Ray already up). One untimed
no-op TorchTrainer fit warms the session first; then the runs alternate (candidate,
baseline, baseline, candidate, ...), each in a fresh storage folder, and medians are
reported. A per-stage breakdown says where the time goes. Prints
``figure: value (ratio vs baseline)``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks.baselines, when run as a script from anywhere
DEFAULT_CONFIG = ROOT / "pipelines" / "configs" / "debug.yaml"


def _warm_up() -> None:
    """One no-op fit with 2 workers: Ray Train's controller and worker imports happen here, untimed."""
    import ray.train
    from ray.train.torch import TorchTrainer

    def noop(_config) -> None:
        ray.train.report({"ok": 1})

    storage = tempfile.mkdtemp(prefix="bench-pipeline-warmup-")
    try:
        TorchTrainer(noop, scaling_config=ray.train.ScalingConfig(num_workers=2), run_config=ray.train.RunConfig(name="warmup", storage_path=storage)).fit()
    finally:
        shutil.rmtree(storage, ignore_errors=True)


def run_candidate(config: Path, storage: Path) -> dict:
    """run_pipeline, with the fit of each stage timed (a wrapper around the name it calls)."""
    import cascade_ray.pipeline.stages as stages_mod
    from cascade_ray.config import load_config
    from cascade_ray.pipeline.driver import run_pipeline

    fits: list[float] = []
    original = stages_mod.fit_stage

    def timed_fit(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            fits.append(time.perf_counter() - t0)

    cfg = load_config(config, [f"storage_path={storage}"])
    stages_mod.fit_stage = timed_fit
    try:
        t0 = time.perf_counter()
        summary = run_pipeline(cfg, log=lambda line: None)
        wall = time.perf_counter() - t0
    finally:
        stages_mod.fit_stage = original
    stage_s = [s["wall_s"] for s in summary["stages"]]
    return {"wall": wall, "fits": fits, "stages": stage_s, "accuracy": summary["test_accuracy"]}


def run_baseline(config: Path, storage: Path) -> dict:
    from ray import cloudpickle

    import benchmarks.baselines.plain_chain as plain_chain
    from cascade_ray.config import load_config

    cloudpickle.register_pickle_by_value(plain_chain)  # Ray workers need not find benchmarks/ on their path
    run_plain_chain = plain_chain.run_plain_chain

    cfg = load_config(config, [f"storage_path={storage}"])
    t0 = time.perf_counter()
    out = run_plain_chain(cfg, storage, log=lambda line: None)
    wall = time.perf_counter() - t0
    fits = [s["wall_s"] for s in out["stages"]]
    return {"wall": wall, "fits": fits, "stages": fits, "accuracy": out["test_accuracy"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each (alternating)")
    args = parser.parse_args(argv)

    os.environ.pop("RAY_ADDRESS", None)
    import ray

    from cascade_ray.config import load_config
    from cascade_ray.constants import apply_ray_env_defaults

    cfg = load_config(args.config)
    root = Path(tempfile.mkdtemp(prefix="bench-pipeline-")).resolve()
    env = apply_ray_env_defaults()
    t0 = time.perf_counter()
    ray.init(num_cpus=2, runtime_env={"env_vars": env}, log_to_driver=False, include_dashboard=False)
    init_s = time.perf_counter() - t0
    try:
        plan = ", ".join(f"{s.name} {s.model.type} {s.train.epochs} ep x {s.scaling.num_workers} worker(s)" for s in cfg.stages)
        print(f"bench_pipeline: {args.config.name} ({plan}); ray {ray.__version__}, ray.init(num_cpus=2) once ({init_s:.1f} s, not timed), "
              f"env {env}; {args.repeats} runs each, alternating, medians", flush=True)
        t0 = time.perf_counter()
        _warm_up()
        print(f"  warm-up no-op fit (not timed): {time.perf_counter() - t0:.1f} s", flush=True)
        runs: dict[str, list[dict]] = {"candidate": [], "baseline": []}
        for rep in range(args.repeats):
            order = ("candidate", "baseline") if rep % 2 == 0 else ("baseline", "candidate")
            for kind in order:
                storage = root / f"{rep}-{kind}"
                storage.mkdir()
                r = (run_candidate if kind == "candidate" else run_baseline)(args.config, storage)
                runs[kind].append(r)
                print(f"  repeat {rep + 1} {kind}: {r['wall']:.1f} s (stages {', '.join(f'{s:.1f}' for s in r['stages'])}; "
                      f"test accuracy {r['accuracy']:.3f})", flush=True)
        cand = statistics.median(r["wall"] for r in runs["candidate"])
        base = statistics.median(r["wall"] for r in runs["baseline"])
        print(f"plain chain (TorchTrainer + checkpoint dirs) wall time: {base:.1f} s (1.000 vs baseline)")
        print(f"run_pipeline wall time: {cand:.1f} s ({cand / base:.3f} vs baseline)")
        for i, stage in enumerate(cfg.stages):
            b_fit = statistics.median(r["fits"][i] for r in runs["baseline"])
            c_fit = statistics.median(r["fits"][i] for r in runs["candidate"])
            c_stage = statistics.median(r["stages"][i] for r in runs["candidate"])
            print(f"  stage {stage.name}: plain fit {b_fit:.1f} s; run_pipeline fit {c_fit:.1f} s ({c_fit / b_fit:.3f} vs baseline), "
                  f"+ after-fit (best checkpoint, frozen check, artifact, put) {c_stage - c_fit:.2f} s")
        outside = [r["wall"] - sum(r["stages"]) for r in runs["candidate"]]
        b_outside = [r["wall"] - sum(r["fits"]) for r in runs["baseline"]]
        print(f"  outside the stages (data, checks, put; test evaluation, summary, reports): run_pipeline {statistics.median(outside):.2f} s, "
              f"plain chain {statistics.median(b_outside):.2f} s")
        ratio = cand / base
        print(f"P2 target: run_pipeline wall time <= 1.0 x plain chain: {ratio:.3f} -> {'met' if ratio <= 1.0 else 'NOT met'}")
    finally:
        ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
