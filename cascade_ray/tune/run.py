"""Sweep orchestration: upstream (reused or trained) -> Tuner -> results table -> best override.

Outputs under ``{storage_path}/{name}/tune/<stage>/``: ``tune/`` (the Tune experiment,
restorable), ``trials/`` (each trial's Train run), ``results.parquet`` (one row per trial,
sorted by the metric, failed trials last with their ``error``) and ``best.yaml`` (the best
trial's values as overrides:
``python pipelines/three_stage.py --config X best.yaml``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import yaml

from cascade_ray.config.metrics import rank
from cascade_ray.config.schema import PipelineConfig
from cascade_ray.errors import CascadeError, RunInterruptedError
from cascade_ray.logs import print_guard, set_print_guard
from cascade_ray.pipeline.failures import error_message
from cascade_ray.pipeline.outputs import without_credentials
from cascade_ray.pipeline.records import SweepRecord
from cascade_ray.pipeline.stages import (
    CHANGES_SHOWN,
    Handoff,
    StageOutcome,
    StageSession,
    changed_keys,
    fingerprint_inputs,
    input_changes,
    stage_fingerprint,
)
from cascade_ray.ray_compat import quiet_preset_warnings, read_run_result
from cascade_ray.storage import StorageDir, full_uri, redact, write_table
from cascade_ray.tracking import flatten
from cascade_ray.tune.space import TuneSpace
from cascade_ray.tune.state import (
    drop_state,
    interrupted,
    restore_signal_handlers,
    signal_handlers,
    watch_interrupts,
    write_state,
)
from cascade_ray.tune.sweep import build_tuner, encoded_keys, explain_reference, stage_values, trial_config

CONFIG_PREFIX = "config/"


@dataclass(frozen=True)
class SweepOutcome:
    """What a sweep found."""

    stage: str
    best_values: dict[str, Any]
    best_metric: float
    best_trial_run: StorageDir
    best_history: list[dict[str, Any]]
    table: list[dict[str, Any]]
    results_path: StorageDir
    best_yaml: StorageDir


@dataclass(frozen=True)
class SweepRunner:
    """The stage runner for a stage with a search space: sweep, then make the best trial the stage.

    Injected into the driver by :func:`cascade_ray.api.run_pipeline`; the space is loaded (and
    checked) before Ray starts.
    """

    space: TuneSpace
    space_file: str
    resume: bool = False
    trust_state: bool = False  # --trust-tune-state: restore without checking the sidecar

    def __call__(self, session: StageSession, index: int, upstream: Handoff | None) -> StageOutcome:
        started = time.perf_counter()
        outcome = sweep_stage(
            session, self.space, self.space_file, upstream, resume=self.resume, trust_state=self.trust_state
        )
        return finish_sweep(session, index, upstream, outcome, self.space.metric, started)


def finish_sweep(
    session: StageSession, index: int, upstream: Handoff | None, outcome: SweepOutcome, metric: str, started: float
) -> StageOutcome:
    """Log a finished sweep's results, adopt its best trial as the stage and record where the outputs are."""
    session.log(format_results(outcome, metric))
    cfg, record, handoff = adopt_best(session, index, upstream, outcome, started=started)
    record["sweep"] = SweepRecord(
        results=str(outcome.results_path), best=str(outcome.best_yaml), trials=len(outcome.table)
    ).to_json()
    return StageOutcome(record, handoff, cfg)


