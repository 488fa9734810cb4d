"""Runtime training health: the monitor run_stage uses, loop hooks, diagnose and the LR finder."""

from cascade_ray.health.hooks import LoopHooks, LoopState, chain_hooks
from cascade_ray.health.monitor import HealthMonitor

__all__ = ["HealthMonitor", "LoopHooks", "LoopState", "chain_hooks"]
