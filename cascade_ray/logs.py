"""``--log-level debug|info|warning``: how much of Ray's and cascade-ray's own output is shown.

- ``debug``: everything. Ray's driver logger at DEBUG, Ray Train's logs at DEBUG, every line
  every Ray process prints, forwarded with Ray's ``(Actor pid=...)`` prefix; each worker's own
  progress lines too.
- ``info`` (default): cascade-ray's lines (the driver's, the progress display, and what rank 0
  says: warnings, plateaus, early stops, profile summaries). Ray's own INFO/WARNING log lines
  (``ray.init``, Ray Train's controller and workers) and the output of Ray's internal actors are
  hidden; errors are not: a failing worker's traceback reaches the driver in the raised
  exception, and ERROR records and tracebacks that workers print are still forwarded.
- ``warning``: as ``info`` without the progress display and rank 0's informational lines.

Knobs used (Ray 2.60): ``ray.init(logging_level=...)`` for the driver's ``ray`` logger,
``RunConfig(logging_config=LoggingConfig(log_level=...))`` for Ray Train's controller and
worker loggers, and a filter in front of Ray's worker-output printer (a private hook, in
``cascade_ray/ray_compat.py``: when it is missing, the output is shown unfiltered).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from cascade_ray.options import LOG_LEVELS

__all__ = [
    "LOG_LEVELS",
    "apply_log_level",
    "install_worker_filter",
    "keep_lines",
    "quiet_ray_data",
    "ray_logging_level",
    "train_logging_config",
]

# Ray Train / Tune / Data machinery (SplitCoordinator: a streamed dataset's split); their lines are Ray's business unless --log-level debug
_RAY_ACTORS = re.compile(
    r"(TrainController|PlacementGroupCleaner|SynchronizationActor|TrainStateActor|PreemptionWatcher|DatasetManager|SplitCoordinator|_PackActor)\b"
)
# Ray's own log format (ray_constants.LOGGER_FORMAT): "2026-01-01 10:00:00,123\tINFO file.py:12 -- message"
_RAY_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\s+(DEBUG|INFO|WARNING)\s+\S+:\d+ -- ")
# Ray Train's INFO lines on workers that bypass LoggingConfig (Ray 2.60 logs "Reporting training
# result" through logging.getLogger(__file__), i.e. the root logger)
_RAY_TRAIN_CHATTER = re.compile(
    r"^(Reporting training result \d+: |Checkpoint successfully created at: |Setting up process group for: |Wrapping provided model in )"
)
# rank 0's informational lines: "[stage] resumed ...", "[stage] val_loss plateaued ...", progress
_OWN_INFO = re.compile(r"^\[[\w.-]+\] ")

_print_guard: Callable[[], AbstractContextManager[Any]] = nullcontext


def apply_log_level(level: str) -> None:
    """Set this driver process's ``ray`` logger for `level` (before ``ray.init``).

    The level itself travels in :class:`~cascade_ray.options.RunOptions`; Ray's workers get it
    in their train loop config, Ray Train's loggers through :func:`train_logging_config`.
    """
    logging.getLogger("ray").setLevel(ray_logging_level(level))


def ray_logging_level(level: str) -> int:
    """Level of the driver's ``ray`` logger: DEBUG with ``debug``, else ERROR."""
    return logging.DEBUG if level == "debug" else logging.ERROR


def train_logging_config(level: str) -> Any:
    """Ray Train's ``LoggingConfig`` for a stage's ``RunConfig`` (controller and worker loggers)."""
    import ray.train

    return ray.train.LoggingConfig(log_level="DEBUG" if level == "debug" else "ERROR")


def keep_lines(data: dict[str, Any], level: str) -> list[str]:
    """The lines of one batch of forwarded Ray process output that `level` shows.

    `data` is what Ray's log monitor publishes: ``lines``, ``actor_name``, ``task_name``,
    ``is_err``, ``pid``.
    """
    lines = list(data.get("lines") or [])
    if level == "debug":
        return lines
    if _RAY_ACTORS.match(data.get("actor_name") or "") or data.get("pid") in ("autoscaler", "raylet", "gcs_server"):
        return []
    kept = [line for line in lines if not _RAY_RECORD.match(line) and not _RAY_TRAIN_CHATTER.match(line)]
    if level == "warning":
        kept = [line for line in kept if not _OWN_INFO.match(line)]
    return kept


def quiet_ray_data() -> None:
    """Ray Data in the driver (streamed datasets, the streamed feature cache) without its progress
    bars and INFO lines unless the ``ray`` logger is at DEBUG (``--log-level debug``)."""
    import ray.data

    level = logging.getLogger("ray").getEffectiveLevel()
    if level > logging.DEBUG:
        ray.data.DataContext.get_current().enable_progress_bars = False
        logging.getLogger("ray.data").setLevel(max(level, logging.WARNING))


def set_print_guard(guard: Callable[[], AbstractContextManager[Any]] | None) -> None:
    """A context manager entered around each forwarded batch (the live progress line clears itself)."""
    global _print_guard
    _print_guard = guard or nullcontext


def print_guard() -> Callable[[], AbstractContextManager[Any]]:
    """The guard :func:`set_print_guard` set (a sweep's display chains its own in front of it)."""
    return _print_guard


def install_worker_filter(level: str) -> bool:
    """Put :func:`keep_lines` in front of Ray's printer of forwarded worker output (after ``ray.init``).

    Returns False (output unfiltered) with ``log_to_driver=False`` or when this Ray does not
    have the private hook (:func:`cascade_ray.ray_compat.wrap_worker_output_printer`, which
    then warns once).
    """
    from cascade_ray.ray_compat import wrap_worker_output_printer  # imports Ray Train: not at module level

    def wrap(original: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
        def handler(data: dict[str, Any]) -> None:
            lines = keep_lines(data, level)
            if lines:
                with _print_guard():
                    original({**data, "lines": lines})

        return handler

    return wrap_worker_output_printer(wrap)
