"""Space values that are lists or mappings (``model.hidden: {choice: [[32], [64]]}``): Tune samples
them as JSON text, so the first trial can run the stage's configured list (``evaluate_current``),
and every trial, the results table and ``best.yaml`` get the values themselves back. The
generator here is Ray Tune's own, run for real (no cluster needed)."""

from __future__ import annotations

import tempfile

import pytest
from paths import CONFIGS

from cascade_ray.checks import load_config
from cascade_ray.tune.batched import sample_values
from cascade_ray.tune.space import TuneSpace
from cascade_ray.tune.sweep import (
    encoded_keys,
    outside_space,
    param_space,
    reference_values,
    search_algorithm,
    stage_values,
    tune_values,
)


def _space(**space):
    return TuneSpace.model_validate({"stage": "classifier", "num_samples": 4, "space": space})


def test_a_list_choice_samples_the_configured_list_first_and_lists_after():
    cfg = load_config(CONFIGS / "debug.yaml")
    assert cfg.stages[2].model.hidden == [32]
    space = _space(**{"model.hidden": {"choice": [[32], [64], [16, 16]]}, "solver.lr": {"loguniform": [1e-4, 1e-2]}})
    assert encoded_keys(space) == {"model.hidden"}
    values = sample_values(cfg, space)
    assert values[0] == {"model.hidden": [32], "solver.lr": cfg.stages[2].solver.lr}  # the stage as configured
    assert all(v["model.hidden"] in ([32], [64], [16, 16]) for v in values)
    assert outside_space(space, reference_values(cfg, space)) == {}  # [32] is one of the choices


def test_a_grid_of_lists_is_every_list():
    cfg = load_config(CONFIGS / "debug.yaml")
    space = TuneSpace.model_validate(
        {
            "stage": "classifier",
            "search": "grid",
            "num_samples": 1,
            "space": {"solver.betas": {"grid": [[0.9, 0.999], [0.8, 0.99]]}},
        }
    )
    assert [v["solver.betas"] for v in sample_values(cfg, space)] == [[0.9, 0.999], [0.8, 0.99]]


def test_the_text_round_trips_and_scalars_stay_as_they_are():
    space = _space(**{"model.hidden": {"choice": [[32], [64]]}, "loss.scale": {"choice": [0.5, 1.0]}})
    values = {"model.hidden": [64], "loss.scale": 0.5}
    as_tune = tune_values(space, values)
    assert as_tune == {"model.hidden": "[64]", "loss.scale": 0.5}
    assert stage_values(encoded_keys(space), as_tune) == values
    assert param_space(space)["loss.scale"].categories == [0.5, 1.0]


def test_tune_itself_cannot_take_a_list_as_the_first_trials_value():
    """The control: why the lists are handed to Tune as text. If this stops failing, Ray fixed
    its variant generator and the encoding could go."""
    from ray import tune

    space = _space(**{"model.hidden": {"choice": [[32], [64]]}})
    generator, _ = search_algorithm(space, {"model.hidden": [32]}, 0, "", seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        spec = {
            "run": lambda config: None,
            "config": {"model.hidden": tune.choice([[32], [64]])},
            "num_samples": 2,
            "storage_path": tmp,
        }
        generator.add_configurations({"control": spec})
        with pytest.raises(TypeError):
            while generator.next_trial() is not None:
                pass


def test_the_printed_table_lines_up_long_trial_ids_and_heads_the_best_epoch():
    from pathlib import Path

    from cascade_ray.tune.run import SweepOutcome, format_results

    rows = [
        {"trial_id": "batched-a12_00000", "val_loss": 0.1667, "epoch": 1, "config/model.hidden": [32]},
        {"trial_id": "batched-a12_00003", "val_loss": 0.57, "epoch": 2, "config/model.hidden": [16, 16]},
    ]
    table = format_results(
        SweepOutcome("classifier", {}, 0.1667, Path("t"), [], rows, Path("r"), Path("b")), "val_loss"
    )
    head, first, second, _ = table.splitlines()
    assert head.split()[:3] == ["trial", "val_loss", "epoch"]
    assert head.index("val_loss") + len("val_loss") == first.index("0.1667") + len("0.1667")  # right-aligned
    assert first.split()[:3] == ["batched-a12_00000", "0.1667", "1"] and second.split()[:3] == [
        "batched-a12_00003",
        "0.5700",
        "2",
    ]
