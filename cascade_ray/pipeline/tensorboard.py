"""TensorBoard event files of a run, written by the driver from the per-stage metric rows.

``{run}/tensorboard/<stage>/``: step rows as ``step/<metric>`` and epoch rows as
``epoch/<metric>``, both against the optimizer step, so a stage's curves line up. Needs the
``tensorboard`` package (``pip install 'cascade-ray[tensorboard]'``); without it one info line
says so and nothing else changes.

    tensorboard --logdir {storage_path}/{name}/tensorboard
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

TENSORBOARD_DIR = "tensorboard"
_NOT_SCALARS = ("stage", "kind", "epoch", "step")


def write_tensorboard(
    out: Path,
    tables: Mapping[str, list[dict[str, Any]]],
    log: Callable[[str], None] = print,
    written_live: Collection[str] = (),
) -> Path | None:
    """Write one event-file folder per stage; return ``{out}/tensorboard``, or None without tensorboard.

    `written_live` (``loggers.tensorboard: true``): stages whose rank 0 wrote their events while
    they trained (:mod:`cascade_ray.tracking.tensorboard_live`); their folders are left as they are.
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch's writer needs the tensorboard package
        log(
            f"info: tensorboard is not installed, so no event files; pip install 'cascade-ray[tensorboard]' to get {out / TENSORBOARD_DIR}/"
        )
        return None
    root = out / TENSORBOARD_DIR
    for stage, rows in tables.items():
        if stage in written_live:
            continue
        # the folder mirrors metrics/<stage>.parquet: a rerun into the same run folder replaces
        # it (event files are appended to, so TensorBoard would show every point twice)
        shutil.rmtree(root / stage, ignore_errors=True)
        with SummaryWriter(log_dir=str(root / stage)) as writer:
            for row in rows:
                group = "step" if row.get("kind") == "step" else "epoch"
                for key, value in row.items():
                    if (
                        key in _NOT_SCALARS
                        or not isinstance(value, (int, float))
                        or isinstance(value, bool)
                        or not math.isfinite(value)
                    ):
                        continue
                    writer.add_scalar(f"{group}/{key}", value, global_step=int(row["step"]))
    return root
