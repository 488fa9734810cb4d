"""The pipeline driver: validate, load data, then for each stage fit -> artifact -> ray.put.

Everything that can fail on bad input (config, shapes, data, resources) fails before
the first stage starts. Each finished stage is written durably under
``{storage_path}/{name}/stages/{stage}/`` and handed to the next stage once through
the object store.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import ray
import torch

from cascade_ray.config.schema import PipelineConfig
from cascade_ray.constants import apply_ray_env_defaults
from cascade_ray.data import DataSplits
from cascade_ray.data.batches import ArraySource, eval_batches
from cascade_ray.data.source import load_data
from cascade_ray.errors import ConfigError, ConfigIssue
from cascade_ray.logs import install_worker_filter, log_level, ray_logging_level
from cascade_ray.models.cascade import build_cascade
from cascade_ray.models.plan import require_plans
from cascade_ray.models.weights import NumpyState, load_numpy_state
from cascade_ray.pipeline.fit import Cluster, check_resources, cluster_view
from cascade_ray.pipeline.outputs import write_run_outputs
from cascade_ray.pipeline.records import RunSummary, SweepRecord, summary_text
from cascade_ray.pipeline.stages import Handoff, StageSession
from cascade_ray.solver import step_count_issues
from cascade_ray.stage.progress import ProgressSession
from cascade_ray.storage import StorageDir, check_shared_storage, in_ray_job, staged_dir, storage_root


def run_dir(cfg: PipelineConfig) -> StorageDir:
    """``{storage_path}/{name}``: an absolute local path (Ray workers run in other
    directories) or a :class:`~cascade_ray.storage.UriPath` on a pyarrow filesystem."""
    return storage_root(cfg.storage_path) / cfg.name


def run_pipeline(
    cfg: PipelineConfig,
    *,
    address: str | None = None,
    resume: bool = False,
    spaces: Mapping[str, str] | None = None,
    stop_after: str | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Train (or sweep) every stage in order and evaluate the composed model on the test split.

    Args:
        cfg: a validated config.
        address: Ray cluster address; default ``RAY_ADDRESS`` or an embedded Ray.
        resume: reuse each stage artifact whose fingerprint matches and whose digests verify
            (and restore interrupted sweeps).
        spaces: stage name -> Tune space file; those stages are swept with Ray Tune and the
            best trial becomes the stage (its config, its weights) before the next stage.
        stop_after: stop after this stage (no composed-model evaluation).
        log: where progress lines go.

    Returns:
        The summary, also written to ``{storage_path}/{name}/summary.json`` for full runs.
    """
    from cascade_ray.tune.space import load_space

    out = run_dir(cfg)
    loaded = {stage: (load_space(path, cfg), str(path)) for stage, path in (spaces or {}).items()}  # errors before Ray
    data = load_data(cfg.data, cfg.seed)  # DataError before any Ray resource
    require_plans(cfg, data.image_shape, data.num_classes)
    # schedule lengths vs the real optimizer steps need the training-set size
    errors, warnings = step_count_issues(cfg, len(data.y_train))
    for issue in warnings:
        log(f"warning: {issue.render()}")
    if errors:
        raise ConfigError(errors, source=f"{cfg.name} ({len(data.y_train)} training samples)")
    log(
        f"data: {data.source}: train {len(data.y_train)}, val {len(data.y_val)}, test {len(data.y_test)}, {data.num_classes} classes"
    )
    if not ray.is_initialized() and not (address or os.environ.get("RAY_ADDRESS")):
        _check_embedded_resources(cfg)  # the embedded Ray will be this machine: fail before starting it
    started_ray = _init_ray(address)
    progress = ProgressSession.start(show=log_level() != "warning")  # board + display; see progress.py
    log = progress.wrap(log)
    try:
        cluster = cluster_view()
        for line in check_resources(cfg, cluster):
            log(line)
        check_shared_storage(out, hosts=cluster.hosts, may_add_nodes=cluster.may_add_nodes, log=log)
        session = StageSession(
            cfg,
            out,
            ray.put(data.to_arrays()),
            data.fingerprint(),
            data.image_shape,
            data.num_classes,
            log,
            split_sizes={"train": len(data.y_train), "val": len(data.y_val)},
        )
        upstream: Handoff | None = None
        records = []
        for index, stage in enumerate(cfg.stages):
            log(
                f"stage {index + 1}/{len(cfg.stages)}: {stage.name} ({stage.type}) on {stage.scaling.num_workers} worker(s)"
            )
            if stage.name in loaded:
                record, upstream = _sweep(session, index, upstream, *loaded[stage.name], resume=resume, log=log)
            else:
                record, upstream = session.run(index, upstream, resume=resume or stop_after is not None)
            records.append(record)
            log(f"  {stage.name} {record['status']}: {_fmt_metrics(record['metrics'])} ({record['wall_s']:.1f} s)")
            if stage.name == stop_after:
                return {"name": cfg.name, "stages": records, "storage": str(out)}
    finally:
        progress.stop()
        if started_ray:
            ray.shutdown()
    assert upstream is not None
    final_cfg = session.cfg  # swept stages carry their best trial's values
    test = evaluate_composed(final_cfg, data, upstream.state)
    run_summary = RunSummary(
        name=cfg.name, test_accuracy=test["accuracy"], test_loss=test["loss"], stages=records, storage=str(out)
    )
    summary = run_summary.to_json()
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(summary_text(run_summary))
    with staged_dir(out) as local:  # the report writers use local paths; staged to s3:// / gs:// here
        write_run_outputs(local, final_cfg, records, np.asarray(data.y_test), test["predictions"], log=log)
    log(format_table(summary))
    return summary


