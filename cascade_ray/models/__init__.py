"""Builtin stage modules (resnet, transformer, mlp) and the registry that builds them.

Every builtin has ``in_width`` (see :func:`tensor_width` for the width convention) and
``cascade_layers()`` (its layers in forward order, covering every parameter once), and
builds and runs under ``torch.device("meta")``.
"""

from cascade_ray.models.mlp import mlp
from cascade_ray.models.registry import (
    BUILTIN_MODELS,
    ModelSpecError,
    build_module,
    check_kwargs,
    module_in_width,
    module_layers,
    resolve_factory,
    tensor_width,
)
from cascade_ray.models.resnet import resnet
from cascade_ray.models.transformer import transformer

__all__ = [
    "BUILTIN_MODELS",
    "ModelSpecError",
    "build_module",
    "check_kwargs",
    "mlp",
    "module_in_width",
    "module_layers",
    "resnet",
    "resolve_factory",
    "tensor_width",
    "transformer",
]
