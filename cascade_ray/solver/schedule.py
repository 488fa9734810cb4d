"""Learning-rate schedules counted in optimizer steps, as closed-form plans.

Every schedule is a pure function ``lr_factor(cfg, step, total)``: the multiplier on
each parameter group's base lr at optimizer step ``step`` (0-based). :class:`LrSchedule`
applies it once per optimizer step and keeps the count, so the health monitor can
compare the lr actually applied with the plan for that step (a scheduler stepped per
micro-batch shows up at once). ``ReduceLROnPlateau`` adds a per-epoch multiplier on top.
"""

from __future__ import annotations

import bisect
import math
from typing import Any

import torch

from cascade_ray.config.metrics import metric_mode
from cascade_ray.config.schema import SchedulerConfig, StageConfig
from cascade_ray.data.batches import num_optimizer_steps
from cascade_ray.errors import ConfigIssue

# The keys each schedule type reads (besides `type` and `warmup_steps`).
SCHEDULER_KEYS: dict[str, tuple[str, ...]] = {
    "constant": (),
    "StepLR": ("step_size", "gamma"),
    "MultiStepLR": ("milestones", "gamma"),
    "CosineAnnealingLR": ("T_max", "min_lr_ratio"),
    "cosine": ("T_max", "min_lr_ratio"),
    "OneCycleLR": ("total_steps", "pct_start", "div_factor", "final_div_factor"),
    "ReduceLROnPlateau": ("factor", "patience", "threshold", "monitor", "min_lr_ratio"),
}


def total_optimizer_steps(stage: StageConfig, n_train: int, world: int) -> int:
    """Optimizer steps the stage will take: epochs x windows per epoch, capped by max_steps."""
    per_epoch = num_optimizer_steps(n_train, stage.train.batch_size, world, stage.solver.accumulation_steps)
    steps = stage.train.epochs * per_epoch
    return min(steps, stage.train.max_steps) if stage.train.max_steps is not None else steps


def _main_factor(cfg: SchedulerConfig, s: int, span: int) -> float:
    """The schedule after warmup, at step `s` of its `span` steps."""
    kind = cfg.type
    if kind in ("constant", "ReduceLROnPlateau"):
        return 1.0
    if kind == "StepLR":
        assert cfg.step_size is not None  # required, checked by scheduler_issues
        return cfg.gamma ** (s // cfg.step_size)
    if kind == "MultiStepLR":
        return cfg.gamma ** bisect.bisect_right(cfg.milestones or [], s)
    if kind in ("CosineAnnealingLR", "cosine"):
        progress = min(1.0, s / max(1, cfg.T_max or span))  # flat at the floor after T_max, never back up
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    # OneCycleLR, torch's two-phase cosine form (three_phase=False)
    length = max(2, cfg.total_steps or span)
    start, end = 1.0 / cfg.div_factor, 1.0 / (cfg.div_factor * cfg.final_div_factor)
    peak = max(1.0, cfg.pct_start * length - 1)
    if s <= peak:
        return _cos(start, 1.0, s / peak)
    return _cos(1.0, end, min(1.0, (s - peak) / max(1.0, length - 1 - peak)))


def _cos(a: float, b: float, pct: float) -> float:
    return b + (a - b) * 0.5 * (1.0 + math.cos(math.pi * pct))


def lr_factor(cfg: SchedulerConfig, step: int, total: int) -> float:
    """Multiplier on the base lr at optimizer step `step` (0-based) of `total`.

    Warmup rises linearly to the main schedule's first value, so every type starts
    continuous after warmup (OneCycleLR's first value is 1/div_factor).
    """
    span = max(1, total - cfg.warmup_steps)
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1) * _main_factor(cfg, 0, span)
    return _main_factor(cfg, step - cfg.warmup_steps, span)


