"""Pieces the benchmark scripts share (they run as scripts: ``benchmarks/`` is on sys.path)."""

from __future__ import annotations


class ListReporter:
    """Minimal single-rank Reporter for in-process ``run_stage`` calls: keeps the metrics and a
    reference to the last reported state (the idea of tests/support/fakes.ListReporter, without
    checkpoint copies)."""

    rank, world = 0, 1

    def __init__(self) -> None:
        self.reports: list[dict] = []
        self.last_state: dict | None = None

    def all_sum(self, values):
        return list(values)

    def report(self, metrics, state, trainer=None, frozen=None):
        self.reports.append(dict(metrics))
        if state is not None:
            self.last_state = state


def last_stage_replicas(config: str, configs: int, epochs: int):
    """The config's last stage as a batched sweep's inputs, built in this process: (cfg with the
    stage's epochs set, stage index, data, upstream state, cached features, `configs` replica
    configs with lr log-spaced over 1e-3..1e-1, seconds spent building the upstream and its
    features). The upstream is randomly initialised: how its weights were trained does not
    change what a step of the stage costs."""
    import time

    import numpy as np

    from cascade_ray.checks import load_config
    from cascade_ray.data.source import load_data
    from cascade_ray.pipeline.features import upstream_outputs
    from cascade_ray.stage.setup import build_stage_model
    from cascade_ray.tune.sweep import trial_config

    probe = load_config(config)
    index = len(probe.stages) - 1
    name = probe.stages[index].name
    cfg = load_config(config, [f"stages.{name}.train.epochs={epochs}"])
    data = load_data(cfg.data, cfg.seed)
    started = time.perf_counter()
    model, _ = build_stage_model(cfg, index - 1, data, None)
    upstream = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    out = upstream_outputs(cfg, index, data, upstream)
    features = {"x_train": out["train"], "x_val": out["val"]}
    cfgs = [trial_config(cfg, name, {"solver.lr": float(lr)}) for lr in np.logspace(-3, -1, configs)]
    return cfg, index, data, upstream, features, cfgs, time.perf_counter() - started


def timed_batched(cfgs, index, data, upstream, features, save=None, group_size=None, upstream_digests=None):
    """``run_batched`` of `cfgs` on the CPU, its replicas' progress lines silenced:
    (wall seconds, the ListReporter that got its one report). `group_size`: replicas per grouped step
    (``stage/grouped.py``; None: its default, 1: every replica steps alone); `upstream_digests`: the
    upstream's tensor digests, as the driver's hand-off gives them to the batched job."""
    import contextlib
    import io
    import time

    import torch

    from cascade_ray.stage.batched import run_batched

    reporter = ListReporter()
    started = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        run_batched(
            cfgs,
            index,
            data,
            upstream,
            features,
            reporter,
            torch.device("cpu"),
            metric="val_accuracy",
            mode="max",
            save=save,
            upstream_digests=upstream_digests,
            **({"group_size": group_size} if group_size is not None else {}),
        )
    return time.perf_counter() - started, reporter


def ship_by_value() -> None:
    """Let Ray workers run this module's functions and classes: pickled by value, since the
    workers do not have ``benchmarks/`` on their path. Call once after ``ray.init``."""
    import sys

    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def in_train_worker(fn, *args, cpus: int = 2):
    """``fn(*args)`` in the training thread of a one-worker ``TorchTrainer`` (1 worker x `cpus`
    CPUs); its JSON-able return value, handed back through a file (driver and worker share a host)."""
    import json
    import tempfile
    from pathlib import Path

    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    def loop(config: dict) -> None:
        Path(config["out"]).write_text(json.dumps(config["fn"](*config["args"])))

    with tempfile.TemporaryDirectory(prefix="bench-train-worker-") as storage:
        out = Path(storage) / "out.json"
        TorchTrainer(
            loop,
            train_loop_config={"fn": fn, "args": args, "out": str(out)},
            scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": cpus}),
            run_config=RunConfig(storage_path=storage, name="bench-train-worker"),
        ).fit()
        return json.loads(out.read_text())
