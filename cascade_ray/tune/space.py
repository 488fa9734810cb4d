"""Tune search spaces (``tune_spaces/<stage>.yaml``): a typed schema, checked against the stage.

A space maps dotted keys of one stage's config (``solver.lr``, ``loss.scale``,
``solver.lr_scheduler.warmup_steps``, ...) to a distribution. Every key is checked by
writing a sample into the stage config and validating it with the pipeline schema, so a
key that is not a stage field, or a value the stage would reject, fails before any trial.
"""

from __future__ import annotations

import copy
import importlib.util
import itertools
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from cascade_ray.checks import validate_config
from cascade_ray.config.loader import schema_issues
from cascade_ray.config.metrics import epoch_metric_names, metric_mode
from cascade_ray.config.schema import PipelineConfig
from cascade_ray.config.yaml_io import read_yaml, split_key
from cascade_ray.errors import ConfigError, ConfigIssue


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Distribution(_Strict):
    """Exactly one of the keys: how to sample one stage value."""

    loguniform: list[float] | None = Field(
        None, min_length=2, max_length=2, description="[low, high], both > 0, sampled log-uniformly."
    )
    uniform: list[float] | None = Field(None, min_length=2, max_length=2, description="[low, high], sampled uniformly.")
    randint: list[int] | None = Field(None, min_length=2, max_length=2, description="[low, high), an integer.")
    choice: list[Any] | None = Field(None, min_length=1, description="Values, sampled uniformly.")
    grid: list[Any] | None = Field(None, min_length=1, description="Values, every one tried (times num_samples).")

    def kind(self) -> str:
        """The one distribution set."""
        return next(k for k in type(self).model_fields if getattr(self, k) is not None)

    def values(self) -> list[Any]:
        return getattr(self, self.kind())


class SchedulerSpec(_Strict):
    """Trial scheduler."""

    type: Literal["asha", "fifo"] = Field(
        "asha", description="`asha` stops poor trials early; `fifo` runs all to the end."
    )
    grace_period: int = Field(
        1,
        ge=1,
        description="ASHA: epochs every trial runs before it can be stopped; past the epochs a trial trains is "
        "an error (ASHA could stop nothing, and Ray refuses it).",
    )
    max_t: int | None = Field(
        None,
        ge=1,
        description="ASHA: most epochs a trial runs; default the most epochs a trial trains (the stage's "
        "`train.epochs`, or the largest sampled one). Below them is an error: trials would be cut short.",
    )
    reduction_factor: float = Field(2.0, gt=1.0, description="ASHA: keep 1/reduction_factor of trials per rung.")


class TuneSpace(_Strict):
    """One stage's sweep."""

    stage: str = Field(description="Name of the stage to sweep; earlier stages are frozen and shared.")
    metric: str = Field("val_accuracy", description="Reported metric to optimize.")
    mode: Literal["max", "min"] = Field(
        "max",
        description="Maximize or minimize the metric. `mode: batched` is short for `batched: true` with the "
        "metric's own direction (max for accuracies, min for losses and errors).",
        json_schema_extra={"doc_type": "`max` | `min` | `batched`"},
    )
    num_samples: int = Field(4, ge=1, description="Trials to sample (per grid point when a grid is used).")
    max_concurrent_trials: int | None = Field(
        None, ge=1, description="Trials at once; default: as many as the cluster's CPUs/GPUs can place."
    )
    scheduler: SchedulerSpec = Field(default_factory=SchedulerSpec, description="Trial scheduler.")
    search: Literal["random", "grid", "optuna"] = Field(
        "random", description="Search algorithm (`optuna` when installed)."
    )
    space: dict[str, Distribution] = Field(min_length=1, description="Dotted stage key -> distribution.")
    evaluate_current: bool = Field(
        True,
        description="random search: the first trial runs the stage's current values, so a sweep never "
        "returns a config worse than the one it started from (counts toward num_samples; ASHA never stops "
        "this trial early).",
    )
    batched: bool = Field(
        False,
        description="Train every sampled config at once in one TorchTrainer job (`cascade-ray tune --batched`): "
        "for a stage on cached features whose space varies only solver.*, loss.* values and seed, with scheduler "
        "fifo and search random or grid; anything else is refused before Ray starts.",
    )

    _batched_by_mode: bool = PrivateAttr(False)

    @property
    def batched_by_mode(self) -> bool:
        """The file asked for the batched sweep with the short form ``mode: batched``."""
        return self._batched_by_mode

    @model_validator(mode="wrap")
    @classmethod
    def _remember_short_form(cls, raw: Any, handler: Any) -> TuneSpace:
        space = handler(raw)
        space._batched_by_mode = isinstance(raw, dict) and raw.get("mode") == "batched"
        return space

    @model_validator(mode="before")
    @classmethod
    def _mode_batched(cls, raw: Any) -> Any:
        """``mode: batched`` (the short form) -> ``batched: true`` and the metric's own direction
        (left as it is beside ``batched: false``, for :meth:`_mode` to refuse at its key)."""
        if not isinstance(raw, dict) or raw.get("mode") != "batched" or raw.get("batched") is False:
            return raw
        metric = raw.get("metric", cls.model_fields["metric"].default)
        return {**raw, "batched": True, "mode": metric_mode(metric) if isinstance(metric, str) else "max"}

    @field_validator("mode", mode="before")
    @classmethod
    def _mode(cls, value: Any) -> Any:
        if value == "batched":  # only beside batched: false (see _mode_batched)
            raise PydanticCustomError(
                "mode_batched",
                "mode: batched asks for a batched sweep but batched: false refuses it; drop batched: false, "
                "or set mode: max or min for a plain sweep",
            )
        return value


