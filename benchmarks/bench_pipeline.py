"""P2 pipeline overhead: ``run_pipeline`` wall time vs plain TorchTrainer jobs chained through directories.

    /work/venv/bin/python benchmarks/bench_pipeline.py [--repeats 2] [--config pipelines/configs/debug.yaml] [--feature-cache off|auto]

Both run in one embedded Ray session, started once with ``ray.init(num_cpus=2)`` and
cascade-ray's Ray env knobs (``cascade_ray.constants``: 0.1 s Train report polling, no
preemption watcher / metrics / print patch) in its ``runtime_env``, so both sides get the
same Ray tuning; ``RAY_ADDRESS`` is unset first (never another engineer's cluster).

- **candidate**: ``cascade_ray.api.run_pipeline(cfg)``: data, resource and storage
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
reported. ``--feature-cache`` sets every later stage's ``freeze.cache_features`` for the
candidate (default ``off``: the target is stated without the cache; ``auto`` is the
shipped default). A per-stage breakdown says where the time goes. Prints
``figure: value (ratio vs baseline)``.
"""

from __future__ import annotations

import argparse
import json
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
        TorchTrainer(
            noop,
            scaling_config=ray.train.ScalingConfig(num_workers=2),
            run_config=ray.train.RunConfig(name="warmup", storage_path=storage),
        ).fit()
    finally:
        shutil.rmtree(storage, ignore_errors=True)


def timed_loop(fn, log_path: str):
    """Wrap a train_loop_per_worker so each worker appends (stage, rank, start, end) to `log_path`.

    Attribution only: splits a fit into start-up (fit() called -> loop starts), the loop, and
    teardown (loop ends -> fit() returns). One append per worker per fit: negligible.
    """

    def wrapper(config):
        import ray.train

        start = time.time()
        try:
            return fn(config)
        finally:
            end = time.time()
            with open(log_path, "a") as f:
                stage = config.get("stage_index", config.get("index"))
                f.write(
                    json.dumps(
                        {"stage": stage, "rank": ray.train.get_context().get_world_rank(), "start": start, "end": end}
                    )
                    + "\n"
                )

    return wrapper


def _phases(fits: list[tuple[float, float]], log_path: Path) -> list[dict[str, float]]:
    """Per stage: start-up, loop and teardown seconds from the driver's fit times and the workers' log."""
    rows = [json.loads(line) for line in log_path.read_text().splitlines()] if log_path.exists() else []
    out = []
    for i, (fit_start, fit_end) in enumerate(fits):
        mine = [r for r in rows if r["stage"] == i]
        if not mine:
            out.append({"startup": float("nan"), "loop": float("nan"), "teardown": float("nan")})
            continue
        first, last = min(r["start"] for r in mine), max(r["end"] for r in mine)
        out.append({"startup": first - fit_start, "loop": last - first, "teardown": fit_end - last})
    return out


def run_candidate(config: Path, storage: Path, overrides: list[str] = ()) -> dict:
    """run_pipeline, with each stage's fit timed (wrappers around the names it calls)."""
    import cascade_ray.pipeline.fit as fit_mod
    import cascade_ray.pipeline.stages as stages_mod
    from cascade_ray.api import run_pipeline
    from cascade_ray.checks import load_config

    fits: list[tuple[float, float]] = []
    original_fit = stages_mod.fit_stage
    log_path = storage / "loop_times.jsonl"

    def timed_fit(*args, **kwargs):
        # fit_stage's `train_loop` default is bound when it is defined: pass the wrapped loop explicitly
        kwargs["train_loop"] = timed_loop(kwargs.get("train_loop", fit_mod.train_loop_per_worker), str(log_path))
        t0 = time.time()
        try:
            return original_fit(*args, **kwargs)
        finally:
            fits.append((t0, time.time()))

    cfg = load_config(config, [f"storage_path={storage}", *overrides])
    stages_mod.fit_stage = timed_fit
    try:
        t0 = time.perf_counter()
        summary = run_pipeline(cfg, log=lambda line: None)
        wall = time.perf_counter() - t0
    finally:
        stages_mod.fit_stage = original_fit
    stage_s = [s["wall_s"] for s in summary["stages"]]
    return {
        "wall": wall,
        "fits": [b - a for a, b in fits],
        "stages": stage_s,
        "phases": _phases(fits, log_path),
        "accuracy": summary["test_accuracy"],
    }


