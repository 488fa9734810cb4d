"""The pipeline driver: validate, load data, then for each stage fit -> artifact -> ray.put.

Everything that can fail on bad input (config, shapes, data, resources) fails before
the first stage starts. Each finished stage is written durably under
``{storage_path}/{name}/stages/{stage}/`` and handed to the next stage once through
the object store.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import ray
import torch

from cascade_ray.checks.reach import check_reach
from cascade_ray.config.metrics import HEADLINE_METRIC
from cascade_ray.config.schema import PipelineConfig
from cascade_ray.constants import apply_ray_env_defaults
from cascade_ray.data import DataSplits
from cascade_ray.data.batches import ArraySource
from cascade_ray.data.source import describe_stats, load_data
from cascade_ray.errors import ConfigError, ConfigIssue, RunFinishedError
from cascade_ray.logs import install_worker_filter, ray_logging_level
from cascade_ray.models.cascade import build_cascade
from cascade_ray.models.losses import build_loss
from cascade_ray.models.metrics import EvalMetrics, output_predictions
from cascade_ray.models.plan import plan_chain, require_plans
from cascade_ray.models.weights import NumpyState, load_numpy_state
from cascade_ray.options import RunOptions
from cascade_ray.pipeline.fit import Cluster, check_resources, cluster_view
from cascade_ray.pipeline.outputs import SUMMARY_FILE, RunOutputs, next_steps
from cascade_ray.pipeline.ray_token import ensure_private_token, unreachable_cluster
from cascade_ray.pipeline.records import summary_status
from cascade_ray.pipeline.stages import Handoff, StageOutcome, StageRunner, StageSession
from cascade_ray.pipeline.streaming import StreamedData, check_streaming_resources, scan_data
from cascade_ray.ray_compat import detected_cpus
from cascade_ray.solver import step_count_issues
from cascade_ray.solver.precision import precision_config_issues
from cascade_ray.stage.progress import ProgressSession
from cascade_ray.storage import StorageDir, check_shared_storage, in_ray_job, storage_root
from cascade_ray.storage_lock import display, hold_run_lock
from cascade_ray.tracking import TrackingContext
from cascade_ray.tracking.pipeline_run import PipelineTracking


def run_dir(cfg: PipelineConfig) -> StorageDir:
    """``{storage_path}/{name}``: an absolute local path (Ray workers run in other
    directories) or a :class:`~cascade_ray.storage.UriPath` on a pyarrow filesystem."""
    return storage_root(cfg.storage_path) / cfg.name


def run_pipeline(
    cfg: PipelineConfig,
    options: RunOptions | None = None,
    *,
    runners: Mapping[str, StageRunner] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run every stage in order and evaluate the composed model on the test split.

    Args:
        cfg: a validated config.
        options: the run's options (address, resume, log level, profiled stages, stop_after).
        runners: stage name -> the runner of that stage (e.g. a Tune sweep, whose best trial
            becomes the stage: its config, its weights); other stages are reused or fitted
            (:meth:`StageSession.run`). :func:`cascade_ray.api.run_pipeline` builds them from
            ``options.spaces``.
        log: where progress lines go.

    Returns:
        The summary, also written to ``{storage_path}/{name}/summary.json`` for full runs (which
        rewrite it as they go: status running after each stage, failed when they stop on an error).

    Raises:
        RunLockedError: another driver holds the run lock (``options.break_lock`` takes it).
        RunFinishedError: the run folder holds a finished run (its summary's status is finished)
            and neither ``options.resume`` nor ``options.overwrite`` is set; a failed or
            interrupted run is trained again (or resumed with ``options.resume``).
    """
    options = options or RunOptions()
    runners = dict(runners or {})
    unknown = sorted(set(runners) - {s.name for s in cfg.stages})
    if unknown:
        raise ConfigError([ConfigIssue("stage", f"no stage {', '.join(map(repr, unknown))} to run a runner for")])
    out = run_dir(cfg)
    check_reach(cfg)  # storage writable, data readable (a small probe), before any Ray resource
    # DataError before any Ray resource; streamed data is scanned (every row checked), not loaded
    data: DataSplits | StreamedData = (
        scan_data(cfg) if cfg.data.streaming is not False else load_data(cfg.data, cfg.seed)
    )
    require_plans(cfg, data.input_shape, data.out_width)
    if any(s.pretrained is not None for s in cfg.stages):
        # every pretrained file read whole for NaN/Inf before Ray (validate reads only small ones)
        bad = plan_chain(cfg, data.input_shape, data.out_width, read_bytes=math.inf)[1]
        if bad:
            raise ConfigError(bad, source=cfg.name)
    # schedule lengths vs the real optimizer steps need the training-set size
    errors, warnings = step_count_issues(cfg, data.n_train)
    bf16_errors, bf16_warnings = precision_config_issues(cfg)  # explicit bf16 on this CPU if it emulates it
    errors, warnings = errors + bf16_errors, warnings + bf16_warnings
    for issue in warnings:
        log(f"warning: {issue.render()}")
    if errors:
        raise ConfigError(errors, source=f"{cfg.name} ({data.n_train} training samples)")
    log(f"data: {data.source}: {describe_data(data)}")
    if options.resume and not any((out / part).exists() for part in ("stages", "ray", "tune")):
        # a typo in storage_path or name would otherwise cost a whole retrain without a word
        log(
            f"resume: nothing to resume in {display(out)} (no stage, stage attempt or sweep there yet): every stage trains"
        )
    # one driver per run folder, for the whole run: taken once the input is known good, before Ray
    with hold_run_lock(out, break_lock=options.break_lock, log=log):
        # a stop_after run (cascade-ray tune) reuses matching stages and writes no summary.json
        asked = options.resume or options.overwrite or options.stop_after  # to run over whatever is there
        if not asked and summary_status(out / SUMMARY_FILE) == "finished":
            raise RunFinishedError(display(out))
        # a stop_after run leaves the run's outputs alone: it would demote a finished summary
        outputs = None if options.stop_after else RunOutputs(out, cfg, data.target_kind, log)
        # the MLflow parent run / W&B group: opened once the input is known good, ended FINISHED or FAILED
        # (after the failed summary is written, so the parent run's artifacts show where the run stopped)
        with PipelineTracking(cfg, out, log) as tracking:
            context = tracking.context() if cfg.loggers.any else None
            try:
                return _run_locked(cfg, options, runners, out, data, log, outputs, context)
            except BaseException as exc:  # Ctrl-C too: the summary says the run stopped, and where
                if outputs is not None:
                    outputs.failed(exc)  # never raises: the original error is what propagates
                raise


