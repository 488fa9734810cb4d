"""The same batched-sweep epochs in one process, in a Ray task and in a Ray Train worker.

    flock /tmp/cascade-cpu.lock .venv/bin/python benchmarks/bench_batched_where.py [--config pipelines/configs/three_stage.yaml] [--configs 16] [--epochs 2] [--group-size G]

Workload: ``run_batched`` of the config's last stage as `--configs` replicas (the demo's
classifier by default; ``common.last_stage_replicas``: a randomly initialised upstream's cached
features, lr log-spaced), `--epochs` epochs, the in-process reporter, no progress board, resume
writer or trackers: only where it runs changes. Places, in this order:

1. **process** (the baseline): this process's main thread, before Ray starts;
2. **process, Ray up**: the same, after ``ray.init`` (Ray's own processes now share the CPUs);
3. **Ray task** (``num_cpus=2``): a worker process's main thread;
4. **Ray Train worker** (a ``TorchTrainer``, 1 worker x 2 CPUs): Ray's training thread.

Each place gets the inputs through the object store (``ray.put`` once) and calls
``torch.set_num_threads(2)``; embedded ``ray.init(num_cpus=2)`` with cascade-ray's Ray env defaults.
Prints each epoch's training rate (replica-samples/s, as the job's ``replicas.json`` records it)
and each place's median against the process's; then, around each place's call, the wall time, the
CPU time of the process that ran it, the CPU time of every other process on the machine and the
time the hypervisor stole (``/proc/stat``), and the process's minor page faults and context
switches: what else ran, and what the epochs paid for, while they trained.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def usage() -> dict[str, float]:
    """This process's CPU seconds, minor page faults and context switches, and the whole machine's
    busy and stolen CPU seconds (``/proc/stat``), for the deltas around the epochs."""
    import os
    import resource
    import time

    r = resource.getrusage(resource.RUSAGE_SELF)
    # /proc/stat's first line: user nice system idle iowait irq softirq steal ... (clock ticks)
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    hz = os.sysconf("SC_CLK_TCK")
    return {
        "wall_s": time.perf_counter(),
        "cpu_s": r.ru_utime + r.ru_stime,
        "minflt": r.ru_minflt,
        "nvcsw": r.ru_nvcsw,
        "nivcsw": r.ru_nivcsw,
        "busy_s": (sum(ticks[:3]) + ticks[5] + ticks[6]) / hz,
        "steal_s": ticks[7] / hz,
    }


def epochs(payload: tuple, group_size: int | None) -> dict:
    """Each epoch's training rate of one ``run_batched`` call, in this process, and what the call
    cost around it (:func:`usage` deltas)."""
    import torch
    from common import ListReporter

    from cascade_ray.stage.batched import run_batched

    torch.set_num_threads(2)
    cfgs, index, data, upstream, features = payload
    extra = {"group_size": group_size} if group_size is not None else {}
    before = usage()
    with contextlib.redirect_stdout(io.StringIO()):
        out = run_batched(
            cfgs,
            index,
            data,
            upstream,
            features,
            ListReporter(),
            torch.device("cpu"),
            metric="val_accuracy",
            mode="max",
            **extra,
        )
    after = usage()
    return {"rates": [h["samples_per_s"] for h in out.histories[0]]} | {k: after[k] - before[k] for k in before}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "pipelines" / "configs" / "three_stage.yaml"))
    parser.add_argument("--configs", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=None, help="stage/grouped.py's default when not given")
    args = parser.parse_args(argv)
    from cascade_ray.hardware import hardware_line

    print(hardware_line(), flush=True)  # first line: the hardware these figures come from
    import ray
    import torch
    from common import in_train_worker, last_stage_replicas, ship_by_value

    from cascade_ray.constants import apply_ray_env_defaults

    _, index, data, upstream, features, cfgs, _ = last_stage_replicas(args.config, args.configs, args.epochs)
    payload = (cfgs, index, data, upstream, features)
    runs: dict[str, dict] = {"process": epochs(payload, args.group_size)}
    ray.init(
        num_cpus=2,
        runtime_env={"env_vars": apply_ray_env_defaults()},
        log_to_driver=False,
        include_dashboard=False,
    )
    try:
        ship_by_value()
        ref = ray.put(payload)
        runs["process, Ray up"] = epochs(ray.get(ref), args.group_size)
        runs["Ray task"] = ray.get(ray.remote(num_cpus=2)(epochs).remote(ref, args.group_size))
        runs["Ray Train worker"] = in_train_worker(lambda: epochs(ray.get(ref), args.group_size))
    finally:
        ray.shutdown()
    print(
        f"bench_batched_where: stage {cfgs[0].stages[index].name!r} of {args.config}, {args.configs} replicas, "
        f"{args.epochs} epochs of {len(data.y_train)} rows, group size {args.group_size or 'default'}; "
        f"torch {torch.__version__}, ray {ray.__version__}"
    )
    base = statistics.median(runs["process"]["rates"])
    for place, run in runs.items():
        med = statistics.median(run["rates"])
        each = ", ".join(f"{r:.0f}" for r in run["rates"])
        print(f"{place}: epochs at {each} replica-samples/s; median {med:.0f} ({med / base:.2f}x the process's)")
    print("around each place's run_batched call: this process's CPU and the rest of the machine's, in seconds")
    for place, run in runs.items():
        print(
            f"  {place}: wall {run['wall_s']:.1f}, CPU {run['cpu_s']:.1f} ({run['cpu_s'] / run['wall_s']:.2f} cores); "
            f"other processes {run['busy_s'] - run['cpu_s']:.1f}, stolen {run['steal_s']:.1f}; "
            f"{run['minflt']:.0f} minor faults, {run['nivcsw']:.0f} involuntary / {run['nvcsw']:.0f} voluntary switches"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
