"""Overhead of the runtime health monitor: step time with every rule on vs off, same process.

    /work/venv/bin/python benchmarks/bench_health.py [--repeats 7] [--epochs 4] [--config pipelines/configs/debug.yaml]

Runs ``run_stage`` in-process (no Ray) on the digits data for stage 0 (a ResNet trained
from scratch) and stage 1 (a Transformer on the frozen ResNet, so the per-epoch frozen
digest is included). Variants run interleaved, ``--repeats`` times each, the best taken:

- baseline: every health rule ``off`` (no measurements, no checks);
- monitor on: the defaults (rules measured every ``health.interval`` = 10 optimizer steps);
- monitor on, interval 1: every step measured (the cost ``interval`` saves);
- monitor on + clipping: grad-norm clipping on, whose norm the monitor reuses; its baseline
  is clipping with the monitor off.

A second figure attributes the cost directly: the CPU time spent inside the monitor's
calls, as a ratio of the run with and without it (far less noisy than two separate runs).

Prints one line per figure: ``figure: value (ratio vs baseline)``. Step time is the mean
CPU time from one optimizer step to the next within an epoch (every per-step and
per-measurement cost, no evaluation); stage time is the CPU time of the whole
``run_stage`` call (sanity and epoch evaluation, frozen digests included). CPU time of a
single torch thread, so a busy shared machine disturbs the figures far less than wall time.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ListReporter

ROOT = Path(__file__).resolve().parents[1]
RULES = ("nonfinite", "grad_flow", "stall", "clip_saturation", "scale_collapse", "lr_drift", "frozen_drift")


class _MonitorClock:
    """Accumulates the CPU time spent inside HealthMonitor's loop calls (direct attribution)."""

    METHODS = ("start_epoch", "before_step", "after_step", "end_epoch")

    def __init__(self):
        self.seconds = 0.0

    @contextlib.contextmanager
    def installed(self):
        from cascade_ray.stage.monitor import HealthMonitor

        originals = {m: getattr(HealthMonitor, m) for m in self.METHODS}

        def timed(fn):
            def wrapper(*args, **kwargs):
                t0 = time.process_time()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.seconds += time.process_time() - t0

            return wrapper

        for m, fn in originals.items():
            setattr(HealthMonitor, m, timed(fn))
        try:
            yield self
        finally:
            for m, fn in originals.items():
                setattr(HealthMonitor, m, fn)


def _run(config: Path, index: int, overrides: list[str], data, upstream) -> tuple[float, float]:
    """(CPU seconds per optimizer step inside the training loop, CPU seconds of the whole run_stage)."""
    from cascade_ray.checks import load_config
    from cascade_ray.stage.hooks import LoopHooks
    from cascade_ray.stage.loop import run_stage

    cfg = load_config(config, overrides)
    marks: list[tuple[int, float]] = []
    hooks = LoopHooks(after_optimizer_step=lambda s: marks.append((s.epoch, time.process_time())))
    started = time.process_time()
    with contextlib.redirect_stdout(io.StringIO()):
        run_stage(cfg, index, data, upstream, ListReporter(), torch.device("cpu"), hooks=hooks)
    stage_s = time.process_time() - started
    # step to step within an epoch: every per-step and per-measurement cost, no evaluation
    gaps = [b - a for (ea, a), (eb, b) in zip(marks, marks[1:]) if ea == eb]
    return sum(gaps) / len(gaps), stage_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "pipelines" / "configs" / "debug.yaml")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args(argv)
    from cascade_ray.hardware import hardware_line

    print(hardware_line(), flush=True)  # first line: the hardware these figures come from
    torch.set_num_threads(1)

    from cascade_ray.checks import load_config
    from cascade_ray.data.source import load_data
    from cascade_ray.models.weights import to_numpy_state
    from cascade_ray.stage.setup import build_stage_model

    base_cfg = load_config(args.config)
    data = load_data(base_cfg.data, base_cfg.seed)
    upstream0 = to_numpy_state(build_stage_model(base_cfg, 0, data, None)[0].state_dict())
    print(
        f"bench_health: {args.config.name}, data {data.source} ({len(data.y_train)} train), {args.epochs} epochs per run, "
        f"{args.repeats} interleaved repeats (best of), torch {torch.__version__}, 1 thread, cpu"
    )
    worst = 0.0
    for index in (0, 1):
        s = f"stages[{index}]"
        common = [f"{s}.train.epochs={args.epochs}"]
        off = [f"{s}.health.{rule}.policy=off" for rule in RULES]
        clip = [f"{s}.solver.grad_clip={{enabled: true, max_norm: 10.0}}"]
        variants = {
            "monitor off": common + off,
            "monitor on (interval 10)": common,
            "monitor on, interval 1": common + [f"{s}.health.interval=1"],
            "clipping, monitor off": common + off + clip,
            "clipping, monitor on (reuses its norm)": common + clip,
        }
        upstream = upstream0 if index == 1 else None
        _run(args.config, index, variants["monitor on (interval 10)"], data, upstream)  # warm-up
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
        for _ in range(args.repeats):
            for name, overrides in variants.items():
                times[name].append(_run(args.config, index, overrides, data, upstream))
        # best of the repeats: the run least disturbed by other processes (equal work in every run)
        med = {k: (min(t[0] for t in v), min(t[1] for t in v)) for k, v in times.items()}
        stage = base_cfg.stages[index].name
        for name, (step_s, _wall_s) in med.items():
            base = med["clipping, monitor off"] if name.startswith("clipping") else med["monitor off"]
            print(f"{stage} step CPU time, {name}: {step_s * 1e3:.3f} ms ({step_s / base[0]:.3f} vs baseline)")
            if not name.endswith("interval 1"):  # the defaults only
                worst = max(worst, step_s / base[0])
        for name in ("monitor off", "monitor on (interval 10)"):
            print(
                f"{stage} stage CPU time, {name}: {med[name][1]:.3f} s ({med[name][1] / med['monitor off'][1]:.3f} vs baseline)"
            )
        # direct attribution, insensitive to run-to-run noise: time inside the monitor's calls
        shares = []
        for _ in range(args.repeats):
            with _MonitorClock().installed() as clock:
                _, stage_s = _run(args.config, index, variants["monitor on (interval 10)"], data, upstream)
            shares.append((stage_s, clock.seconds))
        stage_s, monitor_s = min(shares)
        print(
            f"{stage} stage CPU time inside the monitor (interval 10): {monitor_s * 1e3:.1f} ms of {stage_s:.3f} s "
            f"({stage_s / (stage_s - monitor_s):.3f} vs the same run without it)"
        )
    print(f"worst default-monitor step-time ratio: {worst:.3f} (target <= 1.03)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
