"""The sha256 sidecar of a sweep's Tune state (issue 18, part 3): ``tune --resume`` checks it before
``Tuner.restore`` unpickles ``tuner.pkl``. No Ray: the folders are written here as Tune lays them out.

    pytest tests/unit/test_tune_state.py
"""

from __future__ import annotations

import pickle

import pytest

from cascade_ray.errors import ArtifactError
from cascade_ray.storage import as_storage
from cascade_ray.tune.state import STATE_SIDECAR, StateDigestCallback, verify_state, write_state


@pytest.fixture
def exp_dir(tmp_path):
    """``{run}/tune/<stage>`` with the files Tune writes in its experiment folder, and the sidecar."""
    experiment = tmp_path / "exp" / "tune"
    experiment.mkdir(parents=True)
    (experiment / "tuner.pkl").write_bytes(pickle.dumps({"state": 1}))
    (experiment / "experiment_state-2026-01-01.json").write_text('{"trials": []}')
    (experiment / "trial-0").mkdir()  # trial folders are not Tune's restore state
    write_state(as_storage(tmp_path / "exp"))
    return tmp_path / "exp"


def _tamper_tuner(exp_dir, **_):
    (exp_dir / "tune" / "tuner.pkl").write_bytes(pickle.dumps({"state": 2}))


def _flip_a_bit(exp_dir, **_):
    path = exp_dir / "tune" / "experiment_state-2026-01-01.json"
    data = bytearray(path.read_bytes())
    data[0] ^= 1
    path.write_bytes(bytes(data))


def _plant_a_pickle(exp_dir, **_):
    (exp_dir / "tune" / "search_gen_state-1.pkl").write_bytes(pickle.dumps("planted"))


def _remove_a_listed_file(exp_dir, **_):
    (exp_dir / "tune" / "experiment_state-2026-01-01.json").unlink()


def _drop_the_sidecar(exp_dir, **_):
    (exp_dir / STATE_SIDECAR).unlink()


def _rewrite_the_sidecar_for_another_file(exp_dir, **_):
    (exp_dir / STATE_SIDECAR).write_text("0" * 64 + "  tuner.pkl\n")


# tampered Tune state: (change, the file named, what is said)
TAMPER_CASES = [
    (_tamper_tuner, "tuner.pkl", "does not match its sha256"),
    (_flip_a_bit, "experiment_state-2026-01-01.json", "does not match its sha256"),
    (_plant_a_pickle, "search_gen_state-1.pkl", "is not listed in"),
    (_remove_a_listed_file, "experiment_state-2026-01-01.json", "is missing but listed"),
    (_drop_the_sidecar, "tuner.pkl", f"no {STATE_SIDECAR}"),
    (_rewrite_the_sidecar_for_another_file, "experiment_state-2026-01-01.json", "is not listed in"),
]


def test_the_state_cascade_ray_wrote_verifies(exp_dir):
    verify_state(as_storage(exp_dir))
    lines = (exp_dir / STATE_SIDECAR).read_text().splitlines()
    assert [line.split("  ")[1] for line in lines] == ["experiment_state-2026-01-01.json", "tuner.pkl"]
    assert all(len(line.split("  ")[0]) == 64 for line in lines)


@pytest.mark.parametrize(
    ("change", "named", "said"), TAMPER_CASES, ids=[c.__name__.strip("_") for c, _, _ in TAMPER_CASES]
)
def test_tampered_state_is_refused_naming_the_file_and_the_way_out(change, named, said, exp_dir):
    change(exp_dir)
    with pytest.raises(ArtifactError) as info:
        verify_state(as_storage(exp_dir))
    text = str(info.value)
    assert f"/{named}" in text and said in text
    assert "start a fresh sweep" in text and "--trust-tune-state" in text
    assert info.value.exit_code == 2
    verify_state(as_storage(exp_dir), trust_state=True)  # the explicit override


def test_no_tune_state_is_a_fresh_sweep(tmp_path):
    verify_state(as_storage(tmp_path / "never-swept"))
    (tmp_path / "started" / "tune").mkdir(parents=True)  # Ray made the folder, wrote nothing yet
    verify_state(as_storage(tmp_path / "started"))


def test_the_callback_rewrites_the_sidecar_and_survives_tunes_pickle(exp_dir):
    callback = StateDigestCallback(as_storage(exp_dir), interval_s=3600)
    _tamper_tuner(exp_dir)  # Ray rewrote its state during the sweep
    callback.on_step_end(iteration=1, trials=[])
    verify_state(as_storage(exp_dir))
    _tamper_tuner(exp_dir)
    (exp_dir / "tune" / "tuner.pkl").write_bytes(b"changed again")
    callback.on_step_end(iteration=2, trials=[])  # within the interval: not rewritten
    with pytest.raises(ArtifactError):
        verify_state(as_storage(exp_dir))
    restored = pickle.loads(pickle.dumps(callback))  # Tune pickles its callbacks into tuner.pkl
    restored.on_experiment_end(trials=[])
    verify_state(as_storage(exp_dir))