def sweep_stage(
    session: StageSession,
    space: TuneSpace,
    space_file: str,
    upstream: Handoff | None,
    *,
    resume: bool,
    trust_state: bool = False,
) -> SweepOutcome:
    """Run one stage's sweep on top of `upstream` (frozen, one object-store copy for all trials)."""
    exp_dir = session.out / "tune" / space.stage
    index = session.cfg.stage_index(space.stage)
    ran_on = sweep_inputs(session, space, index, upstream)
    if resume:
        changed = sweep_changes(exp_dir, ran_on, session.cfg, index)
        if changed is not None:  # as a changed stage trains again on --resume: its sweep runs again
            session.log(
                f"  {space.stage}: the sweep in {exp_dir} ran on another config or space ({changed}); sweeping again"
            )
            resume = False
    exp_dir.mkdir(parents=True, exist_ok=True)
    if not resume:  # a new sweep: no older state beside it that a later --resume could restore instead
        drop_state(exp_dir)
    (exp_dir / SWEEP_INPUTS).write_text(json.dumps(ran_on, sort_keys=True))
    cache = session.feature_cache(index, upstream)  # one copy for every trial
    streamed = session.stream is not None  # then every trial streams the data (or the streamed cache's shards)
    tuner = build_tuner(
        session.cfg,
        space,
        space_file=space_file,
        data_ref=session.data_ref,
        upstream_ref=upstream.ref if upstream else None,
        upstream_digests=upstream.digests if upstream else None,
        exp_dir=exp_dir,
        resume=resume,
        features_ref=cache.ref if cache is not None and not streamed else None,
        options=session.options,
        stream=(cache or session.stream) if streamed else None,
        tracking=session.tracking,
        trust_state=trust_state,
    )
    outside = explain_reference(session.cfg, space, space_file, session.log)
    guard = print_guard()
    watch_interrupts()
    handlers = signal_handlers()
    try:
        with quiet_preset_warnings(outside):  # Tune generates the trials inside fit()
            grid = tuner.fit()
    finally:  # a sweep that raised leaves no trial block's print guard behind (SweepProgress on a TTY)
        set_print_guard(guard)
        restore_signal_handlers(handlers)  # Tune leaves its stop handler installed after the sweep
    write_state(exp_dir)  # Ray's final state is synced by now: what a later --resume verifies
    if interrupted():  # Tune returns from fit() on Ctrl-C as if the sweep had ended
        raise RunInterruptedError(
            f"stage {space.stage!r}: the sweep was interrupted (Ctrl-C or SIGUSR1) with "
            f"{sum(1 for r in grid if r.metrics)} of its trials reporting; "
            f"nothing was adopted and {exp_dir} keeps its state\n"
            "    fix: run the same command with --resume to continue it (finished trials are kept)"
        )
    table = table_order(trial_rows(grid, space), space.metric, space.mode)
    for row in table:
        if row["error"] is not None:  # as Tune marks the trial ERROR: kept in the table, never adopted
            session.log(f"WARNING trial {row['trial_id']} failed and is not a candidate for best: {row['error']}")
    results_path = exp_dir / "results.parquet"
    write_table(pa.Table.from_pylist(table), results_path)
    top = table[0] if table else {"error": None, space.metric: None}
    if top["error"] is not None or rank(top[space.metric], space.mode)[0]:
        raise nothing_trained(space, table, results_path)
    best = next(r for r in grid if r.metrics.get("trial_id") == top["trial_id"])
    values = stage_values(encoded_keys(space), {k: best.config[k] for k in space.space})
    best_yaml = exp_dir / "best.yaml"
    best_yaml.write_text(best_yaml_text(session, space, len(table), values))
    history = (
        [
            {k: v for k, v in row.items() if not k.startswith(CONFIG_PREFIX)}
            for row in best.metrics_dataframe.to_dict("records")
        ]
        if best.metrics_dataframe is not None
        else []
    )
    return SweepOutcome(
        space.stage,
        values,
        float(top[space.metric]),  # its best epoch's by the sweep's metric
        exp_dir / "trials" / f"trial-{top['trial_id']}",
        history,
        table,
        results_path,
        best_yaml,
    )


SWEEP_INPUTS = "sweep.json"  # what a plain sweep ran on: a --resume compares it before restoring