def load_space(path: str | Path, cfg: PipelineConfig) -> TuneSpace:
    """Read a space file and check it against `cfg` (stage exists, keys valid, ranges sane)."""
    raw = read_yaml(path)
    try:
        space = TuneSpace.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(schema_issues(exc, TuneSpace), str(path)) from None
    issues = space_issues(space, cfg)
    if issues:
        raise ConfigError(issues, str(path))
    return space


def metrics_reported(cfg: PipelineConfig, stage: str) -> list[str]:
    """Metric names a stage reports every epoch."""
    names = [
        *epoch_metric_names(cfg.data.target.kind, cfg.data.target.num_classes),
        "samples_per_s",
        "lr",
        "epoch",
        "step",
    ]
    index = cfg.stage_index(stage)
    if cfg.stages[index].type == "joint":
        names += [f"loss/{s.name}" for s in cfg.stages[:index] if s.type == "module"]
    return names


def space_issues(space: TuneSpace, cfg: PipelineConfig) -> list[ConfigIssue]:
    """Problems with a space relative to the pipeline config."""
    from cascade_ray.text import did_you_mean

    names = [s.name for s in cfg.stages]
    if space.stage not in names:
        return [
            ConfigIssue(
                "stage", f"no stage {space.stage!r}{did_you_mean(space.stage, names)} (stages: {', '.join(names)})"
            )
        ]
    issues = []
    if cfg.stages[names.index(space.stage)].train.epochs == 0:
        issues.append(
            ConfigIssue(
                "stage",
                f"stage {space.stage!r} is import-only (train.epochs: 0): it trains nothing, so there is nothing to sweep",
                "sweep a stage that trains, or give this one train.epochs >= 1",
            )
        )
    epochs = space.space.get("train.epochs")
    probe = _probe_values(epochs) if epochs is not None and not _distribution_issues("", epochs) else []
    if any(isinstance(v, (int, float)) and not isinstance(v, bool) and v < 1 for v in probe):
        issues.append(
            ConfigIssue(
                "space.train.epochs",
                "a trial of 0 epochs would be an import-only stage, which trains nothing to compare",
                "sample train.epochs from values >= 1",
            )
        )
    issues += _scheduler_issues(space, cfg.stages[names.index(space.stage)].train.epochs)
    reported = metrics_reported(cfg, space.stage)
    if space.metric not in reported:
        issues.append(
            ConfigIssue(
                "metric",
                f"stage {space.stage!r} does not report {space.metric!r}{did_you_mean(space.metric, reported)} (reports: {', '.join(reported)})",
            )
        )
    elif space.metric in epoch_metric_names(cfg.data.target.kind) and space.mode != metric_mode(space.metric):
        natural = metric_mode(space.metric)
        issues.append(
            ConfigIssue(
                "mode",
                f"{space.metric} improves by going {'up' if natural == 'max' else 'down'}, but mode is {space.mode!r}",
                f"set mode: {natural}",
            )
        )
    if space.search == "grid" and any(d.kind() != "grid" for d in space.space.values()):
        issues.append(
            ConfigIssue(
                "search", "search: grid needs every space entry to be a grid", "use search: random, or grid lists only"
            )
        )
    if space.search == "optuna" and importlib.util.find_spec("optuna") is None:
        # Ray's OptunaSearch imports without it and fails only when the sweep builds it, after Ray starts
        issues.append(
            ConfigIssue(
                "search",
                "search: optuna needs the optuna package, which is not installed",
                "pip install optuna, or use search: random",
            )
        )
    for key, dist in space.space.items():
        wrong = _distribution_issues(f"space.{key}", dist)
        issues += wrong
        if wrong:
            continue  # no values to probe the stage with
        for value in _probe_values(dist):
            found = _key_issues(cfg, space.stage, key, value)
            issues += found
            if found:
                break  # one report per key is enough
    if not issues:
        issues += _combination_issues(cfg, space)
    return _unique(issues)


