"""Sweep one stage with Ray Tune, the upstream frozen and shared by every trial.

Ray 2.60's Train V2 trainers cannot be passed to ``Tuner`` directly: each trial is a
function that validates its sampled config and fits the stage's own ``TorchTrainer``,
with ``TuneReportCallback`` forwarding rank 0's per-epoch reports to Tune. The data and
upstream weights are object refs created once by the driver; trials pass the refs on
(inside a dict, so nothing resolves them early), so every trial worker reads the same
object-store copy.

Trial drivers hold no CPU (a 1-byte ``memory`` request): with Tune's default of 1 CPU per
trial, trials on a small cluster hold the CPUs their own Train workers wait for, forever.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import ray
from ray import tune

from cascade_ray.checks import validate_config
from cascade_ray.config.schema import PipelineConfig
from cascade_ray.errors import ConfigError, ConfigIssue
from cascade_ray.models.plan import known_plans, remember_plans
from cascade_ray.options import RunOptions
from cascade_ray.pipeline.fit import fit_stage, worker_resources
from cascade_ray.ray_compat import uncount_asha_stop, wait_for_tune_reports_taken
from cascade_ray.storage import StorageDir, as_storage, full_uri
from cascade_ray.tracking import TrackingContext
from cascade_ray.tune.progress import SweepProgress
from cascade_ray.tune.space import TuneSpace, asha_max_t, current_values, set_stage_value
from cascade_ray.tune.state import InterruptWatch, StateDigestCallback, verify_state

TRIAL_DRIVER_RESOURCES = {"memory": 1}  # bytes: schedulable anywhere, holds no CPU
INPUTS_FILE = "inputs.json"
STARTUP_FILE = "startup.json"  # the trial fit's start-up phases (cascade_ray/stage/startup.py)


def encoded_keys(space: TuneSpace) -> frozenset[str]:
    """Space keys whose ``choice`` / ``grid`` values include a list or a mapping (``model.hidden:
    {choice: [[32], [64]]}``, ``solver.betas``): Tune gets each such value as its JSON text.

    Ray Tune's variant generator walks into a list or dict it is handed as a preset value (the
    first trial's, ``evaluate_current``) as if it were nested search space, and fails on it; a
    text is one value to it. :func:`stage_values` turns what Tune hands back into the values again.
    """
    return frozenset(
        key
        for key, d in space.space.items()
        if d.kind() in ("choice", "grid") and any(isinstance(v, (list, dict)) for v in d.values())
    )


def _as_text(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def tune_values(space: TuneSpace, values: dict[str, Any]) -> dict[str, Any]:
    """`values` (stage values by space key) as Tune samples them (:func:`encoded_keys`)."""
    encoded = encoded_keys(space)
    return {k: _as_text(v) if k in encoded else v for k, v in values.items()}


def stage_values(encoded: frozenset[str], values: dict[str, Any]) -> dict[str, Any]:
    """A trial's values as Tune sampled them, as stage values again (the inverse of :func:`tune_values`)."""
    return {k: json.loads(v) if k in encoded and isinstance(v, str) else v for k, v in values.items()}


def param_space(space: TuneSpace) -> dict[str, Any]:
    """Tune's search space; keys are the stage's dotted config keys."""
    make = {
        "loguniform": lambda v: tune.loguniform(*v),
        "uniform": lambda v: tune.uniform(*v),
        "randint": lambda v: tune.randint(*v),
        "choice": tune.choice,
        "grid": tune.grid_search,
    }
    encoded = encoded_keys(space)
    return {
        key: make[d.kind()]([_as_text(v) for v in d.values()] if key in encoded else d.values())
        for key, d in space.space.items()
    }


def reference_values(cfg: PipelineConfig, space: TuneSpace) -> dict[str, Any] | None:
    """The first trial's values, as Tune takes them (:func:`tune_values`): the stage's configured
    ones (random search with ``evaluate_current``)."""
    current = current_values(cfg, space) if space.evaluate_current and space.search == "random" else None
    return tune_values(space, current) if current is not None else None