def _sweep(
    session: StageSession,
    index: int,
    upstream: Handoff | None,
    space: Any,
    space_file: str,
    *,
    resume: bool,
    log: Callable[[str], None],
) -> tuple[dict[str, Any], Handoff]:
    from cascade_ray.tune.run import adopt_best, format_results, sweep_stage

    outcome = sweep_stage(session, space, space_file, upstream, resume=resume)
    log(format_results(outcome, space.metric))
    _, record, handoff = adopt_best(session, index, upstream, outcome)
    record["sweep"] = SweepRecord(
        results=str(outcome.results_path), best=str(outcome.best_yaml), trials=len(outcome.table)
    ).to_json()
    return record, handoff


def _init_ray(address: str | None) -> bool:
    """Connect to `address`/``RAY_ADDRESS`` or start an embedded Ray; True if we started it.

    The env knobs reach the cluster's Train controller and workers through this driver's
    runtime_env; inside a Ray job, keys the job's own runtime_env sets are left to it
    (Ray refuses a driver runtime_env that repeats a job env var).
    """
    env = apply_ray_env_defaults()
    if ray.is_initialized():
        return False
    target = address or os.environ.get("RAY_ADDRESS")
    if target and target.startswith(("http://", "https://")) and not in_ray_job():
        raise ConfigError(
            [
                ConfigIssue(
                    "--address / RAY_ADDRESS",
                    f"{target!r} is a dashboard / job-submission address; a driver cannot connect to it",
                    "submit the pipeline as a job (`cascade-ray submit ...` or `ray job submit --working-dir . -- python "
                    "pipelines/three_stage.py ...`), or give the GCS address (host:port, e.g. 127.0.0.1:6379)",
                )
            ]
        )
    if target:
        ray.init(
            address=target,
            log_to_driver=True,
            logging_level=ray_logging_level(),
            runtime_env={"env_vars": {k: v for k, v in env.items() if k not in _job_env_vars()}},
        )
    else:
        ray.init(logging_level=ray_logging_level(), runtime_env={"env_vars": env})
    install_worker_filter()  # --log-level: Ray's own chatter out of the way, errors kept
    return True


def _check_embedded_resources(cfg: PipelineConfig) -> None:
    """Resource check against this machine, before an embedded Ray starts.

    Stages asking for custom resources are left to the check after ``ray.init``.
    """
    try:
        from ray._private.utils import get_num_cpus  # what an embedded Ray will detect (cgroup-aware)

        cpus = float(get_num_cpus())
    except Exception:  # noqa: BLE001 - private API; fall back to the OS count
        cpus = float(os.cpu_count() or 1)
    node = {"CPU": cpus, "GPU": float(torch.cuda.device_count())}
    if any(k not in node for s in cfg.stages for k in (s.scaling.resources_per_worker or {})):
        return
    check_resources(cfg, Cluster((node,)))


def _job_env_vars() -> set[str]:
    """Env var names the enclosing Ray job's runtime_env sets (empty outside a job)."""
    raw = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if not raw:
        return set()
    return set((json.loads(raw).get("runtime_env") or {}).get("env_vars") or {})


@torch.no_grad()
def evaluate_composed(cfg: PipelineConfig, data: DataSplits, state: NumpyState) -> dict[str, Any]:
    """Accuracy, loss and per-sample predictions of the composed model (last head) on the test split."""
    plans = require_plans(cfg, data.image_shape, data.num_classes)
    model = build_cascade(cfg, plans, data.num_classes, upto=len(cfg.stages) - 1)
    load_numpy_state(model, state)
    model.eval()
    source = ArraySource(data.x_test, data.y_test, data.mean, data.std, torch.device("cpu"))
    head = model.order[-1]
    loss, predictions = 0.0, []
    for batch in eval_batches(len(source), 1000, rank=0, world=1):
        x, y = source.batch(batch)
        logits = model(x, heads=[head])[head]
        loss += torch.nn.functional.cross_entropy(logits, y, reduction="sum").item()
        predictions.append(logits.argmax(1))
    predicted = torch.cat(predictions).numpy()
    labels = np.asarray(data.y_test)
    return {"accuracy": float((predicted == labels).mean()), "loss": loss / len(source), "predictions": predicted}


def _fmt_metrics(metrics: dict[str, Any]) -> str:
    keys = ("val_accuracy", "val_loss", "train_loss")
    return ", ".join(
        f"{k} {metrics[k]:.4f}" for k in keys if isinstance(metrics.get(k), (int, float)) and np.isfinite(metrics[k])
    )


def format_table(summary: dict[str, Any]) -> str:
    """A compact per-stage table and the composed test accuracy."""
    rows = [f"{'stage':<12} {'status':<8} {'val_acc':>8} {'val_loss':>9} {'trainable':>10} {'frozen':>9} {'wall_s':>7}"]
    for s in summary["stages"]:
        m = s["metrics"]
        rows.append(
            f"{s['name']:<12} {s['status']:<8} {m['val_accuracy']:>8.4f} {m['val_loss']:>9.4f} {s['trainable_params']:>10,} {s['frozen_params']:>9,} {s['wall_s']:>7.1f}"
        )
    rows.append(
        f"composed model test_accuracy {summary['test_accuracy']:.4f} (loss {summary['test_loss']:.4f}); artifacts in {summary['storage']}"
    )
    return "\n".join(rows)
