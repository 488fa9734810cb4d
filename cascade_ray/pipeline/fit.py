"""One stage as one Ray Train ``TorchTrainer`` job, and the checks around it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import ray
import ray.train
from ray.train.torch import TorchTrainer

from cascade_ray.config.schema import PipelineConfig, StageConfig
from cascade_ray.errors import CascadeError, ResourceError
from cascade_ray.stage.worker import train_loop_per_worker


def unique_run_name(ray_dir: Path, stage: StageConfig, index: int, fingerprint: str) -> str:
    """A deterministic Ray Train run name that no earlier run in `ray_dir` has used.

    Ray 2.60 silently resumes a run whose ``(storage_path, name)`` already exists, so
    a rerun of the same stage gets the next free attempt number instead.
    """
    prefix = f"{index:02d}-{stage.name}-{fingerprint[:12]}"
    taken = {int(m.group(1)) for p in ray_dir.glob(f"{prefix}-a*") if (m := re.fullmatch(re.escape(prefix) + r"-a(\d+)", p.name))}
    return f"{prefix}-a{max(taken, default=0) + 1}"


def worker_resources(stage: StageConfig) -> dict[str, float]:
    """Resources one worker of `stage` asks Ray for."""
    res = dict(stage.scaling.resources_per_worker or {"CPU": 1.0})
    if stage.scaling.use_gpu:
        res.setdefault("GPU", 1.0)
    return res


def check_resources(cfg: PipelineConfig) -> None:
    """Fail fast when a stage asks for more than the cluster has in total or on any node.

    Without this, Ray Train retries starting the worker group forever.
    """
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    total: dict[str, float] = {}
    for res in nodes:
        for key, value in res.items():
            total[key] = total.get(key, 0.0) + value
    for i, stage in enumerate(cfg.stages):
        per_worker = worker_resources(stage)
        n = stage.scaling.num_workers
        for key, amount in per_worker.items():
            if amount * n > total.get(key, 0.0) or not any(res.get(key, 0.0) >= amount for res in nodes):
                raise ResourceError(
                    f"stages[{i}].scaling: stage {stage.name!r} needs {n} worker(s) x {amount:g} {key} "
                    f"(at least {amount:g} on one node), but the cluster has {total.get(key, 0.0):g} {key} "
                    f"in total. Lower stages[{i}].scaling.num_workers or resources_per_worker, or add nodes."
                )


def fit_stage(
    cfg: PipelineConfig, index: int, *, data_ref: ray.ObjectRef, upstream_ref: ray.ObjectRef | None, ray_dir: Path, run_name: str, callbacks: list[Any] | None = None
) -> ray.train.Result:
    """Train one stage as a TorchTrainer job and return its Result.

    ``callbacks`` go to ``RunConfig`` (Tune trials pass ``TuneReportCallback``).

    Raises:
        CascadeError: a worker raised one (re-raised as is, with its message).
    """
    stage = cfg.stages[index]
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "pipeline": cfg.model_dump(mode="json"),
            "stage_index": index,
            # refs inside lists: the worker ray.get()s them itself
            "data_ref": [data_ref],
            "upstream_ref": [upstream_ref] if upstream_ref is not None else [],
        },
        scaling_config=ray.train.ScalingConfig(
            num_workers=stage.scaling.num_workers,
            use_gpu=stage.scaling.use_gpu,
            resources_per_worker=stage.scaling.resources_per_worker,
        ),
        run_config=ray.train.RunConfig(
            name=run_name,
            storage_path=str(ray_dir),
            callbacks=callbacks,
            checkpoint_config=ray.train.CheckpointConfig(
                num_to_keep=1,
                checkpoint_score_attribute=stage.train.metric,
                checkpoint_score_order=metric_mode(stage),
            ),
        ),
    )
    try:
        return trainer.fit()
    except ray.train.WorkerGroupError as exc:
        raise _cascade_cause(exc) or exc from None


def metric_mode(stage: StageConfig) -> str:
    """``max`` for accuracy, ``min`` for losses."""
    return "min" if stage.train.metric.endswith("loss") else "max"


def _cascade_cause(exc: ray.train.WorkerGroupError) -> Exception | None:
    """The first worker failure that is one of ours (its message is the useful one)."""
    for failure in exc.worker_failures.values():
        seen: Any = failure
        while seen is not None:
            if isinstance(seen, CascadeError):
                return seen
            seen = getattr(seen, "cause", None) or seen.__cause__
    return None
