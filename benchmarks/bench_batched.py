"""Batched sweep vs Tune trials: a cascade's classifier swept over 16 configs.

    flock /tmp/cascade-cpu.lock /work/main/.venv/bin/python benchmarks/bench_batched.py [--configs 16] [--repeats 2] [--config PATH]

Workload: ``--config`` (default ``pipelines/configs/debug.yaml``, digits; the demo is
``pipelines/configs/three_stage.yaml``, Fashion-MNIST), the shipped ``tune_spaces/classifier.yaml``
space (lr and weight decay, random search, FIFO) with ``num_samples`` raised to `--configs`, on top
of features/encoder artifacts trained once beforehand (not timed; reused with ``resume``). Embedded
``ray.init(num_cpus=2)``, started once, not timed. Three ways, each a ``run_pipeline(...,
stop_after="classifier")`` call; the figure is the classifier's record ``wall_s`` (the sweep from
its feature-cache read to the adopted artifact), the whole call in parentheses:

1. **batched**: ``RunOptions(batched=True)``: every config in one TorchTrainer job (1 worker x 1 CPU).
2. **Tune trials**: the same space as a plain sweep: one TorchTrainer per trial, 2 at once on 2 CPUs.
3. **one trial**: the plain sweep with ``num_samples: 1`` (the stage's current values only).

Before any timed call, one untimed one-trial sweep computes and stores the classifier's feature
cache, so every timed call reads the same stored cache (without it the first timed call, the
batched one, also paid for computing it).

After the batched line, ``job:``: the batched job's seconds before its first step and each
epoch's training rate (replica-samples/s), so a run shows which of the two moved.

Last line: whether both ways sampled the same configs, and how far apart each config's
``val_accuracy`` is between its replica and its trial. Order: batched, one trial, Tune trials, then batched and one trial again per extra repeat
(the Tune trials run once: they take minutes); medians are reported.
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

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "pipelines" / "configs" / "debug.yaml"
SPACE = ROOT / "tune_spaces" / "classifier.yaml"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--config", type=Path, default=CONFIG, help="the cascade whose classifier is swept")
    args = parser.parse_args(argv)
    from cascade_ray.hardware import hardware_line

    print(hardware_line(), flush=True)  # first line: the hardware these figures come from
    os.environ.pop("RAY_ADDRESS", None)
    import pyarrow.parquet as pq
    import ray
    import yaml

    from cascade_ray.api import RunOptions, run_pipeline
    from cascade_ray.checks import load_config
    from cascade_ray.constants import apply_ray_env_defaults

    root = Path(tempfile.mkdtemp(prefix="bench-batched-")).resolve()
    spaces = {}
    for name, samples in (("many", args.configs), ("one", 1)):
        space = yaml.safe_load(SPACE.read_text()) | {"num_samples": samples, "scheduler": {"type": "fifo"}}
        spaces[name] = root / f"classifier-{name}.yaml"
        spaces[name].write_text(yaml.safe_dump(space))
    cfg = load_config(args.config, [f"storage_path={root}"])
    ray.init(
        num_cpus=2, runtime_env={"env_vars": apply_ray_env_defaults()}, log_to_driver=False, include_dashboard=False
    )
    times: dict[str, list[tuple[float, float]]] = {"batched": [], "tune": [], "one": []}
    tables: dict[str, dict[tuple, float]] = {}  # config values -> val_accuracy, per way

    def sweep(kind: str, timed: bool = True) -> None:
        shutil.rmtree(root / cfg.name / "tune", ignore_errors=True)  # a plain sweep with resume would restore it
        space = spaces["one" if kind == "one" else "many"]
        options = RunOptions(
            spaces=(("classifier", str(space)),), stop_after="classifier", resume=True, batched=kind == "batched"
        )
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            summary = run_pipeline(cfg, options, log=lambda _: None)
        call = time.perf_counter() - t0
        record = summary["stages"][2]
        assert record["status"] == "tuned" and record["sweep"]["trials"] == (1 if kind == "one" else args.configs)
        assert [s["status"] for s in summary["stages"][:2]] == ["reused", "reused"]
        if not timed:
            print(f"  feature cache computed and stored by an untimed one-trial sweep ({call:.1f} s)", flush=True)
            return
        times[kind].append((record["wall_s"], call))
        rows = pq.read_table(record["sweep"]["results"]).to_pylist()
        tables[kind] = {
            tuple(v for k, v in sorted(r.items()) if k.startswith("config/")): r["val_accuracy"] for r in rows
        }
        print(
            f"  {kind}: sweep {record['wall_s']:.1f} s (call {call:.1f} s), best val_accuracy "
            f"{record['metrics']['val_accuracy']:.4f}, feature cache {(record.get('feature_cache') or {}).get('status')}",
            flush=True,
        )
        if kind == "batched":  # where the one job's time went: its start-up, then each epoch's rate
            print(f"    {_batched_split(Path(record['sweep']['results']).parent)}", flush=True)

    try:
        t0 = time.perf_counter()
        run_pipeline(cfg, RunOptions(stop_after="encoder"), log=lambda _: None)
        print(
            f"{args.configs}-config sweep of classifier ({SPACE.name} space, FIFO) on {args.config.name}; upstream trained "
            f"in {time.perf_counter() - t0:.1f} s (not timed); ray {ray.__version__}; 2 CPUs",
            flush=True,
        )
        sweep("one", timed=False)  # the feature cache, stored once before anything is timed
        for rep in range(args.repeats):
            for kind in ("batched", "one", "tune") if rep == 0 else ("batched", "one"):
                sweep(kind)
    finally:
        ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(t for t, _ in v) for k, v in times.items()}
    call = {k: statistics.median(c for _, c in v) for k, v in times.items()}
    n = args.configs
    print(f"{n} configs as Tune trials: {med['tune']:.1f} s (call {call['tune']:.1f} s) (1.000 vs baseline)")
    print(
        f"{n} configs batched: {med['batched']:.1f} s (call {call['batched']:.1f} s) ({med['tune'] / med['batched']:.2f}x faster)"
    )
    print(f"one Tune trial: {med['one']:.1f} s (call {call['one']:.1f} s)")
    print(f"{n} configs batched vs one Tune trial: {med['batched'] / med['one']:.2f}x the wall time")
    same = tables["batched"].keys() == tables["tune"].keys()
    gap = max((abs(tables["batched"][k] - tables["tune"][k]) for k in tables["tune"]), default=0.0) if same else None
    print(
        f"same {len(tables['tune'])} configs sampled both ways: {same}; largest val_accuracy difference per config: "
        + (f"{gap:.4g}" if gap is not None else "n/a")
    )
    if same:
        for k, v in tables["tune"].items():
            if tables["batched"][k] != v:
                print(f"  differs: config {k}: batched {tables['batched'][k]:.4f}, Tune trial {v:.4f}")
    return 0


def _batched_split(exp_dir: Path) -> str:
    """The batched job's start-up before its first step (``startup.json``) and each epoch's training
    rate as the job recorded it (``replicas.json``: samples x live replicas per second of the epoch's
    training loop, evaluation excluded)."""
    import json

    (startup,) = [json.loads(p.read_text()) for p in exp_dir.glob("trials/*/startup.json")]
    history = json.loads((exp_dir / "replicas.json").read_text())[0]["history"]
    rates = ", ".join(f"{h['samples_per_s']:.0f}" for h in history)
    return f"job: {startup['to_first_step_s']:.1f} s to its first step; epochs' training at {rates} replica-samples/s"


if __name__ == "__main__":
    sys.exit(main())