def outside_space(space: TuneSpace, reference: dict[str, Any] | None) -> dict[str, str]:
    """Key -> its distribution, for each reference value the space cannot sample (Tune's own
    ``Domain.is_valid``, the test behind its "Pre-set value ... not within valid values" warning)."""
    outside: dict[str, str] = {}
    for key, domain in param_space(space).items() if reference is not None else ():
        value = reference[key]
        try:
            valid = value in domain["grid_search"] if isinstance(domain, dict) else domain.is_valid(value)
        except TypeError:  # e.g. a string against a numeric range
            valid = False
        if not valid:
            dist = space.space[key]
            outside[key] = f"{dist.kind()} {dist.values()}"
    return outside


def reference_note(space: TuneSpace, space_file: str, reference: dict[str, Any], outside: dict[str, str]) -> str:
    """What cascade-ray logs when the first trial's configured values lie outside the space."""
    shown = stage_values(encoded_keys(space), reference)
    values = "; ".join(f"{key}={shown[key]!r} (space: {dist})" for key, dist in outside.items())
    return (
        f"sweep of {space.stage!r}: the first trial runs the stage's configured {values}, outside the space, "
        f"as the baseline the sweep must beat (evaluate_current: true); set evaluate_current: false in "
        f"{space_file} to sample every trial from the space"
    )


def explain_reference(
    cfg: PipelineConfig, space: TuneSpace, space_file: str, log: Callable[[str], None]
) -> dict[str, str]:
    """Log :func:`reference_note` when the first trial's values lie outside the space; the
    :func:`outside_space` keys (for :func:`cascade_ray.ray_compat.quiet_preset_warnings`)."""
    reference = reference_values(cfg, space)
    outside = outside_space(space, reference)
    if reference is not None and outside:
        log(reference_note(space, space_file, reference, outside))
    return outside


def trial_config(cfg: PipelineConfig, stage: str, values: dict[str, Any]) -> PipelineConfig:
    """`cfg` with one trial's sampled values, re-validated like a YAML file."""
    raw = cfg.model_dump(mode="json")
    for key, value in values.items():
        set_stage_value(raw, stage, key, value)
    return validate_config(raw, source=f"tune trial {values}")


def max_concurrent(cfg: PipelineConfig, space: TuneSpace, space_file: str) -> int:
    """Trials that fit at once; an explicit value above that is an error."""
    stage = cfg.stages[cfg.stage_index(space.stage)]
    per_trial = {k: v * stage.scaling.num_workers for k, v in worker_resources(stage).items()}
    total = dict(ray.cluster_resources())
    if cfg.data.streaming is not False:  # Ray Data's read tasks keep their CPUs (data.streaming_cpus)
        total["CPU"] = total.get("CPU", 0.0) - cfg.data.streaming_cpus
    fits = min(math.floor(total.get(k, 0.0) / v) for k, v in per_trial.items() if v > 0)
    if fits < 1:
        raise ConfigError(
            [ConfigIssue("stage", f"one trial of {space.stage!r} needs {per_trial}, the cluster has {total}")],
            space_file,
        )
    if space.max_concurrent_trials is not None and space.max_concurrent_trials > fits:
        raise ConfigError(
            [
                ConfigIssue(
                    "max_concurrent_trials",
                    f"{space.max_concurrent_trials} trials x {per_trial} do not fit in the cluster ({fits} do)",
                    f"set max_concurrent_trials: {fits} or less",
                )
            ],
            space_file,
        )
    return space.max_concurrent_trials or fits


