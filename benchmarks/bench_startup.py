"""Fixed cost of one stage fit: cascade-ray's ``StageTrainer`` vs Ray's ``TorchTrainer``.

    /work/venv/bin/python benchmarks/bench_startup.py [--repeats 4] [--workers 1]

Both fit the same no-op train loop (it returns the time it started), one worker with
2 CPUs by default, in one embedded Ray (``ray.init(num_cpus=2)``) with cascade-ray's Ray env
knobs in its ``runtime_env`` (as ``run_pipeline`` starts it). One untimed fit of each warms
the session; then the fits alternate (candidate, baseline, baseline, candidate, ...) and the
medians are reported. ``StageTrainer`` differs only in its controller callbacks
(``cascade_ray/pipeline/trainer.py``): no Ray Data ``DatasetManager`` actor when no datasets
are passed, and the placement-group cleaner's stop is not waited for.

Each fit is split into start-up (``fit()`` called until the loop starts) and teardown (loop
returned until ``fit()`` returns). A check at the end: no placement group of these fits is
left and no ``PlacementGroupCleaner`` actor is alive (the cleaner still stops).
Prints ``figure: value (ratio vs baseline)``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def noop(_config) -> float:
    return time.time()


def one_fit(cls, workers: int, storage: str, name: str) -> tuple[float, float, float]:
    import ray.train

    t0 = time.time()
    result = cls(
        noop,
        scaling_config=ray.train.ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 2 / workers}),
        run_config=ray.train.RunConfig(name=name, storage_path=storage),
    ).fit()
    t1 = time.time()
    started = float(result.return_value)
    return t1 - t0, started - t0, t1 - started


def leftovers(wait_s: float = 10.0) -> tuple[int, int]:
    """(placement groups still CREATED, PlacementGroupCleaner actors still ALIVE), after up to `wait_s`."""
    from ray.util.state import list_actors, list_placement_groups

    deadline = time.time() + wait_s
    while True:
        pgs = len(list_placement_groups(filters=[("state", "=", "CREATED")], raise_on_missing_output=False))
        cleaners = sum(
            a.class_name == "PlacementGroupCleaner"
            for a in list_actors(filters=[("state", "=", "ALIVE")], raise_on_missing_output=False)
        )
        if (pgs == 0 and cleaners == 0) or time.time() > deadline:
            return pgs, cleaners
        time.sleep(0.5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=4, help="timed fits of each trainer (alternating)")
    parser.add_argument("--workers", type=int, default=1, help="workers per fit (2 CPUs shared among them)")
    args = parser.parse_args()
    from cascade_ray.hardware import hardware_line

    print(hardware_line(), flush=True)  # first line: the hardware these figures come from

    import ray
    from ray.train.torch import TorchTrainer

    from cascade_ray.constants import apply_ray_env_defaults
    from cascade_ray.pipeline.trainer import StageTrainer

    env = apply_ray_env_defaults()
    ray.init(num_cpus=2, runtime_env={"env_vars": env}, log_to_driver=False, logging_level="ERROR")
    storage = tempfile.mkdtemp(prefix="bench-startup-")
    print(
        f"bench_startup: no-op fit, {args.workers} worker(s) x {2 / args.workers:g} CPU; ray {ray.__version__}, ray.init(num_cpus=2), env {env}; {args.repeats} fits each, alternating, after 1 untimed fit each; medians",
        flush=True,
    )
    kinds = {"TorchTrainer": TorchTrainer, "StageTrainer": StageTrainer}
    runs: dict[str, list[tuple[float, float, float]]] = {k: [] for k in kinds}
    try:
        for name, cls in kinds.items():
            one_fit(cls, args.workers, storage, f"warmup-{name}")
        order = []
        for r in range(args.repeats):
            pair = ["StageTrainer", "TorchTrainer"] if r % 2 == 0 else ["TorchTrainer", "StageTrainer"]
            order += pair
        for i, name in enumerate(order):
            total, start, tear = one_fit(kinds[name], args.workers, storage, f"fit-{i}-{name}")
            runs[name].append((total, start, tear))
            print(f"  fit {i + 1} {name}: {total:.2f} s (start-up {start:.2f}, teardown {tear:.2f})", flush=True)
        pgs, cleaners = leftovers()
    finally:
        ray.shutdown()
        shutil.rmtree(storage, ignore_errors=True)

    med = {k: [statistics.median(x[j] for x in v) for j in range(3)] for k, v in runs.items()}
    base, cand = med["TorchTrainer"], med["StageTrainer"]
    print(f"after all fits: {pgs} placement group(s) left, {cleaners} PlacementGroupCleaner actor(s) alive")
    for j, what in enumerate(
        ["fit wall time", "start-up (fit() -> loop starts)", "teardown (loop returns -> fit() returns)"]
    ):
        print(f"TorchTrainer {what}: {base[j]:.2f} s (1.000 vs baseline)")
        print(
            f"StageTrainer {what}: {cand[j]:.2f} s ({cand[j] / base[j]:.3f} vs baseline; {base[j] - cand[j]:+.2f} s saved)"
        )
    return 0 if pgs == 0 and cleaners == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
