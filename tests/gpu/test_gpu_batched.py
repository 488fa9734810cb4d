"""Batched sweep replicas on a CUDA device: each replica's CUDA generator is its own, so with
dropout a replica still ends with the weights of its config trained alone. Skips without CUDA;
`bash scripts/gpu_check.sh` runs it on a GPU machine."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fakes import ListReporter
from paths import CONFIGS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and a CUDA build of torch"),
]


def test_cuda_replicas_match_their_configs_trained_alone(digits):
    from cascade_ray.checks import load_config
    from cascade_ray.pipeline.features import upstream_outputs
    from cascade_ray.stage.batched import train_replicas
    from cascade_ray.stage.loop import run_stage
    from cascade_ray.stage.setup import build_stage_model
    from cascade_ray.tune.sweep import trial_config

    cuda = torch.device("cuda")
    cfg = load_config(
        CONFIGS / "debug.yaml", ["stages.classifier.model.dropout=0.3", "stages.classifier.solver.precision=fp32"]
    )
    model, _ = build_stage_model(cfg, 1, digits, None)
    upstream = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    out = upstream_outputs(cfg, 2, digits, upstream)
    features = {"x_train": out["train"], "x_val": out["val"]}
    cfgs = [trial_config(cfg, "classifier", {"solver.lr": lr}) for lr in (1e-2, 3e-3)]
    replicas = train_replicas(
        cfgs, 2, digits, upstream, features, ListReporter(), cuda, metric="val_accuracy", mode="max"
    )
    for replica, one in zip(replicas, cfgs, strict=True):
        lone = ListReporter()
        run_stage(one, 2, digits, upstream, lone, cuda, features=features)
        for key, value in lone.states[-1].items():
            mine = replica.setup.model.state_dict()[key].detach().cpu().numpy()
            np.testing.assert_allclose(mine, value, rtol=1e-4, atol=1e-5, err_msg=key)


def test_cuda_replicas_hold_one_device_copy_of_the_frozen_upstream(digits):
    """Every replica holds the first one's frozen upstream on the device (setup_stage(frozen=)): one
    host-to-device copy for all of them, and the device memory of a replica is only what it trains."""
    from cascade_ray.checks import load_config
    from cascade_ray.pipeline.features import upstream_outputs
    from cascade_ray.stage.batched import train_replicas
    from cascade_ray.stage.setup import build_stage_model
    from cascade_ray.tune.sweep import trial_config

    cuda = torch.device("cuda")
    cfg = load_config(CONFIGS / "debug.yaml", ["stages.classifier.solver.precision=fp32"])
    model, _ = build_stage_model(cfg, 1, digits, None)
    upstream = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    out = upstream_outputs(cfg, 2, digits, upstream)
    features = {"x_train": out["train"], "x_val": out["val"]}
    cfgs = [trial_config(cfg, "classifier", {"solver.lr": lr}) for lr in (1e-2, 3e-3, 1e-3)]
    replicas = train_replicas(
        cfgs, 2, digits, upstream, features, ListReporter(), cuda, metric="val_accuracy", mode="max"
    )
    frozen = replicas[0].setup.plan.frozen_keys
    held = [r.setup.model.state_dict() for r in replicas]
    assert frozen and all(held[0][k].is_cuda for k in frozen)
    assert all(len({h[k].data_ptr() for h in held}) == 1 for k in frozen)
