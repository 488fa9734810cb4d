"""Environment knobs, declared once. Units are in the names.

`RAY_ENV_DEFAULTS` are set in the driver before Ray starts (unless the user already
set them) and passed to every Ray process through ``runtime_env``.
"""

from __future__ import annotations

import os

# Ray Train V2 paces ray.train.report() by controller polling (default every 2 s, result
# queue of one): with per-epoch reports that made each report after the second block
# for ~2 s. 0.1 s polling keeps reports cheap.
RAY_TRAIN_HEALTH_CHECK_INTERVAL_S = "0.1"

RAY_ENV_DEFAULTS: dict[str, str] = {
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": RAY_TRAIN_HEALTH_CHECK_INTERVAL_S,
    # one fewer actor per fit, and no per-fit metrics noise
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_TRAIN_METRICS_ENABLED": "0",
    # Train V2 patches print() on workers to also log it, so every progress line showed twice
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
}


def apply_ray_env_defaults() -> dict[str, str]:
    """Set the Ray env defaults in this process (user values win); return what is in force."""
    for key, value in RAY_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in RAY_ENV_DEFAULTS if key in os.environ}


# Run lock (cascade_ray/storage_lock/): the holder rewrites {run}/.lock every
# RUN_LOCK_HEARTBEAT_S; a lock whose last beat is older than RUN_LOCK_STALE_S (3 missed
# beats) counts as abandoned and the next driver takes it over. The stale limit also
# absorbs clock skew between hosts on local/NFS storage (S3 compares server times).
RUN_LOCK_HEARTBEAT_S = 30.0
RUN_LOCK_STALE_BEATS = 3
RUN_LOCK_STALE_S = RUN_LOCK_HEARTBEAT_S * RUN_LOCK_STALE_BEATS

# Test hook: "<stage>:<optimizer step>:<marker file>" kills rank 0 of that stage right after
# that step, once (the marker file records it). Read by the driver and passed to the
# workers in the train loop config, so it reaches workers of an already-running cluster.
FAULT_ONCE_ENV = "CASCADE_RAY_FAULT_ONCE"

# Progress (cascade_ray/stage/progress.py): rank 0 pushes at most every PROGRESS_PUSH_INTERVAL_S to the
# driver's board; without a terminal the driver prints a plain line at most every
# PROGRESS_LINE_INTERVAL_S (and train.log_interval steps), overridable in the driver's env.
PROGRESS_PUSH_INTERVAL_S = 0.5
PROGRESS_LINE_INTERVAL_S = 15.0
PROGRESS_LINE_INTERVAL_ENV = "CASCADE_RAY_PROGRESS_LINE_INTERVAL_S"

# Live tracking (cascade_ray/tracking/): MLflow's REST client retries 7 times with a growing backoff
# and waits up to 120 s per request by default, so a tracking server that went away mid-run would
# stall rank 0 for minutes before the logger is switched off. Set in the processes that log (the
# driver and rank 0 of each stage), unless the user set them. Validate's probe of a tracking
# server or of W&B waits at most TRACKING_PROBE_TIMEOUT_S.
MLFLOW_HTTP_ENV_DEFAULTS: dict[str, str] = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}
TRACKING_PROBE_TIMEOUT_S = 5.0
