"""What a batched sweep's per-epoch resume state costs: the batched loop with and without it.

    flock /tmp/cascade-cpu.lock /work/main/.venv/bin/python benchmarks/bench_batched_resume.py \
        [--config pipelines/configs/debug.yaml] [--configs 16] [--epochs 3] [--repeats 3]

Workload: the config's last stage (the classifier) as a batched sweep of `--configs` replicas
(lr spread log-uniformly over 1e-3..1e-1, everything else the stage's own), trained by
``cascade_ray.stage.batched.run_batched`` in this process (no Ray) on the features of a
randomly initialised upstream (how the weights were trained does not change what a step or a
save costs). Two ways, alternating (without, with, with, without, ...), after one unmeasured
warm-up of each:

- **baseline**: ``run_batched`` without a resume state (``save=None``);
- **candidate**: ``run_batched`` with the ``ResumeWriter`` a batched job's rank 0 uses, writing
  every replica's state after each epoch to a local temporary folder.

Printed: the median wall time of each way and their ratio, the state file's size, and the
median time of one save (each save timed inside the candidate's runs). Both ways must end with
the same weights (checked: the benchmark fails otherwise).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "pipelines" / "configs" / "debug.yaml"))
    parser.add_argument("--configs", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    from cascade_ray.hardware import hardware_line

    print(hardware_line(), flush=True)  # first line: the hardware these figures come from
    import torch
    from common import last_stage_replicas, timed_batched

    from cascade_ray.stage.batched_resume import ResumeWriter, read_resume

    cfg, index, data, upstream, features, cfgs, built_s = last_stage_replicas(args.config, args.configs, args.epochs)
    name = cfg.stages[index].name
    print(
        f"bench_batched_resume: {args.config}, stage {name!r}: {args.configs} replicas, {args.epochs} epochs, "
        f"{len(data.y_train)} training rows; upstream features computed in {built_s:.1f} s "
        f"(not timed); torch {torch.__version__}, {torch.get_num_threads()} threads; {args.repeats} repeats, medians",
        flush=True,
    )
    folder = Path(tempfile.mkdtemp(prefix="bench-batched-resume-"))
    save_times: list[float] = []

    def run(with_state: bool):
        save = None
        if with_state:
            writer = ResumeWriter(folder, "bench")

            def save(epochs_done, states):
                t = time.perf_counter()
                writer.save(epochs_done, states)
                save_times.append(time.perf_counter() - t)

        return timed_batched(cfgs, index, data, upstream, features, save=save)

    run(False)  # warm-ups, not measured
    run(True)
    save_times.clear()
    walls: dict[bool, list[float]] = {False: [], True: []}
    finals = {}
    for r in range(args.repeats):
        for with_state in (False, True) if r % 2 == 0 else (True, False):
            wall, reporter = run(with_state)
            walls[with_state].append(wall)
            finals[with_state] = reporter
            print(f"  {'with' if with_state else 'without'} resume state: {wall:.2f} s", flush=True)
    a, b = finals[False].last_state, finals[True].last_state
    if a.keys() != b.keys() or any(not torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])) for k in a):
        print("FAILED: the two ways ended with different weights", flush=True)
        return 1
    size = len(read_resume(folder).blob)  # the same tensors every epoch: one size, read after the timing
    base, cand = statistics.median(walls[False]), statistics.median(walls[True])
    print(
        f"without resume state: {base:.2f} s (1.000 vs baseline; runs {min(walls[False]):.2f}..{max(walls[False]):.2f})"
    )
    print(
        f"with resume state: {cand:.2f} s ({cand / base:.3f}x the baseline's wall time; "
        f"runs {min(walls[True]):.2f}..{max(walls[True]):.2f})"
    )
    print(
        f"one save (every replica after an epoch): {statistics.median(save_times) * 1e3:.1f} ms median "
        f"({len(save_times)} saves), state file {size / 2**20:.2f} MiB; both ways' weights identical"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