def test_a_resumed_sweep_names_what_changed_since_it_ran(tmp_path):
    """--resume of a plain sweep compares what it ran on (sweep.json: the space and the stage's fingerprint
    inputs) and names the config and space keys that changed; the same inputs, or a sweep from before the
    file existed, restore as before (None)."""
    import json

    from paths import CONFIGS

    from cascade_ray.checks import load_config
    from cascade_ray.pipeline.stages import StageSession
    from cascade_ray.tune.run import SWEEP_INPUTS, sweep_changes, sweep_inputs
    from cascade_ray.tune.space import load_space

    space_file = tmp_path / "space.yaml"
    space_file.write_text(
        "stage: classifier\nnum_samples: 2\nscheduler: {type: fifo}\nspace:\n  solver.lr: {loguniform: [1.0e-4, 1.0e-2]}\n"
    )

    def inputs(overrides, text=None):
        if text is not None:
            space_file.write_text(text)
        cfg = load_config(CONFIGS / "debug.yaml", overrides)
        session = StageSession(cfg, tmp_path, None, "d" * 64, (1, 8, 8), 10)
        index = cfg.stage_index("classifier")
        return cfg, index, sweep_inputs(session, load_space(space_file, cfg), index, None)

    cfg, index, ran_on = inputs([])
    assert sweep_changes(tmp_path, ran_on, cfg, index) is None  # no sweep.json: an older sweep, restored
    (tmp_path / SWEEP_INPUTS).write_text(json.dumps(ran_on, sort_keys=True))
    assert sweep_changes(tmp_path, ran_on, cfg, index) is None
    cfg, index, now = inputs(["stages.classifier.train.epochs=7"])
    assert sweep_changes(tmp_path, now, cfg, index).startswith("stages.classifier.train.epochs: ")
    assert "-> 7" in sweep_changes(tmp_path, now, cfg, index)
    cfg, index, now = inputs([], space_file.read_text().replace("num_samples: 2", "num_samples: 3"))
    assert sweep_changes(tmp_path, now, cfg, index) == "the space file changed: num_samples"


@pytest.mark.parametrize(
    ("entry", "path", "said"),
    [
        ("solver.lr: {}", "space.solver.lr", "give exactly one distribution, got none"),
        ("solver.lr: {choice: [0.1]}\nsearch: optuna", "search", "needs the optuna package"),
    ],
)
def test_space_mistakes_found_before_ray_name_the_key(tmp_path, monkeypatch, entry, path, said):
    """An empty distribution (it crashed the check with StopIteration) and search: optuna without optuna
    (Ray's OptunaSearch imports without it and failed after Ray started) are ConfigErrors naming the key."""
    import importlib.util

    from paths import CONFIGS

    from cascade_ray.checks import load_config
    from cascade_ray.errors import ConfigError
    from cascade_ray.tune.space import load_space

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "optuna" else real(name, *a))
    space_file = tmp_path / "space.yaml"
    key, _, rest = entry.partition("\n")
    space_file.write_text(f"stage: classifier\nspace:\n  {key}\n{rest}\n")
    with pytest.raises(ConfigError) as caught:
        load_space(space_file, load_config(CONFIGS / "debug.yaml"))
    found = {issue.path: issue.message for issue in caught.value.issues}
    assert said in found.get(path, ""), found


def test_a_space_files_schema_errors_read_like_a_configs(tmp_path):
    """Unknown keys and choices get a did-you-mean and the valid names, as in a config (they were pydantic's
    bare "Extra inputs are not permitted")."""
    from paths import CONFIGS

    from cascade_ray.checks import load_config
    from cascade_ray.errors import ConfigError
    from cascade_ray.tune.space import load_space

    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "stage: classifier\nnum_sampels: 2\nsearch: randm\nspace:\n  solver.lr: {loguniformm: [1.0e-4, 1.0e-2]}\n"
    )
    with pytest.raises(ConfigError) as caught:
        load_space(bad, load_config(CONFIGS / "debug.yaml"))
    found = {issue.path: issue.message for issue in caught.value.issues}
    assert "unknown key 'num_sampels'; did you mean 'num_samples'?" in found["num_sampels"]
    assert "'randm' is not allowed; did you mean 'random'?" in found["search"]
    assert "did you mean 'loguniform'?" in found["space.solver.lr.loguniformm"]


@pytest.mark.parametrize(
    ("stage", "entries", "said"),
    [
        ("encoder", "  model.d_model: {choice: [16, 24]}\n", "the trial with model.d_model=24 cannot train"),
        (
            "classifier",
            "  solver.type: {grid: [Adam, SGD]}\n  solver.betas: {choice: [[0.9, 0.99]]}\n",
            "the trial with solver.type='SGD', solver.betas=[0.9, 0.99] cannot train",
        ),
    ],
)
def test_values_that_fail_together_or_with_the_next_stage_are_found_before_any_trial(tmp_path, stage, entries, said):
    """Each value passes alone; in combination (or with the next stage's input width) a trial could not
    train: the space is refused before Ray starts, naming the combination (every trial with it failed)."""
    from paths import CONFIGS

    from cascade_ray.checks import load_config
    from cascade_ray.errors import ConfigError
    from cascade_ray.tune.space import load_space

    space_file = tmp_path / "space.yaml"
    space_file.write_text(f"stage: {stage}\nspace:\n{entries}")
    with pytest.raises(ConfigError) as caught:
        load_space(space_file, load_config(CONFIGS / "debug.yaml"))
    (issue,) = caught.value.issues
    assert issue.path == "space" and said in issue.message, issue.render()
    assert "take out the values that cannot go together" in issue.fix