def _run_locked(
    cfg: PipelineConfig,
    options: RunOptions,
    runners: dict[str, StageRunner],
    out: StorageDir,
    data: DataSplits | StreamedData,
    log: Callable[[str], None],
    outputs: RunOutputs | None,
    tracking: TrackingContext | None = None,
) -> dict[str, Any]:
    """The run itself, under the run lock: Ray, every stage, the composed-model test, the outputs
    (`outputs`: kept current after each stage; None for a stop_after run)."""
    if not ray.is_initialized() and not (options.address or os.environ.get("RAY_ADDRESS")):
        _check_embedded_resources(cfg)  # the embedded Ray will be this machine: fail before starting it
    started_ray = init_ray(options.address, options.log_level)
    progress = ProgressSession.start(show=options.show_progress)  # board + display; see stage/progress.py
    log = progress.wrap(log)
    try:
        cluster = cluster_view()
        for line in check_resources(cfg, cluster):
            log(line)
        check_shared_storage(out, hosts=cluster.hosts, may_add_nodes=cluster.may_add_nodes, log=log)
        data = _settle_streaming(cfg, data, log)
        stream = data if isinstance(data, StreamedData) else None
        session = StageSession(
            cfg,
            out,
            ray.put(data.to_arrays()) if stream is None else None,
            data.fingerprint(),
            data.input_shape,
            data.out_width,
            log,
            data_spec=data.spec(),
            split_sizes={"train": len(data.y_train), "val": len(data.y_val)} if stream is None else {},
            stream=stream,
            options=options,
            board=progress.board,
            tracking=tracking,
        )
        upstream: Handoff | None = None
        records = []
        for index, stage in enumerate(cfg.stages):
            where = (
                "import-only, on the driver" if stage.train.epochs == 0 else f"on {stage.scaling.num_workers} worker(s)"
            )
            log(f"stage {index + 1}/{len(cfg.stages)}: {stage.name} ({stage.type}) {where}")
            if outputs is not None:
                outputs.stage_started(index)
            if stage.name in runners:
                outcome = runners[stage.name](session, index, upstream)
            else:
                record, handoff = session.run(index, upstream, resume=options.resume or options.stop_after is not None)
                outcome = StageOutcome(record, handoff, session.cfg)
            if outcome.cfg is not session.cfg:  # a sweep's best values hold from this stage on
                session = dataclasses.replace(session, cfg=outcome.cfg)
            upstream = outcome.handoff
            records.append(outcome.record)
            if outputs is not None:
                outputs.stage_done(outcome.record, session.cfg)
            log(
                f"  {stage.name} {outcome.record['status']}: {_fmt_metrics(outcome.record['metrics'])} "
                f"({outcome.record['wall_s']:.1f} s)"
            )
            if stage.name == options.stop_after:
                return {"name": cfg.name, "stages": records, "storage": str(out)}
    finally:
        progress.stop()
        if started_ray:
            ray.shutdown()
    if upstream is None:
        raise ConfigError([ConfigIssue("stages", "the pipeline has no stage", "add at least one stage")])
    if outputs is None:  # a stop_after naming no stage ran them all: still no outputs of its own
        return {"name": cfg.name, "stages": records, "storage": str(out)}
    final_cfg = session.cfg  # swept stages carry their best trial's values
    test = evaluate_composed(final_cfg, data, upstream.state)
    run_summary, events = outputs.finish(final_cfg, test)  # the predictions, then the finished summary
    summary = run_summary.to_json()
    log(format_table(summary))
    steps = next_steps(str(out), tensorboard=None if events is None else str(out / events.name))
    log("\n".join(["next:", *(f"  {step}" for step in steps)]))
    return summary