def run_baseline(config: Path, storage: Path, overrides: list[str] = ()) -> dict:
    from ray import cloudpickle

    import benchmarks.baselines.plain_chain as plain_chain
    from cascade_ray.checks import load_config

    cloudpickle.register_pickle_by_value(plain_chain)  # Ray workers need not find benchmarks/ on their path
    log_path = storage / "loop_times.jsonl"
    original_loop = plain_chain.train_stage
    cfg = load_config(config, [f"storage_path={storage}", *overrides])
    plain_chain.train_stage = timed_loop(original_loop, str(log_path))
    try:
        t0 = time.perf_counter()
        out = plain_chain.run_plain_chain(cfg, storage, log=lambda line: None)
        wall = time.perf_counter() - t0
    finally:
        plain_chain.train_stage = original_loop
    fits = [(s["fit_start"], s["fit_end"]) for s in out["stages"]]
    stage_s = [s["wall_s"] for s in out["stages"]]
    return {
        "wall": wall,
        "fits": [b - a for a, b in fits],
        "stages": stage_s,
        "phases": _phases(fits, log_path),
        "accuracy": out["test_accuracy"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each (alternating)")
    parser.add_argument(
        "--feature-cache",
        choices=["auto", "on", "off"],
        default="off",
        help="freeze.cache_features of every stage after the first (default off: the P2 target)",
    )
    args = parser.parse_args(argv)
    from cascade_ray.hardware import hardware_line

    print(hardware_line(), flush=True)  # first line: the hardware these figures come from

    os.environ.pop("RAY_ADDRESS", None)
    import ray

    from cascade_ray.checks import load_config
    from cascade_ray.constants import apply_ray_env_defaults

    cfg = load_config(args.config)
    cache = [f"stages[{i}].freeze.cache_features={args.feature_cache}" for i in range(1, len(cfg.stages))]
    # both sides in fp32: the plain loop has no autocast (precision auto would pick bf16 on a native-bf16 CPU)
    fp32 = [f"stages[{i}].solver.precision=fp32" for i in range(len(cfg.stages))]
    root = Path(tempfile.mkdtemp(prefix="bench-pipeline-")).resolve()
    env = apply_ray_env_defaults()
    t0 = time.perf_counter()
    ray.init(num_cpus=2, runtime_env={"env_vars": env}, log_to_driver=False, include_dashboard=False)
    init_s = time.perf_counter() - t0
    try:
        plan = ", ".join(
            f"{s.name} {s.model.type} {s.train.epochs} ep x {s.scaling.num_workers} worker(s)" for s in cfg.stages
        )
        print(
            f"bench_pipeline: {args.config.name} ({plan}); ray {ray.__version__}, ray.init(num_cpus=2) once ({init_s:.1f} s, not timed), "
            f"env {env}; cascade-ray feature cache {args.feature_cache}; precision fp32 on both sides; {args.repeats} runs "
            "each, alternating, medians",
            flush=True,
        )
        t0 = time.perf_counter()
        _warm_up()
        print(f"  warm-up no-op fit (not timed): {time.perf_counter() - t0:.1f} s", flush=True)
        runs: dict[str, list[dict]] = {"candidate": [], "baseline": []}
        for rep in range(args.repeats):
            order = ("candidate", "baseline") if rep % 2 == 0 else ("baseline", "candidate")
            for kind in order:
                storage = root / f"{rep}-{kind}"
                storage.mkdir()
                r = (
                    run_candidate(args.config, storage, [*cache, *fp32])
                    if kind == "candidate"
                    else run_baseline(args.config, storage, fp32)
                )
                runs[kind].append(r)
                print(
                    f"  repeat {rep + 1} {kind}: {r['wall']:.1f} s (stages {', '.join(f'{s:.1f}' for s in r['stages'])}; "
                    f"test accuracy {r['accuracy']:.3f})",
                    flush=True,
                )
        cand = statistics.median(r["wall"] for r in runs["candidate"])
        base = statistics.median(r["wall"] for r in runs["baseline"])
        print(f"plain chain (TorchTrainer + checkpoint dirs) wall time: {base:.1f} s (1.000 vs baseline)")
        print(f"run_pipeline wall time: {cand:.1f} s ({cand / base:.3f} vs baseline)")

        def med(kind: str, fn) -> float:
            return statistics.median(fn(r) for r in runs[kind])

        for i, stage in enumerate(cfg.stages):
            parts = []
            for kind, label in (("baseline", "plain"), ("candidate", "run_pipeline")):
                ph = {k: med(kind, lambda r, k=k, i=i: r["phases"][i][k]) for k in ("startup", "loop", "teardown")}
                after = med(kind, lambda r, i=i: r["stages"][i] - r["fits"][i])
                parts.append(
                    f"{label} fit {med(kind, lambda r, i=i: r['fits'][i]):.1f} s (start-up {ph['startup']:.1f}, loop {ph['loop']:.1f}, "
                    f"teardown {ph['teardown']:.1f}) + after fit {after:.2f} s"
                )
            print(f"  stage {stage.name}: " + "; ".join(parts))
        outside = [r["wall"] - sum(r["stages"]) for r in runs["candidate"]]
        b_outside = [r["wall"] - sum(r["stages"]) for r in runs["baseline"]]
        print(
            f"  outside the stages (data, checks, put; test evaluation, summary, reports): run_pipeline {statistics.median(outside):.2f} s, "
            f"plain chain {statistics.median(b_outside):.2f} s"
        )
        ratio = cand / base
        if args.feature_cache == "off":
            print(
                f"P2 target: run_pipeline wall time <= 1.0 x plain chain: {ratio:.3f} -> {'met' if ratio <= 1.0 else 'NOT met'}"
            )
        else:
            print(
                f"P2 with the feature cache {args.feature_cache}: run_pipeline / plain chain wall time {ratio:.3f} (the target is stated without the cache)"
            )
    finally:
        ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
