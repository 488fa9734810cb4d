"""TensorBoard event files written by rank 0 while a stage trains (``loggers.tensorboard: true``).

``{run}/tensorboard/<stage>/`` (a Tune trial: ``.../<stage>/trial-<id>/``): step rows as
``step/<metric>``, epoch rows as ``epoch/<metric>``, both against the optimizer step, like the
driver's after-run writer (:mod:`cascade_ray.pipeline.tensorboard`). Each row is flushed as it
is written, so ``tensorboard --logdir`` shows the curves while the stage runs.

A run folder on object storage (``s3://``, ``gs://``): the events are written to a local
folder on rank 0's node (``tensorboard --logdir`` there shows them live) and copied to the run
folder when the stage ends.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cascade_ray.storage import StorageDir, as_storage, local_path
from cascade_ray.tracking import scalars

TENSORBOARD_DIR = "tensorboard"


def tensorboard_dir(run_dir: str, stage: str, trial: str | None = None) -> StorageDir:
    """Where a stage's (or a trial's) live event files belong."""
    folder = as_storage(run_dir) / TENSORBOARD_DIR / stage
    return folder / f"trial-{trial}" if trial is not None else folder


def clear_events(folder: StorageDir) -> None:
    """Remove a previous fit's event files from `folder` (local run folders; the driver calls it
    before a fit, so a restarted worker group appends to its own events instead)."""
    local = local_path(folder)
    if local is not None:
        for old in local.glob("events.out.tfevents*"):
            old.unlink(missing_ok=True)


class TensorBoardLogger:
    """One SummaryWriter on rank 0."""

    name = "tensorboard"

    def __init__(self, target: StorageDir):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package (validated)

        self.target = target
        local = local_path(target)
        self.staging = None if local is not None else Path(tempfile.mkdtemp(prefix="cascade-tensorboard-"))
        self.folder = local if local is not None else self.staging
        self.writer = SummaryWriter(log_dir=str(self.folder))

    def log(self, group: str, row: Mapping[str, Any]) -> None:
        step = int(row["step"])
        for key, value in scalars(row).items():
            self.writer.add_scalar(f"{group}/{key}", value, global_step=step)
        self.writer.flush()

    def close(self, failed: bool) -> None:
        self.writer.close()
        if self.staging is not None:  # object storage: the events go to the run folder now
            try:
                for event in sorted(self.staging.iterdir()):
                    (self.target / event.name).write_bytes(event.read_bytes())
            finally:
                shutil.rmtree(self.staging, ignore_errors=True)
