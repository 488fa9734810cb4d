"""``cascade-ray diagnose``: run one stage in-process for a few optimizer steps and report.

It answers the manual checklist of a run that "trains" but does not learn: the solver
as loaded, the optimizer actually built (groups, lr, weight decay, parameter counts),
the lr plan, gradient flow and parameter updates per module, the fp16 scaler, and a
verdict from the health rules. No Ray: the real ``run_stage`` runs with hooks that
record and stop it, so the model, groups, loss and precision are those of
:func:`~cascade_ray.stage.setup.setup_stage`, as in every run. For the verdict to mean something in a few steps, the rules
measure every step, their patience is capped at half the steps, and every rule that
is not ``off`` warns instead of raising, so all alarms are listed.

    cascade-ray diagnose pipelines/configs/debug.yaml --stage encoder --steps 20
"""

from __future__ import annotations

import contextlib
import io
import math
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cascade_ray.config.schema import PipelineConfig
from cascade_ray.data import DataSplits
from cascade_ray.errors import CascadeError
from cascade_ray.stage.hooks import LoopHooks, LoopState, chain_hooks

_RULES = ("nonfinite", "grad_flow", "stall", "clip_saturation", "scale_collapse", "lr_drift", "frozen_drift")


class _Stop(Exception):
    """Raised by the recorder once enough optimizer steps have run."""


