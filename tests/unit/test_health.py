"""The health monitor: healthy runs raise nothing, policies warn/off, rules name the right key."""

from __future__ import annotations

import math

import pytest
import torch
from fakes import ListReporter
from paths import CONFIGS

from cascade_ray.checks import load_config
from cascade_ray.errors import HealthError
from cascade_ray.stage.hooks import LoopHooks
from cascade_ray.stage.loop import run_stage

CPU = torch.device("cpu")
RULES = ("nonfinite", "grad_flow", "stall", "clip_saturation", "scale_collapse", "lr_drift", "frozen_drift")


def test_the_debug_cascade_trains_with_zero_alarms(digits, capsys):
    # every rule set to warn: an alarm is counted instead of stopping, so "zero" covers all of them
    overrides = [f"stages[{i}].health.{rule}.policy=warn" for i in range(3) for rule in RULES]
    cfg = load_config(CONFIGS / "debug.yaml", overrides)
    upstream = None
    for index in range(3):
        reporter = ListReporter()
        outcome = run_stage(cfg, index, digits, upstream, reporter, CPU)
        upstream = reporter.states[-1]
        assert outcome.health_warnings == 0 and outcome.skipped_steps == 0
        assert all(r["health_warnings"] == 0 for r in reporter.reports)
        assert all(math.isfinite(r["grad_norm"]) and math.isfinite(r["update_ratio"]) for r in reporter.reports)
    assert "WARNING" not in capsys.readouterr().out


def test_warn_policy_prints_once_per_epoch_and_counts_every_firing(digits, capsys):
    cfg = load_config(
        CONFIGS / "debug.yaml",
        ["stages[0].solver.lr=1e-12", "stages[0].health.stall={policy: warn, patience_steps: 10}"],
    )
    reporter = ListReporter()
    outcome = run_stage(cfg, 0, digits, None, reporter, CPU)
    out = capsys.readouterr().out
    # measured every 10 steps, steps 10..60 (the last 5% of 72 are exempt): one firing per measurement
    assert outcome.health_warnings == 6 and [r["health_warnings"] for r in reporter.reports] == [3, 3]
    assert out.count("WARNING health: stage 'features'") == 2 and "key: stages[0].solver.lr" in out


def test_off_skips_every_measurement(digits):
    cfg = load_config(
        CONFIGS / "debug.yaml",
        [f"stages[0].health.{rule}.policy=off" for rule in RULES] + ["stages[0].solver.lr=1e-12"],
    )
    reporter = ListReporter()
    outcome = run_stage(cfg, 0, digits, None, reporter, CPU)
    assert outcome.health_warnings == 0 and math.isnan(reporter.reports[-1]["grad_norm"])


def test_a_schedule_that_decayed_to_nothing_names_the_scheduler(digits):
    overrides = [
        "stages[0].solver.lr_scheduler={type: StepLR, step_size: 5, gamma: 1.0e-6}",
        "stages[0].health.stall.patience_steps=20",
    ]
    err = pytest.raises(
        HealthError, run_stage, load_config(CONFIGS / "debug.yaml", overrides), 0, digits, None, ListReporter(), CPU
    ).value
    assert err.rule == "stall" and err.key == "stages[0].solver.lr_scheduler" and "decayed the lr" in err.fix
    # the same decay inside the exempt tail of the run is no alarm
    cfg = load_config(CONFIGS / "debug.yaml", [*overrides, "stages[0].health.stall.tail_fraction=0.95"])
    assert run_stage(cfg, 0, digits, None, ListReporter(), CPU).health_warnings == 0


def test_zero_initialized_layers_are_not_a_grad_flow_alarm(digits):
    """A zero-init BatchNorm gamma gives the conv before it zero gradients at step 1 only."""

    def zero_last_bn(s):
        bn = [m for m in s.model.blocks["features"].modules() if isinstance(m, torch.nn.BatchNorm2d)][-1]
        torch.nn.init.zeros_(bn.weight)

    zero_at_step_1 = []

    def record(s):
        if s.step == 0:
            zero_at_step_1.extend(n for n, p in s.named_params if p.grad is not None and not p.grad.any())

    cfg = load_config(CONFIGS / "debug.yaml", ["stages[0].train.epochs=1"])
    hooks = LoopHooks(on_setup=zero_last_bn, before_optimizer_step=record)
    assert run_stage(cfg, 0, digits, None, ListReporter(), CPU, hooks=hooks).health_warnings == 0
    assert zero_at_step_1 == [
        "blocks.features.blocks.1.shortcut.0.weight"
    ]  # the conv before it: a suspect, then cleared


def test_an_lr_set_by_hand_is_lr_drift(digits):
    def meddle(s):
        if s.step == 3:
            s.optimizer.param_groups[0]["lr"] = 0.5

    cfg = load_config(CONFIGS / "debug.yaml")
    with pytest.raises(HealthError) as info:
        run_stage(cfg, 0, digits, None, ListReporter(), CPU, hooks=LoopHooks(after_optimizer_step=meddle))
    err = info.value
    assert (
        err.rule == "lr_drift"
        and err.step == 4
        and "runs optimizer step 4 at lr 0.5, but the plan says 0.01" in err.detail
    )


def test_clip_saturation_reuses_the_clipping_norm_and_names_the_typical_norm(digits):
    cfg = load_config(
        CONFIGS / "debug.yaml",
        [
            "stages[0].solver.grad_clip={enabled: true, max_norm: 1e-4}",
            "stages[0].health.clip_saturation.patience_steps=20",
        ],
    )
    with pytest.raises(HealthError) as info:
        run_stage(cfg, 0, digits, None, ListReporter(), CPU)
    assert info.value.step == 20 and "(~" in info.value.fix