def sweep_inputs(session: StageSession, space: TuneSpace, index: int, upstream: Handoff | None) -> dict[str, Any]:
    """What a sweep's trials depend on besides their sampled values: the space file's content and the
    swept stage's base fingerprint inputs (config, upstream, data, seed, version), credentials redacted."""
    parent = upstream.fingerprint if upstream else ""
    stage = fingerprint_inputs(session.cfg, index, parent, session.data_fp)
    # how many trials run at once changes no trial (and a restore keeps the old value anyway)
    kept = space.model_dump(mode="json", exclude={"max_concurrent_trials"})
    return without_credentials({"space": kept, "stage": stage})


def sweep_changes(exp_dir: StorageDir, now: dict[str, Any], cfg: PipelineConfig, index: int) -> str | None:
    """Why the sweep stored in `exp_dir` cannot be continued with `now` (:func:`sweep_inputs`), or None
    (the same inputs, or a sweep from before they were recorded: restored as before)."""
    file = exp_dir / SWEEP_INPUTS
    if not file.is_file():
        return None
    try:
        old = json.loads(file.read_text())
    except ValueError:
        return f"its {SWEEP_INPUTS} is unreadable"
    if old == now:
        return None
    stage = cfg.stages[index].name
    why = []
    if old.get("stage") != now["stage"]:
        parent = cfg.stages[index - 1].name if index > 0 else None
        why.append(input_changes(old.get("stage") or {}, now["stage"], stage=stage, parent=parent))
    if old.get("space") != now["space"]:
        keys = changed_keys(flatten(old.get("space") or {}), flatten(now["space"]))
        why.append(
            "the space file changed: " + ", ".join(keys[:CHANGES_SHOWN]) + (" ..." if len(keys) > CHANGES_SHOWN else "")
        )
    return "; ".join(why)


def best_yaml_text(
    session: StageSession, space: TuneSpace, trials: int, values: dict[str, Any], *, batched: bool = False
) -> str:
    """``best.yaml``: the best trial's swept values as overrides, under a header saying what else that
    trial trained with (the config and overrides the sweep ran on, the best of the stages swept before it
    in the same run) and the command that trains its config again."""
    swept = [stage for stage, _ in session.options.spaces]
    before = swept[: swept.index(space.stage)] if space.stage in swept else []
    files = [str(session.out / "tune" / stage / "best.yaml") for stage in before]
    files.append(str(session.out / "tune" / space.stage / "best.yaml"))
    config_arg = redact(session.options.config_arg)  # the file may be read by others: no credentials in it
    lines = [
        f"# best of {trials} trials{' (batched)' if batched else ''} of stage {space.stage!r} by {space.metric} "
        f"({space.mode})",
        f"# the swept values only; the sweep ran on: {config_arg}",
        *(
            [f"# on the best of the stages swept before it: {', '.join(repr(stage) for stage in before)}"]
            if before
            else []
        ),
        f"# its config again: cascade-ray run {config_arg} {shlex.join(files)}"
        # a sweep inside a full run: that run folder will hold a finished run, which `run` refuses to train over
        + (f" name={session.cfg.name[:59]}-best" if session.options.stop_after is None else ""),  # names: <= 64
    ]
    return (
        "\n".join(lines)
        + "\n"
        + yaml.safe_dump({f"stages.{space.stage}.{k}": v for k, v in values.items()}, sort_keys=True)
    )