class LrSchedule:
    """Sets each group's lr to ``base_lr * lr_factor(step) * plateau_scale``.

    Call :meth:`step` once per optimizer step that was taken (not per micro-batch, not
    for a step the fp16 scaler skipped) and :meth:`step_epoch` once per epoch.

    Attributes:
        steps: how many times :meth:`step` was called (the plan's position).
        total: the planned number of optimizer steps.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: SchedulerConfig, total: int):
        self.optimizer, self.cfg, self.total = optimizer, cfg, total
        # like torch, the base lr lives in the group, so a schedule rebuilt on the same optimizer agrees
        self.base_lrs = [float(g.setdefault("initial_lr", g["lr"])) for g in optimizer.param_groups]
        self.steps = 0
        self.scale = 1.0  # ReduceLROnPlateau's multiplier
        self._best: float | None = None
        self._bad_epochs = 0
        self._apply()

    def factor(self, step: int) -> float:
        """Planned multiplier at optimizer step `step` (plateau reductions included)."""
        return lr_factor(self.cfg, step, self.total) * self.scale

    def planned_lrs(self, step: int) -> list[float]:
        """Per group, the lr the plan applies at optimizer step `step`."""
        f = self.factor(step)
        return [base * f for base in self.base_lrs]

    def _apply(self) -> None:
        for group, lr in zip(self.optimizer.param_groups, self.planned_lrs(self.steps)):
            group["lr"] = lr

    def step(self) -> None:
        """Advance the plan by one optimizer step."""
        self.steps += 1
        self._apply()

    def step_epoch(self, metrics: dict[str, float]) -> bool:
        """ReduceLROnPlateau: watch `monitor` once per epoch; True when the lr was reduced."""
        if self.cfg.type != "ReduceLROnPlateau":
            return False
        value, thr = metrics[self.cfg.monitor], self.cfg.threshold
        # torch's relative threshold: accuracy must beat best * (1 + thr), a loss best * (1 - thr)
        if self._best is None or (
            value > self._best * (1.0 + thr)
            if metric_mode(self.cfg.monitor) == "max"
            else value < self._best * (1.0 - thr)
        ):
            self._best, self._bad_epochs = value, 0
            return False
        self._bad_epochs += 1
        if self._bad_epochs <= self.cfg.patience:
            return False
        self._bad_epochs = 0
        new = max(self.scale * self.cfg.factor, self.cfg.min_lr_ratio)
        reduced, self.scale = new < self.scale, new
        self._apply()
        return reduced

    def get_last_lr(self) -> list[float]:
        """The lr of every group now."""
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        """Position and plateau state (the plan itself comes from the config)."""
        return {"steps": self.steps, "scale": self.scale, "best": self._best, "bad_epochs": self._bad_epochs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` and re-apply the lr of that position."""
        self.steps, self.scale = int(state["steps"]), float(state["scale"])
        self._best, self._bad_epochs = state["best"], int(state["bad_epochs"])
        self._apply()


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: SchedulerConfig, total: int) -> LrSchedule:
    """The stage's :class:`LrSchedule` over `total` optimizer steps."""
    return LrSchedule(optimizer, cfg, total)


def scheduler_issues(cfg: SchedulerConfig, path: str) -> list[ConfigIssue]:
    """Keys the chosen type does not read (set to a non-default value), and missing required ones.

    Compared with the defaults rather than with the keys written, so a config dumped and
    re-validated (a Ray worker, a Tune trial) gets the same answer as the YAML file.
    """
    used = SCHEDULER_KEYS[cfg.type]
    issues = []
    for key, field in SchedulerConfig.model_fields.items():
        if key in ("type", "warmup_steps") or key in used:
            continue
        default = None if key in ("T_max", "total_steps") else field.default
        if getattr(cfg, key) != default:
            takers = sorted({t for t, keys in SCHEDULER_KEYS.items() if key in keys and t != "cosine"})
            issues.append(
                ConfigIssue(
                    f"{path}.{key}",
                    f"{cfg.type} does not use {key!r} ({key} is for {', '.join(takers)}); it would be silently ignored",
                    f"remove {path}.{key}, or set {path}.type to one that uses it",
                )
            )
    if cfg.type == "StepLR" and cfg.step_size is None:
        issues.append(
            ConfigIssue(
                f"{path}.step_size", "StepLR needs step_size (optimizer steps between decays)", f"set {path}.step_size"
            )
        )
    if cfg.type == "MultiStepLR":
        ms = cfg.milestones
        if ms is None:
            issues.append(
                ConfigIssue(
                    f"{path}.milestones",
                    "MultiStepLR needs milestones (optimizer steps at which lr decays)",
                    f"set {path}.milestones, e.g. [1000, 2000]",
                )
            )
        elif any(b <= a for a, b in zip(ms, ms[1:])) or ms[0] < 1:
            issues.append(
                ConfigIssue(
                    f"{path}.milestones",
                    f"{ms} must be positive and strictly increasing",
                    "sort them and drop duplicates",
                )
            )
    return issues
