"""``cascade-ray lr-find``: the exponential range test, its suggestion and its PNG."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from paths import CONFIGS

from cascade_ray.checks import load_config
from cascade_ray.cli import main as cli_main
from cascade_ray.data import load_digits
from cascade_ray.data.batches import ArraySource, train_batches
from cascade_ray.stage.setup import build_stage_model, stage_seed
from cascade_ray.tools.lrfind import lr_find, suggest


def test_suggestion_is_the_steepest_descent_before_the_minimum():
    lrs = list(np.logspace(-6, 1, 71))
    x = np.log10(lrs)
    # a smooth drop centred at 1e-3 and a blow-up after 1e-1
    losses = list(2.0 - 1.5 / (1 + np.exp(-3 * (x + 3))) + np.where(x > -1, (x + 1) ** 2 * 5, 0.0))
    steep, low = suggest(lrs, losses)
    assert steep == pytest.approx(1e-3, rel=0.2)
    assert 1e-2 < low < 2e-1


def test_range_test_on_the_debug_stage_grows_lr_geometrically_and_suggests_inside_the_range():
    cfg = load_config(CONFIGS / "debug.yaml")
    result = lr_find(cfg, 0, load_digits(train_size=None, val_fraction=0.2, seed=0), steps=80)
    ratios = np.diff(np.log(result.lrs))
    assert np.allclose(ratios, ratios[0]) and result.lrs[0] == pytest.approx(1e-7)
    assert len(result.lrs) == len(result.losses) == len(result.smoothed) <= 80
    assert 1e-5 < result.suggestion < 1.0 and math.isfinite(result.min_loss_lr)
    assert min(result.smoothed) < result.smoothed[0]  # it learned somewhere in the range


@pytest.mark.parametrize(("config", "stage"), [("debug.yaml", "classifier"), ("debug_joint.yaml", "joint")])
def test_cli_writes_the_png_and_prints_the_suggestion(tmp_path, capsys, config, stage):
    png = tmp_path / "lr.png"
    assert cli_main(["lr-find", str(CONFIGS / config), "--stage", stage, "--steps", "40", "--out", str(png)]) == 0
    out = capsys.readouterr().out
    assert "suggested lr: " in out and "set stages[" in out and "freshly initialized" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_range_test_loss_honours_the_joint_loss_weights(digits):
    """The range test's first loss is the stage's training loss (loss.weights included) on its first batch."""
    cfg = load_config(CONFIGS / "debug_joint.yaml", ["stages.joint.loss.weights={features: 0.05, classifier: 2.0}"])
    index, stage = 3, cfg.stages[3]
    result = lr_find(cfg, index, digits, steps=1)
    # the same freshly built (seeded) model and first batch, the loss written out by hand
    model, _ = build_stage_model(cfg, index, digits, None)
    model.train()
    (batch, *_) = train_batches(
        len(digits.y_train), stage.train.batch_size, rank=0, world=1, seed=stage_seed(cfg, index), epoch=0
    )
    x, y = ArraySource(digits.x_train, digits.y_train, digits.mean, digits.std, torch.device("cpu")).batch(batch)
    with torch.no_grad():
        outs = model(x, heads=["features", "encoder", "classifier"])
    ce = {n: float(F.cross_entropy(outs[n], y, label_smoothing=stage.loss.label_smoothing)) for n in outs}
    weighted = 0.05 * ce["features"] + cfg.stages[1].loss.scale * ce["encoder"] + 2.0 * ce["classifier"]
    scales_only = sum(cfg.stages[i].loss.scale * ce[cfg.stages[i].name] for i in range(3))
    assert abs(weighted - scales_only) > 1e-2  # the weights change this batch's loss
    assert result.losses[0] == pytest.approx(weighted, rel=1e-5)
