"""The solver: torch-exact schedules, param groups, strict keys, step-count preflight, precision, clipping."""

from __future__ import annotations

import math
import pickle

import pytest
import torch
from paths import CONFIGS

from cascade_ray.checks import load_config, validate_config
from cascade_ray.config.schema import EarlyStoppingConfig, GradClipConfig, SchedulerConfig, SolverConfig
from cascade_ray.data.batches import accumulation_windows, num_optimizer_steps
from cascade_ray.errors import ConfigError, HealthError
from cascade_ray.solver import (
    EarlyStopping,
    build_optimizer,
    build_param_groups,
    build_precision,
    build_scheduler,
    clip_gradients,
    lr_factor,
    step_count_issues,
)
from cascade_ray.stage.setup import build_stage_model


def issues_of(raw) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        validate_config(raw)
    return {issue.path: issue.render() for issue in info.value.issues}


def _torch_lrs(make, steps: int, lr: float = 0.1) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = make(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize(
    ("cfg", "make"),
    [
        (SchedulerConfig(type="StepLR", step_size=7, gamma=0.5), lambda o: torch.optim.lr_scheduler.StepLR(o, 7, 0.5)),
        (
            SchedulerConfig(type="MultiStepLR", milestones=[5, 20, 33], gamma=0.3),
            lambda o: torch.optim.lr_scheduler.MultiStepLR(o, [5, 20, 33], 0.3),
        ),
        (
            SchedulerConfig(type="CosineAnnealingLR", T_max=40, min_lr_ratio=0.1),
            lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 40, eta_min=0.01),
        ),
        (
            SchedulerConfig(type="OneCycleLR", pct_start=0.25),
            lambda o: torch.optim.lr_scheduler.OneCycleLR(
                o, max_lr=0.1, total_steps=40, pct_start=0.25, cycle_momentum=False
            ),
        ),
    ],
    ids=["StepLR", "MultiStepLR", "CosineAnnealingLR", "OneCycleLR"],
)
def test_schedules_follow_torch_exactly(cfg, make):
    ours = [0.1 * lr_factor(cfg, k, 40) for k in range(40)]
    assert ours == pytest.approx(_torch_lrs(make, 40), rel=1e-9, abs=1e-12)


def test_warmup_rises_linearly_into_any_schedule_and_cosine_stays_at_its_floor():
    cfg = SchedulerConfig(type="cosine", warmup_steps=4, min_lr_ratio=0.2, T_max=10)
    assert [lr_factor(cfg, k, 100) for k in range(4)] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert lr_factor(cfg, 4, 100) == pytest.approx(1.0)
    assert lr_factor(cfg, 60, 100) == pytest.approx(0.2)  # past T_max: flat, never back up
    one = SchedulerConfig(type="OneCycleLR", warmup_steps=3)
    assert lr_factor(one, 2, 50) == pytest.approx(0.75 / 25)  # warms up to the cycle's first value, lr / div_factor


