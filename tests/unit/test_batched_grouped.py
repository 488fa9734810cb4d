"""Grouped replica steps (stage/grouped.py): replicas of an MLP stage that share a seed run one
batched GEMM per layer, and each still ends as its config trained alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fakes import ListReporter
from paths import CONFIGS

from cascade_ray.checks import load_config
from cascade_ray.pipeline.features import upstream_outputs
from cascade_ray.stage.batched import _replica, train_replicas
from cascade_ray.stage.grouped import GroupedSteps, grouped_layers
from cascade_ray.stage.loop import run_stage
from cascade_ray.stage.setup import build_stage_model
from cascade_ray.tune.sweep import trial_config

CPU = torch.device("cpu")
STAGE = 2
# the demo classifier's shape at debug size: a per-token MLP (pool: none) under a flattening head,
# dropout in both, so the shared masks and each replica's generator matter
DEMO_LIKE = [
    "stages.classifier.model.pool=none",
    "stages.classifier.model.dropout=0.3",
    "stages.classifier.head.pool=flatten",
    "stages.classifier.head.dropout=0.2",
    "stages.classifier.solver.type=AdamW",
]
VALUES = [
    {"solver.lr": 1e-2, "solver.weight_decay": 0.0},
    {"solver.lr": 3e-3, "solver.weight_decay": 1e-2, "loss.scale": 0.5},
    {"solver.lr": 2e-2, "solver.grad_clip.enabled": True, "solver.grad_clip.max_norm": 0.5},
    {"solver.lr": 1e-2, "seed": 7},  # its own seed: its own generator state, so it steps alone
]


def _inputs(digits, overrides):
    cfg = load_config(CONFIGS / "debug.yaml", overrides)
    model, _ = build_stage_model(cfg, STAGE - 1, digits, None)
    upstream = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    out = upstream_outputs(cfg, STAGE, digits, upstream)
    features = {"x_train": out["train"], "x_val": out["val"]}
    return [trial_config(cfg, "classifier", v) for v in VALUES], upstream, features


@pytest.fixture(scope="module")
def demo_like(digits):
    return _inputs(digits, DEMO_LIKE)


def _state(model):
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


@pytest.fixture
def spy(monkeypatch):
    """The sizes of the groups that ran grouped, per call."""
    sizes: list[int] = []
    real = GroupedSteps.forward_backward

    def record(self, group, *args):
        sizes.append(len(group))
        return real(self, group, *args)

    monkeypatch.setattr(GroupedSteps, "forward_backward", record)
    return sizes


@pytest.mark.parametrize("group_size", [8, 2])
def test_grouped_replicas_end_as_their_configs_trained_alone(demo_like, digits, spy, group_size):
    cfgs, upstream, features = demo_like
    replicas = train_replicas(
        cfgs,
        STAGE,
        digits,
        upstream,
        features,
        ListReporter(),
        CPU,
        metric="val_accuracy",
        mode="max",
        group_size=group_size,
    )
    steps = replicas[0].step
    assert steps > 0
    # the three replicas of seed 0 stepped as one group (or a group of two and one alone) on every batch
    assert spy == [min(3, group_size)] * steps
    for cfg, replica in zip(cfgs, replicas):
        lone = ListReporter()
        run_stage(cfg, STAGE, digits, upstream, lone, CPU, features=features)
        mine, alone = _state(replica.setup.model), lone.states[-1]
        assert mine.keys() == alone.keys()
        for key in mine:
            np.testing.assert_allclose(mine[key], alone[key], rtol=1e-5, atol=1e-6, err_msg=key)
        for row, theirs in zip(replica.history, lone.reports, strict=True):
            for name in ("train_loss", "val_loss", "val_accuracy", "lr", "step"):
                assert row[name] == pytest.approx(theirs[name], rel=1e-5), name


def test_group_size_one_steps_every_replica_alone(demo_like, digits, spy):
    cfgs, upstream, features = demo_like
    train_replicas(
        cfgs[:2], STAGE, digits, upstream, features, ListReporter(), CPU, metric="val_loss", mode="min", group_size=1
    )
    assert spy == []


def test_groups_are_runs_of_one_generator_state_and_skip_failed_replicas(demo_like, digits):
    cfgs, upstream, features = demo_like
    replicas = [_replica(cfg, STAGE, digits, upstream, ListReporter(), CPU, None) for cfg in cfgs]
    steps = GroupedSteps(replicas, group_size=8)
    assert steps.groups(replicas) == [replicas[:3]]  # the fourth has its own seed
    replicas[1].error = "diverged"
    assert steps.groups(replicas) == [[replicas[0], replicas[2]]]
    replicas[2].error = "diverged"
    assert steps.groups(replicas) == []  # a group of one steps alone
    assert GroupedSteps(replicas, group_size=1).groups(replicas) == []


@pytest.mark.parametrize(
    ("override", "why"),
    [
        (
            "stages.classifier.train.activation_checkpointing=true",
            "a checkpointed block's forward is not the grouped one",
        ),
        (
            "stages.classifier.model={type: transformer, in_channels: 16, d_model: 16, depth: 1, heads: 2}",
            "not the builtin MLP",
        ),
    ],
)
def test_a_stage_the_grouped_step_cannot_run_steps_alone(digits, override, why):
    cfg = load_config(CONFIGS / "debug.yaml", [override])
    model, _ = build_stage_model(cfg, STAGE - 1, digits, None)
    upstream = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    replica = _replica(cfg, STAGE, digits, upstream, ListReporter(), CPU, None)
    assert grouped_layers(replica) is None, why


def test_a_forward_hook_on_the_stage_keeps_its_replica_alone(demo_like, digits):
    cfgs, upstream, features = demo_like
    replica = _replica(cfgs[0], STAGE, digits, upstream, ListReporter(), CPU, None)
    assert grouped_layers(replica) is not None
    replica.setup.model.heads["classifier"].fc.register_forward_hook(lambda *a: None)
    assert grouped_layers(replica) is None
