"""Live tracking: what rank 0 of a stage logs while it trains, and the pipeline run around it.

One small protocol, :class:`Logger` (``log(group, row)``, ``close(failed)``), with three
implementations, each imported only when configured (``loggers:``): TensorBoard event files
(:mod:`.tensorboard_live`), MLflow runs (:mod:`.mlflow_runs`), W&B runs (:mod:`.wandb_runs`).
The loop's row hooks feed them the rows ``metrics/<stage>.parquet`` is made of: ``group`` is
``"step"`` (every ``train.log_interval`` steps) or ``"epoch"``.

The driver opens the pipeline's own run first (:mod:`.pipeline_run`: the MLflow parent run, the
W&B group) and hands a :class:`TrackingContext` to every stage's workers through the train loop
config; rank 0 opens the stage's runs under it. A logger that raises is reported once (one
warning line naming it) and switched off; training never stops for it (:class:`Loggers`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from cascade_ray.storage import redact


class Logger(Protocol):
    """Where a stage's metric rows go as they happen."""

    name: str  # shown in the warning when it fails: "mlflow", "wandb", "tensorboard"

    def log(self, group: str, row: Mapping[str, Any]) -> None:
        """Log one row: `group` ``"step"`` or ``"epoch"``; ``row["step"]`` is the optimizer step."""

    def close(self, failed: bool) -> None:
        """The stage ended (`failed`: with an error); flush and end the run."""


@dataclass(frozen=True)
class TrackingContext:
    """What the driver's pipeline run hands each stage fit (plain values: it crosses processes).

    Attributes:
        run_dir: ``{storage_path}/{name}`` as a full URI or absolute local path.
        mlflow_parent: the pipeline's MLflow run id (None: no MLflow, or opening it failed).
        mlflow_experiment: the experiment id of that run.
        wandb_group: the W&B group of this pipeline run (None: no W&B, or it failed).
        fingerprint: the fitted stage's fingerprint (set per fit).
        trial: the Tune trial id when the fit is a trial.
    """

    run_dir: str
    mlflow_parent: str | None = None
    mlflow_experiment: str | None = None
    wandb_group: str | None = None
    fingerprint: str | None = None
    trial: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> TrackingContext:
        return cls(**raw)


def run_label(stage: str, trial: str | None) -> str:
    """The stage run's name: the stage, or ``<stage> trial <id>`` for a Tune trial."""
    return stage if trial is None else f"{stage} trial {trial}"


def scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of a row, less its coordinates (``step``, ``epoch``) and labels."""
    return {
        key: float(value)
        for key, value in row.items()
        if key not in ("stage", "kind", "step", "epoch")
        and isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
    }


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"solver": {"lr": 0.01}}`` -> ``{"solver.lr": 0.01}``; lists and empty mappings stay whole.

    W&B keeps the values' types; MLflow params are text (:func:`param_text`)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out |= flatten(value, f"{name}.")
        else:
            out[name] = value
    return out


def param_text(value: Any) -> str:
    """A flattened value as an MLflow param: ``null`` for None, else ``str``."""
    return "null" if value is None else str(value)


class Loggers:
    """The stage's loggers behind one guard: the first error of a logger prints one warning line
    naming it and switches it off; the others and training go on."""

    def __init__(self, loggers: list[Logger], where: str, warn: Callable[[str], None] = print):
        self.active = list(loggers)
        self.where = where
        self.warn = warn
        self.failed: list[str] = []

    def log(self, group: str, row: Mapping[str, Any]) -> None:
        for logger in list(self.active):
            self._guard(logger, f"at step {row.get('step')}", lambda lg=logger: lg.log(group, row))

    def close(self, failed: bool) -> None:
        for logger in list(self.active):
            self._guard(logger, "at the end", lambda lg=logger: lg.close(failed))
        self.active = []

    def _guard(self, logger: Logger, when: str, call: Callable[[], None]) -> None:
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - a tracker must never stop training; reported once
            self.active.remove(logger)
            self.failed.append(logger.name)
            self.warn(
                f"WARNING {self.where}: the {logger.name} logger failed {when} ({describe(exc)}); "
                "it is off for the rest of this stage, training goes on"
            )


def open_guarded(
    opener: Callable[[], Logger], name: str, where: str, warn: Callable[[str], None] = print
) -> Logger | None:
    """``opener()``, or None after one warning line when it raises."""
    try:
        return opener()
    except Exception as exc:  # noqa: BLE001 - reported once; the stage trains without this logger
        warn(f"WARNING {where}: the {name} logger could not start ({describe(exc)}); training goes on without it")
        return None


def describe(exc: BaseException) -> str:
    """The error's type and first line (at most 200 characters), credentials removed."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {redact(text[0])[:200]}" if text else type(exc).__name__
