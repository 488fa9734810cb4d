"""A batched sweep's resume state (no Ray): saved after every epoch, verified when read back, and
a job continued from it ends exactly as one that was never stopped."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from fakes import ListReporter
from paths import CONFIGS

from cascade_ray.checks import load_config
from cascade_ray.errors import CascadeError
from cascade_ray.pipeline.features import upstream_outputs
from cascade_ray.stage.batched import run_batched
from cascade_ray.stage.batched_resume import LATEST, ResumeWriter, read_resume
from cascade_ray.stage.setup import build_stage_model
from cascade_ray.tune.batched import find_resume, replicas_key
from cascade_ray.tune.sweep import trial_config

CPU = torch.device("cpu")
STAGE = 2
VALUES = [  # Adam with dropout (RNG state), SGD with momentum (optimizer state), a cosine-free constant lr
    {"solver.lr": 1e-2},
    {"solver.lr": 2e-2, "loss.scale": 0.5, "solver.type": "SGD", "solver.momentum": 0.9},
]


@pytest.fixture(scope="module")
def inputs(digits):
    cfg = load_config(
        CONFIGS / "debug.yaml", ["stages.classifier.model.dropout=0.3", "stages.classifier.train.epochs=3"]
    )
    model, _ = build_stage_model(cfg, STAGE - 1, digits, None)
    upstream = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    out = upstream_outputs(cfg, STAGE, digits, upstream)
    return (
        cfg,
        [trial_config(cfg, "classifier", v) for v in VALUES],
        upstream,
        {"x_train": out["train"], "x_val": out["val"]},
    )


def _trained(histories):
    """The histories without the epochs' wall-time throughput (the only figure that is not the training's)."""
    return [[{k: v for k, v in row.items() if k != "samples_per_s"} for row in h] for h in histories]


def _run(inputs, digits, **kwargs):
    _, cfgs, upstream, features = inputs
    reporter = ListReporter()
    outcome = run_batched(
        cfgs, STAGE, digits, upstream, features, reporter, CPU, metric="val_accuracy", mode="max", **kwargs
    )
    return outcome, reporter


@pytest.fixture(scope="module")
def uninterrupted(inputs, digits, tmp_path_factory):
    """The whole job, its state written after every epoch (what a killed job leaves behind)."""
    folder = tmp_path_factory.mktemp("resume")
    saved = {}
    writer = ResumeWriter(folder, "key-1")

    def save(epochs_done, states):
        writer.save(epochs_done, states)
        saved[epochs_done] = read_resume(folder)  # what a job killed right after this epoch would find

    outcome, reporter = _run(inputs, digits, save=save)
    return outcome, reporter, saved, folder


def test_the_state_after_each_epoch_replaces_the_one_before(uninterrupted):
    _, _, saved, folder = uninterrupted
    assert sorted(saved) == [1, 2, 3]
    assert sorted(p.name for p in folder.iterdir()) == [LATEST, "state-e0003.pt"]
    meta = json.loads((folder / LATEST).read_text())
    assert meta["epochs_done"] == 3 and meta["replicas"] == 2 and meta["key"] == "key-1"


@pytest.mark.parametrize("after", [1, 2])
def test_a_job_resumed_after_an_epoch_ends_exactly_as_one_never_stopped(inputs, digits, uninterrupted, after, capsys):
    outcome, reporter, saved, _ = uninterrupted
    point = saved[after]
    assert point.epochs_done == after
    resumed, resumed_reporter = _run(inputs, digits, resume=point.load())
    assert resumed.resumed_after == after
    assert f"batched sweep resumed after epoch {after}: 2 replicas" in capsys.readouterr().out
    # every epoch's metrics, the pick, and the reported weights are bit for bit the same
    assert _trained(resumed.histories) == _trained(outcome.histories)
    assert (resumed.best, resumed.best_epoch) == (outcome.best, outcome.best_epoch)
    (state,), (expected,) = resumed_reporter.states, reporter.states
    assert state.keys() == expected.keys()
    for key in expected:
        np.testing.assert_array_equal(state[key], expected[key], err_msg=key)


def test_a_finished_jobs_state_resumes_to_the_same_report_without_training(inputs, digits, uninterrupted, tmp_path):
    outcome, reporter, saved, _ = uninterrupted
    writer = ResumeWriter(tmp_path, "key-1")
    resumed, resumed_reporter = _run(inputs, digits, resume=saved[3].load(), save=writer.save)
    assert _trained(resumed.histories) == _trained(outcome.histories) and resumed.best == outcome.best
    kept = read_resume(tmp_path)  # the new attempt keeps the state it continued: its folder stands alone
    assert kept.epochs_done == 3 and sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "state-e0003.pt"]
    assert _trained([r["trainer"]["history"] for r in kept.load()["replicas"]]) == _trained(outcome.histories)
    for key, value in reporter.states[0].items():
        np.testing.assert_array_equal(resumed_reporter.states[0][key], value, err_msg=key)


def test_a_state_of_another_number_of_replicas_is_refused(inputs, digits, uninterrupted):
    _, _, saved, _ = uninterrupted
    state = saved[1].load()
    state["replicas"] = state["replicas"][:1]
    with pytest.raises(CascadeError, match="holds 1 replicas, the sweep has 2.*without --resume"):
        _run(inputs, digits, resume=state)


def _flip_a_byte(path):
    blob = bytearray(path.read_bytes())
    blob[-5] ^= 0xFF
    path.write_bytes(bytes(blob))


def test_a_damaged_state_is_refused_naming_the_file_and_the_fix(tmp_path):
    writer = ResumeWriter(tmp_path, "k")
    writer.save(1, [{"own": {"w": torch.ones(2)}}])
    assert read_resume(tmp_path).load()["replicas"][0]["own"]["w"].tolist() == [1.0, 1.0]
    _flip_a_byte(tmp_path / "state-e0001.pt")
    with pytest.raises(CascadeError, match=r"state-e0001\.pt: the resume state is damaged .*without --resume"):
        read_resume(tmp_path)
    (tmp_path / LATEST).write_text("{not json")
    with pytest.raises(CascadeError, match=r"latest\.json: the batched sweep's resume record is damaged"):
        read_resume(tmp_path)
    (tmp_path / LATEST).write_text(
        json.dumps({"file": "gone.pt", "bytes": 1, "sha256": "0", "epochs_done": 1, "key": "k"})
    )
    with pytest.raises(CascadeError, match="names the resume state 'gone.pt', which is not in"):
        read_resume(tmp_path)
    assert read_resume(tmp_path / "nothing-here") is None


def test_the_newest_attempt_of_the_same_configs_is_found(tmp_path, inputs):
    cfg, cfgs, _, _ = inputs
    key = replicas_key(cfgs, STAGE, "upstream-fp", "data-fp")
    # the key follows every replica's config, the upstream and the data
    assert key != replicas_key(cfgs[::-1], STAGE, "upstream-fp", "data-fp")
    assert key != replicas_key(cfgs, STAGE, "other-upstream", "data-fp")
    assert key != replicas_key(cfgs, STAGE, "upstream-fp", "other-data")
    assert key != replicas_key(
        [trial_config(cfg, "classifier", {"solver.lr": 0.5}), cfgs[1]], STAGE, "upstream-fp", "data-fp"
    )
    trials = tmp_path / "trials"
    assert find_resume(trials, key) is None
    for attempt, (written_with, epochs) in {2: (key, 1), 3: ("another-space", 2), 10: (key, 2)}.items():
        ResumeWriter(trials / f"batched-a{attempt}" / "resume", written_with).save(epochs, [])
    (trials / "batched-a11").mkdir()  # an attempt killed before its first epoch ended: nothing to resume
    point = find_resume(trials, key)
    assert point.folder == trials / "batched-a10" / "resume" and point.epochs_done == 2  # a10 is newer than a2
    assert find_resume(trials, "a-key-no-attempt-has") is None


def test_the_state_is_kept_and_verified_on_s3(s3):
    """The same writer and reader on the moto S3 server: an object put replaces latest.json whole,
    the earlier epoch's object is deleted after it, and a flipped byte is refused."""
    from cascade_ray.storage import as_storage

    folder = as_storage(s3.uri("batched-resume", "trials", "batched-a1", "resume"))
    writer = ResumeWriter(folder, "k")
    for epochs in (1, 2):
        writer.save(epochs, [{"own": {"w": torch.full((3,), float(epochs))}}])
    point = read_resume(folder)
    assert point.epochs_done == 2 and point.load()["replicas"][0]["own"]["w"].tolist() == [2.0, 2.0, 2.0]
    assert sorted(p.name for p in folder.iterdir()) == [LATEST, "state-e0002.pt"]
    assert find_resume(as_storage(s3.uri("batched-resume", "trials")), "k").folder == folder
    _flip_a_byte(folder / "state-e0002.pt")
    with pytest.raises(CascadeError, match=r"state-e0002\.pt: the resume state is damaged"):
        read_resume(folder)


