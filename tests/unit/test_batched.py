"""Batched sweeps in-process (no Ray): each replica trains exactly as its config alone, and the
report carries the best replica's best epoch."""

from __future__ import annotations

import logging
import shlex
import tempfile

import numpy as np
import pytest
import torch
from fakes import ListReporter
from paths import CONFIGS

from cascade_ray.checks import load_config, validate_config
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
    {"solver.lr": 1e-2, "solver.weight_decay": 0.0, "seed": 7},  # the first config with its own stage seed
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
    # the replicas really differ (a shared optimizer or RNG would not show up above otherwise);
    # the last differs from the first by its seed alone (its own initialization and dropout)
    assert not np.allclose(finals[0], finals[1]) and not np.allclose(finals[0], finals[2])
    assert not np.allclose(finals[0], finals[3])


def test_a_per_parameter_group_value_is_per_replica(inputs, digits):
    """A space over ``solver.param_groups[0].lr`` (the head's own lr here): each replica's optimizer
    gets its value, and the replica ends as that config trained alone."""
    base, _, upstream, features = inputs
    cfg = trial_config(base, "classifier", {"solver.param_groups": [{"match": "heads", "lr": 1e-2}]})
    cfgs = [trial_config(cfg, "classifier", {"solver.param_groups[0].lr": lr}) for lr in (1e-2, 5e-2)]
    replicas = train_replicas(
        cfgs, STAGE, digits, upstream, features, ListReporter(), CPU, metric="val_accuracy", mode="max"
    )
    assert [r.setup.optimizer.param_groups[0]["lr"] for r in replicas] == [1e-2, 5e-2]
    lone = ListReporter()
    run_stage(cfgs[1], STAGE, digits, upstream, lone, CPU, features=features)
    state = {k: v.detach().numpy() for k, v in replicas[1].setup.model.state_dict().items()}
    for key, value in lone.states[-1].items():
        np.testing.assert_allclose(state[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
    head = "heads.classifier.fc.weight"
    assert head in state and not np.allclose(state[head], replicas[0].setup.model.state_dict()[head].numpy())


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
    # its checkpoint names the frozen upstream by digest, as each of the lone stage's checkpoints does
    assert reporter.frozen == [lone.frozen[epoch]] and lone.frozen[epoch]


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
        (
            FIFO + "space: {solver.lr: {loguniform: [1e-3, 1e-2]}}",
            "classifier",
            ["stages.classifier.scaling.strategy=fsdp", "stages.classifier.scaling.num_workers=2"],
            "stages[2].scaling.strategy",
            "silently not shard",
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


def test_mode_batched_is_the_short_form_of_batched_true(tmp_path, inputs):
    """The issue's spelling, ``mode: batched``: a batched sweep ranked in the metric's own direction."""
    from cascade_ray.api import RunOptions, stage_runners
    from cascade_ray.errors import ConfigError
    from cascade_ray.tune.batched import BatchedSweepRunner
    from cascade_ray.tune.space import load_space

    cfg = inputs[0]

    def space(head: str):
        path = tmp_path / "short.yaml"
        path.write_text(f"stage: classifier\n{head}{FIFO}space: {{solver.lr: {{loguniform: [1e-3, 1e-2]}}}}\n")
        return path

    short = load_space(space("mode: batched\n"), cfg)
    assert short.batched and short.mode == "max" and short.metric == "val_accuracy"
    by_loss = load_space(space("metric: val_loss\nmode: batched\n"), cfg)
    assert by_loss.batched and by_loss.mode == "min"
    (runner,) = stage_runners(cfg, RunOptions(spaces=(("classifier", str(space("mode: batched\n"))),))).values()
    assert isinstance(runner, BatchedSweepRunner)
    with pytest.raises(
        ConfigError, match="mode: batched asks for a batched sweep but batched: false refuses it"
    ) as caught:
        load_space(space("mode: batched\nbatched: false\n"), cfg)
    assert [i.path for i in caught.value.issues] == ["mode"]
    # a short-form space that cannot run batched: its fix says what to write instead of mode: batched
    unbatchable = tmp_path / "unbatchable.yaml"
    unbatchable.write_text(
        f"stage: classifier\nmode: batched\n{FIFO}space: {{model.dropout: {{choice: [0.0, 0.1]}}}}\n"
    )
    assert (
        load_space(unbatchable, cfg).batched_by_mode and not load_space(space("batched: true\n"), cfg).batched_by_mode
    )
    with pytest.raises(ConfigError, match="set mode: max instead of mode: batched in the space file"):
        stage_runners(cfg, RunOptions(spaces=(("classifier", str(unbatchable)),)))


def test_a_seed_sweep_is_batched_and_varies_the_initialization_only(tmp_path, inputs, digits):
    """``seed`` is a stage key a space can vary, plain or batched: the stage's initialization and
    dropout follow it, the batch order stays the pipeline seed's (so replicas share batches)."""
    from cascade_ray.pipeline.stages import stage_fingerprint
    from cascade_ray.tune.batched import batch_issues
    from cascade_ray.tune.space import load_space

    cfg = inputs[0]
    path = tmp_path / "seeds.yaml"
    path.write_text(f"stage: classifier\nmode: batched\n{FIFO}space: {{seed: {{grid: [0, 1, 2]}}}}\n")
    space = load_space(path, cfg)
    assert space.batched and batch_issues(cfg, space, str(path)) == []

    def own(seed):
        model, _ = build_stage_model(trial_config(cfg, "classifier", {"seed": seed}), STAGE, digits, inputs[2])
        return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}

    a, b, again = own(1), own(2), own(1)
    mine = [k for k in a if k.split(".")[1] == "classifier"]
    assert mine and all(np.array_equal(a[k], again[k]) for k in a)
    assert any(not np.array_equal(a[k], b[k]) for k in mine)
    assert all(np.array_equal(a[k], b[k]) for k in a if k not in mine)  # the frozen upstream is the hand-off
    fps = {stage_fingerprint(trial_config(cfg, "classifier", {"seed": s}), STAGE, "p", "d") for s in (1, 2)}
    assert len(fps | {stage_fingerprint(cfg, STAGE, "p", "d")}) == 3  # its own artifact per seed


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


def test_a_configured_value_outside_the_space_is_explained_once_and_tunes_warning_dropped(inputs):
    """The shipped classifier space samples weight decay log-uniformly over [1e-5, 1e-2]; a stage
    configured with none (0.0) still runs 0.0 first, as the baseline. Tune's variant generator,
    run for real here, warns about it; cascade-ray's note replaces that warning."""
    from fakes import records_of, shim_logger

    from cascade_ray.tune.batched import sample_values
    from cascade_ray.tune.space import TuneSpace
    from cascade_ray.tune.sweep import outside_space, reference_note, reference_values

    cfg = inputs[0]
    space = TuneSpace.model_validate(
        {
            "stage": "classifier",
            "num_samples": 3,
            "space": {"solver.lr": {"loguniform": [1e-4, 1e-2]}, "solver.weight_decay": {"loguniform": [1e-5, 1e-2]}},
        }
    )
    assert cfg.stages[2].solver.weight_decay == 0.0
    reference = reference_values(cfg, space)
    outside = outside_space(space, reference)
    assert outside == {"solver.weight_decay": "loguniform [1e-05, 0.01]"}  # lr 1e-3 lies inside
    note = reference_note(space, "spaces/classifier.yaml", reference, outside)
    assert "solver.weight_decay=0.0 (space: loguniform [1e-05, 0.01])" in note
    assert "set evaluate_current: false in spaces/classifier.yaml" in note
    ray_logger = shim_logger("quiet_preset_warnings")
    with records_of(ray_logger, logging.WARNING) as records:
        values = sample_values(cfg, space)
        assert values[0] == {"solver.lr": cfg.stages[2].solver.lr, "solver.weight_decay": 0.0}
        assert not [m for m in records.messages if m.startswith("Pre-set value")], records.messages
        assert ray_logger.filters == []
        # the control: Tune's own generator, without the filter, does warn about this point
        from cascade_ray.tune.sweep import param_space, search_algorithm

        generator, _ = search_algorithm(space, reference, 0, "", seed=cfg.seed)
        with tempfile.TemporaryDirectory() as tmp:
            spec = {"run": lambda config: None, "config": param_space(space), "num_samples": 3, "storage_path": tmp}
            generator.add_configurations({"control": spec})
            while generator.next_trial() is not None:
                pass
        assert [m for m in records.messages if m.startswith("Pre-set value")], "Tune no longer warns here"
    assert outside_space(space, None) == {}
    inside = TuneSpace.model_validate({"stage": "classifier", "space": {"loss.scale": {"choice": [1.0, 2.0]}}})
    assert outside_space(inside, reference_values(cfg, inside)) == {}
    grid = TuneSpace.model_validate({"stage": "classifier", "space": {"loss.scale": {"grid": [0.5, 2.0]}}})
    assert outside_space(grid, {"loss.scale": 1.0}) == {"loss.scale": "grid [0.5, 2.0]"}


def test_the_refusal_names_a_shipped_config_as_the_user_did(tmp_path, monkeypatch, capsys):
    import ray

    from cascade_ray.cli import main as cli_main

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray started for a refused batched sweep"))
    space = _space(tmp_path, "space: {solver.lr: {loguniform: [1e-3, 1e-2]}}")  # asha: refused
    assert cli_main(["tune", "debug", "--space", str(space), "--batched", "seed=3"]) == 2
    assert f"cascade-ray tune debug seed=3 --space {space} (without --batched)" in capsys.readouterr().err


# -- health: a replica that diverges fails alone (as one Tune trial ERRORs), the others go on --

DIVERGING = {"solver.type": "SGD", "solver.lr": 1e30}  # the loss is NaN within the first steps


def test_a_diverging_replica_fails_alone_and_cannot_be_best(inputs, lone_runs, digits, capsys):
    _, cfgs, upstream, features = inputs
    bad = trial_config(inputs[0], "classifier", DIVERGING)
    reporter = ListReporter()
    outcome = run_batched(
        [cfgs[0], bad],
        STAGE,
        digits,
        upstream,
        features,
        reporter,
        CPU,
        metric="val_accuracy",
        mode="max",
        names=["batched-a1_00000", "batched-a1_00001"],  # the results table's trial ids, as the sweep passes
    )
    assert outcome.errors[0] is None and outcome.best == 0
    assert "nonfinite" in outcome.errors[1] and "stages[2].solver.lr" in outcome.errors[1]
    assert outcome.histories[1] == []  # it failed in its first epoch: no epoch of it is reported
    out = capsys.readouterr().out
    assert "batched replica 1 (batched-a1_00001) failed" in out
    # the progress lines call each replica by its trial id in the results table
    assert "[classifier] trial batched-a1_00000" in out and "replica-" not in out
    # the healthy replica trained as alone (the failed one stepping no more does not disturb it)
    lone = lone_runs[0]
    for mine, theirs in zip(outcome.histories[0], lone.reports, strict=True):
        assert mine["val_loss"] == pytest.approx(theirs["val_loss"], rel=1e-5)


def test_every_replica_failing_fails_the_job_naming_each(inputs, digits):
    from cascade_ray.errors import HealthError

    cfg, _, upstream, features = inputs
    bad = [trial_config(cfg, "classifier", DIVERGING | {"solver.lr": lr}) for lr in (1e30, 1e31)]
    with pytest.raises(
        HealthError,
        match="(?s)every replica .* failed or reported no finite val_accuracy: replica 0: .*nonfinite.*; replica 1: ",
    ):
        run_batched(bad, STAGE, digits, upstream, features, ListReporter(), CPU, metric="val_accuracy", mode="max")


def test_frozen_drift_of_the_shared_upstream_fails_that_replica(inputs, digits, monkeypatch):
    """The digest each replica took of its frozen upstream before training is checked every epoch."""
    import cascade_ray.stage.batched as batched

    _, cfgs, upstream, features = inputs
    real, calls = batched.frozen_digest, []

    def digest(model, plan, *rest):  # the second replica's "before" digest is off: as if its upstream changed
        calls.append(1)
        taken = real(model, plan, *rest)
        return dict.fromkeys(taken, "changed") if len(calls) == 2 else taken

    monkeypatch.setattr(batched, "frozen_digest", digest)
    replicas = train_replicas(
        cfgs[:2], STAGE, digits, upstream, features, ListReporter(), CPU, metric="val_accuracy", mode="max"
    )
    assert replicas[0].error is None and len(replicas[0].history) == 2
    assert "frozen tensor(s) changed" in replicas[1].error and replicas[1].history == []


def test_sanity_val_steps_evaluate_every_replica_before_training(inputs, digits, monkeypatch):
    import cascade_ray.stage.batched as batched

    cfg, _, upstream, features = inputs
    cfgs = [trial_config(cfg, "classifier", v | {"train.sanity_val_steps": 2}) for v in VALUES[:2]]
    real, calls = batched._evaluate, []

    def spy(live, source, reporter, prefix="val_", max_batches=None):
        calls.append((len(live), prefix, max_batches))
        return real(live, source, reporter, prefix, max_batches)

    monkeypatch.setattr(batched, "_evaluate", spy)
    train_replicas(cfgs, STAGE, digits, upstream, features, ListReporter(), CPU, metric="val_accuracy", mode="max")
    assert calls[0] == (2, "sanity_", 2) and calls[1:] == [(2, "val_", None)] * 2


def test_a_failed_replicas_row_says_so_and_keeps_its_values():
    from cascade_ray.tune.batched import replica_rows

    histories = [[{"epoch": 1, "val_accuracy": 0.5}, {"epoch": 2, "val_accuracy": 0.7}], []]
    rows = replica_rows(
        "batched-a1",
        [{"solver.lr": 0.01}, {"solver.lr": 1e30}],
        histories,
        [None, "nonfinite ..."],
        "val_accuracy",
        "max",
    )
    assert rows[0] == {
        "trial_id": "batched-a1_00000",
        "val_accuracy": 0.7,
        "epoch": 2,
        "error": None,
        "config/solver.lr": 0.01,
    }
    assert rows[1]["error"] == "nonfinite ..." and rows[1]["epoch"] == 0 and np.isnan(rows[1]["val_accuracy"])
    assert rows[1]["config/solver.lr"] == 1e30


def test_each_replica_is_tracked_live_as_a_trial_run_and_a_failed_one_ends_failed(inputs, digits, tmp_path):
    """``loggers.mlflow`` on a local database (no server): rank 0 gives every replica its own run,
    nested under the pipeline's, with its epoch rows as they happen; a replica a health rule
    failed ends FAILED, the others FINISHED."""
    from mlflow.tracking import MlflowClient

    from cascade_ray.tracking.pipeline_run import PipelineTracking

    cfg, _, upstream, features = inputs
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    raw = cfg.model_dump(mode="json") | {"storage_path": str(tmp_path), "loggers": {"mlflow": {"tracking_uri": uri}}}
    tracked = validate_config(raw, preflight=False)
    values = [VALUES[0], DIVERGING]  # the second diverges: a health rule fails it
    cfgs = [trial_config(tracked, "classifier", v) for v in values]
    with PipelineTracking(tracked, tmp_path / tracked.name, log=print) as run:
        outcome = run_batched(
            cfgs,
            STAGE,
            digits,
            upstream,
            features,
            ListReporter(),
            CPU,
            metric="val_accuracy",
            mode="max",
            tracking=run.context().to_dict(),
            nodes=["node-a"],
            names=["batched-a1_00000", "batched-a1_00001"],
        )
    assert outcome.errors[0] is None and outcome.errors[1] is not None
    client = MlflowClient(uri)
    children = client.search_runs([run.experiment], f"tags.`mlflow.parentRunId` = '{run.parent}'")
    by_name = {c.info.run_name: c for c in children}
    assert set(by_name) == {"classifier trial batched-a1_00000", "classifier trial batched-a1_00001"}
    ok, failed = by_name["classifier trial batched-a1_00000"], by_name["classifier trial batched-a1_00001"]
    assert (ok.info.status, failed.info.status) == ("FINISHED", "FAILED")
    assert ok.data.tags["cascade.nodes"] == "node-a" and ok.data.params["solver.lr"] == str(VALUES[0]["solver.lr"])
    history = client.get_metric_history(ok.info.run_id, "epoch/val_accuracy")
    assert [m.value for m in history] == pytest.approx([h["val_accuracy"] for h in outcome.histories[0]])
    assert len(history) == cfg.stages[STAGE].train.epochs
