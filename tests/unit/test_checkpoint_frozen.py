"""``train.checkpoint.frozen``: a ``reference`` checkpoint holds only what its stage trains and
names the frozen upstream by digest (``frozen.json``); the loop decides what it may name, the
driver's ``finish`` and a restarted worker make the weights whole from the upstream, digests checked.
The real fits (Ray Train, local folder and S3, a killed worker resuming) are in
tests/integration/test_checkpoints.py, test_fsdp.py and test_batched_tune.py."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import ray
import torch
from fakes import ListReporter
from paths import CONFIGS

from cascade_ray.checks import load_config
from cascade_ray.errors import CascadeError, FrozenDriftError
from cascade_ray.models.weights import load_safetensors, state_digests, to_numpy_state
from cascade_ray.pipeline.artifacts import read_artifact
from cascade_ray.pipeline.stages import Handoff, StageSession, stage_fingerprint
from cascade_ray.stage.loop import run_stage
from cascade_ray.stage.resume import frozen_reference
from cascade_ray.stage.setup import build_stage_model
from cascade_ray.stage.worker import (
    CHECKPOINT_FROZEN,
    CHECKPOINT_WEIGHTS,
    read_checkpoint,
    write_checkpoint,
)

CPU = torch.device("cpu")
METRICS = {"epoch": 1, "step": 9, "train_loss": 1.5, "val_loss": 1.2, "val_accuracy": 0.6}


@pytest.fixture(scope="module")
def encoder(digits):
    """The debug cascade's features stage (upstream) and its encoder stage built on it, as numpy states."""
    cfg = load_config(CONFIGS / "debug.yaml")
    features, _ = build_stage_model(cfg, 0, digits, None)
    upstream = to_numpy_state(features.state_dict())
    model, plan = build_stage_model(cfg, 1, digits, upstream)
    return cfg, upstream, to_numpy_state(model.state_dict()), plan


def _checkpoint(folder: Path, state, frozen) -> Path:
    folder.mkdir()
    write_checkpoint(folder, state, METRICS, nodes=["a" * 56], frozen=frozen)
    return folder


def test_a_reference_checkpoint_holds_only_the_trained_tensors_and_reads_back_whole(encoder, tmp_path):
    _, upstream, state, plan = encoder
    frozen = state_digests(state, plan.frozen_keys)
    folder = _checkpoint(tmp_path / "ckpt", state, frozen)
    held = load_safetensors(folder / CHECKPOINT_WEIGHTS)
    assert set(held) == set(state) - set(plan.frozen_keys) and held  # the encoder's own tensors only
    assert all(not k.startswith(("blocks.features.", "heads.features.")) for k in held)
    listed = json.loads((folder / CHECKPOINT_FROZEN).read_text())
    assert listed == {"format": 1, "digests": frozen}
    weights = read_checkpoint(folder, upstream)
    assert weights.frozen_digests == frozen
    assert set(weights.state) == set(state)
    for key, value in state.items():  # whole again, bit for bit
        assert weights.state[key].dtype == value.dtype and np.array_equal(weights.state[key], value), key


def test_a_copy_checkpoint_holds_everything_and_needs_no_upstream(encoder, tmp_path):
    _, _, state, _ = encoder
    folder = _checkpoint(tmp_path / "ckpt", state, None)
    assert not (folder / CHECKPOINT_FROZEN).exists()
    weights = read_checkpoint(folder)  # as every checkpoint written before the reference format
    assert weights.frozen_digests is None and set(weights.state) == set(state)


def test_an_upstream_that_changed_since_the_checkpoint_is_refused_naming_the_tensor(encoder, tmp_path):
    _, upstream, state, plan = encoder
    folder = _checkpoint(tmp_path / "ckpt", state, state_digests(state, plan.frozen_keys))
    key = plan.frozen_keys[0]
    changed = dict(upstream) | {key: upstream[key] + 1}
    with pytest.raises(FrozenDriftError, match=rf"1: {key}\).*rerun without --resume"):
        read_checkpoint(folder, changed)
    lacking = {k: v for k, v in upstream.items() if k != key}
    with pytest.raises(FrozenDriftError, match=key):
        read_checkpoint(folder, lacking)
    with pytest.raises(CascadeError, match=r"names \d+ frozen upstream tensor\(s\) by digest.*no upstream"):
        read_checkpoint(folder)


def test_the_upstreams_verified_digests_stand_in_for_hashing_it(encoder, tmp_path, monkeypatch):
    from cascade_ray.stage import worker

    _, upstream, state, plan = encoder
    frozen = state_digests(state, plan.frozen_keys)
    folder = _checkpoint(tmp_path / "ckpt", state, frozen)
    hashed: list[list[str]] = []
    real = worker.state_digests
    monkeypatch.setattr(worker, "state_digests", lambda s, keys: hashed.append(sorted(keys)) or real(s, keys))
    known = state_digests(upstream)  # what the upstream's artifact manifest records
    assert read_checkpoint(folder, upstream, known).frozen_digests == frozen
    partly = {k: d for k, d in known.items() if k != plan.frozen_keys[0]}
    assert read_checkpoint(folder, upstream, partly).frozen_digests == frozen
    assert hashed == [[], [plan.frozen_keys[0]]]  # only the entry whose digest was not given
    # the given digests decide: one that differs from the recorded is drift, named
    key = plan.frozen_keys[-1]
    with pytest.raises(FrozenDriftError, match=key):
        read_checkpoint(folder, upstream, known | {key: "0" * 64})


def test_only_unchanged_entries_are_named():
    state = {"a": torch.zeros(2), "b": torch.ones(2)}
    before = {"a": "da", "b": "db", "c": "dc"}
    # b drifted: it stays in the file for the driver's bit check; c is not in the state
    assert frozen_reference(state, before, {"a": "da", "b": "db2", "c": "dc"}) == {"a": "da"}
    assert frozen_reference(state, before, {"b": "db2"}) is None


