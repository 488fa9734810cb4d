"""One stage setup: run_stage, lr-find and diagnose train the same model, groups and loss."""

from __future__ import annotations

import pytest
import torch
from fakes import ListReporter
from paths import CONFIGS

import cascade_ray.stage.loop as loop_mod
import cascade_ray.stage.setup as setup_mod
from cascade_ray.checks import load_config
from cascade_ray.stage.hooks import LoopHooks, LoopState
from cascade_ray.stage.loop import run_stage
from cascade_ray.stage.monitor import HealthMonitor
from cascade_ray.stage.setup import StageSetup, setup_stage
from cascade_ray.tools.diagnose import diagnose
from cascade_ray.tools.lrfind import lr_find

CPU = torch.device("cpu")
WEIGHTED = "stages.joint.loss.weights={features: 0.05, classifier: 2.0}"


def _signature(setup: StageSetup) -> dict:
    """What must agree between the loop and the tools: groups (by parameter name), loss, precision."""
    names = {id(p): n for n, p in setup.named_params}
    groups = [
        {
            **{k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")},
            "base_lr": base,
            "params": [names[id(p)] for p in g["params"]],
        }
        for g, base in zip(setup.optimizer.param_groups, setup.scheduler.base_lrs)
    ]
    return {
        "optimizer": type(setup.optimizer).__name__,
        "groups": groups,
        "scales": setup.scales,
        "log_vars": None if setup.log_vars is None else tuple(setup.log_vars.shape),
        "precision": setup.precision.name,
        "total_steps": setup.total_steps,
    }


@pytest.mark.parametrize("overrides", [[WEIGHTED], [WEIGHTED, "stages.joint.loss.weighting=uncertainty"]])
def test_run_stage_lr_find_and_diagnose_train_with_the_same_setup(digits, monkeypatch, overrides):
    cfg = load_config(CONFIGS / "debug_joint.yaml", ["stages.joint.train.max_steps=2", *overrides])
    index = 3
    built: list[StageSetup] = []
    losses: list[int] = []

    def spy(*args, **kwargs):
        built.append(setup_stage(*args, **kwargs))
        losses.append(0)
        return built[-1]

    real_loss = StageSetup.loss

    def counting_loss(self, net, x, y):
        losses[-1] += 1
        return real_loss(self, net, x, y)

    # loop.py binds setup_stage at import; lr_find imports it from its module when called
    monkeypatch.setattr(loop_mod, "setup_stage", spy)
    monkeypatch.setattr(setup_mod, "setup_stage", spy)
    monkeypatch.setattr(StageSetup, "loss", counting_loss)

    seen: list[LoopState] = []
    run_stage(cfg, index, digits, None, ListReporter(), CPU, hooks=LoopHooks(on_setup=seen.append))
    lr_find(cfg, index, digits, steps=2)
    report = diagnose(cfg, index, digits, steps=1)

    assert len(built) == 3, "run_stage, lr_find and diagnose each build their stage through setup_stage"
    assert all(n > 0 for n in losses), f"each takes its loss from the setup: {losses} loss calls"
    # the loop trains exactly the objects setup_stage returned
    assert seen[0].optimizer is built[0].optimizer and seen[0].named_params is built[0].named_params
    fresh = _signature(setup_stage(cfg, index, digits, None, CPU))
    assert fresh["scales"] == {"features": 0.05, "encoder": cfg.stages[1].loss.scale, "classifier": 2.0}
    for setup in built:
        assert _signature(setup) == fresh
    # and what diagnose reports is what it trained
    assert [(g["name"], g["lr"], g["weight_decay"]) for g in report["optimizer"]["groups"]] == [
        (g["name"], g["base_lr"], g["weight_decay"]) for g in fresh["groups"]
    ]


def test_setup_loss_applies_the_weights_and_uncertainty_weighting(digits):
    cfg = load_config(
        CONFIGS / "debug_joint.yaml",
        [WEIGHTED, "stages.joint.loss.weighting=uncertainty", "stages.joint.loss.label_smoothing=0.1"],
    )
    setup = setup_stage(cfg, 3, digits, None, CPU)
    assert setup.heads == ["features", "encoder", "classifier"] and setup.named_params[-1][0] == "loss.log_vars"
    with torch.no_grad():
        setup.log_vars.copy_(torch.tensor([0.5, -0.25, 1.0]))
        x = torch.as_tensor(digits.x_train[:16], dtype=torch.float32)
        x = (x - digits.mean) / digits.std
        y = torch.as_tensor(digits.y_train[:16], dtype=torch.long)
        loss, terms = setup.loss(setup.model, x, y)
        outs = setup.model(x, heads=setup.heads)
    ce = [torch.nn.functional.cross_entropy(outs[n], y, label_smoothing=0.1) for n in setup.heads]
    s = setup.log_vars.detach()
    expected = sum(torch.exp(-s[i]) * w * ce[i] + s[i] for i, w in enumerate([0.05, cfg.stages[1].loss.scale, 2.0]))
    assert [float(t) for t in terms] == pytest.approx([float(c) for c in ce], rel=1e-6)
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)


def test_loop_state_and_health_monitor_take_keywords_only(digits):
    cfg = load_config(CONFIGS / "debug.yaml")
    s = setup_stage(cfg, 0, digits, None, CPU)
    args = (s.stage, 0, s.named_params, s.optimizer, s.scheduler, s.precision, s.model, s.plan)
    with pytest.raises(TypeError):
        HealthMonitor(*args)
    monitor = HealthMonitor(
        stage=s.stage,
        index=0,
        named=s.named_params,
        optimizer=s.optimizer,
        scheduler=s.scheduler,
        precision=s.precision,
        model=s.model,
        plan=s.plan,
    )
    with pytest.raises(TypeError):
        LoopState(s.stage, 0, s.model, s.model, s.plan, s.named_params, s.optimizer, s.scheduler, s.precision, monitor)
    state = LoopState(
        stage=s.stage,
        index=0,
        model=s.model,
        net=s.model,
        plan=s.plan,
        named_params=s.named_params,
        optimizer=s.optimizer,
        scheduler=s.scheduler,
        precision=s.precision,
        monitor=monitor,
    )
    assert (state.step, state.rank, state.world, monitor.rank) == (0, 0, 1, 0)
