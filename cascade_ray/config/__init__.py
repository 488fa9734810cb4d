"""Typed, strict configuration: YAML -> :class:`PipelineConfig`, every problem reported at once."""

from cascade_ray.config.loader import load_config, validate_config
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
    "load_config",
    "validate_config",
]