def trial_epochs(space: TuneSpace, stage_epochs: int) -> tuple[int, int]:
    """The fewest and the most epochs a trial trains: the stage's ``train.epochs``, or the bounds of a
    sampled ``train.epochs`` (a malformed one counts as not sampled; it is reported at its own key)."""
    dist = space.space.get("train.epochs")
    sampled = [] if dist is None or _distribution_issues("", dist) else _probe_values(dist)
    values = [v for v in sampled if isinstance(v, int) and not isinstance(v, bool) and v >= 1]
    return (min(values), max(values)) if values else (stage_epochs, stage_epochs)


def asha_max_t(space: TuneSpace, stage_epochs: int) -> int:
    """ASHA's ``max_t``: the space's, or the most epochs a trial trains (so no trial is cut short)."""
    return space.scheduler.max_t or trial_epochs(space, stage_epochs)[1]


def _scheduler_issues(space: TuneSpace, stage_epochs: int) -> list[ConfigIssue]:
    """ASHA settings the stage's epochs make wrong: a ``max_t`` that would stop every trial before its
    ``train.epochs`` (the adopted stage would have trained fewer epochs than its config says), and a
    ``grace_period`` past ``max_t`` (Ray's scheduler failed an assert after Ray started). A grace_period
    equal to the last epoch is accepted: ASHA then stops nothing early, which a 1-epoch stage cannot avoid."""
    if space.scheduler.type != "asha" or stage_epochs < 1:
        return []
    most = trial_epochs(space, stage_epochs)[1]
    max_t, grace = asha_max_t(space, stage_epochs), space.scheduler.grace_period
    if max_t < most:
        sampled = "train.epochs" in space.space
        return [
            ConfigIssue(
                "scheduler.max_t",
                f"trials would stop at epoch {max_t}, before the {most} epochs "
                f"{'a trial samples (space.train.epochs)' if sampled else 'the stage trains (train.epochs)'}: "
                "the adopted stage would have trained fewer epochs than its config says",
                "drop max_t (it defaults to the most epochs a trial trains), or "
                + (
                    f"sample space.train.epochs up to {max_t}"
                    if sampled
                    else f"set stages.{space.stage}.train.epochs={max_t}"
                ),
            )
        ]
    if grace > max_t:  # Ray's ASHA asserts grace_period <= max_t when the sweep starts, after Ray started
        return [
            ConfigIssue(
                "scheduler.grace_period",
                f"grace_period {grace} is past the last epoch a trial trains ({max_t}), so ASHA could never stop "
                "a trial (Ray's scheduler refuses it)",
                f"set grace_period to at most {max_t}, or use scheduler: {{type: fifo}}, which runs every trial to "
                "the end",
            )
        ]
    return []


# combinations of the space's values validated together before any trial (each ~1-30 ms)
COMBINATIONS_CHECKED = 64