@pytest.mark.parametrize(
    ("stage", "entries", "path", "said", "fix"),
    [
        # features trains 2 epochs in debug.yaml: Ray's ASHA asserted "grace_period must be <= max_t!" after Ray started
        (
            "features",
            "scheduler: {grace_period: 4}\n",
            "scheduler.grace_period",
            "ASHA could never stop",
            "fifo",
        ),
        (
            "classifier",
            "scheduler: {grace_period: 3}\n",
            "scheduler.grace_period",
            "past the last epoch",
            "at most 2",
        ),
        (
            "classifier",
            "scheduler: {max_t: 1}\n",
            "scheduler.max_t",
            "stop at epoch 1, before the 2 epochs",
            "epochs=1",
        ),
        (
            "classifier",
            "scheduler: {max_t: 3}\n",
            "scheduler.max_t",
            "before the 5 epochs a trial samples",
            "sample space.train.epochs up to 3",
        ),
    ],
)
def test_asha_settings_the_stages_epochs_make_useless_or_truncating_are_refused(
    tmp_path, stage, entries, path, said, fix
):
    """A grace_period past a trial's last epoch failed Ray's assert after Ray started; a max_t below the
    epochs cut every trial short and adopted a stage trained fewer epochs than its config said."""
    from paths import CONFIGS

    from cascade_ray.checks import load_config
    from cascade_ray.errors import ConfigError
    from cascade_ray.tune.space import load_space

    sampled = "  train.epochs: {choice: [2, 5]}\n" if "samples" in said else ""
    space_file = tmp_path / "space.yaml"
    space_file.write_text(f"stage: {stage}\n{entries}space:\n  solver.lr: {{loguniform: [1.0e-3, 1.0e-2]}}\n{sampled}")
    with pytest.raises(ConfigError) as caught:
        load_space(space_file, load_config(CONFIGS / "debug.yaml"))
    (issue,) = caught.value.issues
    assert issue.path == path and said in issue.message and fix in issue.fix, issue.render()


def test_asha_runs_sampled_epochs_to_their_end_and_a_grace_below_them_is_fine(tmp_path):
    """max_t defaults to the most epochs a trial samples (it was the stage's own epochs, so a trial sampled
    with more was stopped at the stage's count)."""
    from paths import CONFIGS

    from cascade_ray.checks import load_config
    from cascade_ray.tune.space import asha_max_t, load_space

    space_file = tmp_path / "space.yaml"
    space_file.write_text("stage: classifier\nspace:\n  train.epochs: {randint: [2, 6]}\n")
    space = load_space(space_file, load_config(CONFIGS / "debug.yaml"))
    assert space.scheduler.type == "asha" and asha_max_t(space, 2) == 5
    # the default scheduler (asha, grace 1) on 1-epoch stages: nothing to stop early, but a valid sweep
    space_file.write_text("stage: joint\nspace:\n  solver.lr: {loguniform: [1.0e-4, 1.0e-3]}\n")
    assert load_space(space_file, load_config(CONFIGS / "debug_joint.yaml")).scheduler.grace_period == 1


def test_the_interrupt_watch_records_tunes_stop_signals_and_the_handlers_come_back(tmp_path):
    """InterruptWatch sits in front of the handlers Tune installed (SIGINT, SIGUSR1): the signal is recorded
    and still reaches Tune's; the handlers from before the sweep are put back after it."""
    import os
    import signal

    from cascade_ray.tune.state import (
        InterruptWatch,
        drop_state,
        interrupted,
        restore_signal_handlers,
        signal_handlers,
        watch_interrupts,
    )

    before = signal_handlers()
    seen: list[int] = []
    try:
        for sig in (signal.SIGINT, signal.SIGUSR1):  # what Tune's _setup_signal_catching installs
            signal.signal(sig, lambda s, f: seen.append(s))
        watch_interrupts()
        InterruptWatch().setup()
        assert not interrupted()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert interrupted() and seen == [signal.SIGUSR1]
    finally:
        restore_signal_handlers(before)
    assert signal_handlers() == before
    watch_interrupts()
    assert not interrupted()
    # a sweep that does not continue the stored one removes the state a restore would read, and its sidecar
    (tmp_path / "tune").mkdir()
    for name in ("tuner.pkl", "experiment_state-2026.json", STATE_SIDECAR):
        (tmp_path / ("" if name == STATE_SIDECAR else "tune") / name).write_text("x")
    (tmp_path / "tune" / "trial-a").mkdir()
    drop_state(tmp_path)
    assert sorted(p.name for p in (tmp_path / "tune").iterdir()) == ["trial-a"]
    assert not (tmp_path / STATE_SIDECAR).exists()