def init_ray(address: str | None, level: str) -> bool:
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
        try:
            ray.init(
                address=target,
                log_to_driver=True,
                logging_level=ray_logging_level(level),
                runtime_env={"env_vars": {k: v for k, v in env.items() if k not in _job_env_vars()}},
            )
        except (ConnectionError, ray.exceptions.AuthenticationError) as exc:  # nothing there, or no token
            raise ConfigError([unreachable_cluster(target, exc)]) from None
    else:
        ensure_private_token()  # Ray would write ~/.ray/auth_token with the umask (0644)
        ray.init(logging_level=ray_logging_level(level), runtime_env={"env_vars": env})
    install_worker_filter(level)  # --log-level: Ray's own chatter out of the way, errors kept
    return True


def _check_embedded_resources(cfg: PipelineConfig) -> None:
    """Resource check against this machine, before an embedded Ray starts.

    Stages asking for custom resources are left to the check after ``ray.init``.
    """
    node = {"CPU": detected_cpus(), "GPU": float(torch.cuda.device_count())}
    if any(k not in node for s in cfg.stages for k in (s.scaling.resources_per_worker or {})):
        return
    check_resources(cfg, Cluster((node,)))


def _job_env_vars() -> set[str]:
    """Env var names the enclosing Ray job's runtime_env sets (empty outside a job)."""
    raw = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if not raw:
        return set()
    return set((json.loads(raw).get("runtime_env") or {}).get("env_vars") or {})


def _settle_streaming(
    cfg: PipelineConfig, data: DataSplits | StreamedData, log: Callable[[str], None]
) -> DataSplits | StreamedData:
    """After ``ray.init``: ``data.streaming: auto`` decides against the object store's size (loading
    the data when it fits); streamed data must leave Ray Data its CPUs."""
    if not isinstance(data, StreamedData):
        return data
    if cfg.data.streaming == "auto":
        from cascade_ray.data.stream_ingest import decide_streaming

        store = float(ray.cluster_resources().get("object_store_memory", 0.0))
        stream, line = decide_streaming("auto", data.scan.train_nbytes, store)
        log(line)
        if not stream:
            return load_data(cfg.data, cfg.seed)
    check_streaming_resources(cfg, float(ray.cluster_resources().get("CPU", 0.0)))
    return data


