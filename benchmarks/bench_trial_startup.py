"""What a stage fit and a Tune trial pay before their first optimizer step, by phase.

    flock /tmp/cascade-cpu.lock .venv/bin/python benchmarks/bench_trial_startup.py [--trials 4]

One embedded Ray (``ray.init(num_cpus=2)``, as ``run_pipeline`` starts it) runs the debug
pipeline with its classifier stage swept (`--trials` trials, random search, FIFO, each trial a
few optimizer steps on the cached upstream features), then reads the start-up record every
fit wrote (``cascade_ray/stage/startup.py``): the pipeline stages' from ``summary.json``, the
trials' from their ``startup.json``. Then the same sweep batched (``--batched``: the `--trials`
configs as replicas of one fit, on a second run of the pipeline) and its one fit's record, the
start-up the whole sweep pays. Baseline in the same session: Ray's plain ``TorchTrainer``
fitting a no-op loop (1 worker, 2 CPUs), its ``fit()`` to loop-start time, the floor of any
Ray Train fit here. Prints the median of each phase and its ratio to that baseline.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SPACE = """
stage: classifier
metric: val_accuracy
num_samples: {trials}
evaluate_current: false
scheduler: {{type: fifo}}
space:
  solver.lr: {{loguniform: [1.0e-3, 3.0e-2]}}
"""


def noop(_config) -> float:
    return time.time()


def bare_fit_startup(storage: str, repeats: int = 3) -> float:
    """Median ``fit()`` -> loop start of Ray's own TorchTrainer on a no-op loop (after one warm fit)."""
    import ray.train
    from ray.train.torch import TorchTrainer

    times = []
    for i in range(repeats + 1):
        t0 = time.time()
        result = TorchTrainer(
            noop,
            scaling_config=ray.train.ScalingConfig(num_workers=1, resources_per_worker={"CPU": 2}),
            run_config=ray.train.RunConfig(name=f"bare-{i}", storage_path=storage),
        ).fit()
        if i:
            times.append(float(result.return_value) - t0)
    return statistics.median(times)


def sweep_startups(summary: dict) -> list[dict]:
    """The start-up records of the classifier sweep's fits (a trial each, or the one batched fit)."""
    from cascade_ray.tune.sweep import STARTUP_FILE

    folder = Path(summary["storage"]) / "tune" / "classifier" / "trials"
    return [json.loads(p.read_text()) for p in folder.glob(f"*/{STARTUP_FILE}")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=4, help="Tune trials of the classifier stage")
    args = parser.parse_args()
    from cascade_ray.hardware import hardware_line

    print(hardware_line(), flush=True)
    import ray

    from cascade_ray.api import RunOptions, run_pipeline
    from cascade_ray.checks import load_config
    from cascade_ray.constants import apply_ray_env_defaults
    from cascade_ray.pipeline.ray_token import ensure_private_token
    from cascade_ray.stage.startup import PHASES

    ensure_private_token()
    ray.init(num_cpus=2, runtime_env={"env_vars": apply_ray_env_defaults()})
    with tempfile.TemporaryDirectory() as tmp:
        bare = bare_fit_startup(str(Path(tmp) / "bare"))
        space = Path(tmp) / "space.yaml"
        space.write_text(SPACE.format(trials=args.trials))
        short = [f"stages[{i}].train.max_steps=5" for i in range(3)] + [f"stages[{i}].train.epochs=1" for i in range(3)]
        cfg = load_config(ROOT / "pipelines" / "configs" / "debug.yaml", [f"storage_path={tmp}", *short])
        summary = run_pipeline(cfg, RunOptions(spaces=(("classifier", str(space)),)), log=lambda _: None)
        stages = [s["startup"] for s in summary["stages"] if s.get("startup")]
        trials = sweep_startups(summary)
        cfg = load_config(ROOT / "pipelines" / "configs" / "debug.yaml", [f"storage_path={tmp}/b", *short])
        batched = run_pipeline(cfg, RunOptions(spaces=(("classifier", str(space)),), batched=True), log=lambda _: None)
        stages += [s["startup"] for s in batched["stages"] if s.get("startup")]
        one_fit = sweep_startups(batched)
    ray.shutdown()
    print(f"baseline: TorchTrainer no-op fit() -> loop start {bare:.2f} s (median of 3, 1 worker x 2 CPUs)")
    for label, records in (
        ("pipeline stage fits", stages),
        ("tune trials (classifier)", trials),
        (f"batched sweep (classifier, {args.trials} configs in one fit)", one_fit),
    ):
        records = [r for r in records if r and "to_first_step_s" in r]
        print(f"{label}: {len(records)}")
        for phase in (*PHASES, "to_first_step_s"):
            values = [r[phase] for r in records if phase in r]
            if values:
                med = statistics.median(values)
                print(
                    f"  {phase:16s} median {med:6.2f} s  (min {min(values):.2f}, max {max(values):.2f})  {med / bare:.2f}x baseline"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