def _combination_issues(cfg: PipelineConfig, space: TuneSpace) -> list[ConfigIssue]:
    """Values that pass one key at a time but not together, or not with the rest of the pipeline (an encoder's
    width the next stage does not take, ``betas`` with ``solver.type: SGD``): the space's probe values
    (:func:`_probe_values`: every listed value, a range's bounds) in combination, up to
    :data:`COMBINATIONS_CHECKED` of them, each validated with the shape preflight. The first failing
    combination is reported, naming its values."""
    keys = list(space.space)
    for values in itertools.islice(
        itertools.product(*(_probe_values(space.space[k]) for k in keys)), COMBINATIONS_CHECKED
    ):
        raw = cfg.model_dump(mode="json")
        for key, value in zip(keys, values):
            set_stage_value(raw, space.stage, key, value)
        try:
            validate_config(raw)
        except ConfigError as exc:
            shown = ", ".join(f"{k}={v!r}" for k, v in zip(keys, values))
            first = exc.issues[0]
            apart = "take out the values that cannot go together (or sweep them in separate space files)"
            return [
                ConfigIssue(
                    "space",
                    f"the trial with {shown} cannot train: {first.path}: {first.message}",
                    f"{first.fix}; or {apart}" if first.fix else apart,
                )
            ]
    return []


def _distribution_issues(path: str, dist: Distribution) -> list[ConfigIssue]:
    set_keys = [k for k in Distribution.model_fields if getattr(dist, k) is not None]
    if len(set_keys) != 1:
        return [
            ConfigIssue(
                path, f"give exactly one distribution, got {set_keys or 'none'}", "e.g. {loguniform: [1e-4, 1e-2]}"
            )
        ]
    kind, values = set_keys[0], dist.values()
    if kind in ("loguniform", "uniform", "randint"):
        low, high = values
        if not low < high:
            return [
                ConfigIssue(
                    f"{path}.{kind}", f"empty or inverted range [{low}, {high}]", "write [low, high] with low < high"
                )
            ]
        if kind == "loguniform" and low <= 0:
            return [
                ConfigIssue(
                    f"{path}.{kind}", f"a log range must be > 0, got low {low}", "use a positive low bound, e.g. 1e-6"
                )
            ]
        if kind != "randint" and not all(math.isfinite(v) for v in values):
            return [ConfigIssue(f"{path}.{kind}", "bounds must be finite")]
    return []


def _probe_values(dist: Distribution) -> list[Any]:
    """Values to validate against the stage: the bounds, or every listed value."""
    kind, values = dist.kind(), dist.values()
    if kind == "randint":
        return [values[0], values[1] - 1]
    return list(values)


def _key_issues(cfg: PipelineConfig, stage: str, key: str, value: Any) -> list[ConfigIssue]:
    raw = cfg.model_dump(mode="json")
    try:
        set_stage_value(raw, stage, key, value)
    except (KeyError, ValueError, IndexError, TypeError) as exc:
        return [ConfigIssue(f"space.{key}", f"not a field of stage {stage!r}: {exc}")]
    try:
        validate_config(raw, preflight=False)
    except ConfigError as exc:
        return [ConfigIssue(f"space.{key}", f"value {value!r}: {issue.render()}") for issue in exc.issues]
    return []


def current_values(cfg: PipelineConfig, space: TuneSpace) -> dict[str, Any] | None:
    """The stage's configured value at every space key; None when one has no value (e.g. unset weights)."""
    node0: Any = next(s for s in cfg.model_dump(mode="json")["stages"] if s["name"] == space.stage)
    values = {}
    for key in space.space:
        node = node0
        for part in split_key(key):
            node = node[part] if isinstance(node, (dict, list)) and (isinstance(node, list) or part in node) else None
            if node is None:
                return None
        values[key] = node
    return values


def set_stage_value(raw: dict[str, Any], stage: str, key: str, value: Any) -> None:
    """Write `value` at dotted `key` inside the raw config of `stage` (in place).

    Intermediate keys must exist in the stage's dumped config (so a typo is reported
    by the schema's unknown-key check at the last component, or here for the others).
    """
    node: Any = next(s for s in raw["stages"] if s["name"] == stage)
    parts = split_key(key)
    for part, nxt in zip(parts[:-1], parts[1:]):
        if isinstance(node, dict) and node.get(part) is None and isinstance(nxt, str):
            node[part] = {}  # an optional mapping left at null (e.g. loss.weights)
        node = node[part]
    if isinstance(node, list) and not isinstance(parts[-1], int):
        raise TypeError(f"{key}: {parts[-1]!r} indexes a list")
    node[parts[-1]] = copy.deepcopy(value)


def _unique(issues: list[ConfigIssue]) -> list[ConfigIssue]:
    seen: dict[tuple[str, str], ConfigIssue] = {}
    for issue in issues:
        seen.setdefault((issue.path, issue.message), issue)
    return list(seen.values())
