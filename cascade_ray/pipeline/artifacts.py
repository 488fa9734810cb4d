"""Durable stage artifacts: ``weights.safetensors`` + ``manifest.json``, written atomically.

An artifact holds the composed state of every stage up to and including its own
(upstream weights are copied bit-for-bit, so any artifact alone rebuilds the model it
was evaluated as). The manifest records the file's sha256 and per-tensor digests, and
loading verifies both.

The folder is local (a :class:`~pathlib.Path`, written to a temp folder and renamed into
place) or on a ``pyarrow.fs`` filesystem (a :class:`~cascade_ray.storage.UriPath`: object
stores have no atomic rename, so the old manifest goes first and the new one is written
last; a reader sees no artifact or a complete one, and the sha256 check catches the rest).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cascade_ray import __version__
from cascade_ray.errors import ArtifactError
from cascade_ray.models.packed import read_packed_from
from cascade_ray.models.weights import NumpyState, load_safetensors_hashed, save_safetensors, state_digests
from cascade_ray.pipeline.records import Manifest, ManifestFields, manifest_text, read_manifest, seal_manifest
from cascade_ray.storage import (
    StorageDir,
    UriPath,
    file_sha256,
    local_copy,
    local_path,
    not_regular_reason,
    parse_uri,
)

# each read of a remote artifact's weights is one ranged GET: fewer, larger requests than on disk
REMOTE_READ_CHUNK_BYTES = 64 << 20
WEIGHTS = "weights.safetensors"
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Artifact:
    """A stage artifact on disk."""

    path: StorageDir
    manifest: Manifest

    @property
    def weights_path(self) -> StorageDir:
        return self.path / WEIGHTS


def as_storage_dir(directory: str | StorageDir) -> StorageDir:
    """A local path or URI string as a :class:`Path` or :class:`UriPath`."""
    if isinstance(directory, (Path, UriPath)):
        return directory
    return parse_uri(str(directory)) or Path(directory)


def _complete(fields: ManifestFields, weights: Path, state: NumpyState, known: Mapping[str, str]) -> Manifest:
    with ThreadPoolExecutor(1, thread_name_prefix="cascade-file-hash") as pool:  # the file hashed while the tensors are
        file_hash = pool.submit(file_sha256, weights)
        hashed = state_digests(state, [k for k in state if k not in known])
        sha = file_hash.result()
    digests = {k: hashed[k] if k in hashed else known[k] for k in sorted(state)}
    return seal_manifest(
        Manifest(
            **fields.model_dump(),
            cascade_ray_version=__version__,
            weights_sha256=sha,
            tensor_digests=digests,
            manifest_sha256="",
        )
    )


def write_artifact(
    directory: str | StorageDir, state: NumpyState, manifest: ManifestFields, *, known: Mapping[str, str] | None = None
) -> Artifact:
    """Write weights and manifest to a temp folder, then rename it into place (locally).

    `known`: digests the caller already took of these very arrays of `state` (a stage's frozen
    upstream, checked as the checkpoint was read); the manifest takes them instead of hashing
    those entries again. A wrong one makes an artifact that :func:`read_artifact` refuses.
    """
    final = as_storage_dir(directory)
    known = known or {}
    if isinstance(final, UriPath):
        return _write_uri(final, state, manifest, known)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_safetensors(state, tmp / WEIGHTS)
    full = _complete(manifest, tmp / WEIGHTS, state, known)
    (tmp / MANIFEST).write_text(manifest_text(full))
    if final.exists():
        # keep the previous artifact until the new one is complete, then swap
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    return Artifact(final, full)


def _write_uri(final: UriPath, state: NumpyState, manifest: ManifestFields, known: Mapping[str, str]) -> Artifact:
    """Manifest last: without a rename, a missing manifest is what marks an incomplete artifact."""
    with tempfile.TemporaryDirectory(prefix="cascade-ray-artifact-") as tmp:
        weights = Path(tmp) / WEIGHTS
        save_safetensors(state, weights)
        full = _complete(manifest, weights, state, known)
        (final / MANIFEST).unlink(missing_ok=True)
        with weights.open("rb") as src, (final / WEIGHTS).open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    (final / MANIFEST).write_text(manifest_text(full))
    return Artifact(final, full)


def read_artifact(directory: str | StorageDir) -> tuple[Artifact, NumpyState]:
    """Load and verify an artifact (file hash and every tensor digest)."""
    path = as_storage_dir(directory)
    retrain = "delete the folder and rerun the pipeline to retrain this stage"
    for name in (MANIFEST, WEIGHTS):  # a FIFO or device is refused before anything opens it
        reason = not_regular_reason(path / name)
        if reason is not None:
            raise ArtifactError(f"artifact {path}: {name} {reason}; {retrain}")
    manifest = read_manifest(path / MANIFEST)  # ArtifactError naming the file and key when malformed
    weights = path / WEIGHTS
    mismatch = f"artifact {path}: {WEIGHTS} does not match its sha256 in {MANIFEST}; {retrain}"
    try:
        state, sha = _load_weights(weights)
    except ValueError as exc:  # a file changed since it was written is that, whatever broke in it
        raise ArtifactError(
            mismatch
            if file_sha256(weights) != manifest.weights_sha256
            else f"artifact {path}: {WEIGHTS}: {exc}; {retrain}"
        ) from None
    if sha != manifest.weights_sha256:
        raise ArtifactError(mismatch)
    if state_digests(state) != manifest.tensor_digests:
        raise ArtifactError(f"artifact {path}: tensor digests differ from {MANIFEST}; {retrain}")
    bad = non_finite(state)
    if bad:
        raise ArtifactError(f"artifact {path}: {WEIGHTS} holds NaN/Inf in {', '.join(bad[:3])}; {retrain}")
    return Artifact(path, manifest), state


def _load_weights(weights: StorageDir) -> tuple[NumpyState, str]:
    """The state in `weights` and the sha256 of the bytes it was cut from, the file read once.

    On remote storage the object is read straight into the state's one block, hashed as it
    arrives: no local copy, no second pass. A file the block cannot view (not written by
    cascade-ray) is downloaded and read by safetensors.
    """
    if isinstance(weights, UriPath) and local_path(weights) is None:
        digest = hashlib.sha256()
        with weights.open_input_file() as f:
            state = read_packed_from(f, f.size(), weights, digest, chunk_bytes=REMOTE_READ_CHUNK_BYTES)
        if state is not None:
            return state, digest.hexdigest()
    with local_copy(weights) as local:
        return load_safetensors_hashed(local)


def non_finite(state: NumpyState) -> list[str]:
    """Keys of the floating-point tensors of `state` that hold a NaN or an infinity, sorted."""
    return sorted(
        k for k, v in state.items() if np.issubdtype(np.asarray(v).dtype, np.floating) and not np.isfinite(v).all()
    )


def frozen_changes(before: NumpyState, after: NumpyState) -> list[str]:
    """Keys of `before` whose tensors differ (bitwise) or are absent in `after`."""
    return sorted(
        k for k, v in before.items() if k not in after or v.dtype != after[k].dtype or not np.array_equal(v, after[k])
    )
