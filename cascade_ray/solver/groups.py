"""Parameter groups: regex matches on parameter names, first match wins, no decay on 1-D params.

Only trainable parameters ever reach a group (frozen ones are not passed in). Each
configured group, and the default group of everything unmatched, is split in two torch
param groups: parameters with 2+ dimensions get the group's weight decay, 1-D ones
(biases, normalization weights) get none unless ``solver.decay_bias_and_norm``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from torch import nn

from cascade_ray.config.schema import PipelineConfig, SolverConfig
from cascade_ray.errors import ConfigError, ConfigIssue
from cascade_ray.solver.optim import optimizer_args

NamedParams = Sequence[tuple[str, nn.Parameter]]


def assign_groups(names: Sequence[str], solver: SolverConfig) -> list[int]:
    """Per parameter name, the index of the first group whose regex matches it (-1: defaults)."""
    patterns = [re.compile(g.match) for g in solver.param_groups]
    return [next((j for j, p in enumerate(patterns) if p.search(name)), -1) for name in names]


def unmatched_group_issues(names: Sequence[str], solver: SolverConfig, path: str, stage: str) -> list[ConfigIssue]:
    """One issue per configured group that receives no trainable parameter."""
    owners = assign_groups(names, solver)
    issues = []
    for j, group in enumerate(solver.param_groups):
        if j in owners:
            continue
        hits = [n for n in names if re.search(group.match, n)]
        why = (
            f"every parameter it matches is taken by an earlier group (first match wins), e.g. {hits[0]!r}"
            if hits
            else "it matches no trainable parameter"
        )
        sample = ", ".join(names[:3]) + (f", ... ({len(names)} in all)" if len(names) > 3 else "")
        issues.append(
            ConfigIssue(
                f"{path}.param_groups[{j}].match",
                f"pattern {group.match!r} of stage {stage!r} selects nothing: {why}. Trainable parameters: {sample}",
                "fix the regex (it is searched in the full parameter name), reorder the groups, or remove this group",
            )
        )
    return issues


def build_param_groups(named: NamedParams, solver: SolverConfig, path: str, stage: str) -> list[dict[str, Any]]:
    """Torch param groups for the trainable parameters `named`.

    Raises:
        ConfigError: a configured group receives no parameter.
    """
    names = [n for n, _ in named]
    issues = unmatched_group_issues(names, solver, path, stage)
    if issues:
        raise ConfigError(issues)
    owners = assign_groups(names, solver)
    groups = []
    for j in [*range(len(solver.param_groups)), -1]:
        settings = optimizer_args(solver) | (optimizer_args(solver.param_groups[j]) if j >= 0 else {})
        label = f"param_groups[{j}] {solver.param_groups[j].match!r}" if j >= 0 else "default"
        members = [(n, p) for (n, p), owner in zip(named, owners) if owner == j]
        for decay in (True, False):
            part = [(n, p) for n, p in members if (p.ndim >= 2 or solver.decay_bias_and_norm) == decay]
            if not part:
                continue
            wd = settings["weight_decay"] if decay else 0.0
            groups.append(
                {
                    "params": [p for _, p in part],
                    "param_names": [n for n, _ in part],
                    "name": label + ("" if decay else " (no decay)"),
                    **settings,
                    "weight_decay": wd,
                }
            )
    return groups


def param_group_issues(cfg: PipelineConfig) -> list[ConfigIssue]:
    """Config-time check that every param-group pattern selects a trainable parameter.

    Builds each stage that has groups on the ``meta`` device (no memory, no data) to
    learn the parameter names; shape problems are left to the shape preflight.
    """
    if not any(s.solver.param_groups for s in cfg.stages):
        return []
    import torch

    from cascade_ray.models.cascade import build_cascade
    from cascade_ray.preflight import data_input_shape, plan_chain
    from cascade_ray.stage.freeze import apply_freeze, plan_trainable

    shape = data_input_shape(cfg.data)
    if shape is None:
        return []
    try:
        plans, problems = plan_chain(cfg, shape, num_classes=2)
    except Exception:  # noqa: BLE001 - an unbuildable model is reported by the model checks
        return []
    if problems:
        return []
    issues = []
    for i, stage in enumerate(cfg.stages):
        if not stage.solver.param_groups:
            continue
        try:
            with torch.device("meta"):
                model = build_cascade(cfg, plans, 2, upto=i)
            apply_freeze(model, plan_trainable(model, cfg, i))
        except Exception:  # noqa: BLE001 - reported elsewhere (model spec, trainable_layers)
            continue
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        if stage.loss.weighting == "uncertainty":
            names.append("loss.log_vars")
        try:
            issues += unmatched_group_issues(names, stage.solver, f"stages[{i}].solver", stage.name)
        except re.error:  # an invalid regex is reported by solver_issues
            continue
    return issues
