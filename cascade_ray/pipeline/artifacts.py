"""Durable stage artifacts: ``weights.safetensors`` + ``manifest.json``, written atomically.

An artifact holds the composed state of every stage up to and including its own
(upstream weights are copied bit-for-bit, so any artifact alone rebuilds the model it
was evaluated as). The manifest records the file's sha256 and per-tensor digests, and
loading verifies both.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cascade_ray import __version__
from cascade_ray.errors import ArtifactError
from cascade_ray.stage.weights import NumpyState, load_safetensors, save_safetensors, state_digests

WEIGHTS = "weights.safetensors"
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Artifact:
    """A stage artifact on disk."""

    path: Path
    manifest: dict[str, Any]

    @property
    def weights_path(self) -> Path:
        return self.path / WEIGHTS


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_artifact(directory: str | Path, state: NumpyState, manifest: dict[str, Any]) -> Artifact:
    """Write weights and manifest to a temp folder, then rename it into place."""
    final = Path(directory)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_safetensors(state, tmp / WEIGHTS)
    full = {
        **manifest,
        "cascade_ray_version": __version__,
        "weights_sha256": file_sha256(tmp / WEIGHTS),
        "tensor_digests": state_digests(state),
    }
    (tmp / MANIFEST).write_text(json.dumps(full, indent=2, sort_keys=True))
    if final.exists():
        # keep the previous artifact until the new one is complete, then swap
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    return Artifact(final, full)


def read_artifact(directory: str | Path) -> tuple[Artifact, NumpyState]:
    """Load and verify an artifact (file hash and every tensor digest)."""
    path = Path(directory)
    retrain = "delete the folder and rerun the pipeline to retrain this stage"
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"artifact {path}: unreadable {MANIFEST} ({exc}); {retrain}") from None
    weights = path / WEIGHTS
    if not weights.is_file() or file_sha256(weights) != manifest.get("weights_sha256"):
        raise ArtifactError(f"artifact {path}: {WEIGHTS} is missing or does not match its sha256 in {MANIFEST}; {retrain}")
    state = load_safetensors(weights)
    if state_digests(state) != manifest.get("tensor_digests"):
        raise ArtifactError(f"artifact {path}: tensor digests differ from {MANIFEST}; {retrain}")
    return Artifact(path, manifest), state


def frozen_changes(before: NumpyState, after: NumpyState) -> list[str]:
    """Keys of `before` whose tensors differ (bitwise) or are absent in `after`."""
    return sorted(k for k, v in before.items() if k not in after or v.dtype != after[k].dtype or not np.array_equal(v, after[k]))
