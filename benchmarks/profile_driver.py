"""Where the driver spends its time outside the stage fits: ``run_pipeline`` on a config, timed
piece by piece (monkeypatched timers around the driver's calls).

    /work/venv/bin/python benchmarks/profile_driver.py [--config pipelines/configs/debug.yaml] [--runs 2] [key=value ...]

One embedded Ray (``num_cpus=2``) for all runs; the first run pays one-time costs (imports,
data loading, Ray worker start), so read the last. Prints per run: total wall time, the
seconds inside each timed piece, and ``outside fits`` = total minus the ``fit_stage`` calls.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "pipelines" / "configs" / "debug.yaml")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    from cascade_ray.hardware import hardware_line

    print(hardware_line(), flush=True)  # first line: the hardware these figures come from
    os.environ.pop("RAY_ADDRESS", None)
    import ray

    import cascade_ray.pipeline.driver as driver
    import cascade_ray.pipeline.stages as stages
    import cascade_ray.stage.progress as progress
    from cascade_ray.checks import load_config
    from cascade_ray.constants import apply_ray_env_defaults

    seconds: dict[str, float] = {}

    def timed(name, fn):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - t0

        return wrapper

    for name in ("write_run_outputs", "evaluate_composed", "load_data"):
        setattr(driver, name, timed(name, getattr(driver, name)))
    progress.ProgressSession.start = classmethod(timed("progress.start", progress.ProgressSession.start.__func__))
    progress.ProgressSession.stop = timed("progress.stop", progress.ProgressSession.stop)
    stages.fit_stage = timed("fit_stage", stages.fit_stage)
    stages.StageSession.finish = timed("finish", stages.StageSession.finish)
    stages.StageSession.feature_cache = timed("feature_cache", stages.StageSession.feature_cache)

    ray.init(
        num_cpus=2, runtime_env={"env_vars": apply_ray_env_defaults()}, log_to_driver=False, include_dashboard=False
    )
    try:
        for run in range(args.runs):
            cfg = load_config(
                args.config, [f"storage_path={tempfile.mkdtemp(prefix='profile-driver-')}", *args.overrides]
            )
            seconds.clear()
            t0 = time.perf_counter()
            driver.run_pipeline(cfg, log=lambda _: None)
            total = time.perf_counter() - t0
            pieces = ", ".join(f"{k} {v:.2f}" for k, v in seconds.items())
            print(
                f"run {run + 1}: total {total:.2f} s; {pieces}; outside fits {total - seconds.get('fit_stage', 0.0):.2f} s",
                flush=True,
            )
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
