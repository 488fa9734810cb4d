"""Frozen means bit-identical: requires_grad off, eval mode (BatchNorm stats), digests."""

from __future__ import annotations

import pytest
import torch
from paths import CONFIGS

from cascade_ray.checks import load_config
from cascade_ray.errors import FrozenDriftError
from cascade_ray.models.freeze import check_frozen, frozen_digest
from cascade_ray.models.registry import module_layers
from cascade_ray.models.weights import to_numpy_state
from cascade_ray.stage.setup import build_stage_model


def _stage0_state(cfg, digits):
    model, _ = build_stage_model(cfg, 0, digits, None)
    # give BatchNorm non-trivial running stats so a drift would be visible
    model.train()
    with torch.no_grad():
        model(torch.randn(16, 1, 8, 8), heads=["features"])
    return to_numpy_state(model.state_dict())


def test_frozen_upstream_is_bit_identical_after_training_steps(digits):
    cfg = load_config(CONFIGS / "debug.yaml")
    upstream = _stage0_state(cfg, digits)
    model, plan = build_stage_model(cfg, 1, digits, upstream)
    assert any("running_mean" in k for k in plan.frozen_keys), "BatchNorm buffers must be in the digest"
    before = frozen_digest(model, plan)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model.train()
    for _ in range(3):
        out = model(torch.randn(8, 1, 8, 8), heads=["encoder"])["encoder"]
        out.sum().backward()
        opt.step()
    check_frozen(before, frozen_digest(model, plan), "encoder")  # does not raise
    assert all(
        not p.requires_grad for n, p in model.named_parameters() if n.startswith(("blocks.features", "heads.features"))
    )
    assert not model.blocks["features"].training


def test_batchnorm_left_in_train_mode_is_caught(digits):
    cfg = load_config(CONFIGS / "debug.yaml")
    model, plan = build_stage_model(cfg, 1, digits, _stage0_state(cfg, digits))
    before = frozen_digest(model, plan)
    model.set_frozen_modules([])  # simulate the classic bug: frozen BatchNorm in train mode
    model.train()
    with torch.no_grad():
        model(torch.randn(8, 1, 8, 8) * 3, heads=["encoder"])
    with pytest.raises(FrozenDriftError, match="running_mean"):
        check_frozen(before, frozen_digest(model, plan), "encoder")


def test_trainable_layers_open_exactly_the_last_layers(digits):
    cfg = load_config(CONFIGS / "debug.yaml", ["stages[1].trainable_layers={features: 1}"])
    model, plan = build_stage_model(cfg, 1, digits, _stage0_state(cfg, digits))
    layers = module_layers(model.blocks["features"])
    assert all(p.requires_grad for p in layers[-1].parameters())
    assert not any(p.requires_grad for layer in layers[:-1] for p in layer.parameters())
    assert not any(p.requires_grad for p in model.heads["features"].parameters())
    assert layers[-1].training is True and layers[0].training is False
    opened = {k for k in model.state_dict() if k.startswith("blocks.features.") and k not in plan.frozen_keys}
    last_prefix = next(n for n, m in model.named_modules() if m is layers[-1])
    assert opened == {f"{last_prefix}.{k}" for k in layers[-1].state_dict()}