@pytest.mark.parametrize(
    "listing",
    ["{not json", '{"format": 2, "digests": {}}', '{"format": 1}', '{"format": 1, "digests": {"k": 3}}', "[]"],
    ids=["not-json", "unknown-format", "no-digests", "digest-not-text", "not-an-object"],
)
def test_a_damaged_frozen_listing_is_an_error_naming_the_file(encoder, tmp_path, listing):
    _, upstream, state, plan = encoder
    folder = _checkpoint(tmp_path / "ckpt", state, state_digests(state, plan.frozen_keys))
    (folder / CHECKPOINT_FROZEN).write_text(listing)
    with pytest.raises(CascadeError, match=rf"{folder / CHECKPOINT_FROZEN}: not a frozen-entry listing"):
        read_checkpoint(folder, upstream)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ([], True),
        (["stages.encoder.health.frozen_drift.policy=off"], True),  # not checked per epoch: hashed for the checkpoint
        (["stages.encoder.train.checkpoint.frozen=copy"], False),
    ],
    ids=["reference", "reference-drift-rule-off", "copy"],
)
def test_the_loop_names_the_frozen_upstream_in_every_checkpoint(digits, encoder, overrides, named):
    _, upstream, _, plan = encoder
    cfg = load_config(CONFIGS / "debug.yaml", ["stages.encoder.train.epochs=2", *overrides])
    reporter = ListReporter()
    run_stage(cfg, 1, digits, upstream, reporter, CPU)
    assert len(reporter.frozen) == 2
    expected = state_digests(upstream, plan.frozen_keys) if named else None
    assert reporter.frozen == [expected, expected]


def test_the_first_stage_has_nothing_to_name(digits):
    reporter = ListReporter()
    run_stage(load_config(CONFIGS / "debug.yaml", ["stages.features.train.epochs=1"]), 0, digits, None, reporter, CPU)
    assert reporter.frozen == [None]


class _Result:
    """What StageSession.finish reads of a ray.train.Result: the best checkpoint and rank 0's return value."""

    def __init__(self, folder: Path):
        self.folder, self.return_value = folder, {"history": [METRICS], "world_size": 1}

    def get_best_checkpoint(self, metric, mode):
        return self

    @contextmanager
    def as_directory(self):
        yield str(self.folder)


def _session(cfg, digits, tmp_path):
    return StageSession(cfg, tmp_path / "run", "data-ref", "d" * 64, digits.input_shape, digits.out_width)


def test_finish_writes_the_whole_stage_from_a_reference_checkpoint(encoder, digits, tmp_path, monkeypatch):
    monkeypatch.setattr(ray, "put", lambda value: "ref")  # no object store needed here
    cfg, upstream, state, plan = encoder
    folder = _checkpoint(tmp_path / "ckpt", state, state_digests(state, plan.frozen_keys))
    handoff = Handoff(upstream, "up-ref", "p" * 64)
    record, _ = _session(cfg, digits, tmp_path).finish(
        1,
        handoff,
        _Result(folder),
        fp=stage_fingerprint(cfg, 1, handoff.fingerprint, "d" * 64),
        run_name="01-encoder-x-a1",
        started=0.0,
    )
    artifact, weights = read_artifact(record["artifact"])  # verified: sha256 and every tensor digest
    assert set(weights) == set(state)
    assert all(np.array_equal(weights[k], v) for k, v in state.items())
    assert artifact.manifest.frozen_digest == state_digests(upstream, plan.frozen_keys)


def test_finish_hashes_only_what_the_stage_trained_when_the_upstream_digests_are_known(
    encoder, digits, tmp_path, monkeypatch
):
    from cascade_ray.models import weights as weights_module

    monkeypatch.setattr(ray, "put", lambda value: "ref")
    cfg, upstream, state, plan = encoder
    folder = _checkpoint(tmp_path / "ckpt", state, state_digests(state, plan.frozen_keys))
    handoff = Handoff(upstream, "up-ref", "p" * 64, state_digests(upstream))  # as the driver's hand-off carries them
    calls = []
    real = weights_module.tensor_digest
    monkeypatch.setattr(weights_module, "tensor_digest", lambda t: calls.append(1) or real(t))
    record, done = _session(cfg, digits, tmp_path).finish(
        1, handoff, _Result(folder), fp="f" * 64, run_name="01-encoder-x-a1", started=0.0
    )
    assert len(calls) == len(state) - len(plan.frozen_keys)  # the frozen upstream: hashed neither to check nor to write
    monkeypatch.undo()
    artifact, weights = read_artifact(record["artifact"])  # verified: sha256 and every tensor digest
    assert all(np.array_equal(weights[k], v) for k, v in state.items())
    assert done.digests == artifact.manifest.tensor_digests == state_digests(state)


def test_finish_refuses_a_reference_checkpoint_of_another_upstream(encoder, digits, tmp_path, monkeypatch):
    monkeypatch.setattr(ray, "put", lambda value: "ref")
    cfg, upstream, state, plan = encoder
    folder = _checkpoint(tmp_path / "ckpt", state, state_digests(state, plan.frozen_keys))
    key = plan.frozen_keys[-1]
    other = Handoff(dict(upstream) | {key: np.zeros_like(upstream[key]) + 3}, "up-ref", "p" * 64)
    with pytest.raises(FrozenDriftError, match=key):
        _session(cfg, digits, tmp_path).finish(1, other, _Result(folder), fp="f" * 64, run_name="r", started=0.0)
    assert not (tmp_path / "run" / "stages").exists() or not any((tmp_path / "run" / "stages").rglob("*.safetensors"))
