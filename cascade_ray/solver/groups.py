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

from cascade_ray.config.schema import SolverConfig
from cascade_ray.errors import ConfigError, ConfigIssue
from cascade_ray.solver.optim import optimizer_args
from cascade_ray.text import short_repr

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
            f"every parameter it matches is taken by an earlier group (first match wins), e.g. {short_repr(hits[0])}"
            if hits
            else "it matches no trainable parameter"
        )
        sample = ", ".join(names[:3]) + (f", ... ({len(names)} in all)" if len(names) > 3 else "")
        issues.append(
            ConfigIssue(
                f"{path}.param_groups[{j}].match",
                f"pattern {short_repr(group.match)} of stage {stage!r} selects nothing: {why}. Trainable parameters: {sample}",
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
        label = f"param_groups[{j}] {short_repr(solver.param_groups[j].match)}" if j >= 0 else "default"
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
