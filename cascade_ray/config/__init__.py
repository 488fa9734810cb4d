"""Typed, strict configuration: the schema and YAML reading. Full validation: :mod:`cascade_ray.checks`."""

from cascade_ray.config.schema import (
    DataConfig,
    HeadConfig,
    LossConfig,
    ModelConfig,
    PipelineConfig,
    ScalingConfig,
    SolverConfig,
    StageConfig,
    TrainConfig,
)

__all__ = [
    "DataConfig",
    "HeadConfig",
    "LossConfig",
    "ModelConfig",
    "PipelineConfig",
    "ScalingConfig",
    "SolverConfig",
    "StageConfig",
    "TrainConfig",
]