def describe_data(data: DataSplits | StreamedData) -> str:
    """``train 5400, val 600, test 10000; inputs (1, 28, 28) uint8; 10 classes; normalize mean [...] std [...]``"""
    if isinstance(data, StreamedData):
        return f"{data.describe()}; {describe_stats(data)}"
    target = {
        "class": f"{data.out_width} classes",
        "multilabel": f"{data.out_width} labels (multilabel)",
        "regression": f"regression, {data.out_width} output(s)",
    }[data.target_kind]
    return (
        f"train {len(data.y_train)}, val {len(data.y_val)}, test {len(data.y_test)}; inputs {data.input_shape} "
        f"{data.x_train.dtype}; {target}; {describe_stats(data)}"
    )


@torch.no_grad()
def evaluate_composed(cfg: PipelineConfig, data: DataSplits | StreamedData, state: NumpyState) -> dict[str, Any]:
    """The composed model (last head) on the test split: ``metrics`` (the target kind's, see
    :mod:`cascade_ray.models.metrics`), and ``labels`` and ``predictions`` per sample (class index,
    0/1 flags, or regression values); streamed test files are read batch by batch."""
    plans = require_plans(cfg, data.input_shape, data.out_width)
    model = build_cascade(cfg, plans, data.out_width, upto=len(cfg.stages) - 1)
    load_numpy_state(model, state)
    model.eval()
    if isinstance(data, StreamedData):
        batches = data.test_batches()
    else:
        batches = ArraySource(data.x_test, data.y_test, data.mean, data.std, torch.device("cpu")).eval_epoch(
            1000, rank=0, world=1
        )
    head = model.order[-1]
    metrics = EvalMetrics(
        data.target_kind,
        data.out_width,
        build_loss(cfg.stages[-1].loss, data.target_kind, training=False, trusted=cfg.trusted_modules),
    )
    labels, predictions = [], []
    for x, y in batches:
        out = model(x, heads=[head])[head]
        metrics.update(out, y)
        labels.append(y)
        predictions.append(output_predictions(out, data.target_kind))
    return {
        "metrics": metrics.compute(lambda v: v),
        "labels": torch.cat(labels).numpy(),
        "predictions": torch.cat(predictions).numpy(),
    }


_SHOWN = ("val_accuracy", "val_map", "val_micro_f1", "val_r2", "val_mae", "val_loss", "train_loss")


def _fmt_metrics(metrics: dict[str, Any]) -> str:
    return ", ".join(
        f"{k} {metrics[k]:.4f}" for k in _SHOWN if isinstance(metrics.get(k), (int, float)) and np.isfinite(metrics[k])
    )


def format_table(summary: dict[str, Any]) -> str:
    """A compact per-stage table and the composed model's headline test metric."""
    name = HEADLINE_METRIC[summary.get("target_kind", "class")]
    col = f"val_{name}"[:8]
    rows = [f"{'stage':<12} {'status':<8} {col:>8} {'val_loss':>9} {'trainable':>10} {'frozen':>9} {'wall_s':>7}"]
    for s in summary["stages"]:
        m = s["metrics"]
        rows.append(
            f"{s['name']:<12} {s['status']:<8} {m.get(f'val_{name}', float('nan')):>8.4f} {m['val_loss']:>9.4f} {s['trainable_params']:>10,} {s['frozen_params']:>9,} {s['wall_s']:>7.1f}"
        )
    test = summary.get("test_metrics") or {"accuracy": summary.get("test_accuracy"), "loss": summary["test_loss"]}
    rows.append(
        f"composed model test_{name} {test[name]:.4f} (loss {summary['test_loss']:.4f}); artifacts in {summary['storage']}"
    )
    return "\n".join(rows)