def test_lr_schedule_keeps_group_ratios_counts_steps_and_reduces_on_plateau():
    groups = [
        {"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 0.1},
        {"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 0.01},
    ]
    opt = torch.optim.SGD(groups, lr=0.1)
    sched = build_scheduler(
        opt, SchedulerConfig(type="ReduceLROnPlateau", patience=1, factor=0.5, min_lr_ratio=0.3), total=10
    )
    sched.step()
    assert sched.steps == 1 and sched.get_last_lr() == pytest.approx([0.1, 0.01])
    assert not sched.step_epoch({"val_loss": 1.0})
    assert not sched.step_epoch({"val_loss": 1.0})  # 1 bad epoch <= patience
    assert sched.step_epoch({"val_loss": 1.0})
    assert sched.get_last_lr() == pytest.approx([0.05, 0.005])
    for _ in range(6):
        sched.step_epoch({"val_loss": 1.0})
    assert sched.get_last_lr() == pytest.approx([0.03, 0.003])  # floored at min_lr_ratio
    state = sched.state_dict()
    again = build_scheduler(opt, sched.cfg, total=10)
    again.load_state_dict(state)
    assert again.get_last_lr() == pytest.approx([0.03, 0.003]) and again.steps == 1


def test_param_groups_first_match_wins_no_decay_on_1d_and_frozen_never_included(digits):
    cfg = load_config(
        CONFIGS / "debug.yaml",
        [
            "stages[1].solver.weight_decay=0.1",
            "stages[1].solver.param_groups=[{match: '^heads\\.', lr: 0.003}, {match: 'heads|layers', lr: 0.5, weight_decay: 0.2}]",
        ],
    )
    model, _ = build_stage_model(cfg, 1, digits, None)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = build_optimizer(
        build_param_groups(named, cfg.stages[1].solver, "stages[1].solver", "encoder"), cfg.stages[1].solver
    )
    by_name = {n: g for g in opt.param_groups for n in g["param_names"]}
    assert set(by_name) == {n for n, _ in named}
    assert not any(n.startswith(("blocks.features", "heads.features")) for n in by_name), (
        "frozen parameters are in the optimizer"
    )
    assert (
        by_name["heads.encoder.fc.weight"]["lr"] == 0.003 and by_name["heads.encoder.fc.weight"]["weight_decay"] == 0.1
    )
    assert by_name["heads.encoder.fc.bias"]["weight_decay"] == 0.0  # 1-D: no decay
    layer_w = next(n for n in by_name if ".layers." in n and n.endswith("linear1.weight"))
    assert by_name[layer_w]["lr"] == 0.5 and by_name[layer_w]["weight_decay"] == 0.2
    norm_w = next(n for n in by_name if n.endswith("norm.weight"))
    assert by_name[norm_w]["weight_decay"] == 0.0 and by_name[norm_w]["lr"] == cfg.stages[1].solver.lr
    cfg2 = load_config(
        CONFIGS / "debug.yaml", ["stages[1].solver.decay_bias_and_norm=true", "stages[1].solver.weight_decay=0.1"]
    )
    groups = build_param_groups(named, cfg2.stages[1].solver, "stages[1].solver", "encoder")
    assert [g["weight_decay"] for g in groups] == [0.1]


@pytest.mark.parametrize(
    ("override", "path", "text"),
    [
        (
            "stages[0].solver.param_groups=[{match: 'nothing_here'}]",
            "stages[0].solver.param_groups[0].match",
            "matches no trainable parameter",
        ),
        (
            "stages[0].solver.param_groups=[{match: heads}, {match: '^heads\\.features'}]",
            "stages[0].solver.param_groups[1].match",
            "taken by an earlier group",
        ),
        (
            "stages[0].solver.param_groups=[{match: '(unclosed'}]",
            "stages[0].solver.param_groups[0].match",
            "not a valid regex",
        ),
        (
            "stages[1].solver.param_groups=[{match: features}]",
            "stages[1].solver.param_groups[0].match",
            "matches no trainable parameter",
        ),
        (
            "stages[0].solver.param_groups=[{match: heads, momentum: 0.9}]",
            "stages[0].solver.param_groups[0].momentum",
            "AdamW takes no 'momentum'",
        ),
        (
            "stages[0].solver.lr_scheduler={type: StepLR}",
            "stages[0].solver.lr_scheduler.step_size",
            "StepLR needs step_size",
        ),
        (
            "stages[0].solver.lr_scheduler={type: cosine, step_size: 5}",
            "stages[0].solver.lr_scheduler.step_size",
            "cosine does not use 'step_size'",
        ),
        (
            "stages[0].solver.lr_scheduler={type: MultiStepLR, milestones: [5, 3]}",
            "stages[0].solver.lr_scheduler.milestones",
            "strictly increasing",
        ),
        (
            "stages[0].solver.lr_scheduler={type: Cosine}",
            "stages[0].solver.lr_scheduler.type",
            "valid: constant, StepLR",
        ),
        (
            "stages[0].solver.grad_clip={enabled: true, mode: value}",
            "stages[0].solver.grad_clip.clip_value",
            "mode value needs clip_value",
        ),
        (
            "stages[0].solver.precision=fp32|stages[0].solver.scaler={init_scale: 1024.0}",
            "stages[0].solver.scaler",
            "only used with precision fp16",
        ),
        (
            "stages[0].solver.precision=fp16|stages[0].scaling.use_gpu=false",
            "stages[0].solver.precision",
            "precision: bf16",
        ),
        (
            "stages[0].train.early_stopping={metric: val_accuracy, mode: min}",
            "stages[0].train.early_stopping.mode",
            "set mode: max",
        ),
        ("stages[0].health.stall.policy=Warn", "stages[0].health.stall.policy", "did you mean 'warn'"),
    ],
)
def test_solver_problems_name_key_and_fix(override, path, text):
    with pytest.raises(ConfigError) as info:
        load_config(CONFIGS / "debug.yaml", override.split("|"))
    found = {i.path: i.render() for i in info.value.issues}
    assert path in found, found
    assert text in found[path]


def test_a_dumped_config_revalidates_clean(debug_raw):
    """Ray workers and Tune trials re-validate cfg.model_dump(): every default must pass the strict checks."""
    debug_raw["stages"][0]["solver"].update(
        lr_scheduler={"type": "StepLR", "step_size": 5}, grad_clip={"enabled": True, "mode": "value", "clip_value": 0.5}
    )
    cfg = validate_config(debug_raw)
    assert validate_config(cfg.model_dump()) == cfg
    assert validate_config(cfg.model_dump(mode="json")) == cfg


def test_step_count_preflight_reports_both_numbers(debug_raw):
    n_train = 1149  # digits, val_fraction 0.2: 36 micro-batches of 32 per epoch, 2 epochs
    debug_raw["stages"][0]["solver"]["lr_scheduler"] = {"type": "cosine", "T_max": 720}
    debug_raw["stages"][1]["solver"]["lr_scheduler"] = {"type": "cosine", "T_max": 100}
    debug_raw["stages"][2]["solver"]["accumulation_steps"] = 64
    cfg = validate_config(debug_raw)
    errors, warnings = step_count_issues(cfg, n_train)
    # stage 1 runs on 2 workers: 18 micro-batches each, 36 steps; 100 > 2x36 is an error too
    assert [e.path for e in errors] == ["stages[0].solver.lr_scheduler.T_max", "stages[1].solver.lr_scheduler.T_max"]
    assert (
        "T_max 720" in errors[0].message
        and "72 optimizer steps" in errors[0].message
        and "set T_max: 72" in errors[0].fix
    )
    assert "36 optimizer steps" in errors[1].message and "2 worker(s)" in errors[1].message
    paths = {w.path for w in warnings}
    assert "stages[2].solver.accumulation_steps" in paths
    debug_raw["stages"][1]["solver"]["lr_scheduler"] = {"type": "cosine", "T_max": 50}
    errors, warnings = step_count_issues(validate_config(debug_raw), n_train)
    assert "stages[1].solver.lr_scheduler.T_max" in {w.path for w in warnings}  # 50 vs 36: within 2x, a warning
    debug_raw["stages"][0]["solver"]["lr_scheduler"] = {"type": "constant", "warmup_steps": 500}
    errors, _ = step_count_issues(validate_config(debug_raw), n_train)
    assert any(e.path == "stages[0].solver.lr_scheduler.warmup_steps" for e in errors)


def test_step_count_preflight_bounds_total_steps_and_batch_size_by_the_data(debug_raw):
    debug_raw["stages"][0]["train"] = {"epochs": 100_000, "batch_size": 1}  # each under its own bound
    debug_raw["stages"][2]["train"] = {"epochs": 2, "batch_size": 400_000}
    errors, warnings = step_count_issues(validate_config(debug_raw), 20_000)
    by_path = {e.path: e for e in errors}
    assert set(by_path) == {"stages[0].train.epochs", "stages[2].train.batch_size"}, by_path
    assert "2000000000 optimizer steps" in by_path["stages[0].train.epochs"].message
    assert "over the bound of 1000000000" in by_path["stages[0].train.epochs"].message
    assert "at most 20000" in by_path["stages[2].train.batch_size"].fix
    debug_raw["stages"][2]["train"] = {"epochs": 2, "batch_size": 30_000}  # > the split, < 16x it: only a warning
    errors, warnings = step_count_issues(validate_config(debug_raw), 20_000)
    assert "stages[2].train.batch_size" in {w.path for w in warnings}
    assert "stages[2].train.batch_size" not in {e.path for e in errors}


def test_accumulation_windows_cover_every_micro_batch_once():
    windows = list(accumulation_windows(iter(range(10)), 10, 4))
    assert [b for b, _, _ in windows] == list(range(10))
    assert [size for _, size, _ in windows] == [4] * 8 + [2] * 2
    assert [i for i, (_, _, last) in enumerate(windows) if last] == [3, 7, 9]
    assert num_optimizer_steps(1149, 32, 1, 4) == 9 and num_optimizer_steps(1149, 40, 1, 4) == 8


def test_precision_fp16_needs_cuda_and_bf16_autocasts_on_cpu():
    with pytest.raises(ConfigError, match="precision: bf16"):
        build_precision(SolverConfig(precision="fp16"), torch.device("cpu"), "stages[0].solver")
    bf16 = build_precision(SolverConfig(precision="bf16"), torch.device("cpu"), "stages[0].solver")
    with bf16.autocast():
        assert torch.nn.Linear(4, 4)(torch.randn(2, 4)).dtype == torch.bfloat16
    assert bf16.scaler is None and bf16.scale is None


def test_clipping_uses_the_global_norm_and_value_mode_clamps():
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))
    a.grad, b.grad = torch.full((3,), 3.0), torch.full((4,), 4.0)  # global norm sqrt(27 + 64)
    norm = clip_gradients([a, b], GradClipConfig(enabled=True, max_norm=1.0))
    assert float(norm) == pytest.approx(math.sqrt(91))
    assert float(torch.cat([a.grad, b.grad]).norm()) == pytest.approx(1.0, rel=1e-5)
    assert float(a.grad[0] / b.grad[0]) == pytest.approx(0.75)  # one common factor, not per parameter
    a.grad = torch.tensor([5.0, -5.0, 0.1])
    assert clip_gradients([a], GradClipConfig(enabled=True, mode="value", clip_value=0.5)) is None
    assert a.grad.tolist() == pytest.approx([0.5, -0.5, 0.1])
    assert clip_gradients([a], GradClipConfig()) is None


def test_early_stopping_counts_epochs_without_improvement():
    stop = EarlyStopping(EarlyStoppingConfig(metric="val_accuracy", patience=2, min_delta=0.01))
    assert [stop.update({"val_accuracy": v}) for v in (0.5, 0.6, 0.605, 0.6)] == [False, False, False, True]
    assert "val_accuracy did not improve" in stop.reason()
    assert not EarlyStopping(None).update({"val_loss": 1.0})


def test_health_error_pickles_with_its_fields():
    err = HealthError("stall", "features", 50, "ratio 1e-12", "stages[0].solver.lr", "raise it")
    back = pickle.loads(pickle.dumps(err))
    assert (back.rule, back.stage, back.step, back.key, back.fix) == (
        "stall",
        "features",
        50,
        "stages[0].solver.lr",
        "raise it",
    )
    assert str(back) == str(err) and "key: stages[0].solver.lr" in str(err)