def _run_trial(
    config: dict[str, Any],
    *,
    base: dict[str, Any],
    stage: str,
    refs: dict[str, Any],
    ray_dir: str,
    options: RunOptions,
    stream: Any = None,
    tracking: TrackingContext | None = None,
    plans: dict[Any, Any] | None = None,
    encoded: frozenset[str] = frozenset(),
    upstream_digests: Mapping[str, str] | None = None,
) -> None:
    """One trial (runs in a Tune trial actor); `stream`: the streamed data or streamed cache it trains on;
    `tracking`: the pipeline run's trackers (the trial's rank 0 opens its own run, ``<stage> trial <id>``);
    `plans`: the driver's shape plans (:func:`~cascade_ray.models.plan.known_plans`); `encoded`: the
    keys Tune samples as JSON text (:func:`encoded_keys`); `upstream_digests`: the upstream hand-off's
    tensor digests (its workers do not hash the upstream again)."""
    from ray.tune.integration.ray_train import TuneReportCallback

    remember_plans(plans)  # a trial of solver values has its base's plans: neither it nor its workers plan

    cfg = trial_config(validate_config(base, preflight=False), stage, stage_values(encoded, config))
    index = cfg.stage_index(stage)
    trial_id = tune.get_context().get_trial_id()
    data_ref, upstream_ref, features_ref = refs.get("data"), refs.get("upstream"), refs.get("features")
    # Train run named after the trial: unique per trial, stable across a Tune restore
    run = as_storage(ray_dir) / f"trial-{trial_id}"
    result = fit_stage(
        cfg,
        index,
        data_ref=data_ref,
        upstream_ref=upstream_ref,
        upstream_digests=upstream_digests,
        ray_dir=run.parent,
        run_name=run.name,
        callbacks=[TuneReportCallback()],
        loop_extra={"trial": True},  # no per-step lines from its rank 0 below --log-level debug
        features_ref=features_ref,
        options=options,
        stream=stream,
        tracking=dataclasses.replace(tracking, trial=trial_id) if tracking is not None else None,
    )
    _drain_tune_reports()
    # which object-store copies this trial read: the same ids for every trial, by design
    (run / INPUTS_FILE).write_text(json.dumps({name: ref.hex() for name, ref in refs.items()}))
    (run / STARTUP_FILE).write_text(json.dumps((result.return_value or {}).get("startup")))


def _drain_tune_reports(timeout_s: float = 60.0) -> None:
    """Wait until Tune has taken this trial's last forwarded report before the trial returns.

    In Ray 2.60 a trial function that returns while TuneReportCallback's last report still
    sits in the session's queues deadlocks the trial actor (its main thread blocks putting
    that report into a result queue the finished function already filled), and the sweep
    waits forever. Seen in a 16-trial sweep on 2 CPUs. The session's queues are Ray
    internals: :func:`cascade_ray.ray_compat.wait_for_tune_reports_taken`.
    """
    wait_for_tune_reports_taken(timeout_s)


def baseline_asha(baseline: dict[str, Any] | None, *, time_attr: str, max_t: int, **kwargs: Any) -> Any:
    """An ASHA scheduler that never stops the trial running `baseline` (the stage's current values) early.

    ASHA compares trials at early rungs; a config that starts slower but ends better (a
    lower lr, say) is stopped after its first epoch. The current-values trial is the
    sweep's reference: it always runs to ``max_t``, so the best trial is never worse than
    what the sweep started from. Its results still enter the rungs other trials are cut at.
    """
    from ray.tune.schedulers import AsyncHyperBandScheduler, TrialScheduler

    class BaselineASHA(AsyncHyperBandScheduler):
        def on_trial_result(self, tune_controller: Any, trial: Any, result: dict[str, Any]) -> str:
            action = super().on_trial_result(tune_controller, trial, result)
            if action == TrialScheduler.STOP and is_baseline(trial.config) and result.get(time_attr, 0) < max_t:
                uncount_asha_stop(self)  # ASHA counted the STOP it returned
                return TrialScheduler.CONTINUE
            return action

    def is_baseline(config: dict[str, Any]) -> bool:
        return baseline is not None and all(config.get(k) == v for k, v in baseline.items())

    return BaselineASHA(time_attr=time_attr, max_t=max_t, **kwargs)


def search_algorithm(
    space: TuneSpace, current: dict[str, Any] | None, concurrency: int, space_file: str, seed: int = 0
) -> tuple[Any, int | None]:
    """(search algorithm, TuneConfig.max_concurrent_trials) for `space`.

    Random and grid search are a ``BasicVariantGenerator`` seeded with the pipeline seed (the
    same config samples the same trials), the current values first when given. It holds the
    concurrency limit itself: Tune ignores ``max_concurrent_trials`` for a generator passed in
    (it only logs a warning).
    """
    if space.search == "optuna":
        try:
            from ray.tune.search.optuna import OptunaSearch

            if importlib.util.find_spec("optuna") is None:  # Ray's module imports without it
                raise ImportError("optuna")
        except ImportError:
            raise ConfigError(
                [ConfigIssue("search", "optuna is not installed", "pip install optuna, or use search: random")],
                space_file,
            ) from None
        return OptunaSearch(), concurrency
    from ray.tune.search.basic_variant import BasicVariantGenerator

    points = [current] if current is not None else None
    return BasicVariantGenerator(points_to_evaluate=points, max_concurrent=concurrency, random_state=seed), None


