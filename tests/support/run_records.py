"""Complete, valid records for tests that write artifacts or summaries without a pipeline run."""

from __future__ import annotations

from typing import Any

from cascade_ray.pipeline.records import ManifestFields, RunSummary, StageRecord

METRICS = {"epoch": 1, "val_accuracy": 0.5, "val_loss": 1.0, "train_loss": 1.1}


def manifest_fields(stage: str = "a", index: int = 0, **override: Any) -> ManifestFields:
    """What a stage hands to write_artifact, with placeholder values."""
    return ManifestFields(
        **{
            "metrics": METRICS,
            "history": [METRICS],
            "num_workers": 1,
            "trainable_params": 10,
            "frozen_params": 0,
            "fingerprint": "f" * 64,
            "ray_run": f"{index:02d}-{stage}-ffffffffffff-a1",
            "stage": stage,
            "index": index,
            "parent_fingerprint": "",
            "data_fingerprint": "d" * 64,
            "frozen_digest": {},
            **override,
        }
    )


def stage_record(name: str, **override: Any) -> StageRecord:
    """A trained stage's summary entry, with placeholder values."""
    return StageRecord(
        **{
            "name": name,
            "type": "module",
            "status": "trained",
            "metrics": METRICS,
            "history": [METRICS],
            "num_workers": 1,
            "trainable_params": 1,
            "frozen_params": 0,
            "fingerprint": "f" * 64,
            "ray_run": f"00-{name}-ffffffffffff-a1",
            "wall_s": 1.0,
            "artifact": f"/nowhere/stages/{name}",
            "digest": "0" * 64,
            **override,
        }
    )


def run_summary(stages: list[StageRecord], **override: Any) -> RunSummary:
    return RunSummary(
        **{"name": "debug", "test_accuracy": 1.0, "test_loss": 0.1, "stages": stages, "storage": "/nowhere", **override}
    )
