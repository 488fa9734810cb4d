"""The Python API: what notebooks, services and the two doors (CLI, pipeline script) call.

from cascade_ray.api import RunOptions, load_config, run_pipeline

cfg = load_config("pipelines/configs/debug.yaml", ["stages.encoder.train.epochs=1"])
summary = run_pipeline(cfg, RunOptions(resume=True))
print(summary["test_accuracy"])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cascade_ray.checks import load_config, validate_config
from cascade_ray.config.schema import PipelineConfig
from cascade_ray.errors import ConfigError, ConfigIssue
from cascade_ray.options import RunOptions
from cascade_ray.pipeline import driver
from cascade_ray.pipeline.stages import StageRunner
from cascade_ray.tune.run import SweepRunner
from cascade_ray.tune.space import load_space

__all__ = ["RunOptions", "load_config", "run_pipeline", "stage_runners", "validate_config"]


def stage_runners(cfg: PipelineConfig, options: RunOptions) -> dict[str, StageRunner]:
    """A sweep runner for every stage ``options.spaces`` names; each space is read and checked
    against `cfg` here, before any Ray resource starts."""
    runners: dict[str, StageRunner] = {}
    for stage, path in options.spaces:
        space = load_space(path, cfg)
        if space.stage != stage:
            raise ConfigError(
                [ConfigIssue("stage", f"the space sweeps stage {space.stage!r}, asked for stage {stage!r}")], str(path)
            )
        runners[stage] = SweepRunner(space, str(path), resume=options.resume)
    return runners


def run_pipeline(
    cfg: PipelineConfig, options: RunOptions | None = None, *, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Train (and, for stages in ``options.spaces``, sweep) every stage, then evaluate the composed model.

    Returns:
        The run summary (also written to ``{storage_path}/{name}/summary.json`` for full runs).

    Raises:
        ConfigError: bad options or search spaces (before Ray starts), or resources the
            cluster does not have.
        CascadeError: a stage failed (earlier stages' artifacts stay, ``resume`` reuses them).
    """
    options = options or RunOptions()
    return driver.run_pipeline(cfg, options, runners=stage_runners(cfg, options), log=log)
