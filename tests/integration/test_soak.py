"""Soak: two debug pipelines and a 4-trial sweep in one Ray session leave nothing behind.

Stages are cut to a few optimizer steps (`max_steps`): what is soaked is the machinery
(object store hand-offs, Train controllers, worker groups, placement groups, Tune trial
actors), not the training. Two pipelines are the least that shows a steady state (the first
sets it, the second must not grow from it; the sweep after them must not either), and 4 trials
are two rounds of the two trials 2 CPUs run at once. Five pipelines and 16 trials ran before
(438 s of CI time), then three and 8 (368 s; 207 s on a quiet Zen 4), all with the same
outcome; every fit adds ~10 s of Ray Train start-up to the suite. The trial-actor deadlock of Ray 2.60 that a 16-trial sweep
showed (docs/benchmarks.md, incident notes) has its own tests (test_ray_compat's
``wait_for_tune_reports_taken``), and any sweep of the suite could hang on it.
"""

from __future__ import annotations

import gc
import time

from paths import CONFIGS

from cascade_ray.api import RunOptions, run_pipeline
from cascade_ray.checks import load_config

SHORT = [f"stages[{i}].train.max_steps=3" for i in range(3)] + [f"stages[{i}].train.epochs=1" for i in range(3)]
SPACE = """
stage: classifier
metric: val_accuracy
num_samples: 4
scheduler: {type: fifo}
space:
  solver.lr: {loguniform: [1.0e-3, 3.0e-2]}
"""


def _alive_actors() -> list[str]:
    from ray.util.state import list_actors

    return sorted(
        a.class_name
        for a in list_actors(filters=[("state", "=", "ALIVE")], limit=10_000, raise_on_missing_output=False)
    )


def _snapshot():
    from ray.util.state import list_objects, list_placement_groups

    gc.collect()
    # StageTrainer stops Ray's placement-group cleaner without waiting: each exits within
    # about its 1 s check interval after its fit. They must all be gone, not accumulate.
    deadline = time.monotonic() + 15
    while "PlacementGroupCleaner" in (actors := _alive_actors()) and time.monotonic() < deadline:
        time.sleep(0.5)
    objects = list_objects(limit=10_000, raise_on_missing_output=False)
    return {
        "object_bytes": sum(o.object_size or 0 for o in objects if o.reference_type != "UNKNOWN_STATUS"),
        "objects": len(objects),
        "actors": actors,
        "placement_groups": len(
            list_placement_groups(filters=[("state", "=", "CREATED")], limit=10_000, raise_on_missing_output=False)
        ),
    }


def test_two_pipelines_and_a_4_trial_sweep_leave_nothing_behind(ray_session, tmp_path):
    baseline = _snapshot()
    after = []
    for run in range(2):
        cfg = load_config(CONFIGS / "debug.yaml", [f"storage_path={tmp_path}", f"name=soak-{run}", *SHORT])
        summary = run_pipeline(cfg, log=lambda _: None)
        assert [s["status"] for s in summary["stages"]] == ["trained"] * 3
        del summary
        after.append(_snapshot())
    space = tmp_path / "classifier.yaml"
    space.write_text(SPACE)
    cfg = load_config(CONFIGS / "debug.yaml", [f"storage_path={tmp_path}", "name=soak-sweep", *SHORT])
    swept = run_pipeline(cfg, RunOptions(spaces=(("classifier", str(space)),)), log=lambda _: None)
    assert swept["stages"][2]["sweep"]["trials"] == 4
    del swept
    final = _snapshot()
    # Ray keeps a per-session actor once the first fit made it (the autoscaling
    # coordinator); a Train controller that lingered with its loop config (the data 0.13 MB, the
    # classifier's upstream weights 0.05 MB and its cached features 1.47 MB, each listed twice by
    # the state API: 3.3 MB) was allowed for: after the first pipeline, live actors and
    # object-store bytes must not grow.
    steady = after[0]
    assert len(steady["actors"]) <= len(baseline["actors"]) + 3, steady
    assert steady["object_bytes"] <= baseline["object_bytes"] + 4 * 1024 * 1024, steady
    for snap in [*after, final]:
        assert "PlacementGroupCleaner" not in snap["actors"], snap
        assert snap["actors"] == steady["actors"], snap
        assert snap["placement_groups"] == baseline["placement_groups"], snap
    for snap in after:  # every hand-off, data and feature-cache ref of a finished pipeline is released
        assert snap["object_bytes"] <= steady["object_bytes"] + 64 * 1024, (snap, steady)
    # Since fit_stage puts back the SIGINT handler Ray Train installs (its closure held the last
    # controller's handle), the last controller no longer lingers: steady is the baseline (0 bytes,
    # measured). Known, not yet explained: after the sweep the driver still holds the refs its trials
    # were given (the classifier's feature cache, 1437 x 16 x 16 float32 = 1.47 MB, the data and the
    # upstream weights: 1,655,546 bytes in 3 objects, measured), most likely through the trainable Tune
    # registered. Bounded here so that any further growth fails.
    sweep_refs = 1437 * 16 * 16 * 4 + 256 * 1024
    assert final["object_bytes"] <= steady["object_bytes"] + sweep_refs + 64 * 1024, (final, steady)
