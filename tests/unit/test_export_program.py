"""torch.export of composed cascades (no Ray): every builtin model type, and a module that does not trace."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from cascade_ray.checks import validate_config
from cascade_ray.config.schema import HeadConfig
from cascade_ray.errors import CascadeError
from cascade_ray.models.cascade import CascadeModel, Head, build_cascade
from cascade_ray.models.plan import require_plans
from cascade_ray.tools.export import export_program
from cascade_ray.tools.inference import Composed, LastHead

# (model section, per-sample input shape): tiny sizes, each type on the inputs it takes
BUILTIN = [
    ({"type": "resnet", "in_channels": 1, "widths": [4, 8], "blocks": [1, 1]}, (1, 8, 8)),
    ({"type": "resnet", "in_channels": 3, "widths": [4], "blocks": [1], "block": "bottleneck"}, (3, 8, 8)),
    ({"type": "transformer", "in_channels": 1, "d_model": 8, "depth": 2, "heads": 2}, (1, 4, 4)),
    ({"type": "transformer", "in_channels": 6, "d_model": 8, "depth": 1, "heads": 2}, (5, 6)),
    ({"type": "mlp", "in_features": 1, "hidden": [8]}, (1, 4, 4)),
    ({"type": "mlp", "in_features": 12, "hidden": [8, 8]}, (12,)),
]


def _composed(cascade: CascadeModel, shape: tuple[int, ...]) -> Composed:
    stats = (shape[0], 1, 1) if len(shape) == 3 else shape[-1:]
    mean = np.full(stats, 3.0, dtype=np.float32)
    std = np.full(stats, 2.0, dtype=np.float32)
    return Composed(LastHead(cascade), mean, std).eval()


def _check_program(model: nn.Module, shape: tuple[int, ...], tmp_path) -> None:
    program = export_program(model, torch.randn(2, *shape))
    torch.export.save(program, str(tmp_path / "model.pt2"))
    loaded = torch.export.load(str(tmp_path / "model.pt2")).module()
    with torch.no_grad():
        for rows in (1, 7):
            x = torch.randn(rows, *shape) * 2 + 3
            torch.testing.assert_close(loaded(x), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("model", "shape"), BUILTIN, ids=lambda v: v["type"] if isinstance(v, dict) else str(v))
def test_every_builtin_model_type_exports_with_a_dynamic_batch(model, shape, tmp_path):
    raw = {"name": "tiny", "data": {"source": "digits"}, "stages": [{"name": "only", "model": model}]}
    cfg = validate_config(raw, preflight=False)
    cascade = build_cascade(cfg, require_plans(cfg, shape, 3), 3, upto=0)
    _check_program(_composed(cascade, shape), shape, tmp_path)


def test_the_debug_chain_exports_with_a_dynamic_batch(tmp_path):
    """resnet -> transformer -> mlp, the shipped debug config's chain, as one program."""
    from paths import CONFIGS

    from cascade_ray.api import load_config

    cfg = load_config(CONFIGS / "debug.yaml")
    cascade = build_cascade(cfg, require_plans(cfg, (1, 8, 8), 10), 10, upto=2)
    _check_program(_composed(cascade, (1, 8, 8)), (1, 8, 8), tmp_path)


class _Gate(nn.Module):
    """A user module with data-dependent control flow: torch.export cannot trace the branch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x * 2
        return x


def test_a_module_torch_export_cannot_trace_is_named_with_the_other_formats_suggested():
    head = Head(HeadConfig(), (4,), 3)
    cascade = CascadeModel(
        ["embed", "gate"],
        {"embed": nn.Linear(4, 4), "gate": _Gate()},
        {},
        {"embed": nn.Identity(), "gate": head},
    )
    with pytest.raises(CascadeError) as err:
        export_program(_composed(cascade, (4,)), torch.randn(2, 4))
    message = str(err.value)
    assert "torch.export cannot trace stage 'gate' (module _Gate)" in message
    assert "--format onnx or --format torchscript" in message
