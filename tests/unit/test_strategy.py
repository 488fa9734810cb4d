"""Issue 19 part 3 without Ray: ``scaling.strategy`` and ``train.activation_checkpointing`` in the
schema and validation, and activation checkpointing leaving losses and gradients unchanged."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from fakes import ListReporter
from torch import nn

from cascade_ray.checks import validate_config
from cascade_ray.config.schema import ScalingConfig, TrainConfig
from cascade_ray.errors import ConfigError
from cascade_ray.models.checkpointing import checkpoint_blocks
from cascade_ray.models.mlp import mlp
from cascade_ray.models.plan import _strategy_issues, module_facts
from cascade_ray.models.resnet import resnet
from cascade_ray.models.transformer import transformer
from cascade_ray.stage.loop import run_stage


def test_defaults_are_ddp_without_checkpointing():
    assert ScalingConfig().strategy == "ddp"
    assert TrainConfig().activation_checkpointing is False


def test_an_unknown_strategy_names_the_key(debug_raw):
    debug_raw["stages"][1]["scaling"]["strategy"] = "zero3"
    with pytest.raises(ConfigError) as info:
        validate_config(debug_raw, preflight=False)
    assert [i.path for i in info.value.issues] == ["stages[1].scaling.strategy"]
    assert "fsdp" in info.value.issues[0].render()


@pytest.mark.parametrize(
    ("key", "value", "fix"),
    [
        (("scaling", "sync_batchnorm"), True, "sync_batchnorm: false"),
        (("solver", "precision"), "fp16", "precision: bf16"),
    ],
)
def test_fsdp_refuses_what_needs_whole_parameters(debug_raw, key, value, fix):
    stage = debug_raw["stages"][1]
    stage["scaling"]["strategy"] = "fsdp"
    stage.setdefault(key[0], {})[key[1]] = value
    with pytest.raises(ConfigError) as info:
        validate_config(debug_raw, preflight=False)
    mine = [i for i in info.value.issues if i.path == "stages[1].scaling.strategy"]
    assert len(mine) == 1, info.value.issues
    assert fix in mine[0].render() and "strategy: ddp" in mine[0].render()


def test_fsdp_refuses_uncertainty_weighting(debug_raw):
    debug_raw["stages"].append(
        {"name": "joint", "type": "joint", "trainable_layers": {"encoder": -1}, "loss": {"weighting": "uncertainty"}}
    )
    debug_raw["stages"][3]["scaling"] = {"num_workers": 2, "strategy": "fsdp"}
    with pytest.raises(ConfigError) as info:
        validate_config(debug_raw, preflight=False)
    (issue,) = info.value.issues
    assert issue.path == "stages[3].scaling.strategy" and "weighting: static" in issue.render()


def test_fsdp_on_one_worker_and_on_several_is_a_valid_config(debug_raw):
    debug_raw["stages"][0]["scaling"] = {"strategy": "fsdp"}  # one worker: one shard, as ddp
    debug_raw["stages"][1]["scaling"]["strategy"] = "fsdp"
    cfg = validate_config(debug_raw)
    assert [s.scaling.strategy for s in cfg.stages] == ["fsdp", "fsdp", "ddp"]


def test_fsdp_with_fp16_on_one_worker_is_valid(debug_raw):
    """One worker runs fsdp unsharded: its one loss scaler sees every gradient, as under ddp."""
    debug_raw["stages"][1]["scaling"] |= {"strategy": "fsdp", "num_workers": 1}
    debug_raw["stages"][1].setdefault("solver", {})["precision"] = "fp16"
    assert validate_config(debug_raw, preflight=False).stages[1].solver.precision == "fp16"


def test_fsdp_on_a_stage_without_parameters_is_refused(debug_raw):
    debug_raw["stages"][1]["scaling"]["strategy"] = "fsdp"
    debug_raw["stages"][1]["head"] = {"type": "none"}
    cfg = validate_config(debug_raw, preflight=False)
    # a parameter-free module, as preflight builds it
    (issue,) = _strategy_issues(cfg, module_facts({"encoder": nn.Flatten()}))
    assert issue.path == "stages[1].scaling.strategy" and "nothing to shard" in issue.message
    assert not _strategy_issues(cfg, module_facts({"encoder": nn.Linear(2, 2)}))


def test_checkpointing_a_module_without_blocks_is_refused_before_ray(debug_raw):
    debug_raw["trusted_modules"] = ["user_models"]
    debug_raw["stages"][0]["model"] = {"type": "user_models:tiny_cnn", "width": 16}
    debug_raw["stages"][0]["train"]["activation_checkpointing"] = True
    with pytest.raises(ConfigError) as info:
        validate_config(debug_raw)
    (issue,) = info.value.issues
    assert issue.path == "stages[0].train.activation_checkpointing"
    assert "cascade_layers()" in issue.message and "activation_checkpointing: false" in issue.render()


def _loss_and_grads(module: nn.Module, x: torch.Tensor):
    torch.manual_seed(7)  # the same dropout masks in both runs
    out = module(x)
    loss = (out.float() ** 2).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    buffers = {n: b.clone() for n, b in module.named_buffers()}
    return loss.detach(), grads, buffers


def _user_block_cnn():
    from user_models import block_cnn

    return block_cnn(1, 8)


@pytest.mark.parametrize(
    ("build", "shape"),
    [
        (lambda: resnet(in_channels=1, widths=[8, 16], blocks=[1, 1]), (6, 1, 8, 8)),
        (lambda: transformer(in_channels=16, d_model=16, depth=2, heads=2, dropout=0.2), (6, 16, 4, 4)),
        (lambda: mlp(in_features=16, hidden=[32, 16], dropout=0.2), (6, 16)),
        (_user_block_cnn, (6, 1, 8, 8)),  # a user module listing its blocks in cascade_layers()
    ],
    ids=["resnet", "transformer", "mlp", "user-cascade_layers"],
)
def test_activation_checkpointing_keeps_loss_grads_and_statistics(build, shape):
    torch.manual_seed(0)
    plain = build().train()
    checked = copy.deepcopy(plain)
    blocks = checkpoint_blocks(checked)
    assert blocks == len(checked.cascade_layers()) >= 2
    x = torch.randn(shape)
    loss, grads, buffers = _loss_and_grads(plain, x)
    loss_c, grads_c, buffers_c = _loss_and_grads(checked, x)
    torch.testing.assert_close(loss_c, loss)
    assert grads_c.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(grads_c[name], grads[name], msg=name)
    for name in buffers:  # BatchNorm statistics moved once, not twice (the recompute restores them)
        torch.testing.assert_close(buffers_c[name], buffers[name], rtol=0, atol=0, msg=name)
    assert list(checked.state_dict()) == list(plain.state_dict())  # names unchanged: artifacts load either way


def test_checkpointing_refuses_a_module_without_blocks():
    with pytest.raises(ValueError, match="cascade_layers"):
        checkpoint_blocks(nn.Sequential(nn.Linear(2, 2)))


def test_a_stage_trains_the_same_with_and_without_checkpointing(debug_raw, digits, capsys):
    """In-process run_stage (no Ray) of the ResNet stage for 5 steps: identical reports; the stage's
    set-up line says when its blocks are checkpointed."""
    debug_raw["stages"][0]["train"] |= {"epochs": 1, "max_steps": 5, "sanity_val_steps": 0}
    debug_raw["stages"][0]["solver"]["precision"] = "fp32"
    debug_raw["stages"][0]["health"] = {"interval": 1}  # grad norms and update ratios measured too
    reports = []
    for on in (False, True):
        debug_raw["stages"][0]["train"]["activation_checkpointing"] = on
        reporter = ListReporter()
        run_stage(validate_config(debug_raw), 0, digits, None, reporter, torch.device("cpu"))
        said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("features: precision")]
        assert len(said) == 1 and ("activation checkpointing: " in said[0]) == on, said
        (report,) = reporter.reports
        reports.append({k: v for k, v in report.items() if k != "samples_per_s"})
    assert reports[0].keys() == reports[1].keys()
    keys = sorted(reports[0])
    np.testing.assert_allclose([reports[1][k] for k in keys], [reports[0][k] for k in keys], rtol=1e-6)


def test_the_worker_modules_do_not_import_fsdp():
    """torch.distributed's FSDP / DTensor / distributed-checkpoint modules are imported by a sharded
    stage only (``stage/sharding.py`` imports them lazily), not by importing the worker's modules.
    (torch itself imports FSDP and DTensor with ``torch._dynamo`` on an optimizer's first use, so
    this guards cascade-ray's own imports, which are what it controls.)"""
    import subprocess
    import sys

    script = """
import sys
import cascade_ray.stage.worker, cascade_ray.stage.loop, cascade_ray.stage.batched, cascade_ray.stage.setup
heavy = ("torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.checkpoint")
print(sorted(m for m in sys.modules if m.startswith(heavy)))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-2000:] + out.stderr[-2000:]
