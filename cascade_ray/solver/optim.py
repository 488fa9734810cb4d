"""Optimizers by exact torch.optim class name; arguments an optimizer does not take are errors.

:func:`solver_issues` checks a whole ``stages[i].solver`` section without building
anything: the optimizer name, every argument (also per parameter group), the
schedule's keys, clipping and the fp16 scaler section.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterable
from typing import Any

import torch

from cascade_ray.config.schema import GradClipConfig, ParamGroupConfig, SolverConfig
from cascade_ray.errors import ConfigIssue
from cascade_ray.solver.schedule import scheduler_issues
from cascade_ray.text import short_repr

# Optimizers that cannot drive a whole stage module, and why.
_UNSUPPORTED = {
    "LBFGS": "needs a closure per step",
    "SparseAdam": "needs sparse gradients",
    "Muon": "only takes 2-D parameters (no biases or norms)",
}
# Settings a parameter group may override (each also a SolverConfig key).
GROUP_KEYS = ("lr", "weight_decay", "betas", "momentum")


def optimizer_names() -> list[str]:
    """Every torch.optim optimizer class a stage can use, sorted."""
    return sorted(
        name
        for name, obj in vars(torch.optim).items()
        if inspect.isclass(obj)
        and issubclass(obj, torch.optim.Optimizer)
        and obj is not torch.optim.Optimizer
        and name not in _UNSUPPORTED
    )


def optimizer_args(section: SolverConfig | ParamGroupConfig) -> dict[str, Any]:
    """The keys of a solver (or parameter-group) section that are optimizer keyword arguments.

    For a group, only the keys it sets; for the solver, lr and weight_decay always.
    """
    args: dict[str, Any] = {}
    for key in GROUP_KEYS:
        value = getattr(section, key)
        if value is not None:
            args[key] = tuple(value) if key == "betas" else value
    return args


def _accepts(name: str, key: str) -> bool:
    return key in inspect.signature(getattr(torch.optim, name)).parameters


def _arg_issues(solver_type: str, args: dict[str, Any], path: str, names: list[str]) -> list[ConfigIssue]:
    issues = []
    for key, value in args.items():
        if not _accepts(solver_type, key):
            takers = [n for n in names if _accepts(n, key)]
            issues.append(
                ConfigIssue(
                    f"{path}.{key}",
                    f"optimizer {solver_type} takes no {short_repr(key)} argument; it would be silently ignored",
                    f"remove {path}.{key}, or use an optimizer that takes it ({', '.join(takers)})",
                )
            )
        elif key == "betas":
            issues += [
                ConfigIssue(f"{path}.betas[{i}]", f"beta {b} is outside [0, 1)", "typical: [0.9, 0.999]")
                for i, b in enumerate(value)
                if not 0.0 <= b < 1.0
            ]
    return issues


def solver_issues(solver: SolverConfig, path: str) -> list[ConfigIssue]:
    """Problems with a stage's solver section (unknown optimizer, arguments it does not take, ...)."""
    from cascade_ray.text import did_you_mean, short_repr

    issues = scheduler_issues(solver.lr_scheduler, f"{path}.lr_scheduler") + clip_issues(
        solver.grad_clip, f"{path}.grad_clip"
    )
    if solver.scaler is not None and solver.precision not in ("fp16", "auto"):
        issues.append(
            ConfigIssue(
                f"{path}.scaler",
                f"the loss scaler is only used with precision fp16, or auto where it resolves to fp16 (precision is {solver.precision!r})",
                f"remove {path}.scaler, or set {path}.precision: fp16 or auto",
            )
        )
    for j, group in enumerate(solver.param_groups):
        try:
            re.compile(group.match)
        except re.error as exc:
            issues.append(
                ConfigIssue(
                    f"{path}.param_groups[{j}].match",
                    f"{short_repr(group.match)} is not a valid regex: {exc}",
                    r"escape dots as \. and close every bracket",
                )
            )
    names = optimizer_names()
    if solver.type not in names:
        hint = did_you_mean(solver.type, names)
        extra = f" ({solver.type} {_UNSUPPORTED[solver.type]})" if solver.type in _UNSUPPORTED else ""
        return issues + [
            ConfigIssue(
                f"{path}.type", f"unknown optimizer {short_repr(solver.type)}{hint}{extra} (valid: {', '.join(names)})"
            )
        ]
    issues += _arg_issues(solver.type, optimizer_args(solver), path, names)
    for j, group in enumerate(solver.param_groups):
        issues += _arg_issues(solver.type, optimizer_args(group), f"{path}.param_groups[{j}]", names)
    return issues


def clip_issues(clip: GradClipConfig, path: str) -> list[ConfigIssue]:
    """Clipping keys that do not fit the clipping mode."""
    if clip.mode == "value" and clip.clip_value is None:
        return [
            ConfigIssue(
                f"{path}.clip_value",
                "mode value needs clip_value",
                f"set {path}.clip_value, or use mode: norm with max_norm",
            )
        ]
    if clip.mode == "norm" and clip.clip_value is not None:
        return [
            ConfigIssue(
                f"{path}.clip_value",
                "clip_value is only used with mode: value; mode norm clips the global norm to max_norm",
                f"remove {path}.clip_value, or set {path}.mode: value",
            )
        ]
    return []


def build_optimizer(
    params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]], solver: SolverConfig
) -> torch.optim.Optimizer:
    """Build the optimizer a validated solver section describes.

    Args:
        params: parameters, or parameter groups from :func:`cascade_ray.solver.groups.build_param_groups`.
        solver: the validated solver section (its settings are every group's defaults).
    """
    return getattr(torch.optim, solver.type)(list(params), **optimizer_args(solver))