class _Ranks:
    """A rank of a `world`-rank job whose all_sum adds the other ranks' values (given)."""

    def __init__(self, others):
        self.rank, self.world, self.others = 0, 1 + len(others), others

    def all_sum(self, values):
        return [v + sum(o[i] for o in self.others) for i, v in enumerate(values)]


def test_ranks_that_found_different_states_stop_naming_the_folder_and_the_fix():
    from cascade_ray.stage.batched import same_resume_on_every_rank

    state = {"epochs_done": 2}
    same_resume_on_every_rank(_Ranks([[2.0, 4.0]]), state, "/runs/x/resume")  # both after epoch 2
    same_resume_on_every_rank(_Ranks([[-1.0, 1.0]] * 3), None, "/runs/x/resume")  # none found one
    for others, mine in (([[-1.0, 1.0]], state), ([[1.0, 1.0], [3.0, 9.0]], state), ([[2.0, 4.0]], None)):
        # a rank on another node saw no state; two ranks whose mean is this one's; this rank saw none
        with pytest.raises(CascadeError, match=r"ranks found different resume states under /runs/x/resume.*shared"):
            same_resume_on_every_rank(_Ranks(others), mine, "/runs/x/resume")


def test_a_finished_attempt_is_used_as_it_is_only_when_its_ray_run_ended_with_the_best_replica(
    uninterrupted, monkeypatch
):
    """``tune --batched --resume`` after a job that trained every epoch: its state gives every
    replica's history and the pick, and its Ray run's one checkpoint is the adopted weights; no job
    starts. A state with epochs left, or a run killed before its report, runs a job as before."""
    from types import SimpleNamespace

    from cascade_ray.tune import batched

    outcome, _, saved, _ = uninterrupted
    assert batched.finished_attempt(None, 3, "val_accuracy", "max") is None
    # the folder holds no Ray run (a job killed before Ray Train wrote one): a new job continues the state
    assert batched.finished_attempt(saved[3], 3, "val_accuracy", "max") is None
    reads = []

    def ended(metrics):
        def read(path):
            reads.append(path)
            return SimpleNamespace(checkpoint=object(), metrics=metrics)

        return read

    monkeypatch.setattr(batched, "read_run_result", ended({"replica": outcome.best}))
    histories, errors, best = batched.finished_attempt(saved[3], 3, "val_accuracy", "max")
    assert _trained(histories) == _trained(outcome.histories) and errors == outcome.errors and best == outcome.best
    assert reads == [batched.full_uri(saved[3].folder.parent)]  # the attempt's own Ray run
    assert batched.finished_attempt(saved[1], 3, "val_accuracy", "max") is None  # two epochs left to train
    assert len(reads) == 1  # not even read: the state says it is unfinished
    monkeypatch.setattr(batched, "read_run_result", ended({"replica": 1 - outcome.best}))
    assert batched.finished_attempt(saved[3], 3, "val_accuracy", "max") is None  # a report of another pick
