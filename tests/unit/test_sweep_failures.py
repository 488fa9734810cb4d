"""A sweep's failed trials: kept in the results table with why they failed, listed last, never
adopted; the same order for a plain sweep's trials and a batched sweep's replicas. The real sweeps
are tests/integration/test_tune.py (a trial that diverges) and test_batched_tune.py."""

from __future__ import annotations

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
