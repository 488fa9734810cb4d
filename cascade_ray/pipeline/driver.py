"""The pipeline driver: validate, load data, then for each stage fit -> artifact -> ray.put.

Everything that can fail on bad input (config, shapes, data, resources) fails before
the first stage starts. Each finished stage is written durably under
``{storage_path}/{name}/stages/{stage}/`` and handed to the next stage once through
the object store.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

from cascade_ray import __version__
from cascade_ray.config.schema import PipelineConfig
from cascade_ray.constants import apply_ray_env_defaults
from cascade_ray.data import DataSplits
from cascade_ray.data.source import load_data
from cascade_ray.errors import FrozenDriftError
from cascade_ray.models.cascade import build_cascade
from cascade_ray.pipeline.artifacts import frozen_changes, write_artifact
from cascade_ray.pipeline.fit import check_resources, fit_stage, metric_mode, unique_run_name
from cascade_ray.preflight import require_plans
from cascade_ray.stage.batches import ArraySource, eval_batches
from cascade_ray.stage.weights import NumpyState, load_numpy_state
from cascade_ray.stage.worker import read_checkpoint


def run_dir(cfg: PipelineConfig) -> Path:
    """``{storage_path}/{name}``, absolute (Ray workers run in other directories)."""
    return (Path(cfg.storage_path).expanduser() / cfg.name).resolve()


def stage_fingerprint(cfg: PipelineConfig, index: int, parent: str, data_fp: str) -> str:
    """Hash of the stage's config, its parent's fingerprint, the data and the package version."""
    stage = cfg.stages[index].model_dump(mode="json")
    blob = json.dumps({"stage": stage, "parent": parent, "data": data_fp, "seed": cfg.seed, "version": __version__}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def run_pipeline(cfg: PipelineConfig, *, address: str | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train every stage in order and evaluate the composed model on the test split.

    Args:
        cfg: a validated config.
        address: Ray cluster address; default ``RAY_ADDRESS`` or an embedded Ray.
        log: where progress lines go.

    Returns:
        The summary also written to ``{storage_path}/{name}/summary.json``.
    """
    out = run_dir(cfg)
    data = load_data(cfg.data, cfg.seed)  # DataError before any Ray resource
    plans = require_plans(cfg, data.image_shape, data.num_classes)
    log(f"data: {data.source}: train {len(data.y_train)}, val {len(data.y_val)}, test {len(data.y_test)}, {data.num_classes} classes")
    started_ray = _init_ray(address)
    try:
        check_resources(cfg)
        data_ref = ray.put(data.to_arrays())
        data_fp = data.fingerprint()
        state: NumpyState | None = None
        state_ref = None
        parent, stages = "", []
        for index, stage in enumerate(cfg.stages):
            log(f"stage {index + 1}/{len(cfg.stages)}: {stage.name} ({stage.type}) on {stage.scaling.num_workers} worker(s)")
            t0 = time.perf_counter()
            fp = stage_fingerprint(cfg, index, parent, data_fp)
            name = unique_run_name(out / "ray", stage, index, fp)
            result = fit_stage(cfg, index, data_ref=data_ref, upstream_ref=state_ref, ray_dir=out / "ray", run_name=name)
            best = result.get_best_checkpoint(stage.train.metric, metric_mode(stage))
            with best.as_directory() as ckpt:
                new_state = read_checkpoint(ckpt)
                best_metrics = json.loads((Path(ckpt) / "train_state.json").read_text())
            outcome = result.return_value
            if state is not None:
                _check_frozen_handoff(stage.name, state, new_state, outcome["frozen_digest"])
            artifact = write_artifact(
                out / "stages" / stage.name,
                new_state,
                {"stage": stage.name, "index": index, "fingerprint": fp, "parent_fingerprint": parent, "data_fingerprint": data_fp,
                 "metrics": best_metrics, "frozen_digest": outcome["frozen_digest"], "ray_run": name},
            )
            state, parent = new_state, fp
            state_ref = ray.put(state)  # once; every worker of the next stage reads this copy
            stages.append({
                "name": stage.name, "type": stage.type, "metrics": best_metrics, "history": outcome["history"],
                "wall_s": round(time.perf_counter() - t0, 2), "num_workers": outcome["world_size"], "trainable_params": outcome["trainable_params"],
                "frozen_params": outcome["frozen_params"], "artifact": str(artifact.path),
                "digest": artifact.manifest["weights_sha256"], "fingerprint": fp, "status": "trained",
            })
            log(f"  {stage.name}: {_fmt_metrics(best_metrics)} ({stages[-1]['wall_s']:.1f} s)")
    finally:
        if started_ray:
            ray.shutdown()
    assert state is not None
    test = evaluate_composed(cfg, data, state)
    summary = {"name": cfg.name, "test_accuracy": test["accuracy"], "test_loss": test["loss"], "stages": stages, "storage": str(out)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    log(format_table(summary))
    return summary


def _init_ray(address: str | None) -> bool:
    """Connect to `address`/``RAY_ADDRESS`` or start an embedded Ray; True if we started it."""
    env = apply_ray_env_defaults()
    if ray.is_initialized():
        return False
    target = address or os.environ.get("RAY_ADDRESS")
    if target:
        ray.init(address=target, log_to_driver=True)
    else:
        ray.init(runtime_env={"env_vars": env})
    return True


def _check_frozen_handoff(stage: str, before: NumpyState, after: NumpyState, frozen_digest: dict[str, str]) -> None:
    """The handed-on weights of every frozen tensor must equal the upstream's, bit for bit."""
    changed = frozen_changes({k: before[k] for k in frozen_digest}, after)
    if changed:
        raise FrozenDriftError(f"stage {stage!r}: {len(changed)} frozen tensor(s) differ from the upstream artifact: {', '.join(changed[:5])}")


@torch.no_grad()
def evaluate_composed(cfg: PipelineConfig, data: DataSplits, state: NumpyState) -> dict[str, float]:
    """Accuracy and loss of the composed model (last module stage's head) on the test split."""
    plans = require_plans(cfg, data.image_shape, data.num_classes)
    model = build_cascade(cfg, plans, data.num_classes, upto=len(cfg.stages) - 1)
    load_numpy_state(model, state)
    model.eval()
    source = ArraySource(data.x_test, data.y_test, data.mean, data.std, torch.device("cpu"))
    head = model.order[-1]
    loss, correct = 0.0, 0
    for batch in eval_batches(len(source), 1000, rank=0, world=1):
        x, y = source.batch(batch)
        logits = model(x, heads=[head])[head]
        loss += torch.nn.functional.cross_entropy(logits, y, reduction="sum").item()
        correct += int((logits.argmax(1) == y).sum())
    return {"accuracy": correct / len(source), "loss": loss / len(source)}


def _fmt_metrics(metrics: dict[str, Any]) -> str:
    keys = ("val_accuracy", "val_loss", "train_loss")
    return ", ".join(f"{k} {metrics[k]:.4f}" for k in keys if isinstance(metrics.get(k), (int, float)) and np.isfinite(metrics[k]))


def format_table(summary: dict[str, Any]) -> str:
    """A compact per-stage table and the composed test accuracy."""
    rows = [f"{'stage':<12} {'val_acc':>8} {'val_loss':>9} {'trainable':>10} {'frozen':>9} {'wall_s':>7}"]
    for s in summary["stages"]:
        m = s["metrics"]
        rows.append(f"{s['name']:<12} {m['val_accuracy']:>8.4f} {m['val_loss']:>9.4f} {s['trainable_params']:>10,} {s['frozen_params']:>9,} {s['wall_s']:>7.1f}")
    rows.append(f"composed model test_accuracy {summary['test_accuracy']:.4f} (loss {summary['test_loss']:.4f}); artifacts in {summary['storage']}")
    return "\n".join(rows)
