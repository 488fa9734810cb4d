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

import pyarrow as pa
import pyarrow.parquet as pq

from cascade_ray.config.schema import PipelineConfig
from cascade_ray.constants import TRACKING_PROBE_TIMEOUT_S
from cascade_ray.data.parquet import LIST_TYPES
from cascade_ray.errors import ConfigError, ConfigIssue
from cascade_ray.storage import STORAGE_ACCESS_FIX, StorageDir, UriPath, as_storage, local_path, redact, resolve_files
from cascade_ray.text import short_repr

PROBE_PREFIX = ".cascade-probe-"


def reach_issues(cfg: PipelineConfig) -> list[ConfigIssue]:
    """Every storage or data location of `cfg` this process cannot use, as issues."""
    issues = _storage_issues(cfg) + logger_issues(cfg)
    if cfg.data.source == "parquet":
        widths: dict[str, int] = {}
        for key, spec in (("data.path", cfg.data.path), ("data.test_path", cfg.data.test_path)):
            if spec is not None:
                found, schema = _data_issues(key, spec)
                where = f"{key} {short_repr(redact(spec))}"
                issues += found or (_schema_issues(where, schema, cfg) if schema is not None else [])
                width = _list_size(schema, cfg.data.inputs.column) if schema is not None and not found else None
                if width is not None:
                    widths[key] = width
        if len(set(widths.values())) > 1:
            issues.append(
                ConfigIssue(
                    "data.test_path",
                    f"its inputs hold {widths['data.test_path']} values per row, data.path's {widths['data.path']}",
                    "point both at data with the same features (the same column, the same layout)",
                )
            )
    return issues


def _list_size(schema: pa.Schema, column: str) -> int | None:
    """Values per row of a fixed-size list column (its type says), else None."""
    if column not in schema.names:
        return None
    kind = schema.field(column).type
    return kind.list_size if pa.types.is_fixed_size_list(kind) else None


def _schema_issues(key: str, schema: pa.Schema, cfg: PipelineConfig) -> list[ConfigIssue]:
    """What the first file's schema already says `run` would refuse (the columns, their types), with the key
    to change: the same checks the data load makes on every row, found by ``validate`` from the footer.
    `key` names the location (``data.path '/data/train.parquet'``)."""
    from cascade_ray.text import did_you_mean

    data, names = cfg.data, schema.names
    missing = [
        ConfigIssue(ckey, f"{key} has no column {col!r}{did_you_mean(col, names)} (columns: {', '.join(names)})")
        for ckey, col in (("data.inputs.column", data.inputs.column), ("data.target.column", data.target.column))
        if col not in names
    ]
    if missing:
        return missing
    issues = []
    inputs, target = schema.field(data.inputs.column).type, schema.field(data.target.column).type
    input_is_list = isinstance(inputs, pa.FixedShapeTensorType) or any(is_list(inputs) for is_list in LIST_TYPES)
    target_is_list = any(is_list(target) for is_list in LIST_TYPES)
    if not input_is_list:
        issues.append(
            ConfigIssue(
                "data.inputs.column",
                f"column {data.inputs.column!r} of {key} is {inputs}; the inputs are a list of numbers per row "
                "or an arrow.fixed_shape_tensor",
                "point data.inputs.column at the features column (cascade_ray.data.write_parquet writes one)",
            )
        )
    numeric = pa.types.is_integer(target) or pa.types.is_floating(target)
    kind = data.target.kind
    if kind == "class" and not numeric:
        issues.append(
            ConfigIssue(
                "data.target.kind" if target_is_list else "data.target.column",
                f"column {data.target.column!r} of {key} is {target}, but class targets are integer class indices",
                "set data.target.kind: multilabel or regression for a list per row"
                if target_is_list
                else "point data.target.column at the integer labels",
            )
        )
    elif kind == "multilabel" and not target_is_list:
        issues.append(
            ConfigIssue(
                "data.target.kind",
                f"column {data.target.column!r} of {key} is {target}, but multilabel targets are a list of 0/1 "
                "flags per row",
                "set data.target.kind: class for one integer label per row",
            )
        )
    elif kind == "regression" and not (numeric or target_is_list):
        issues.append(
            ConfigIssue(
                "data.target.column",
                f"column {data.target.column!r} of {key} is {target}, but regression targets are numbers or lists "
                "of numbers",
                "point data.target.column at the numeric targets",
            )
        )
    width = _list_size(schema, data.target.column)
    if kind == "multilabel" and width is not None and data.target.num_classes not in (None, width):
        issues.append(
            ConfigIssue(
                "data.target.num_classes",
                f"the targets of {key} hold {width} flags per row, but num_classes is {data.target.num_classes}",
                f"set data.target.num_classes: {width} (or leave it out to take it from the data)",
            )
        )
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


def _data_issues(key: str, spec: str) -> tuple[list[ConfigIssue], pa.Schema | None]:
    """Whether the files at `spec` can be found and read, and the first one's schema."""
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
            ], None
        first = files[0]
        if isinstance(first, UriPath):
            schema = pq.read_schema(first.path, filesystem=first.fs)
        else:
            schema = pq.read_schema(first)
    except ConfigError as exc:
        return list(exc.issues), None
    except Exception as exc:  # noqa: BLE001 - any failure is reported with the key and the fix
        return [ConfigIssue(key, f"cannot read {short_repr(shown)}: {_reason(exc)}", STORAGE_ACCESS_FIX)], None
    return [], schema


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
