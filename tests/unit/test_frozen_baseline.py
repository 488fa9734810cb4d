"""The frozen upstream is hashed where something must be checked, not again for a baseline the
driver already holds: a stage's workers take the hand-off's tensor digests (its verified artifact
manifest's) as the frozen digest every epoch is checked against, a batched sweep hashes the
upstream its replicas share once per check instead of once per replica, and the feature cache's
key takes the same digests. The real fits that carry the digests through Ray Train are
tests/integration/test_checkpoints.py, test_batched_tune.py and test_pipeline.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fakes import ListReporter
from paths import CONFIGS

import cascade_ray.models.weights as weights
from cascade_ray.checks import load_config, validate_config
from cascade_ray.errors import FrozenDriftError
from cascade_ray.models.freeze import frozen_digest
from cascade_ray.models.weights import SHARED_KEYS_ATTR, share_numpy_state, state_digests
from cascade_ray.pipeline import fit
from cascade_ray.pipeline.features import cache_key, upstream_outputs
from cascade_ray.stage.batched import run_batched, train_replicas
from cascade_ray.stage.loop import run_stage
from cascade_ray.stage.setup import build_stage_model
from cascade_ray.tune.sweep import trial_config

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def encoder(digits):
    """The debug cascade's features stage as a numpy hand-off, its digests, and the config."""
    cfg = load_config(CONFIGS / "debug.yaml")
    features, _ = build_stage_model(cfg, 0, digits, None)
    upstream = {k: v.detach().numpy().copy() for k, v in features.state_dict().items()}
    return cfg, upstream, state_digests(upstream)


@pytest.fixture
def hashed(monkeypatch):
    """Every tensor the package hashes from here on, counted."""
    calls: list[tuple[int, ...]] = []
    real = weights.tensor_digest

    def counting(tensor):
        calls.append(tuple(tensor.shape))
        return real(tensor)

    monkeypatch.setattr(weights, "tensor_digest", counting)
    return calls


def test_the_hand_offs_digests_stand_in_for_the_entries_the_model_shares(encoder, digits, hashed):
    cfg, upstream, known = encoder
    model, plan = build_stage_model(cfg, 1, digits, upstream)
    shared = getattr(model, SHARED_KEYS_ATTR)
    assert set(plan.frozen_keys) <= shared  # every frozen entry of the encoder is a view of the hand-off
    expected = frozen_digest(model, plan)
    hashed.clear()
    assert frozen_digest(model, plan, known) == expected
    assert hashed == []  # nothing hashed: every frozen entry is a view of arrays the driver verified


def test_an_entry_the_model_holds_a_copy_of_is_hashed(encoder, digits, hashed):
    cfg, upstream, known = encoder
    model, plan = build_stage_model(cfg, 1, digits, upstream)
    key = sorted(plan.frozen_keys)[0]
    setattr(model, SHARED_KEYS_ATTR, getattr(model, SHARED_KEYS_ATTR) - {key})  # as a cast copy is
    wrong = dict.fromkeys(known, "not-the-bytes")
    hashed.clear()
    taken = frozen_digest(model, plan, wrong)
    assert taken[key] == known[key] and len(hashed) == 1  # hashed, not taken from `wrong`
    assert all(taken[k] == "not-the-bytes" for k in plan.frozen_keys if k != key)


def test_a_memo_hashes_the_arrays_several_models_view_once(encoder, digits, hashed):
    cfg, upstream, _ = encoder
    (a, plan), (b, _) = (build_stage_model(cfg, 1, digits, upstream) for _ in range(2))
    hashed.clear()
    memo: dict = {}
    first, second = frozen_digest(a, plan, memo=memo), frozen_digest(b, plan, memo=memo)
    assert first == second and len(hashed) == len(plan.frozen_keys)  # b's frozen entries view the same arrays
    # an entry that views other memory is hashed, with the same memo: its own bytes count
    key = sorted(plan.frozen_keys)[0]
    share_numpy_state(b, {key: upstream[key] + 1}, [key])
    hashed.clear()
    third = frozen_digest(b, plan, memo=memo)
    assert len(hashed) == 1 and third[key] != first[key]
    assert {k: d for k, d in third.items() if k != key} == {k: d for k, d in first.items() if k != key}


