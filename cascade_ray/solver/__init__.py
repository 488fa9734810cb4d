"""Per-stage solvers: optimizer and parameter groups, lr plan, precision, clipping, checks."""

from cascade_ray.solver.groups import build_param_groups
from cascade_ray.solver.optim import build_optimizer, optimizer_names, solver_issues
from cascade_ray.solver.preflight import stage_solver_issues, stage_step_issues, step_count_issues
from cascade_ray.solver.schedule import LrSchedule, build_scheduler, lr_factor, total_optimizer_steps
from cascade_ray.solver.step import Precision, build_precision, clip_gradients, grad_norm
from cascade_ray.solver.stopping import EarlyStopping

__all__ = [
    "EarlyStopping",
    "LrSchedule",
    "Precision",
    "build_optimizer",
    "build_param_groups",
    "build_precision",
    "build_scheduler",
    "clip_gradients",
    "grad_norm",
    "lr_factor",
    "optimizer_names",
    "solver_issues",
    "stage_solver_issues",
    "stage_step_issues",
    "step_count_issues",
    "total_optimizer_steps",
]