def diagnose_config(cfg: PipelineConfig, index: int, steps: int) -> PipelineConfig:
    """The config diagnose runs: measure every step, patience within `steps`, warn instead of raise."""
    from cascade_ray.checks import validate_config

    raw = cfg.model_dump(mode="json")
    health = raw["stages"][index]["health"]
    health["interval"] = 1
    for rule in ("stall", "clip_saturation"):
        health[rule]["patience_steps"] = min(health[rule]["patience_steps"], max(1, steps // 2))
    for rule in _RULES:
        if health[rule]["policy"] == "error":
            health[rule]["policy"] = "warn"
    return validate_config(raw, source="diagnose", preflight=False)


class _Recorder:
    """Hooks that tabulate gradients (first step) and updates (over the run) per module."""

    def __init__(self, steps: int):
        self.steps, self.state = steps, None
        self.grads: list[dict[str, Any]] = []
        self.start: dict[str, torch.Tensor] = {}

    def setup(self, state: LoopState) -> None:
        self.state = state
        self.start = {n: p.detach().clone() for n, p in state.named_params}

    def before_step(self, state: LoopState) -> None:
        if state.step == 0:
            self.grads = _grad_table(state.named_params)

    def after_step(self, state: LoopState) -> None:
        if state.step >= self.steps:
            raise _Stop

    def hooks(self) -> LoopHooks:
        return LoopHooks(
            on_setup=self.setup, before_optimizer_step=self.before_step, after_optimizer_step=self.after_step
        )


def _module(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else name


def _grad_table(named: list[tuple[str, torch.nn.Parameter]]) -> list[dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = defaultdict(
        lambda: {"params": 0, "sq": 0.0, "none": 0, "zero": 0, "nonfinite": 0}
    )
    for name, p in named:
        row = rows[_module(name)]
        row["params"] += p.numel()
        if p.grad is None:
            row["none"] += 1
            continue
        g = p.grad.detach().float()
        row["nonfinite"] += int(not bool(torch.isfinite(g).all()))
        row["zero"] += int(not bool(g.any()))
        row["sq"] += float(g.pow(2).sum())
    return [
        {
            "module": m,
            "params": r["params"],
            "grad_norm": math.sqrt(r["sq"]),
            "none": r["none"],
            "zero": r["zero"],
            "nonfinite": r["nonfinite"],
        }
        for m, r in rows.items()
    ]


def _update_table(
    named: list[tuple[str, torch.nn.Parameter]], start: Mapping[str, torch.Tensor]
) -> list[dict[str, Any]]:
    rows: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for name, p in named:
        row = rows[_module(name)]
        row[0] += float((p.detach().float() - start[name].float()).pow(2).sum())
        row[1] += float(start[name].float().pow(2).sum())
    return [
        {"module": m, "update_ratio": math.sqrt(d) / math.sqrt(s) if s > 0 else math.inf} for m, (d, s) in rows.items()
    ]


def _cached_inputs(
    cfg: PipelineConfig, index: int, data: DataSplits, upstream: Mapping[str, np.ndarray] | None, steps: int
) -> tuple[Any, Any, str]:
    """(upstream, features, note): the stage trains on cached upstream outputs here exactly when
    the pipeline would (``freeze.cache_features``), so steps and profiles match a real run.

    Only the training samples of the first `steps` optimizer steps (and every validation
    sample) are computed; the other rows stay zero and are never read.
    """
    import dataclasses

    from cascade_ray.data.batches import train_batches
    from cascade_ray.pipeline.features import cache_decision, upstream_outputs
    from cascade_ray.stage.setup import build_stage_model, stage_seed

    if index == 0:
        return upstream, None, "none (first stage)"
    wanted, why = cache_decision(cfg, index)
    if not wanted:
        return upstream, None, f"off: {why}"
    if upstream is None:  # the same freshly initialized upstream run_stage would build
        model, _ = build_stage_model(cfg, index, data, None)
        stage = cfg.stages[index].name
        upstream = {k: v.detach().numpy().copy() for k, v in model.state_dict().items() if k.split(".")[1] != stage}
    train = cfg.stages[index].train
    wanted_batches, batches, epoch = steps * cfg.stages[index].solver.accumulation_steps, [], 0
    while len(batches) < wanted_batches and epoch < train.epochs:
        batches += list(
            train_batches(
                len(data.y_train), train.batch_size, rank=0, world=1, seed=stage_seed(cfg, index), epoch=epoch
            )
        )
        epoch += 1
    rows = np.unique(torch.cat(batches[:wanted_batches]).numpy())
    outputs = upstream_outputs(
        cfg, index, dataclasses.replace(data, x_train=data.x_train[rows], y_train=data.y_train[rows]), upstream
    )
    x_train = np.zeros((len(data.y_train), *outputs["train"].shape[1:]), np.float32)
    x_train[rows] = outputs["train"]
    shape = "x".join(str(d) for d in outputs["train"].shape[1:])
    return (
        upstream,
        {"x_train": x_train, "x_val": outputs["val"]},
        f"on: trains on the upstream's {shape} outputs, computed once",
    )


def diagnose(
    cfg: PipelineConfig,
    index: int,
    data: DataSplits,
    *,
    steps: int = 20,
    upstream: Mapping[str, np.ndarray] | None = None,
    upstream_source: str | None = None,
    device: torch.device | None = None,
    profile: str | Path | None = None,
) -> dict[str, Any]:
    """Run stage `index` for `steps` optimizer steps in-process; return the report as a dict.

    Args:
        cfg: the validated config.
        index: the stage to diagnose.
        data: the loaded splits.
        steps: optimizer steps to run (the real schedule is used; the run just stops early).
        upstream: the composed state of the earlier stages (an artifact), or None to build them
            freshly initialized (untrained).
        upstream_source: where `upstream` came from, for the report.
        device: default CPU.
        profile: write a torch.profiler Chrome trace of a few of the steps here
            (:mod:`cascade_ray.stage.profiler`); the report gets its summary and top operators.
    """
    from cascade_ray.solver.schedule import lr_factor, total_optimizer_steps
    from cascade_ray.stage.loop import run_stage

    device = device or torch.device("cpu")
    stage = cfg.stages[index]
    earlier = [s.name for s in cfg.stages[:index] if s.type == "module"]
    if not earlier:
        upstream_note = "none (first stage)"
    elif upstream is None:
        upstream_note = f"{', '.join(earlier)}: freshly initialized, NOT trained (pass --upstream RUN_DIR/stages/{cfg.stages[index - 1].name} for trained weights)"
    else:
        upstream_note = f"{', '.join(earlier)}: loaded from {upstream_source}"
    report: dict[str, Any] = {
        "stage": stage.name,
        "index": index,
        "steps_requested": steps,
        "device": str(device),
        "upstream": upstream_note,
        "solver": stage.solver.model_dump(mode="json"),
    }
    recorder = _Recorder(steps)
    hooks = recorder.hooks()
    profiler = None
    if profile is not None:
        from cascade_ray.stage.profiler import StepProfiler

        profiler = StepProfiler(profile, device, stage.name)
        hooks = chain_hooks(profiler.hooks(), hooks)  # the profiler steps before the recorder stops the run
    upstream, features, report["feature_cache"] = _cached_inputs(cfg, index, data, upstream, steps)
    log = io.StringIO()
    error: CascadeError | None = None
    with contextlib.redirect_stdout(log):
        try:
            run_stage(
                diagnose_config(cfg, index, steps),
                index,
                data,
                upstream,
                _QuietReporter(),
                device,
                hooks=hooks,
                features=features,
            )
        except _Stop:
            pass
        except CascadeError as exc:
            error = exc
        finally:
            if profiler is not None:
                summary = profiler.finish()
                report["profile"] = {
                    "trace": str(profiler.path) if profiler.path.is_file() else None,
                    "summary": summary,
                }
    report["log"] = log.getvalue().splitlines()
    state = recorder.state
    if state is None:  # failed before the model was built (a step-count or precision error)
        report["verdict"] = {"ok": False, "alarms": [str(error)]}
        return report
    opt, sched = state.optimizer, state.scheduler
    # the plan of the real run, on scaling.num_workers ranks (this in-process run is one rank)
    workers = stage.scaling.num_workers
    total = total_optimizer_steps(stage, len(data.y_train), workers)
    plan = [lr_factor(stage.solver.lr_scheduler, k, total) * stage.solver.lr for k in (0, max(0, total - 1))]
    report["optimizer"] = {
        "class": type(opt).__name__,
        "groups": [
            {
                "name": g.get("name", str(i)),
                "lr": sched.base_lrs[i],
                "weight_decay": g.get("weight_decay"),
                "tensors": len(g["params"]),
                "params": sum(p.numel() for p in g["params"]),
            }
            for i, g in enumerate(opt.param_groups)
        ],
    }
    report["schedule"] = {
        "type": stage.solver.lr_scheduler.type,
        "workers": workers,
        "total_optimizer_steps": total,
        "warmup_steps": stage.solver.lr_scheduler.warmup_steps,
        "accumulation_steps": stage.solver.accumulation_steps,
        "first_lr": plan[0],
        "last_lr": plan[1],
        "in_process_total_optimizer_steps": sched.total,
    }
    report["steps_run"] = state.step
    report["gradients"] = recorder.grads
    report["updates"] = _update_table(state.named_params, recorder.start)
    report["precision"] = {
        "precision": state.precision.name,
        "loss_scale": state.precision.scale,
        "skipped_steps": state.monitor.skipped,
    }
    alarms = ([str(error)] if error is not None else []) + state.monitor.warnings
    report["verdict"] = {"ok": not alarms, "alarms": alarms}
    return report


class _QuietReporter:
    """A single-rank reporter that keeps nothing (diagnose reads the loop through hooks)."""

    rank, world = 0, 1

    def all_sum(self, values: list[float]) -> list[float]:
        return list(values)

    def report(self, metrics: dict[str, float], state: Any, trainer: Any = None, frozen: Any = None) -> None:
        return None


def _flatten(section: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in section.items():
        if isinstance(value, dict):
            out |= _flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = "null" if value is None else value
    return out


def format_report(report: dict[str, Any]) -> str:
    """The report as text tables."""
    out = [
        f"diagnose stage {report['stage']!r} (stages[{report['index']}]): {report.get('steps_run', 0)} optimizer step(s) on {report['device']}, no Ray",
        f"upstream: {report['upstream']}",
        f"feature cache: {report.get('feature_cache', 'n/a')}",
        "",
        "solver (as loaded):",
    ]
    out += [f"  {k}: {v}" for k, v in _flatten(report["solver"]).items()]
    if "optimizer" in report:
        opt = report["optimizer"]
        out += [
            "",
            f"optimizer built: {opt['class']}, {len(opt['groups'])} param group(s)",
            f"  {'group':<44} {'lr':>10} {'decay':>8} {'tensors':>8} {'params':>10}",
        ]
        out += [
            f"  {g['name'][:44]:<44} {g['lr']:>10.3g} {g['weight_decay'] if g['weight_decay'] is not None else '-':>8} {g['tensors']:>8} {g['params']:>10,}"
            for g in opt["groups"]
        ]
        s = report["schedule"]
        out += [
            "",
            f"lr plan on {s['workers']} worker(s): {s['type']}, {s['total_optimizer_steps']} optimizer steps (warmup {s['warmup_steps']}, accumulation_steps {s['accumulation_steps']}); "
            f"lr {s['first_lr']:.3g} at the first step -> {s['last_lr']:.3g} at the last (solver lr; groups scale with it)",
        ]
        if s["in_process_total_optimizer_steps"] != s["total_optimizer_steps"]:
            out += [
                f"  (this in-process run is one worker: its plan spans {s['in_process_total_optimizer_steps']} steps)"
            ]
        out += [
            "",
            "gradients after the first backward, per module:",
            f"  {'module':<44} {'params':>9} {'grad norm':>10} {'None':>5} {'zero':>5} {'NaN/inf':>7}",
        ]
        out += [
            f"  {r['module'][:44]:<44} {r['params']:>9,} {r['grad_norm']:>10.3g} {r['none']:>5} {r['zero']:>5} {r['nonfinite']:>7}"
            for r in report["gradients"]
        ]
        out += [
            "",
            f"parameter updates over {report['steps_run']} step(s), ||theta_now - theta_start|| / ||theta_start|| per module:",
        ]
        out += [f"  {r['module'][:44]:<44} {r['update_ratio']:>10.3g}" for r in report["updates"]]
        p = report["precision"]
        out += [
            "",
            f"precision: {p['precision']}"
            + (
                f", loss scale {p['loss_scale']:g}, {p['skipped_steps']} skipped step(s)"
                if p["loss_scale"] is not None
                else " (no loss scaler)"
            ),
        ]
    if "profile" in report:
        out += ["", report["profile"]["summary"]]
    verdict = report["verdict"]
    out += ["", "verdict: " + ("OK: no health alarms" if verdict["ok"] else f"{len(verdict['alarms'])} alarm(s)")]
    out += [f"  - {a}" for a in verdict["alarms"]]
    return "\n".join(out)
