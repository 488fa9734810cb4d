"""A sweep's failed trials: kept in the results table with why they failed, listed last, never
adopted; the same order for a plain sweep's trials and a batched sweep's replicas. The real sweeps
are tests/integration/test_tune.py (a trial that diverges) and test_batched_tune.py."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import ray.exceptions

from cascade_ray.errors import HealthError
from cascade_ray.pipeline.failures import error_message
from cascade_ray.tune.run import SweepOutcome, format_results, table_order


def _row(tid: str, value: float, error: str | None = None) -> dict:
    return {"trial_id": tid, "val_loss": value, "epoch": 1 if error is None else 0, "error": error}


def test_trials_that_trained_come_first_best_first_then_those_without_a_value_then_failed_ones():
    rows = [
        _row("a", math.nan, "nonfinite: loss is NaN"),
        _row("b", 0.5),
        _row("c", math.nan),
        _row("d", 0.2, "frozen drift"),  # its best epoch was good: failed all the same
        _row("e", 0.3),
        _row("f", 0.3),
    ]
    assert [r["trial_id"] for r in table_order(rows, "val_loss", "min")] == ["e", "f", "b", "c", "d", "a"]
    assert [r["trial_id"] for r in table_order(rows, "val_loss", "max")] == ["b", "e", "f", "c", "d", "a"]


def test_the_message_of_the_error_a_trial_raised_not_rays_wrapper():
    cause = HealthError("nonfinite", "encoder", 3, "loss is nan", "stages[1].solver.lr", "lower the lr")
    wrapped = ray.exceptions.RayTaskError("_run_trial", "Traceback (most recent call last): ...", cause)
    assert error_message(wrapped.as_instanceof_cause()) == str(cause)
    assert error_message(RuntimeError("line one\nline two")) == "RuntimeError: line one"


def test_the_printed_table_marks_a_failed_trial():
    rows = [_row("trial_00000", 0.25), _row("trial_00001", math.nan, "nonfinite: loss is NaN")]
    outcome = SweepOutcome("encoder", {}, 0.25, Path("t"), [], rows, Path("r"), Path("b"))
    head, good, bad, _ = format_results(outcome, "val_loss").splitlines()
    assert (
        "FAILED" not in good
        and bad.split()[:3] == ["trial_00001", "nan", "0"]
        and bad.endswith("FAILED (not a candidate)")
    )


class _Result:
    """What trial_rows reads of a Ray Tune Result: the last metrics (its trial id), the error, the
    config and every reported epoch."""

    def __init__(self, tid, epochs, error=None, config=None):
        import pandas as pd

        self.metrics = {"trial_id": tid} | ({"config": config} if config is not None else {})
        self.error, self.config = error, config
        self.metrics_dataframe = pd.DataFrame(epochs) if epochs else None


def _space(**extra):
    from cascade_ray.tune.space import TuneSpace

    return TuneSpace.model_validate(
        {"stage": "encoder", "metric": "val_accuracy", "mode": "max", "space": {"solver.lr": {"grid": [0.1, 1.0]}}}
        | extra
    )


def test_a_trial_that_failed_after_its_best_epoch_is_listed_last_and_the_best_is_one_that_trained():
    """Ray's get_best_result(scope="all") ranks trials by their best epoch whatever their status: it would
    take `early` (0.99 at epoch 1, then a health error) over `steady` (0.80)."""
    from cascade_ray.tune.run import trial_rows

    fail = HealthError("nonfinite", "encoder", 40, "loss is nan", "stages[1].solver.lr", "lower the lr")
    results = [
        _Result(
            "early",
            [{"epoch": 1, "val_accuracy": 0.99}],
            ray.exceptions.RayTaskError("f", "tb", fail),
            {"solver.lr": 1.0},
        ),
        _Result(
            "steady", [{"epoch": 1, "val_accuracy": 0.7}, {"epoch": 2, "val_accuracy": 0.8}], None, {"solver.lr": 0.1}
        ),
        _Result(
            "nan",
            [{"epoch": 1, "val_accuracy": math.nan}, {"epoch": 2, "val_accuracy": math.nan}],
            None,
            {"solver.lr": 0.1},
        ),
        _Result("died", [], RuntimeError("actor died"), None),  # Tune has no config for it
    ]
    table = table_order(trial_rows(results, _space()), "val_accuracy", "max")
    assert [r["trial_id"] for r in table] == ["steady", "nan", "early", "died"]
    steady, nan, early, died = table
    assert steady == {"trial_id": "steady", "val_accuracy": 0.8, "epoch": 2, "error": None, "config/solver.lr": 0.1}
    assert math.isnan(nan["val_accuracy"]) and nan["error"] is None
    assert early["val_accuracy"] == 0.99 and early["error"] == str(fail)
    assert died["epoch"] == 0 and died["error"] == "RuntimeError: actor died" and died["config/solver.lr"] is None


def test_json_text_values_of_a_failed_trial_are_values_again():
    from cascade_ray.tune.run import trial_rows

    space = _space(space={"model.hidden": {"choice": [[32], [64, 64]]}})
    rows = trial_rows([_Result("a", [], RuntimeError("x"), {"model.hidden": "[64, 64]"})], space)
    assert rows[0]["config/model.hidden"] == [64, 64]


def test_the_batched_pick_and_the_table_agree_on_non_finite_values():
    from cascade_ray.stage.batched import best_replica

    histories = [[{"val_loss": math.nan}], [{"val_loss": 0.5}], [{"val_loss": math.inf}], [{"val_loss": 0.4}]]
    errors = [None, None, None, "nonfinite ..."]
    assert best_replica(histories, errors, "val_loss", "min") == 1  # not the NaN one, not the failed one
    rows = [_row(str(k), h[-1]["val_loss"], e) for k, (h, e) in enumerate(zip(histories, errors))]
    assert table_order(rows, "val_loss", "min")[0]["trial_id"] == "1"
    assert best_replica(histories[:1] + histories[2:3], [None, None], "val_loss", "min") is None  # none finite


def test_best_yaml_names_what_else_the_best_trial_trained_with_and_no_credentials(tmp_path):
    """best.yaml holds the swept values only; its header names the command line the sweep ran on
    (credentials in a URI left out) and the command that trains the trial's config again, with the
    best.yaml of each stage swept before it in the same run."""
    from types import SimpleNamespace

    from cascade_ray.config.yaml_io import read_yaml
    from cascade_ray.options import RunOptions
    from cascade_ray.storage import as_storage
    from cascade_ray.tune.run import best_yaml_text

    options = RunOptions(
        spaces=(("encoder", "e.yaml"), ("classifier", "c.yaml")),
        config_arg="debug stages.classifier.solver.type=SGD storage_path=s3://AKID:s3cret@bucket/runs",
    )
    session = SimpleNamespace(options=options, out=as_storage(tmp_path / "debug"), cfg=SimpleNamespace(name="debug"))
    space = SimpleNamespace(stage="classifier", metric="val_accuracy", mode="max")
    text = best_yaml_text(session, space, 4, {"solver.lr": 0.01}, batched=True)
    assert "s3cret" not in text and "AKID" not in text
    header = text.splitlines()[:4]
    assert header == [
        "# best of 4 trials (batched) of stage 'classifier' by val_accuracy (max)",
        "# the swept values only; the sweep ran on: debug stages.classifier.solver.type=SGD "
        "storage_path=s3://bucket/runs",
        "# on the best of the stages swept before it: 'encoder'",
        "# its config again: cascade-ray run debug stages.classifier.solver.type=SGD storage_path=s3://bucket/runs "
        f"{tmp_path}/debug/tune/encoder/best.yaml {tmp_path}/debug/tune/classifier/best.yaml name=debug-best",
    ]  # a sweep inside a full run (run --tune): that folder will hold a finished run, so another name
    alone = dataclasses.replace(options, stop_after="classifier")  # cascade-ray tune: the folder stays open
    again = best_yaml_text(SimpleNamespace(options=alone, out=session.out, cfg=session.cfg), space, 4, {})
    assert again.splitlines()[3].endswith("/debug/tune/classifier/best.yaml"), again
    best = tmp_path / "best.yaml"
    best.write_text(text)
    assert read_yaml(best) == {"stages.classifier.solver.lr": 0.01}  # read back as overrides: the values only
