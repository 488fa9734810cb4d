"""Batched sweeps: K sampled configs of one stage trained at once, in one TorchTrainer job.

    cascade-ray tune pipelines/configs/debug.yaml --space tune_spaces/classifier.yaml --batched

(or ``batched: true`` in the space file). The configs are sampled by the plain sweep's own
``BasicVariantGenerator`` (same space, same pipeline seed, the current values first), so a
batched sweep trains the trials a plain one would. The workers
(:mod:`cascade_ray.stage.batched`) step one replica per config on every shared batch of the
stage's cached upstream features; the outputs are the plain sweep's (``results.parquet``,
``best.yaml``, the best replica adopted as the stage) plus ``replicas.json``, every replica's
per-epoch history. What cannot be per replica (architecture, batches, epochs, ASHA's early
stops, a stage without cached features) is refused before Ray starts.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import ray

from cascade_ray.config.schema import PipelineConfig
from cascade_ray.errors import CascadeError, ConfigError, ConfigIssue
from cascade_ray.options import RunOptions
from cascade_ray.pipeline.features import cache_decision
from cascade_ray.pipeline.fit import fit_stage
from cascade_ray.pipeline.stages import Handoff, StageOutcome, StageSession, stage_fingerprint
from cascade_ray.ray_compat import quiet_preset_warnings, read_run_result, unreadable_run_errors
from cascade_ray.stage.batched import batched_train_loop_per_worker, best_replica
from cascade_ray.stage.batched_resume import LATEST, RESUME_DIR, ResumePoint, read_resume
from cascade_ray.storage import StorageDir, full_uri, write_table
from cascade_ray.tune.run import (
    CONFIG_PREFIX,
    SweepOutcome,
    best_yaml_text,
    finish_sweep,
    nothing_trained,
    table_order,
)
from cascade_ray.tune.space import TuneSpace
from cascade_ray.tune.sweep import (
    STARTUP_FILE,
    encoded_keys,
    explain_reference,
    outside_space,
    param_space,
    reference_values,
    search_algorithm,
    stage_values,
    trial_config,
)

# what each replica sets up on its own (optimizer, lr plan, loss; its initialization and dropout stream)
PER_REPLICA = ("solver.", "loss.", "seed")
SHARED = {  # per-replica prefixes a replica still cannot vary
    "solver.accumulation_steps": "every replica steps on the same shared accumulation windows",
}
WHY_SHARED = {  # first key part -> why the replicas must share it
    "model": "the stage's architecture: every replica is the same module",
    "head": "the stage's architecture: every replica is the same head",
    "adapter": "the stage's architecture: every replica is the same adapter",
    "train": "the replicas share each batch read and one epoch loop (batch size, epochs, steps)",
    "freeze": "what is frozen and cached is the shared upstream",
    "scaling": "the replicas run in one worker group",
}
REPLICAS_FILE = "replicas.json"


def batch_issues(
    cfg: PipelineConfig, space: TuneSpace, space_file: str, config_arg: str = "CONFIG"
) -> list[ConfigIssue]:
    """Why `space` cannot run batched on `cfg` (empty: it can); each fix names the plain sweep,
    as a command with `config_arg` (the config and overrides the user passed) in it."""
    plain = f"run it as Tune trials: cascade-ray tune {config_arg} --space {shlex.quote(space_file)}" + (
        f" (set mode: {space.mode} instead of mode: batched in the space file)"
        if space.batched_by_mode
        else " (set batched: false in the space file)"
        if space.batched
        else " (without --batched)"
    )
    issues = []
    index = cfg.stage_index(space.stage)
    for key in space.space:
        if key.startswith(PER_REPLICA) and not any(key == s or key.startswith(s + ".") for s in SHARED):
            continue
        why = next((w for s, w in SHARED.items() if key == s or key.startswith(s + ".")), None)
        why = why or WHY_SHARED.get(key.split(".")[0], "only solver.*, loss.* values and seed are per replica")
        issues.append(ConfigIssue(f"space.{key}", f"a batched sweep cannot vary {key}: {why}", plain))
    if space.scheduler.type == "asha":
        issues.append(
            ConfigIssue(
                "scheduler.type",
                "asha stops trials one by one on their early results; batched replicas train in lock-step to the end",
                f"set scheduler: {{type: fifo}}, or {plain}",
            )
        )
    if space.search == "optuna":
        issues.append(
            ConfigIssue(
                "search",
                "optuna suggests each trial from the results before it; a batched sweep samples every config up front",
                f"use search: random or grid, or {plain}",
            )
        )
    if index == 0:
        issues.append(
            ConfigIssue("stage", f"stage {space.stage!r} is the first stage: it has no cached upstream features", plain)
        )
    elif not (cached := cache_decision(cfg, index))[0]:
        issues.append(
            ConfigIssue("stage", f"stage {space.stage!r} does not train on cached features: {cached[1]}", plain)
        )
    if index > 0 and cfg.stages[index].scaling.strategy == "fsdp" and cfg.stages[index].scaling.num_workers > 1:
        issues.append(
            ConfigIssue(
                f"stages[{index}].scaling.strategy",
                "fsdp shards one stage's trainable layers across the workers; the batched replicas are each "
                "replicated with DDP, so the sweep would silently not shard",
                f"set stages[{index}].scaling.strategy: ddp for the sweep, or {plain}",
            )
        )
    if cfg.data.streaming is True:
        issues.append(
            ConfigIssue(
                "stage", "data.streaming is true: a batched sweep reads the in-memory feature cache only", plain
            )
        )
    return issues


def check_batchable(cfg: PipelineConfig, space: TuneSpace, space_file: str, config_arg: str = "CONFIG") -> None:
    """Raise the :func:`batch_issues` of `space` as one ConfigError (before Ray starts)."""
    issues = batch_issues(cfg, space, space_file, config_arg)
    if issues:
        raise ConfigError(issues, f"{space_file} (batched sweep)")


def sample_values(cfg: PipelineConfig, space: TuneSpace) -> list[dict[str, Any]]:
    """The trials' sampled values, in trial order, from the plain sweep's own search algorithm."""
    current = reference_values(cfg, space)
    generator, _ = search_algorithm(space, current, 0, "", seed=cfg.seed)  # 0: no concurrency limit
    values = []
    # Tune's trials need an experiment storage (it writes a marker file there): a throwaway one,
    # not Tune's default ~/ray_results. The caller explains values outside the space (explain_reference).
    with (
        tempfile.TemporaryDirectory(prefix="cascade-batched-") as tmp,
        quiet_preset_warnings(outside_space(space, current)),
    ):
        spec = {"run": _not_run, "config": param_space(space), "num_samples": space.num_samples, "storage_path": tmp}
        generator.add_configurations({"batched": spec})
        while (trial := generator.next_trial()) is not None:
            values.append(stage_values(encoded_keys(space), {key: trial.config[key] for key in space.space}))
    return values


def _not_run(config: dict[str, Any]) -> None:  # the spec's trainable: sampled from, never run
    raise NotImplementedError


@dataclass(frozen=True)
class BatchedSweepRunner:
    """The stage runner of a batched sweep (built, and checked, before Ray by ``api.stage_runners``)."""

    space: TuneSpace
    space_file: str
    resume: bool = False  # --resume: continue the newest interrupted attempt of the same configs

    def __call__(self, session: StageSession, index: int, upstream: Handoff | None) -> StageOutcome:
        started = time.perf_counter()
        outcome = batched_sweep(session, index, self.space, upstream, space_file=self.space_file, resume=self.resume)
        return finish_sweep(session, index, upstream, outcome, self.space.metric, started)


def batched_sweep(
    session: StageSession,
    index: int,
    space: TuneSpace,
    upstream: Handoff | None,
    *,
    space_file: str,
    resume: bool = False,
) -> SweepOutcome:
    """Every sampled config of stage `index` trained in one TorchTrainer job; the outputs a plain sweep writes.

    Each attempt (``trials/batched-a<N>``) keeps every replica's state after each epoch
    (:mod:`cascade_ray.stage.batched_resume`). With `resume`, the newest attempt whose state was
    written by the same configs on the same upstream and data is verified and continued by a new
    attempt, from the epoch it had reached; without one, every config trains from the start.
    """
    exp_dir = session.out / "tune" / space.stage
    cache = session.feature_cache(index, upstream)
    if cache is None or session.stream is not None or upstream is None:
        raise ConfigError(
            [
                ConfigIssue(
                    f"stages[{index}].freeze.cache_features",
                    "the stage's features are not cached in the object store here (see the log above)",
                    f"run the sweep as Tune trials: drop --batched / batched: true ({space.stage!r})",
                )
            ]
        )
    explain_reference(session.cfg, space, space_file, session.log)
    values = sample_values(session.cfg, space)
    configs = [trial_config(session.cfg, space.stage, v) for v in values]
    replicas = [c.model_dump(mode="json") for c in configs]
    key = replicas_key(configs, index, upstream.fingerprint, session.data_fp)
    point = find_resume(exp_dir / "trials", key) if resume else None
    finished = finished_attempt(point, session.cfg.stages[index].train.epochs, space.metric, space.mode)
    if finished is not None:  # nothing left to train: its results, no new job (as Tune restores a finished sweep)
        run, (histories, errors, best) = point.folder.parent, finished
        session.log(
            f"batched sweep of {space.stage!r}: {run.name} already trained all {len(values)} configs to their end "
            f"(state {point.folder}, verified); its results are used, no job is started"
        )
        return _sweep_outputs(session, space, exp_dir, run, values, histories, errors, best)
    run = exp_dir / "trials" / _free_name(exp_dir / "trials")
    session.log(f"batched sweep of {space.stage!r}: {len(values)} configs in one TorchTrainer job ({run})")
    if point is not None:
        session.log(
            f"batched sweep of {space.stage!r}: resuming {point.folder.parent.name} after epoch {point.epochs_done} "
            f"(state {point.folder}, verified)"
        )
    elif resume:
        session.log(
            f"batched sweep of {space.stage!r}: no earlier attempt of these {len(values)} configs kept a resume "
            "state: training them from the start"
        )
    try:
        result = _batched_job(session, index, upstream, cache, run, replicas, space, key, point)
    except CascadeError:  # when every replica failed, the job's last state holds why: the table, then the error
        failed = _all_failed(run / RESUME_DIR, key)
        if failed is None:
            raise
        _sweep_outputs(session, space, exp_dir, run, values, *failed, None)  # raises: nothing to adopt
        raise
    histories, errors, best = (result.return_value[k] for k in ("histories", "errors", "best"))
    if (after := result.return_value.get("resumed_after")) is not None:
        session.log(f"batched sweep of {space.stage!r}: its {len(values)} replicas continued after epoch {after}")
    # the one fit's start-up phases, where a Tune trial writes its own (bench_trial_startup reads both)
    (run / STARTUP_FILE).write_text(json.dumps(result.return_value.get("startup")))
    return _sweep_outputs(session, space, exp_dir, run, values, histories, errors, best)


def _batched_job(session, index, upstream, cache, run, replicas, space, key, point):
    """The one TorchTrainer job of a batched sweep (``fit_stage`` with the batched loop)."""
    return fit_stage(
        session.cfg,
        index,
        data_ref=session.data_ref,
        upstream_ref=upstream.ref,
        upstream_digests=upstream.digests,
        ray_dir=run.parent,
        run_name=run.name,
        features_ref=cache.ref,
        options=RunOptions(log_level=session.options.log_level),
        train_loop=batched_train_loop_per_worker,
        loop_extra={
            "replicas": replicas,
            "names": [trial_id(run.name, k) for k in range(len(replicas))],  # as the results table calls them
            "select": {"metric": space.metric, "mode": space.mode},
            "resume": {
                "dir": full_uri(run / RESUME_DIR),
                "key": key,
                "ref": [ray.put(point.blob)] if point is not None else [],  # one read, every worker
            },
        },
        tracking=session.tracking,  # rank 0 logs each replica's epochs as a trial run (its trial id)
    )


def _sweep_outputs(
    session: StageSession,
    space: TuneSpace,
    exp_dir: StorageDir,
    run: StorageDir,
    values: list[dict[str, Any]],
    histories: list[list[dict[str, Any]]],
    errors: list[str | None],
    best: int | None,
) -> SweepOutcome:
    """The batched job `run`'s results as a plain sweep writes them (results table, best.yaml) and
    ``replicas.json``; the outcome whose best trial run is `run` (its one checkpoint: the best replica).

    Raises:
        CascadeError: `best` is None (no replica trained through to a finite value), after the table
            and ``replicas.json`` are written, as a plain sweep of failed trials only.
    """
    rows = replica_rows(run.name, values, histories, errors, space.metric, space.mode)
    for k, (row, v, error) in enumerate(zip(rows, values, errors)):
        if error is not None:  # as Tune marks one trial ERROR and keeps the others; named as the table names it
            shown = ", ".join(f"{key}={value!r}" for key, value in v.items())
            session.log(
                f"WARNING trial {row['trial_id']} (batched replica {k}: {shown}) failed and is not a candidate "
                f"for best: {error}"
            )
    table = table_order(
        rows, space.metric, space.mode
    )  # failed replicas last; ties in trial order, as the worker's pick
    results_path, best_yaml = exp_dir / "results.parquet", exp_dir / "best.yaml"
    write_table(pa.Table.from_pylist(table), results_path)
    (exp_dir / REPLICAS_FILE).write_text(
        json.dumps(
            [
                {"trial_id": r["trial_id"], "values": v, "history": h, "error": r["error"]}
                for r, v, h in zip(rows, values, histories)
            ],
            indent=1,
        )
    )
    if best is None:
        raise nothing_trained(space, table, results_path)
    best_yaml.write_text(best_yaml_text(session, space, len(rows), values[best], batched=True))
    return SweepOutcome(
        space.stage, values[best], float(rows[best][space.metric]), run, histories[best], table, results_path, best_yaml
    )


def replica_rows(
    run_name: str,
    values: list[dict[str, Any]],
    histories: list[list[dict[str, float]]],
    errors: list[str | None],
    metric: str,
    mode: str,
) -> list[dict[str, Any]]:
    """Each replica's row of ``results.parquet``, in replica order: its best epoch by `metric`
    (as Tune's table has a trial's), its ``error`` (None: it trained through; else the health
    error that failed it, whose best epoch is the best one before that, NaN without one) and values."""
    sign = 1 if mode == "max" else -1
    rows = []
    for k, (v, history, error) in enumerate(zip(values, histories, errors, strict=True)):
        top = max(history, key=lambda m: sign * m[metric], default={metric: float("nan"), "epoch": 0})
        rows.append(
            {"trial_id": trial_id(run_name, k), metric: top[metric], "epoch": top["epoch"], "error": error}
            | {f"{CONFIG_PREFIX}{key}": value for key, value in v.items()}
        )
    return rows


def trial_id(run_name: str, k: int) -> str:
    """Replica `k`'s trial id in the results table (``batched-a1_00003``), Tune's ``<run>_<5 digits>`` form."""
    return f"{run_name}_{k:05d}"


def finished_attempt(
    point: ResumePoint | None, epochs: int, metric: str, mode: str
) -> tuple[list[list[dict[str, Any]]], list[str | None], int | None] | None:
    """(histories, errors, best replica) of the attempt `point` was kept by, when it had nothing
    left to train (every epoch done, or every replica stopped early or failed) and its Ray run
    ended with its one report: the best replica's checkpoint, as the job picks it; best None when
    every replica failed (there is nothing to adopt, and no report to wait for). None otherwise
    (a new attempt then continues the state, or trains from the start)."""
    if point is None:
        return None
    replicas = point.load()["replicas"]  # one deserialization of the state
    histories, errors = state_results(replicas)
    done = point.epochs_done >= epochs or all(r["done"] or r["error"] is not None for r in replicas)
    if done and all(e is not None for e in errors):
        return histories, errors, None
    best = best_replica(histories, errors, metric, mode)  # as the job picks
    if not done or best is None:
        return None
    try:
        result = read_run_result(full_uri(point.folder.parent))
    except (*unreadable_run_errors(), OSError, ValueError):  # killed before its report: the job runs again
        return None
    if result.checkpoint is None or (result.metrics or {}).get("replica") != best:
        return None
    return histories, errors, best


def _all_failed(folder: StorageDir, key: str) -> tuple[list[list[dict[str, Any]]], list[str]] | None:
    """(histories, errors) of the newest resume state under `folder` when it was written by `key`'s
    replicas and every one of them had failed; None otherwise (or when it cannot be read)."""
    try:
        state = read_resume(folder)
    except CascadeError:  # a damaged state: the job's own error is the one to show
        return None
    if state is None or state.key != key:
        return None
    histories, errors = state_results(state.load()["replicas"])
    return (histories, errors) if all(e is not None for e in errors) else None


def state_results(replicas: list[dict[str, Any]]) -> tuple[list[list[dict[str, Any]]], list[str | None]]:
    """Every replica's epoch history and error (None: trained through) in a verified resume state's
    ``replicas`` (``ResumePoint.load()["replicas"]``)."""
    return [list(r["trainer"]["history"]) for r in replicas], [r["error"] for r in replicas]


def replicas_key(configs: list[PipelineConfig], index: int, upstream_fp: str, data_fp: str) -> str:
    """What a resume state must have been written by: every replica's stage fingerprint (its
    config, the upstream's fingerprint, the data, the seed, the package version), in order."""
    prints = [stage_fingerprint(c, index, upstream_fp, data_fp) for c in configs]
    return hashlib.sha256(json.dumps(prints).encode()).hexdigest()


def find_resume(trials: StorageDir, key: str) -> ResumePoint | None:
    """The verified resume state of the newest attempt under `trials` written with `key`
    (:func:`replicas_key`), or None. Attempts of other configs are passed over; a damaged state
    of a matching attempt raises (:func:`~cascade_ray.stage.batched_resume.read_resume`)."""
    if not trials.exists():
        return None
    for attempt in sorted(trials.glob("batched-a*"), key=lambda p: _attempt_number(p.name), reverse=True):
        latest = attempt / RESUME_DIR / LATEST
        if not latest.exists():
            continue
        try:
            written_with = json.loads(latest.read_text()).get("key")
        except ValueError:
            written_with = key  # damaged: read_resume says so, naming the file
        if written_with == key:
            return read_resume(attempt / RESUME_DIR)
    return None


def _attempt_number(name: str) -> int:
    number = name.rsplit("-a", 1)[-1]
    return int(number) if number.isdigit() else -1


def _free_name(folder: StorageDir) -> str:
    """``batched-aN``, N one past the highest attempt in `folder` (Ray resumes a run name that exists)."""
    taken = [_attempt_number(p.name) for p in folder.glob("batched-a*")] if folder.exists() else []
    return f"batched-a{max(taken, default=0) + 1}"
