"""Meta-device shape preflight: mismatches name both stages and shapes; adapters fix them."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from cascade_ray.checks import validate_config
from cascade_ray.errors import ConfigError
from cascade_ray.models import build_module
from cascade_ray.models.plan import plan_chain


def test_debug_chain_shapes(debug_raw):
    cfg = validate_config(debug_raw)
    plans, issues = plan_chain(cfg, (1, 8, 8), num_classes=10)
    assert not issues
    assert [p.out_shape for p in plans] == [(16, 4, 4), (16, 16), (32,)]


def test_adapter_bridges_a_width_mismatch(debug_raw):
    debug_raw["stages"][1]["model"]["in_channels"] = 24
    with pytest.raises(ConfigError, match="expects input width 24"):
        validate_config(debug_raw)
    debug_raw["stages"][1]["adapter"] = {"type": "linear"}
    cfg = validate_config(debug_raw)
    plans, _ = plan_chain(cfg, (1, 8, 8), num_classes=10)
    assert plans[1].adapter_width == 24


def test_user_module_by_import_path(debug_raw):
    debug_raw["trusted_modules"] = ["user_models"]
    debug_raw["stages"][0]["model"] = {"type": "user_models:tiny_cnn", "width": 16}
    cfg = validate_config(debug_raw)
    plans, _ = plan_chain(cfg, (1, 8, 8), num_classes=10)
    assert plans[0].out_shape == (16, 8, 8)


def test_user_module_that_cannot_take_the_input_is_reported(debug_raw):
    debug_raw["trusted_modules"] = ["user_models"]
    debug_raw["stages"][0]["model"] = {"type": "user_models:tiny_cnn", "in_channels": 3}
    with pytest.raises(ConfigError) as info:
        validate_config(debug_raw)
    (issue,) = info.value.issues
    assert issue.path == "stages[0].model" and "(B, 1, 8, 8)" in issue.message


def test_pretrained_keys_must_match_the_module(debug_raw, tmp_path):
    kwargs = {k: v for k, v in debug_raw["stages"][0]["model"].items() if k != "type"}
    module = build_module("resnet", kwargs)
    good = tmp_path / "good.safetensors"
    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(good))
    debug_raw["stages"][0]["pretrained"] = str(good)
    validate_config(debug_raw)
    bad = tmp_path / "bad.safetensors"
    save_file({"stem.0.weight": torch.zeros(3)}, str(bad))
    debug_raw["stages"][0]["pretrained"] = str(bad)
    with pytest.raises(ConfigError, match="does not match the module"):
        validate_config(debug_raw)


def test_a_flattening_mlp_is_checked_against_the_flattened_size(debug_raw):
    # the encoder outputs (16 tokens, 16 wide): a flattening MLP takes 256 features, not 16
    debug_raw["stages"][2]["model"] = {"type": "mlp", "in_features": 256, "hidden": [32], "pool": "flatten"}
    plans, issues = plan_chain(validate_config(debug_raw), (1, 8, 8), num_classes=10)
    assert not issues and plans[2].out_shape == (32,)
    debug_raw["stages"][2]["model"]["in_features"] = 16
    with pytest.raises(ConfigError, match="set in_features to 256"):
        validate_config(debug_raw)
