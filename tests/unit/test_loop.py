"""The stage loop in-process (no Ray): metrics, frozen hand-off, joint loss terms, max_steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fakes import ListReporter
from paths import CONFIGS

from cascade_ray.checks import load_config
from cascade_ray.stage.loop import run_stage

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def joint_states(digits):
    """Train the four stages of debug_joint.yaml in-process; return reporters per stage."""
    cfg = load_config(CONFIGS / "debug_joint.yaml")
    upstream, reporters = None, []
    for index in range(len(cfg.stages)):
        reporter = ListReporter()
        outcome = run_stage(cfg, index, digits, upstream, reporter, CPU)
        upstream = reporter.states[-1]
        reporters.append((reporter, outcome))
    return cfg, reporters


def test_reports_once_per_epoch_with_the_documented_metrics(joint_states):
    cfg, reporters = joint_states
    reporter, outcome = reporters[0]
    assert len(reporter.reports) == cfg.stages[0].train.epochs
    assert {"epoch", "step", "train_loss", "val_loss", "val_accuracy", "lr", "samples_per_s"} <= set(
        reporter.reports[-1]
    )
    assert [
        {k: v for k, v in h.items() if k != "steps"} for h in outcome.history
    ] == reporter.reports  # + per-step rows
    assert outcome.frozen_params == 0 and outcome.trainable_params > 0


def test_first_stage_learns(joint_states):
    _, reporters = joint_states
    # one epoch on digits: measured 0.62 (10 classes: chance is 0.1)
    assert reporters[0][0].reports[-1]["val_accuracy"] > 0.4


def test_each_stage_hands_frozen_upstream_on_bit_identical(joint_states):
    _, reporters = joint_states
    for (before, _), (after, _) in zip(reporters[:2], reporters[1:3]):
        prev, new = before.states[-1], after.states[-1]
        for key, value in prev.items():
            assert np.array_equal(value, new[key]), key


def test_joint_stage_reports_per_stage_loss_terms_and_trains_only_opened_layers(joint_states):
    cfg, reporters = joint_states
    metrics = reporters[3][0].reports[-1]
    assert {"loss/features", "loss/encoder", "loss/classifier"} <= set(metrics)
    scales = {s.name: s.loss.scale for s in cfg.stages[:3]}
    expected = sum(scales[n] * metrics[f"loss/{n}"] for n in scales)
    assert metrics["train_loss"] == pytest.approx(expected, rel=1e-6)
    before, after = reporters[2][0].states[-1], reporters[3][0].states[-1]
    changed = {k for k in before if not np.array_equal(before[k], after[k])}
    # debug_joint opens the last block of features, the last block + final norm of encoder, all of classifier
    assert changed, "the joint stage trained nothing"
    allowed = (
        "blocks.features.blocks.1.",
        "heads.features.",
        "blocks.encoder.layers.1.",
        "blocks.encoder.norm.",
        "heads.encoder.",
        "blocks.classifier.",
        "heads.classifier.",
    )
    assert all(k.startswith(allowed) for k in changed), sorted(changed)


def test_max_steps_stops_early(digits):
    cfg = load_config(CONFIGS / "debug.yaml", ["stages[0].train.max_steps=3", "stages[0].train.epochs=5"])
    reporter = ListReporter()
    outcome = run_stage(cfg, 0, digits, None, reporter, CPU)
    assert outcome.steps == 3 and len(reporter.reports) == 1


def test_joint_loss_weights_replace_the_stage_scales(joint_states, digits):
    cfg, reporters = joint_states
    weighted = load_config(
        CONFIGS / "debug_joint.yaml", ["stages.joint.loss.weights={features: 0.05, classifier: 2.0}"]
    )
    reporter = ListReporter()
    run_stage(weighted, 3, digits, reporters[2][0].states[-1], reporter, CPU)
    metrics = reporter.reports[-1]
    # encoder not listed: keeps its own loss.scale
    expected = (
        0.05 * metrics["loss/features"]
        + cfg.stages[1].loss.scale * metrics["loss/encoder"]
        + 2.0 * metrics["loss/classifier"]
    )
    assert metrics["train_loss"] == pytest.approx(expected, rel=1e-6)


def test_resuming_from_a_checkpoint_reproduces_the_uninterrupted_stage(digits):
    cfg = load_config(
        CONFIGS / "debug.yaml", ["stages[0].train.epochs=3", "stages[0].train.augment={hflip: true, crop_padding: 1}"]
    )
    straight = ListReporter()
    run_stage(cfg, 0, digits, None, straight, CPU)
    # "crash" after epoch 1: a new process would start from that checkpoint
    first = ListReporter()
    run_stage(
        load_config(
            CONFIGS / "debug.yaml",
            ["stages[0].train.epochs=1", "stages[0].train.augment={hflip: true, crop_padding: 1}"],
        ),
        0,
        digits,
        None,
        first,
        CPU,
    )
    torch.manual_seed(12345)  # whatever the restarted process's RNG holds, the checkpoint's RNG wins
    resumed = ListReporter()
    outcome = run_stage(
        cfg, 0, digits, None, resumed, CPU, resume={"model": first.states[-1], "trainer": first.trainers[-1]}
    )
    assert outcome.steps == straight.reports[-1]["step"]
    assert [m["epoch"] for m in outcome.history] == [1, 2, 3]
    for key, value in straight.states[-1].items():
        assert np.array_equal(value, resumed.states[-1][key]), key


def test_a_checkpoint_at_the_wrong_step_is_refused(digits):
    from cascade_ray.errors import CascadeError

    cfg = load_config(CONFIGS / "debug.yaml", ["stages[0].train.epochs=2"])
    first = ListReporter()
    run_stage(load_config(CONFIGS / "debug.yaml", ["stages[0].train.epochs=1"]), 0, digits, None, first, CPU)
    trainer = dict(first.trainers[-1], step=first.trainers[-1]["step"] + 5)
    with pytest.raises(CascadeError, match="wrong step"):
        run_stage(cfg, 0, digits, None, ListReporter(), CPU, resume={"model": first.states[-1], "trainer": trainer})


def test_step_rows_every_log_interval_carry_loss_lr_grad_norm_and_rate(digits, capsys):
    """Rank 0 keeps a row every train.log_interval optimizer steps in its epoch's history entry;
    the progress line is printed unless a hook takes it (the driver's progress board)."""
    from cascade_ray.stage.hooks import LoopHooks

    cfg = load_config(
        CONFIGS / "debug.yaml",
        ["stages[0].train.epochs=1", "stages[0].train.log_interval=5", "stages[0].health.interval=10"],
    )
    outcome = run_stage(cfg, 0, digits, None, ListReporter(), CPU)
    rows = outcome.history[0]["steps"]
    assert (
        [r["step"] for r in rows] == list(range(5, 36, 5))
        and {r["kind"] for r in rows} == {"step"}
        and {r["epoch"] for r in rows} == {1}
    )
    assert all(np.isfinite(r["train_loss"]) and r["lr"] == 0.01 and r["samples_per_s"] > 0 for r in rows)
    measured = [r["step"] for r in rows if np.isfinite(r["grad_norm"]) and np.isfinite(r["update_ratio"])]
    assert measured == [10, 20, 30]  # health.interval: measured steps only, no extra device sync
    assert rows[0]["train_loss"] > rows[-1]["train_loss"]  # the window mean falls as it learns
    printed = capsys.readouterr().out
    assert printed.count("[features] epoch 1/1 step ") == len(rows)
    logged = []
    outcome = run_stage(
        cfg, 0, digits, None, ListReporter(), CPU, hooks=LoopHooks(on_log=lambda s: logged.append(dict(s.row)))
    )
    assert logged == outcome.history[0]["steps"] and "[features] epoch" not in capsys.readouterr().out
