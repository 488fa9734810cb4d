"""Config-time check of param-group patterns against the real parameter names."""

from __future__ import annotations

import re

from cascade_ray.config.schema import PipelineConfig
from cascade_ray.errors import ConfigIssue
from cascade_ray.models.cascade import build_cascade
from cascade_ray.models.freeze import apply_freeze, plan_trainable
from cascade_ray.models.meta import meta_device
from cascade_ray.models.plan import data_input_shape, plan_chain
from cascade_ray.solver.groups import unmatched_group_issues


def param_group_issues(cfg: PipelineConfig) -> list[ConfigIssue]:
    """Config-time check that every param-group pattern selects a trainable parameter.

    Builds each stage that has groups on the ``meta`` device (no memory, no data) to
    learn the parameter names; shape problems are left to the shape preflight.
    """
    if not any(s.solver.param_groups for s in cfg.stages):
        return []
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
            with meta_device():
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
