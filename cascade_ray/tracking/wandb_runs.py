"""W&B runs: one per stage fit (rank 0) and one for the pipeline, grouped by pipeline run.

W&B has no nested runs; a group is its way to show runs that belong together: every run of one
pipeline run shares ``group`` (``<name>-<8 hex>``), with ``job_type`` ``stage``, ``trial`` or
``pipeline``. Metrics are ``step/<metric>`` and ``epoch/<metric>`` against the optimizer step
(``train_step`` is the x axis, declared with ``define_metric``). ``mode: offline`` writes under
``{run}/wandb/`` when the run folder is local (``wandb sync`` uploads it later), else in W&B's
own default folder (``WANDB_DIR``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from cascade_ray.config.schema import WandbLoggerConfig
from cascade_ray.storage import as_storage, local_path
from cascade_ray.tracking import scalars

WANDB_DIR = "wandb"


def wandb_dir(run_dir: str) -> str | None:
    """``{run}`` for a local run folder (W&B adds ``wandb/``), else None (W&B's default)."""
    local = local_path(as_storage(run_dir))
    if local is None:
        return None
    local.mkdir(parents=True, exist_ok=True)
    return str(local)


def start(settings: WandbLoggerConfig, run_dir: str, **init: Any) -> Any:
    """``wandb.init`` of a new run with `settings` (quiet: no console capture, no banner)."""
    os.environ.setdefault("WANDB_SILENT", "true")
    import wandb

    return wandb.init(
        project=settings.project,
        entity=settings.entity,
        mode=settings.mode,
        dir=wandb_dir(run_dir),
        reinit="create_new",
        settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
        **init,
    )


class WandbStageLogger:
    """A stage fit's W&B run, in the pipeline run's group."""

    name = "wandb"

    def __init__(self, settings: WandbLoggerConfig, run_dir: str, **init: Any):
        self.run = start(settings, run_dir, **init)
        self.run.define_metric("train_step")
        self.run.define_metric("*", step_metric="train_step")

    def log(self, group: str, row: Mapping[str, Any]) -> None:
        values = {f"{group}/{k}": v for k, v in scalars(row).items()}
        self.run.log(values | {"train_step": int(row["step"]), f"{group}/epoch": row.get("epoch", 0)})

    def close(self, failed: bool) -> None:
        self.run.summary["cascade.status"] = "failed" if failed else "trained"
        self.run.finish(exit_code=1 if failed else 0)
