"""Resume state of a batched sweep: every replica's training state after each epoch, in storage.

Rank 0 of a batched job writes, after every epoch, one file with every replica's own weights
(the stage's tensors; the frozen upstream is the hand-off's and checked by its digest), its
optimizer, lr plan, scaler, early-stopping and RNG state (:func:`~cascade_ray.stage.resume.trainer_state`
of the replica), its step counters, history, best epoch and health verdict:

    {attempt}/resume/state-e0002.pt   # torch.save, read back with weights_only=True
    {attempt}/resume/latest.json      # {"epochs_done", "file", "bytes", "sha256", "key", "replicas"}

``latest.json`` is written after the state file it names (atomically on a local folder; an
object-store put is atomic), and the file before it is deleted only then, so a job killed at any
point leaves a complete, verifiable state. ``key`` hashes every replica's stage fingerprint, so a
state is only ever resumed by the same configs on the same upstream and data. The state is read
back only through :func:`read_resume`, which checks the size and sha256 ``latest.json`` records.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cascade_ray.errors import CascadeError
from cascade_ray.storage import StorageDir
from cascade_ray.text import short_repr

RESUME_DIR = "resume"
LATEST = "latest.json"


@dataclass(frozen=True)
class ResumePoint:
    """A verified resume state: where it lies, after how many epochs, and its bytes."""

    folder: StorageDir
    epochs_done: int
    key: str
    blob: bytes

    def load(self) -> dict[str, Any]:
        """The state (tensors, numbers and strings only: ``torch.load(weights_only=True)``)."""
        return torch.load(io.BytesIO(self.blob), weights_only=True, map_location="cpu")


class ResumeWriter:
    """Rank 0's writer of a batched job's state after each epoch (:func:`save`)."""

    def __init__(self, folder: StorageDir, key: str):
        self.folder, self.key = folder, key
        self.previous: str | None = None
        if isinstance(folder, Path):
            folder.mkdir(parents=True, exist_ok=True)

    def save(self, epochs_done: int, replicas: list[dict[str, Any]]) -> None:
        buffer = io.BytesIO()
        torch.save({"epochs_done": epochs_done, "key": self.key, "replicas": replicas}, buffer)
        blob = buffer.getvalue()
        name = f"state-e{epochs_done:04d}.pt"
        (self.folder / name).write_bytes(blob)
        meta = {
            "epochs_done": epochs_done,
            "file": name,
            "bytes": len(blob),
            "sha256": hashlib.sha256(blob).hexdigest(),
            "key": self.key,
            "replicas": len(replicas),
        }
        _replace(self.folder / LATEST, json.dumps(meta, indent=1).encode())
        if self.previous is not None and self.previous != name:
            (self.folder / self.previous).unlink(missing_ok=True)
        self.previous = name


def read_resume(folder: StorageDir) -> ResumePoint | None:
    """The newest state under `folder` (an attempt's ``resume/``), verified; None when it has none.

    Raises:
        CascadeError: ``latest.json`` or the state it names is damaged or missing (the message
            names the file and the fix).
    """
    latest = folder / LATEST
    if not latest.exists():
        return None
    fix = "rerun without --resume to train the sweep's configs from the start"
    try:
        meta = json.loads(latest.read_text())
        name, size, digest = meta["file"], int(meta["bytes"]), str(meta["sha256"])
        epochs, key = int(meta["epochs_done"]), str(meta["key"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CascadeError(f"{latest}: the batched sweep's resume record is damaged ({exc}); {fix}") from None
    state = folder / name
    if "/" in name or not state.exists():
        raise CascadeError(f"{latest} names the resume state {short_repr(name)}, which is not in {folder}; {fix}")
    blob = state.read_bytes()
    if len(blob) != size or hashlib.sha256(blob).hexdigest() != digest:
        raise CascadeError(
            f"{state}: the resume state is damaged ({len(blob)} bytes, sha256 {hashlib.sha256(blob).hexdigest()[:12]}; "
            f"{LATEST} recorded {size} bytes, sha256 {digest[:12]}); {fix}"
        )
    return ResumePoint(folder, epochs, key, blob)


def _replace(path: StorageDir, data: bytes) -> None:
    """Write `path` whole or not at all: a local file through a rename; an object-store put is atomic."""
    if not isinstance(path, Path):
        path.write_bytes(data)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