def build_tuner(
    cfg: PipelineConfig,
    space: TuneSpace,
    *,
    space_file: str,
    data_ref: ray.ObjectRef | None,
    upstream_ref: ray.ObjectRef | None,
    exp_dir: StorageDir,
    upstream_digests: Mapping[str, str] | None = None,
    resume: bool,
    features_ref: ray.ObjectRef | None = None,
    options: RunOptions | None = None,
    stream: Any = None,
    trust_state: bool = False,
    tracking: TrackingContext | None = None,
) -> tune.Tuner:
    """A Tuner for `space` (restored from `exp_dir` when ``resume`` and it exists); every trial
    reads the same data, upstream and (when the stage caches them) upstream-feature objects;
    `upstream_digests` are the upstream's tensor digests (``Handoff.digests``), handed to every trial.

    Before a restore, the Tune state is checked against the sha256 sidecar cascade-ray wrote
    (:mod:`cascade_ray.tune.state`; `trust_state`: ``--trust-tune-state`` skips it), so Ray
    unpickles nothing that cascade-ray did not write.

    Trials run with the run's log level; they have no progress board and are not profiled."""
    stage = cfg.stages[cfg.stage_index(space.stage)]
    refs = (
        ({"data": data_ref} if data_ref is not None else {})
        | ({"upstream": upstream_ref} if upstream_ref is not None else {})
        | ({"features": features_ref} if features_ref is not None else {})
    )
    fn = functools.partial(
        _run_trial,
        base=cfg.model_dump(mode="json"),
        stage=space.stage,
        refs=refs,
        ray_dir=full_uri(exp_dir / "trials"),
        options=RunOptions(log_level=(options or RunOptions()).log_level),
        stream=stream,
        tracking=tracking,
        plans=known_plans(),
        encoded=encoded_keys(space),
        upstream_digests=upstream_digests,
    )
    trainable = tune.with_resources(fn, TRIAL_DRIVER_RESOURCES)
    show_progress = (options or RunOptions()).show_progress  # not with --log-level warning
    if resume:
        verify_state(exp_dir, trust_state=trust_state)  # before Ray opens a byte of it
    if resume and tune.Tuner.can_restore(full_uri(exp_dir / "tune")):
        return tune.Tuner.restore(
            full_uri(exp_dir / "tune"), trainable=trainable, resume_unfinished=True, resume_errored=True
        )
    current = reference_values(cfg, space)
    scheduler = None
    if space.scheduler.type == "asha":
        scheduler = baseline_asha(
            current,
            time_attr="epoch",
            max_t=asha_max_t(space, stage.train.epochs),
            grace_period=space.scheduler.grace_period,
            reduction_factor=space.scheduler.reduction_factor,
        )
    search_alg, concurrent_trials = search_algorithm(
        space, current, max_concurrent(cfg, space, space_file), space_file, seed=cfg.seed
    )
    return tune.Tuner(
        trainable,
        param_space=param_space(space),
        tune_config=tune.TuneConfig(
            metric=space.metric,
            mode=space.mode,
            num_samples=space.num_samples,
            scheduler=scheduler,
            search_alg=search_alg,
            max_concurrent_trials=concurrent_trials,
            # FIFO: a finished trial's driver process runs the next trial (no new process and
            # imports per trial). Not under a scheduler that stops trials early: Ray 2.60 hands a
            # stopped trial's actor, still inside its fit, to the next trial, whose reset then
            # fails after 2 s; that trial ends ERROR and the sweep can hang
            reuse_actors=scheduler is None,
        ),
        run_config=tune.RunConfig(
            name="tune",
            storage_path=full_uri(exp_dir),
            verbose=0,  # Tune's own table off: SweepProgress shows one line per trial instead
            callbacks=[StateDigestCallback(exp_dir), InterruptWatch()]
            + ([SweepProgress(space.metric, space.mode, stage.train.epochs)] if show_progress else []),
        ),
    )
