"""``scaling.strategy: fsdp`` through the real pipeline: a 2-worker gloo encoder over a frozen
ResNet, against the same stage under DDP, and resumed after a worker crash.

One module-scoped fixture runs the debug cascade up to the encoder three times in one run folder:
DDP; then FSDP (with activation checkpointing) under ``--resume``, so the features artifact is
reused and only the encoder trains; then the same FSDP stage with ``max_failures: 1`` and a
worker killed in its second epoch (a new fingerprint: it trains again, crashes, resumes).
"""

from __future__ import annotations

import numpy as np
import pytest
from paths import CONFIGS

from cascade_ray.api import RunOptions, run_pipeline
from cascade_ray.checks import load_config
from cascade_ray.pipeline.artifacts import read_artifact
from cascade_ray.tools.inference import load_cascade

pytestmark = pytest.mark.slow

BASE = ["stages.features.train.epochs=1"]  # the frozen upstream: one epoch is enough
FSDP = ["stages.encoder.scaling.strategy=fsdp", "stages.encoder.train.activation_checkpointing=true"]
# 2 epochs x 18 steps on 2 workers: step 30 is late in epoch 2, so the restart redoes epoch 2 (killed 2 steps
# into it, under load the worker died before Ray Train had registered epoch 1's checkpoint: no resume)
KILL_STEP = 30


def _run(storage, overrides, resume):
    cfg = load_config(CONFIGS / "debug.yaml", [f"storage_path={storage}", *BASE, *overrides])
    summary = run_pipeline(cfg, RunOptions(stop_after="encoder", resume=resume), log=lambda _: None)
    record = summary["stages"][1]
    return cfg, record, read_artifact(record["artifact"])[1]


@pytest.fixture(scope="module")
def runs(ray_session, tmp_path_factory):
    from cascade_ray.constants import FAULT_ONCE_ENV

    storage = tmp_path_factory.mktemp("fsdp")
    ddp = _run(storage, [], resume=False)
    fsdp = _run(storage, FSDP, resume=True)
    marker = storage / "fault.marker"
    mp = pytest.MonkeyPatch()
    mp.setenv(FAULT_ONCE_ENV, f"encoder:{KILL_STEP}:{marker}")
    try:
        crashed = _run(storage, [*FSDP, "stages.encoder.max_failures=1"], resume=True)
    finally:
        mp.undo()
    return {"ddp": ddp, "fsdp": fsdp, "crashed": crashed, "marker": marker, "storage": storage}


def test_fsdp_loss_curve_matches_ddp(runs):
    (_, ddp, _), (_, fsdp, _) = runs["ddp"], runs["fsdp"]
    assert fsdp["num_workers"] == ddp["num_workers"] == 2
    assert fsdp["trainable_params"] == ddp["trainable_params"] and fsdp["frozen_params"] == ddp["frozen_params"]
    assert [h["epoch"] for h in fsdp["history"]] == [1, 2]
    for key in ("train_loss", "val_loss", "val_accuracy"):
        got, want = [h[key] for h in fsdp["history"]], [h[key] for h in ddp["history"]]
        # FSDP's reduce-scatter and DDP's all-reduce both average the two ranks' gradients, and a sum of
        # two fp32 terms does not depend on their order: measured 2026-12-02, max relative difference 0
        # (every epoch's train_loss, val_loss, val_accuracy). rtol 1e-6 leaves room for other kernels.
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=0, err_msg=key)


def test_fsdp_artifact_is_a_full_state_dict_that_load_cascade_loads(runs):
    (_, _, ddp_state), (cfg, record, state) = runs["ddp"], runs["fsdp"]
    assert state.keys() == ddp_state.keys()
    for key, value in ddp_state.items():
        assert state[key].shape == value.shape and state[key].dtype == value.dtype, key
    # the frozen features stage is handed on bit for bit
    frozen = [k for k in state if k.split(".")[1] == "features"]
    assert frozen and all(np.array_equal(state[k], ddp_state[k]) for k in frozen)
    cascade = load_cascade(record["artifact"], cfg=cfg)
    rows = np.random.default_rng(0).random((5, 1, 8, 8)).astype(np.float32) * 16
    out = cascade.predict(rows)
    assert all(len(v) == 5 for v in out.values()) and out


def test_fsdp_resumes_from_its_checkpoint_bit_identically(runs):
    assert runs["marker"].read_text().startswith(f"killed at step {KILL_STEP}"), "the fault was injected"
    (_, straight, straight_state), (_, resumed, resumed_state) = runs["fsdp"], runs["crashed"]
    assert resumed["resumed_from_epoch"] == 1 and resumed["metrics"]["step"] == 36
    assert [h["train_loss"] for h in resumed["history"]] == [h["train_loss"] for h in straight["history"]]
    assert resumed_state.keys() == straight_state.keys()
    for key, value in straight_state.items():
        assert np.array_equal(value, resumed_state[key]), key
