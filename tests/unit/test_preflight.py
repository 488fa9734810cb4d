"""Meta-device shape preflight: mismatches name both stages and shapes; adapters fix them."""

from __future__ import annotations

import pytest
import torch
from paths import CONFIGS
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


@pytest.mark.parametrize(
    ("kind", "path", "said", "fix"),
    [
        ("tuple", "stages[0].model", "returns a tuple, not a tensor", "return one tensor"),
        ("scalar", "stages[0].model", "returns shape (B,): one number per sample", "x.unsqueeze(1)"),
        ("5d", "stages[0].head.pool", "the head on the module's output (B, 1, 8, 8, 8)", "head.pool: flatten"),
    ],
)
def test_a_module_output_the_head_cannot_take_is_blamed_on_the_output_not_the_input(debug_raw, kind, path, said, fix):
    """These read "fails on input shape (B, 1, 8, 8) ... tuple index out of range", with the fix "make the
    module accept (B, 1, 8, 8)"; a 5-D output's fix was "use head.type: linear", the type it had."""
    debug_raw["trusted_modules"] = ["user_models"]
    debug_raw["stages"][0]["model"] = {"type": "user_models:shaped_output", "kind": kind}
    with pytest.raises(ConfigError) as info:
        validate_config(debug_raw)
    (issue,) = info.value.issues
    assert issue.path == path and said in issue.message and fix in issue.fix, issue.render()
    assert "input shape" not in issue.message


def test_a_module_that_branches_on_values_is_checked_on_one_real_batch(debug_raw):
    """Meta tensors have no values: `if y.mean() > 0` failed the check with "Tensor.item() cannot be called on
    meta tensors" and the fix "make the module accept (B, 1, 8, 8)", so such a module could never train."""
    debug_raw["trusted_modules"] = ["user_models"]
    debug_raw["stages"][0]["model"] = {"type": "user_models:gated", "width": 16}
    plans, issues = plan_chain(validate_config(debug_raw), (1, 8, 8), num_classes=10)
    assert not issues and plans[0].out_shape == (16, 8, 8)
    debug_raw["stages"][0]["model"]["width"] = 8  # its output shape, found on the CPU, still checks the next stage
    with pytest.raises(ConfigError, match=r"stages\[1\]\.model\.in_channels: .*\(B, 8, 8, 8\)"):
        validate_config(debug_raw)


@pytest.mark.parametrize(
    ("shape", "said"),
    [
        ([8, 8, 1], "set data.inputs.shape: [1, 8, 8] (with one channel"),
        ([8, 8, 3], "set data.inputs.shape: [3, 8, 8] and write the rows"),
    ],
)
def test_a_channels_last_shape_gets_the_layout_fix_first(debug_raw, shape, said):
    """[8, 8, 1] on 64 flat values got only "set in_channels: 8", which validates and trains on scrambled
    images."""
    debug_raw["stages"][0]["model"]["in_channels"] = shape[-1]
    plans, issues = plan_chain(validate_config(debug_raw, preflight=False), tuple(shape), num_classes=10)
    (issue,) = issues
    assert issue.path == "stages[0].model.in_channels" and issue.fix.startswith(f"data.inputs.shape {shape} puts")
    assert said in issue.fix and "set stages[0].model.in_channels: 8" in issue.fix


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


def test_plans_are_remembered_per_architecture_and_a_worker_seeded_with_them_does_not_plan(debug_raw, tmp_path):
    """A Tune trial of solver values has its base's plans; a worker given them skips the meta run
    (the first in a process imports torch's compiler stack, about a second)."""
    import pickle
    import subprocess
    import sys

    from cascade_ray.models import plan as planning

    cfg = validate_config(debug_raw)
    planning._PLANS.clear()
    base = planning.require_plans(cfg, (1, 8, 8), 10)
    debug_raw["stages"][2]["solver"]["lr"] = 0.5  # a trial's value: same architecture, same plans
    trial = validate_config(debug_raw)
    assert planning.require_plans(trial, (1, 8, 8), 10) == base and len(planning._PLANS) == 1
    debug_raw["stages"][2]["model"]["hidden"] = [8]  # another architecture: planned again
    assert planning.require_plans(validate_config(debug_raw), (1, 8, 8), 10) != base and len(planning._PLANS) == 2
    # the strategy checks still run per config, from the remembered module facts: a foreign first
    # stage (no cascade_layers()) planned once, then asked to checkpoint activations
    debug_raw["stages"][2]["model"]["hidden"] = trial.stages[2].model.hidden
    debug_raw["trusted_modules"] = ["user_models"]
    debug_raw["stages"][0]["model"] = {"type": "user_models:tiny_cnn", "width": 16}
    foreign = validate_config(debug_raw)
    planning.require_plans(foreign, (1, 8, 8), 10)
    debug_raw["stages"][0]["train"] = {**debug_raw["stages"][0].get("train", {}), "activation_checkpointing": True}
    checkpointed = validate_config(debug_raw, preflight=False)
    assert planning._plan_key(checkpointed, (1, 8, 8), 10) in planning.known_plans()
    with pytest.raises(ConfigError, match=r"stages\[0\].train.activation_checkpointing.*Sequential"):
        planning.require_plans(checkpointed, (1, 8, 8), 10)

    entries = tmp_path / "plans.pkl"
    key = planning._plan_key(cfg, (1, 8, 8), 10)
    entries.write_bytes(pickle.dumps({key: planning.known_plans()[key]}))
    code = f"""
import pickle, sys
import torch
from cascade_ray.checks import validate_config
from cascade_ray.config.yaml_io import read_yaml
from cascade_ray.data import load_digits
from cascade_ray.models.plan import remember_plans
from cascade_ray.stage.setup import build_stage_model
cfg = validate_config(read_yaml({str(CONFIGS / "debug.yaml")!r}), preflight=False)
data = load_digits(train_size=None, val_fraction=0.2, seed=0)
if sys.argv[1] == "seeded":
    remember_plans(pickle.loads(open({str(entries)!r}, "rb").read()))
build_stage_model(cfg, 2, data, None)
print("planned" if "torch._dynamo" in sys.modules else "not planned")
"""
    runs = {
        how: subprocess.run([sys.executable, "-c", code, how], capture_output=True, text=True, timeout=120)
        for how in ("seeded", "fresh")
    }
    assert runs["seeded"].stdout.split()[-2:] == ["not", "planned"], runs["seeded"].stderr[-2000:]
    assert runs["fresh"].stdout.split()[-1:] == ["planned"], runs["fresh"].stderr[-2000:]
