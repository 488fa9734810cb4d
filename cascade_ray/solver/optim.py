"""Optimizers by exact torch.optim class name; arguments an optimizer does not take are errors."""

from __future__ import annotations

import inspect
from collections.abc import Iterable

import torch

from cascade_ray.config.schema import SolverConfig
from cascade_ray.errors import ConfigIssue

# Optimizers that cannot drive a whole stage module, and why.
_UNSUPPORTED = {
    "LBFGS": "needs a closure per step",
    "SparseAdam": "needs sparse gradients",
    "Muon": "only takes 2-D parameters (no biases or norms)",
}


def optimizer_names() -> list[str]:
    """Every torch.optim optimizer class a stage can use, sorted."""
    return sorted(
        name
        for name, obj in vars(torch.optim).items()
        if inspect.isclass(obj) and issubclass(obj, torch.optim.Optimizer)
        and obj is not torch.optim.Optimizer and name not in _UNSUPPORTED
    )


def _optional_args(solver: SolverConfig) -> dict[str, object]:
    """The solver keys the user set that map to optimizer keyword arguments."""
    args: dict[str, object] = {"lr": solver.lr, "weight_decay": solver.weight_decay}
    if solver.betas is not None:
        args["betas"] = tuple(solver.betas)
    if solver.momentum is not None:
        args["momentum"] = solver.momentum
    return args


def solver_issues(solver: SolverConfig, path: str) -> list[ConfigIssue]:
    """Problems with a stage's solver section (unknown optimizer, arguments it does not take)."""
    from cascade_ray.config.loader import did_you_mean

    names = optimizer_names()
    if solver.type not in names:
        hint = did_you_mean(solver.type, names)
        extra = f" ({solver.type} {_UNSUPPORTED[solver.type]})" if solver.type in _UNSUPPORTED else ""
        return [ConfigIssue(f"{path}.type", f"unknown optimizer {solver.type!r}{hint}{extra} (valid: {', '.join(names)})")]
    accepted = inspect.signature(getattr(torch.optim, solver.type)).parameters
    issues = []
    for key in _optional_args(solver):
        if key not in accepted:
            takers = [n for n in names if key in inspect.signature(getattr(torch.optim, n)).parameters]
            issues.append(
                ConfigIssue(
                    f"{path}.{key}",
                    f"optimizer {solver.type} takes no {key!r} argument; it would be silently ignored",
                    f"remove {path}.{key}, or use an optimizer that takes it ({', '.join(takers)})",
                )
            )
    for i, beta in enumerate(solver.betas or ()):
        if not 0.0 <= beta < 1.0:
            issues.append(ConfigIssue(f"{path}.betas[{i}]", f"beta {beta} is outside [0, 1)", "typical: [0.9, 0.999]"))
    return issues


def build_optimizer(params: Iterable[torch.nn.Parameter], solver: SolverConfig) -> torch.optim.Optimizer:
    """Build the optimizer a validated solver section describes."""
    return getattr(torch.optim, solver.type)(list(params), **_optional_args(solver))
