"""Can this process reach the storage and the data a config names? A small probe, before Ray.

- ``storage_path``: a probe object is written under ``{storage_path}/{name}/``, read back and
  deleted (object stores, ``file://``); a local path needs its nearest existing folder to be
  writable (nothing is created).
- ``data.path`` / ``data.test_path`` (Parquet data): the file, folder/prefix or glob must match
  at least one ``*.parquet`` file whose footer reads.

- ``loggers``: each configured tracker's package is installed; an ``http(s)`` MLflow tracking URI
  answers ``GET /health``; a local / ``file:`` one is a folder this process can create;
  W&B ``mode: online`` reaches its server (``WANDB_BASE_URL``, default api.wandb.ai) and has an
  API key. Nothing is imported for it (the probes are plain HTTP).

Each failure is a :class:`~cascade_ray.errors.ConfigIssue` naming the key, the URI without
credentials and what to set (endpoint, credentials env). ``cascade-ray validate`` and every run
call :func:`reach_issues` before any Ray resource starts.
"""

from __future__ import annotations

import importlib.util
import os
import urllib.parse
import uuid
from pathlib import Path

import pyarrow.parquet as pq

from cascade_ray.config.schema import PipelineConfig
from cascade_ray.constants import TRACKING_PROBE_TIMEOUT_S
from cascade_ray.errors import ConfigError, ConfigIssue
from cascade_ray.storage import STORAGE_ACCESS_FIX, StorageDir, UriPath, as_storage, local_path, redact, resolve_files
from cascade_ray.text import short_repr

PROBE_PREFIX = ".cascade-probe-"


def reach_issues(cfg: PipelineConfig) -> list[ConfigIssue]:
    """Every storage or data location of `cfg` this process cannot use, as issues."""
    issues = _storage_issues(cfg) + logger_issues(cfg)
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


_EXTRA = "pip install 'cascade-ray[{}]'"
WANDB_DEFAULT_BASE_URL = "https://api.wandb.ai"


def logger_issues(cfg: PipelineConfig) -> list[ConfigIssue]:
    """Every configured tracker this process cannot use: package missing, server unreachable."""
    loggers, issues = cfg.loggers, []
    for key, on, package, extra in (
        ("loggers.tensorboard", loggers.tensorboard, "tensorboard", "tensorboard"),
        ("loggers.mlflow", loggers.mlflow is not None, "mlflow", "mlflow"),
        ("loggers.wandb", loggers.wandb is not None, "wandb", "wandb"),
    ):
        if on and importlib.util.find_spec(package) is None:
            issues.append(
                ConfigIssue(key, f"the {package} package is not installed", f"{_EXTRA.format(extra)}, or remove {key}")
            )
    if loggers.mlflow is not None:
        issues += mlflow_issues(loggers.mlflow.tracking_uri)
    if loggers.wandb is not None and loggers.wandb.mode == "online":
        issues += wandb_issues()
    return issues


def mlflow_issues(uri: str) -> list[ConfigIssue]:
    """An ``http(s)`` tracking server answers ``/health``; a ``file:`` / local path can be created."""
    import urllib.error  # http.client and email: only when a tracker is configured
    import urllib.request

    key, shown = "loggers.mlflow.tracking_uri", redact(uri)
    scheme = urllib.parse.urlsplit(uri).scheme
    if scheme in ("http", "https"):
        health = uri.rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(health, timeout=TRACKING_PROBE_TIMEOUT_S) as reply:
                if reply.status == 200:
                    return []
                problem = f"answered HTTP {reply.status} on /health"
        except urllib.error.HTTPError as exc:
            problem = f"answered HTTP {exc.code} on /health"
        except (urllib.error.URLError, OSError) as exc:
            problem = f"cannot be reached ({_reason(getattr(exc, 'reason', exc))})"
        return [
            ConfigIssue(
                key,
                f"the MLflow server at {shown} {problem}",
                "start it (`mlflow server --host 127.0.0.1 --port 5000`) or point tracking_uri at a running one; "
                "a local database (sqlite:////abs/path/mlflow.db) needs no server",
            )
        ]
    local_fix = "use a local database (sqlite:////abs/path/mlflow.db) or a tracking server (http://host:5000)"
    if scheme in ("", "file"):
        if _file_store_refused():
            return [
                ConfigIssue(
                    key,
                    f"{shown} is a folder store, which the installed mlflow refuses (it is in maintenance mode)",
                    f"{local_fix}; or set MLFLOW_ALLOW_FILE_STORE=true on the driver and the workers",
                )
            ]
        path = Path(urllib.parse.urlsplit(uri).path if scheme else uri).expanduser()
    elif scheme == "sqlite":
        if not uri.startswith("sqlite:////"):  # sqlite:///rel/path is relative to each process's working dir
            return [ConfigIssue(key, f"{shown} is a relative path", "give it as sqlite:////abs/path/mlflow.db")]
        path = Path(uri.removeprefix("sqlite:///")).parent
    else:
        return []  # other stores (databricks, postgresql, ...) are MLflow's to check
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("/"))
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        return [ConfigIssue(key, f"{shown}: {existing} is not a writable folder", "point it at a folder you can write")]
    return []


def _file_store_refused() -> bool:
    """Whether the installed mlflow refuses folder stores unless MLFLOW_ALLOW_FILE_STORE is set
    (newer 3.x releases): read from its source, as importing mlflow takes seconds."""
    if os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() in ("true", "1"):
        return False
    spec = importlib.util.find_spec("mlflow")
    if spec is None or not spec.submodule_search_locations:
        return False
    env_vars = Path(next(iter(spec.submodule_search_locations))) / "environment_variables.py"
    try:
        return "MLFLOW_ALLOW_FILE_STORE" in env_vars.read_text()
    except OSError:
        return False


def wandb_issues() -> list[ConfigIssue]:
    """W&B online: its server answers and an API key is set (``WANDB_API_KEY`` or ``wandb login``)."""
    key, fix = (
        "loggers.wandb.mode",
        "set loggers.wandb.mode: offline (runs are written under {run}/wandb/; `wandb sync` uploads them later)",
    )
    base = os.environ.get("WANDB_BASE_URL", WANDB_DEFAULT_BASE_URL).rstrip("/")
    try:
        with urllib.request.urlopen(base + "/healthz", timeout=TRACKING_PROBE_TIMEOUT_S):
            pass
    except urllib.error.HTTPError:
        pass  # it answered: the server is there
    except (urllib.error.URLError, OSError) as exc:
        return [
            ConfigIssue(
                key,
                f"online, but the W&B server {base} cannot be reached ({_reason(getattr(exc, 'reason', exc))})",
                fix,
            )
        ]
    if not os.environ.get("WANDB_API_KEY") and not _netrc_has(urllib.parse.urlsplit(base).hostname or ""):
        return [
            ConfigIssue(
                key,
                f"online, but no W&B API key for {base} (WANDB_API_KEY unset, none in ~/.netrc)",
                f"run `wandb login` or set WANDB_API_KEY; or {fix.removeprefix('set ')}",
            )
        ]
    return []


def _netrc_has(host: str) -> bool:
    import netrc

    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False
