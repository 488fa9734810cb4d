"""Every pitfall of the seed's field reports ends in its specific error, naming the key path and the fix.

Config pitfalls fail at load time (ConfigError, exit 2); step-count pitfalls when the
training-set size is known (run_stage start, or the driver's preflight); runtime pitfalls
at the first bad step (HealthError, FrozenDriftError), in-process on the digits data.
Bugs that a config cannot express are simulated through run_stage's hooks
(:mod:`cascade_ray.stage.hooks`).
"""

from __future__ import annotations

import math

import pytest
import torch
from fakes import ListReporter
from paths import CONFIGS

from cascade_ray.checks import load_config
from cascade_ray.errors import ConfigError, FrozenDriftError, HealthError
from cascade_ray.models.weights import to_numpy_state
from cascade_ray.stage.hooks import LoopHooks
from cascade_ray.stage.loop import run_stage
from cascade_ray.stage.setup import build_stage_model

CPU = torch.device("cpu")
DEBUG = CONFIGS / "debug.yaml"


def config_issue(overrides: list[str], path: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(DEBUG, overrides)
    found = {i.path: i.render() for i in info.value.issues}
    assert path in found, found
    return found[path]


def health_error(
    digits, overrides: list[str], index: int = 0, upstream=None, hooks: LoopHooks | None = None
) -> HealthError:
    cfg = load_config(DEBUG, overrides, trust=["pitfall_models", "user_models"])
    with pytest.raises(HealthError) as info:
        run_stage(cfg, index, digits, upstream, ListReporter(), CPU, hooks=hooks)
    return info.value


# --- config time ------------------------------------------------------------------------------


def test_optimizer_typo():
    text = config_issue(["stages[0].solver.type=Adamw"], "stages[0].solver.type")
    assert "unknown optimizer 'Adamw'; did you mean 'AdamW'?" in text and "valid: " in text


def test_betas_as_a_string():
    text = config_issue(['stages[0].solver.betas="0.9, 0.999"'], "stages[0].solver.betas")
    assert "got str '0.9, 0.999'" in text and "fix: write the value unquoted" in text and "betas: [0.9, 0.999]" in text


def test_betas_for_sgd():
    text = config_issue(["stages[0].solver.type=SGD", "stages[0].solver.betas=[0.9, 0.99]"], "stages[0].solver.betas")
    assert "optimizer SGD takes no 'betas' argument" in text and "fix: remove stages[0].solver.betas" in text


def test_param_group_pattern_matching_nothing():
    text = config_issue(
        ["stages[0].solver.param_groups=[{match: '^backbone\\.', lr: 1e-4}]"], "stages[0].solver.param_groups[0].match"
    )
    assert "'^backbone\\\\.'" in text and "matches no trainable parameter" in text and "blocks.features." in text
    assert "fix: fix the regex" in text


def test_fp16_without_a_gpu():
    text = config_issue(
        ["stages[0].solver.precision=fp16", "stages[0].scaling.use_gpu=false"], "stages[0].solver.precision"
    )
    assert "fp16 needs a CUDA GPU" in text and "fix: set stages[0].solver.precision: bf16" in text


# --- once the number of training samples is known ---------------------------------------------


def test_scheduler_length_10x_the_real_step_count(digits):
    cfg = load_config(DEBUG, ["stages[0].solver.lr_scheduler={type: CosineAnnealingLR, T_max: 720}"])
    with pytest.raises(ConfigError) as info:
        run_stage(cfg, 0, digits, None, ListReporter(), CPU)
    (issue,) = info.value.issues
    assert issue.path == "stages[0].solver.lr_scheduler.T_max"
    assert (
        "T_max 720 optimizer steps, but the stage takes 72 optimizer steps" in issue.message and "10x" in issue.message
    )
    assert "set T_max: 72" in issue.fix


# --- runtime: the first bad step --------------------------------------------------------------


def test_lr_1e_12_stalls(digits):
    err = health_error(digits, ["stages[0].solver.lr=1e-12"])
    assert err.rule == "stall" and err.stage == "features" and err.step == 50
    assert "||dtheta||/||theta|| = " in err.detail and "< 1e-08" in err.detail and "lr 1e-12" in err.detail
    assert err.key == "stages[0].solver.lr" and "raise stages[0].solver.lr (now 1e-12" in err.fix


def test_clip_max_norm_1e_8_saturates(digits):
    err = health_error(digits, ["stages[0].solver.grad_clip={enabled: true, max_norm: 1e-8}"])
    assert (
        err.rule == "clip_saturation"
        and "pre-clip gradient norm" in err.detail
        and "x grad_clip.max_norm 1e-08" in err.detail
    )
    assert err.key == "stages[0].solver.grad_clip.max_norm" and "raise stages[0].solver.grad_clip.max_norm" in err.fix


def test_module_cut_off_from_the_loss(digits):
    err = health_error(
        digits,
        [
            "stages=[{name: features, model: {type: 'pitfall_models:cut_off', in_channels: 1, width: 8}, train: {epochs: 1, batch_size: 32}}]"
        ],
    )
    assert err.rule == "grad_flow" and err.step == 1
    assert (
        "blocks.features.stem.weight" in err.detail
        and "blocks.features.stem.bias" in err.detail
        and "None gradients" in err.detail
    )
    assert "blocks.features.body" not in err.detail
    assert err.key == "stages[0].model" and "make the module's forward use them (a .detach()" in err.fix


def test_nan_injected_in_the_loss(digits):
    err = health_error(
        digits,
        [
            "stages=[{name: features, model: {type: 'pitfall_models:nan_after', after: 5}, train: {epochs: 1, batch_size: 32}}]"
        ],
    )
    assert err.rule == "nonfinite" and err.step == 10
    assert "the training loss became NaN/inf between optimizer steps 1 and 10" in err.detail
    assert err.key == "stages[0].solver.lr" and "lower stages[0].solver.lr" in err.fix and "grad_clip" in err.fix


def test_fp16_scale_collapse_simulated_on_cpu(digits):
    """fp16 needs CUDA, so a CPU GradScaler stands in (make_scaler) and every micro-batch's gradients overflow."""
    seen = {}

    def overflow(s):
        s.named_params[0][1].grad.fill_(math.inf)
        seen["state"] = s

    hooks = LoopHooks(
        make_scaler=lambda c: torch.amp.GradScaler("cpu", init_scale=c.init_scale, growth_interval=c.growth_interval),
        after_backward=overflow,
    )
    err = health_error(digits, ["stages[0].solver.precision=fp16", "stages[0].scaling.use_gpu=true"], hooks=hooks)
    assert err.rule == "scale_collapse" and err.step == 12
    assert "12 consecutive and 12 total optimizer steps skipped" in err.detail and "loss scale 16" in err.detail
    assert err.key == "stages[0].solver.precision" and "precision: bf16" in err.fix
    assert seen["state"].scheduler.steps == 0  # a skipped step never advances the lr plan


def test_scheduler_stepped_per_micro_batch_under_accumulation(digits):
    hooks = LoopHooks(after_backward=lambda s: s.scheduler.step())  # the classic bug, in user code
    err = health_error(
        digits, ["stages[0].solver.accumulation_steps=4", "stages[0].solver.lr_scheduler={type: cosine}"], hooks=hooks
    )
    assert err.rule == "lr_drift" and err.step == 1
    assert (
        "stepped 4 time(s) before optimizer step 1, but 0 optimizer step(s) were taken with accumulation_steps 4"
        in err.detail
    )
    assert (
        err.key == "stages[0].solver.lr_scheduler"
        and "once per optimizer step" in err.fix
        and "never per micro-batch" in err.fix
    )


def test_batchnorm_left_in_train_mode_in_a_frozen_stage(digits):
    cfg = load_config(DEBUG)
    model, _ = build_stage_model(cfg, 0, digits, None)
    upstream = to_numpy_state(model.state_dict())
    hooks = LoopHooks(on_setup=lambda s: s.model.set_frozen_modules([]))  # nothing re-pins the frozen stage to eval
    with pytest.raises(FrozenDriftError) as info:
        run_stage(cfg, 1, digits, upstream, ListReporter(), CPU, hooks=hooks)
    text = str(info.value)
    assert (
        "stage 'encoder', optimizer step 0" in text
        and "frozen module(s) are in train mode" in text
        and "blocks.features" in text
    )
    assert "BatchNorm running statistics" in text
    assert "key: stages[1].trainable_layers" in text and "keep frozen modules in eval mode" in text


def test_a_frozen_module_that_writes_its_buffers_in_eval_mode(digits):
    overrides = [
        "stages=[{name: counter, model: {type: 'user_models:drifting', in_features: 64, width: 16}, train: {epochs: 1}}, "
        "{name: classifier, model: {type: mlp, in_features: 16, hidden: [32]}, train: {epochs: 1, batch_size: 32}}]"
    ]
    cfg = load_config(DEBUG, overrides, trust=["user_models"])
    model, _ = build_stage_model(cfg, 0, digits, None)
    with pytest.raises(FrozenDriftError) as info:
        run_stage(cfg, 1, digits, to_numpy_state(model.state_dict()), ListReporter(), CPU)
    text = str(info.value)
    assert "blocks.counter.calls" in text and "key: stages[1].trainable_layers" in text
