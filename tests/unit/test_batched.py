"""Batched sweeps in-process (no Ray): each replica trains exactly as its config alone, and the
report carries the best replica's best epoch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fakes import ListReporter
from paths import CONFIGS

from cascade_ray.checks import load_config
from cascade_ray.pipeline.features import upstream_outputs
from cascade_ray.stage.batched import run_batched, train_replicas
from cascade_ray.stage.loop import run_stage
from cascade_ray.stage.setup import build_stage_model
from cascade_ray.tune.sweep import trial_config

CPU = torch.device("cpu")
STAGE = 2  # the classifier: trains on the cached outputs of features + encoder
VALUES = [  # per-replica solver and loss values, as a space would sample them
    {"solver.lr": 1e-2, "solver.weight_decay": 0.0},
    {
        "solver.lr": 3e-3,
        "solver.weight_decay": 1e-3,
        "solver.grad_clip.enabled": True,
        "solver.grad_clip.max_norm": 0.5,
    },
    {"solver.lr": 2e-2, "loss.scale": 0.5, "solver.type": "SGD"},
]


@pytest.fixture(scope="module")
def inputs(digits):
    """The debug classifier with dropout (so the per-replica RNG matters), a seeded upstream and its features."""
    cfg = load_config(CONFIGS / "debug.yaml", ["stages.classifier.model.dropout=0.3"])
    model, _ = build_stage_model(cfg, STAGE - 1, digits, None)
    upstream = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    out = upstream_outputs(cfg, STAGE, digits, upstream)
    features = {"x_train": out["train"], "x_val": out["val"]}
    return cfg, [trial_config(cfg, "classifier", v) for v in VALUES], upstream, features


@pytest.fixture(scope="module")
def lone_runs(inputs, digits):
    """Each config trained alone by the stage loop (what one Tune trial runs)."""
    _, cfgs, upstream, features = inputs
    runs = []
    for cfg in cfgs:
        reporter = ListReporter()
        run_stage(cfg, STAGE, digits, upstream, reporter, CPU, features=features)
        runs.append(reporter)
    return runs


def test_each_replica_ends_with_the_weights_of_its_config_trained_alone(inputs, lone_runs, digits):
    _, cfgs, upstream, features = inputs
    replicas = train_replicas(
        cfgs, STAGE, digits, upstream, features, ListReporter(), CPU, metric="val_accuracy", mode="max"
    )
    finals = []
    for replica, lone in zip(replicas, lone_runs):
        state = {k: v.detach().numpy() for k, v in replica.setup.model.state_dict().items()}
        alone = lone.states[-1]
        assert state.keys() == alone.keys()
        for key in state:
            np.testing.assert_allclose(state[key], alone[key], rtol=1e-5, atol=1e-6, err_msg=key)
        for mine, theirs in zip(replica.history, lone.reports, strict=True):
            for name in ("train_loss", "val_loss", "val_accuracy", "lr", "step"):
                assert mine[name] == pytest.approx(theirs[name], rel=1e-5), name
        finals.append(state["blocks.classifier.blocks.0.0.weight"])
    # the replicas really differ (a shared optimizer or RNG would not show up above otherwise)
    assert not np.allclose(finals[0], finals[1]) and not np.allclose(finals[0], finals[2])


def test_the_report_is_the_best_replicas_best_epoch(inputs, lone_runs, digits):
    cfg, cfgs, upstream, features = inputs
    reporter = ListReporter()
    outcome = run_batched(cfgs, STAGE, digits, upstream, features, reporter, CPU, metric="val_accuracy", mode="max")
    scores = [max(r["val_accuracy"] for r in lone.reports) for lone in lone_runs]
    assert outcome.best == int(np.argmax(scores))
    assert len(outcome.histories) == len(cfgs) and all(len(h) == 2 for h in outcome.histories)
    (report,) = reporter.reports  # one report, after every epoch of every replica
    assert report["replica"] == outcome.best
    lone = lone_runs[outcome.best]
    # train.metric (val_loss by default) picks the epoch, as a trial's kept checkpoint
    epoch = int(np.argmin([r["val_loss"] for r in lone.reports]))
    assert outcome.best_epoch == epoch + 1
    (state,) = reporter.states
    for key, value in lone.states[epoch].items():
        np.testing.assert_allclose(state[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