def test_the_loop_checks_every_epoch_against_the_hand_offs_digests(encoder, digits):
    """A hand-off digest that the worker's bytes do not match is drift at the first epoch's end:
    the baseline is what the driver verified, not what the worker happened to receive."""
    cfg, upstream, known = encoder
    raw = cfg.model_dump(mode="json")
    raw["stages"][1]["train"]["epochs"] = 1
    cfg = validate_config(raw)
    outcome = run_stage(cfg, 1, digits, upstream, ListReporter(), CPU, upstream_digests=known)
    model, plan = build_stage_model(cfg, 1, digits, upstream)
    assert outcome.frozen_digest == frozen_digest(model, plan)
    key = sorted(plan.frozen_keys)[-1]
    with pytest.raises(FrozenDriftError, match=key.replace(".", r"\.")):
        run_stage(cfg, 1, digits, upstream, ListReporter(), CPU, upstream_digests=known | {key: "0" * 64})


def test_a_batched_sweep_hashes_the_shared_upstream_once_per_check(digits, hashed):
    cfg = load_config(CONFIGS / "debug.yaml")
    stage = 2  # the classifier, on the cached outputs of features + encoder
    model, plan = build_stage_model(cfg, stage - 1, digits, None)
    upstream = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    out = upstream_outputs(cfg, stage, digits, upstream)
    features = {"x_train": out["train"], "x_val": out["val"]}
    cfgs = [trial_config(cfg, "classifier", {"solver.lr": lr}) for lr in (0.01, 0.02, 0.05)]
    frozen = len(build_stage_model(cfg, stage, digits, upstream)[1].frozen_keys)
    epochs = cfg.stages[stage].train.epochs

    def count(**kw):
        hashed.clear()
        replicas = train_replicas(
            cfgs, stage, digits, upstream, features, ListReporter(), CPU, metric="val_accuracy", mode="max", **kw
        )
        assert all(r.error is None and len(r.history) == epochs for r in replicas)
        return len(hashed)

    # before: 3 replicas x (1 + epochs) digests of the whole frozen upstream
    assert count() == (1 + epochs) * frozen  # one baseline, one check per epoch, shared by the 3
    assert count(upstream_digests=state_digests(upstream)) == epochs * frozen  # the checks only

    # the job's one report names the frozen upstream by the digests its last check took (before: hashed again)
    reporter, known = ListReporter(), state_digests(upstream)
    hashed.clear()
    run_batched(
        cfgs,
        stage,
        digits,
        upstream,
        features,
        reporter,
        CPU,
        metric="val_accuracy",
        mode="max",
        upstream_digests=known,
    )
    assert len(hashed) == epochs * frozen
    assert reporter.frozen[-1] == state_digests(
        upstream, build_stage_model(cfg, stage, digits, upstream)[1].frozen_keys
    )


def test_the_feature_cache_key_takes_the_hand_offs_digests(encoder, hashed):
    _, upstream, known = encoder
    hashed.clear()
    key = cache_key("fp", upstream, ["features"])
    assert len(hashed) == sum(k.startswith(("blocks.features.", "adapters.features.")) for k in upstream) > 0
    hashed.clear()
    assert cache_key("fp", upstream, ["features"], known) == key and hashed == []


def test_fit_stage_hands_workers_the_upstreams_digests(debug_raw, monkeypatch, tmp_path):
    seen = {}

    class FakeTrainer:
        def __init__(self, fn, *, train_loop_config, scaling_config, run_config):
            seen.update(train_loop_config)

        def fit(self):
            return "result"

    monkeypatch.setattr(fit, "StageTrainer", FakeTrainer)
    monkeypatch.setattr(fit, "cluster_view", lambda: fit.Cluster(({"CPU": 2.0},)))
    cfg = validate_config(debug_raw)
    digests = {"blocks.features.stem.0.weight": "a" * 64}
    fit.fit_stage(cfg, 1, data_ref=None, upstream_ref=None, upstream_digests=digests, ray_dir=tmp_path, run_name="r")
    assert seen["upstream_digests"] == digests
    fit.fit_stage(cfg, 1, data_ref=None, upstream_ref=None, ray_dir=tmp_path, run_name="r")
    assert seen["upstream_digests"] is None  # unknown: the workers hash the upstream themselves


def test_numpy_views_are_what_the_model_holds(encoder, digits):
    """What the stand-in rests on: a shared frozen entry is the hand-off's array itself."""
    cfg, upstream, _ = encoder
    model, plan = build_stage_model(cfg, 1, digits, upstream)
    state = model.state_dict()
    for key in plan.frozen_keys:
        assert state[key].data_ptr() == upstream[key].ctypes.data, key
        assert np.shares_memory(state[key].numpy(), upstream[key])