def trial_rows(results: Iterable[Any], space: TuneSpace) -> list[dict[str, Any]]:
    """One results-table row per trial of a sweep (`results`: Ray Tune ``Result`` objects): its best
    epoch by the space's metric (:func:`~cascade_ray.config.metrics.rank`: NaN never best; NaN and
    epoch 0 when it never reported one), why it failed (``error``, None when it trained through:
    :func:`~cascade_ray.pipeline.failures.error_message`) and its values (as Tune sampled them,
    JSON-text ones decoded; none when Tune has no config for a trial that died at its start)."""
    metric, encoded = space.metric, encoded_keys(space)
    rows = []
    for result in results:
        frame = result.metrics_dataframe
        epochs = [e for e in (frame.to_dict("records") if frame is not None else []) if metric in e]
        top = min(epochs, key=lambda e: rank(e[metric], space.mode), default={metric: math.nan, "epoch": 0})
        config = {k: v for k, v in (result.config or {}).items() if k in space.space}
        rows.append(
            {
                "trial_id": result.metrics.get("trial_id"),
                metric: float(top[metric]) if top[metric] is not None else math.nan,
                "epoch": int(top.get("epoch") or 0),
                "error": error_message(result.error) if result.error is not None else None,
            }
            | {f"{CONFIG_PREFIX}{k}": v for k, v in stage_values(encoded & set(config), config).items()}
        )
    columns = dict.fromkeys(k for row in rows for k in row)  # every row every column (a value-less one too)
    return [{k: row.get(k) for k in columns} for row in rows]


def nothing_trained(space: TuneSpace, table: list[dict[str, Any]], results_path: StorageDir) -> CascadeError:
    """The error of a sweep (plain or batched) none of whose trials trained through to a finite value,
    naming the table it wrote and its first failure."""
    first = next((row["error"] for row in table if row["error"] is not None), "none")
    return CascadeError(
        f"sweep of {space.stage!r}: every trial failed or reported no finite {space.metric!r} "
        f"(table: {results_path}); first error: {first}. Narrow the space to values that train (each "
        "trial's error is in the table's error column)"
    )


def table_order(rows: list[dict[str, Any]], metric: str, mode: str) -> list[dict[str, Any]]:
    """A sweep's results rows as its table lists them: trials that trained through first, best first by
    `metric` (`mode`: max/min; :func:`~cascade_ray.config.metrics.rank`), those without a finite value
    after them, then failed ones (``error`` set), in the same order among themselves. Stable: ties keep
    the order given (trial order)."""
    return sorted(rows, key=lambda row: (row["error"] is not None, *rank(row[metric], mode)))


def format_results(outcome: SweepOutcome, metric: str, limit: int = 20) -> str:
    """The results table, best first."""
    rows = outcome.table[:limit]
    keys = [k for k in rows[0] if k.startswith(CONFIG_PREFIX)] if rows else []
    width = max([14, *(len(str(r["trial_id"])) for r in rows)])  # a batched sweep's ids are longer
    head = f"{'trial':<{width}} {metric:>12} {'epoch':>6} " + " ".join(f"{k[len(CONFIG_PREFIX) :]:>22}" for k in keys)
    lines = [head] + [
        f"{str(r['trial_id']):<{width}} {r[metric]:>12.4f} {int(r.get('epoch', 0)):>6} "
        + " ".join(f"{_fmt(r[k]):>22}" for k in keys)
        + ("  FAILED (not a candidate)" if r.get("error") is not None else "")
        for r in rows
    ]
    lines.append(f"best -> {outcome.best_yaml}  (table: {outcome.results_path})")
    return "\n".join(lines)


def adopt_best(
    session: StageSession, index: int, upstream: Handoff | None, outcome: SweepOutcome, *, started: float
) -> tuple[PipelineConfig, dict[str, Any], Handoff]:
    """Make the best trial the stage: its weights become the artifact, and the returned config
    (the best trial's values) the pipeline's from this stage on. `session` is left unchanged.

    `started` is when the sweep began (``time.perf_counter()``), so the record's ``wall_s`` is
    the whole sweep's.
    """
    cfg = trial_config(session.cfg, outcome.stage, outcome.best_values)
    fp = stage_fingerprint(cfg, index, upstream.fingerprint if upstream else "", session.data_fp)
    result = read_run_result(full_uri(outcome.best_trial_run))
    record, handoff = dataclasses.replace(session, cfg=cfg).finish(
        index,
        upstream,
        result,
        fp=fp,
        run_name=outcome.best_trial_run.name,
        started=started,
        history=outcome.best_history,
    )
    record["status"] = "tuned"
    return cfg, record, handoff


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
