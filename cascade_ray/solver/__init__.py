"""Per-stage solvers: optimizer construction and its validation."""

from cascade_ray.solver.optim import build_optimizer, optimizer_names, solver_issues

__all__ = ["build_optimizer", "optimizer_names", "solver_issues"]
