"""Batched sweeps in-process (no Ray): each replica trains exactly as its config alone, and the
report carries the best replica's best epoch."""

from __future__ import annotations

import shlex

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


# -- what cannot be batched is refused before Ray starts, naming the key and the plain sweep --

FIFO = "scheduler: {type: fifo}\n"


def _space(tmp_path, body, stage="classifier"):
    path = tmp_path / "space.yaml"
    path.write_text(f"stage: {stage}\nmetric: val_accuracy\nmode: max\nnum_samples: 2\n{body}")
    return path


@pytest.mark.parametrize(
    ("body", "stage", "overrides", "key", "reason"),
    [
        (FIFO + "space: {model.hidden: {grid: [[16], [32]]}}", "classifier", [], "space.model.hidden", "architecture"),
        (FIFO + "space: {train.batch_size: {choice: [16, 32]}}", "classifier", [], "space.train.batch_size", "batch"),
        (FIFO + "space: {train.epochs: {choice: [1, 2]}}", "classifier", [], "space.train.epochs", "epoch loop"),
        (
            FIFO + "space: {solver.accumulation_steps: {choice: [1, 2]}}",
            "classifier",
            [],
            "space.solver.accumulation_steps",
            "accumulation windows",
        ),
        ("space: {solver.lr: {loguniform: [1e-3, 1e-2]}}", "classifier", [], "scheduler.type", "asha"),
        (FIFO + "space: {solver.lr: {loguniform: [1e-3, 1e-2]}}", "features", [], "stage", "first stage"),
        (
            FIFO + "space: {solver.lr: {loguniform: [1e-3, 1e-2]}}",
            "classifier",
            ["stages.classifier.freeze.cache_features=off"],
            "stage",
            "cache_features is off",
        ),
    ],
)
def test_an_unbatchable_sweep_exits_2_before_ray_naming_the_key(
    tmp_path, monkeypatch, capsys, body, stage, overrides, key, reason
):
    import ray

    from cascade_ray.cli import main as cli_main

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray started for a refused batched sweep"))
    space = _space(tmp_path, body, stage)
    assert cli_main(["tune", str(CONFIGS / "debug.yaml"), "--space", str(space), "--batched", *overrides]) == 2
    err = capsys.readouterr().err
    assert f"- {key}:" in err and reason in err, err
    # the suggested plain sweep is the user's own command without --batched: it runs as printed
    again = shlex.join([str(CONFIGS / "debug.yaml"), *overrides])
    assert f"cascade-ray tune {again} --space {space} (without --batched)" in err, err


def test_batched_in_the_space_file_is_checked_as_the_flag(tmp_path, inputs):
    from cascade_ray.api import RunOptions, stage_runners
    from cascade_ray.errors import ConfigError
    from cascade_ray.tune.batched import BatchedSweepRunner

    cfg = inputs[0]
    good = _space(
        tmp_path,
        FIFO + "batched: true\nspace: {solver.lr: {loguniform: [1e-3, 1e-2]}, loss.scale: {choice: [0.5, 1.0]}}",
    )
    (runner,) = stage_runners(cfg, RunOptions(spaces=(("classifier", str(good)),))).values()
    assert isinstance(runner, BatchedSweepRunner)
    bad = _space(tmp_path, "batched: true\nspace: {model.dropout: {choice: [0.0, 0.1]}}")
    with pytest.raises(ConfigError, match="set batched: false in the space file") as caught:
        stage_runners(cfg, RunOptions(spaces=(("classifier", str(bad)),)))
    assert {i.path for i in caught.value.issues} == {"space.model.dropout", "scheduler.type"}


def test_the_configs_are_the_plain_sweeps_trials(inputs):
    """Sampled by the plain sweep's BasicVariantGenerator: the current values first (random
    search), the pipeline seed fixing the rest; a grid is every value times num_samples."""
    from cascade_ray.tune.batched import sample_values
    from cascade_ray.tune.space import TuneSpace

    cfg = inputs[0]
    random = TuneSpace.model_validate(
        {"stage": "classifier", "num_samples": 4, "space": {"solver.lr": {"loguniform": [1e-4, 1e-2]}}}
    )
    values = sample_values(cfg, random)
    assert len(values) == 4 and values[0] == {"solver.lr": cfg.stages[2].solver.lr}
    assert values == sample_values(cfg, random)  # the same seed samples the same trials
    reseeded = sample_values(cfg.model_copy(update={"seed": 1}), random)
    assert reseeded[0] == values[0] and reseeded[1:] != values[1:]
    grid = TuneSpace.model_validate(
        {"stage": "classifier", "num_samples": 2, "search": "grid", "space": {"loss.scale": {"grid": [0.5, 1.0]}}}
    )
    assert [v["loss.scale"] for v in sample_values(cfg, grid)] == [0.5, 1.0, 0.5, 1.0]


def test_the_refusal_names_a_shipped_config_as_the_user_did(tmp_path, monkeypatch, capsys):
    import ray

    from cascade_ray.cli import main as cli_main

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray started for a refused batched sweep"))
    space = _space(tmp_path, "space: {solver.lr: {loguniform: [1e-3, 1e-2]}}")  # asha: refused
    assert cli_main(["tune", "debug", "--space", str(space), "--batched", "seed=3"]) == 2
    assert f"cascade-ray tune debug seed=3 --space {space} (without --batched)" in capsys.readouterr().err
