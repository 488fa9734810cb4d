"""Can this process reach the storage and the data a config names? A small probe, before Ray.

- ``storage_path``: a probe object is written under ``{storage_path}/{name}/``, read back and
  deleted (object stores, ``file://``); a local path needs its nearest existing folder to be
  writable (nothing is created).
- ``data.path`` / ``data.test_path`` (Parquet data): the file, folder/prefix or glob must match
  at least one ``*.parquet`` file whose footer reads.

Each failure is a :class:`~cascade_ray.errors.ConfigIssue` naming the key, the URI without
credentials and what to set (endpoint, credentials env). ``cascade-ray validate`` and every run
call :func:`reach_issues` before any Ray resource starts.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pyarrow.parquet as pq

from cascade_ray.config.schema import PipelineConfig
from cascade_ray.errors import ConfigError, ConfigIssue
from cascade_ray.storage import STORAGE_ACCESS_FIX, StorageDir, UriPath, as_storage, local_path, redact, resolve_files
from cascade_ray.text import short_repr

PROBE_PREFIX = ".cascade-probe-"


def reach_issues(cfg: PipelineConfig) -> list[ConfigIssue]:
    """Every storage or data location of `cfg` this process cannot use, as issues."""
    issues = _storage_issues(cfg)
    if cfg.data.source == "parquet":
        for key, spec in (("data.path", cfg.data.path), ("data.test_path", cfg.data.test_path)):
            if spec is not None:
                issues += _data_issues(key, spec)
    return issues


def check_reach(cfg: PipelineConfig) -> None:
    """:func:`reach_issues`, raised as one :class:`ConfigError`."""
    issues = reach_issues(cfg)
    if issues:
        raise ConfigError(issues, source=cfg.name)


def _storage_issues(cfg: PipelineConfig) -> list[ConfigIssue]:
    try:
        run = as_storage(cfg.storage_path) / cfg.name
    except ConfigError as exc:
        return list(exc.issues)
    return storage_issues(run)


def storage_issues(run: StorageDir) -> list[ConfigIssue]:
    """Whether this process can write under `run` (a local folder: may it be created; a URI: a
    probe object written, read back and deleted)."""
    local = local_path(run)
    if isinstance(run, Path) and local is not None:
        existing = next((p for p in (local, *local.parents) if p.exists()), Path("/"))
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            return [
                ConfigIssue(
                    "storage_path",
                    f"{local} cannot be created: {existing} is {'not a folder' if not existing.is_dir() else 'not writable'}",
                    "point storage_path at a folder you can write (or a URI: s3://bucket/prefix)",
                )
            ]
        return []
    probe = run / f"{PROBE_PREFIX}{uuid.uuid4().hex[:12]}"
    try:
        probe.write_bytes(b"cascade-ray storage probe\n")
        ok = probe.read_bytes() == b"cascade-ray storage probe\n"
        probe.unlink(missing_ok=True)
    except Exception as exc:  # noqa: BLE001 - any failure is reported with the key and the fix
        return [ConfigIssue("storage_path", f"cannot write to {run}: {_reason(exc)}", STORAGE_ACCESS_FIX)]
    if not ok:
        return [ConfigIssue("storage_path", f"{run}: a probe object read back different bytes", STORAGE_ACCESS_FIX)]
    return []


def _data_issues(key: str, spec: str) -> list[ConfigIssue]:
    shown = redact(spec)
    try:
        files = resolve_files(spec)
        if not files:
            return [
                ConfigIssue(
                    key,
                    f"no parquet file matches {short_repr(shown)}",
                    "point it at a .parquet file, a folder (or object-store prefix) of *.parquet files, or a glob",
                )
            ]
        first = files[0]
        if isinstance(first, UriPath):
            pq.read_schema(first.path, filesystem=first.fs)
        else:
            pq.read_schema(first)
    except ConfigError as exc:
        return list(exc.issues)
    except Exception as exc:  # noqa: BLE001 - any failure is reported with the key and the fix
        return [ConfigIssue(key, f"cannot read {short_repr(shown)}: {_reason(exc)}", STORAGE_ACCESS_FIX)]
    return []


def _reason(exc: BaseException) -> str:
    """The error's own words, first line, credentials removed."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return redact(text)
