"""Batch prediction on the cluster: a finished run's cascade over Parquet rows, with Ray Data.

cascade-ray predict ~/cascade-ray-runs/debug --data new.parquet --out predictions/
cascade-ray predict s3://bucket/runs/debug --data s3://bucket/new/ --out s3://bucket/predictions/debug

from cascade_ray.api import predict
report = predict("s3://bucket/runs/debug", "s3://bucket/new/", "s3://bucket/predictions/debug")

Before Ray starts, the driver loads the cascade once (:func:`load_cascade`: weights verified
against the manifest) and checks the input column of every file's footer against the run's
input spec (:func:`input_issue`). Ray Data then streams the rows through ``map_batches``
with an actor pool of :class:`CascadePredictor`: one work unit per input row group, which
the actor reads, predicts and writes as ``{out}/part-<first row, 12 digits>.parquet``. The
output folder's file names sort in the input's row order (``pq.read_table(out)`` and
``ray.data.read_parquet(out)`` read it back in that order). Ray Data's own ``preserve_order``
was tried first (``read_parquet`` -> ``map_batches`` -> ``write_parquet``) and did not hold:
in Ray 2.60 a batch of an actor pool now and then came out after later ones.

The weights reach the actors through the object store: the driver puts the numpy state once
and every actor rebuilds the cascade from the run's config and that state. The alternative,
each actor calling ``load_cascade`` on the run URI, would download and hash-check the
artifact once per actor (N object-store GETs for N actors) and need the run's storage
credentials on every worker; through the object store the state is read and verified once,
and actors on one node share one copy of it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import shutil
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray
import torch

from cascade_ray.data.parquet import LIST_TYPES, SHAPE_METADATA_KEY, _resolve_files
from cascade_ray.errors import CascadeError, innermost
from cascade_ray.logs import quiet_ray_data
from cascade_ray.models.weights import to_numpy_state
from cascade_ray.pipeline.driver import init_ray
from cascade_ray.storage import StorageDir, UriPath, as_storage, full_uri, redact, write_table
from cascade_ray.text import did_you_mean
from cascade_ray.tools.inference import (
    PREDICT_BATCH_ROWS,
    InputError,
    InputScaleWarning,
    InputSpec,
    assemble_cascade,
    load_cascade,
    usable_config,
)

OUTPUT_COLUMNS = ("prediction", "probabilities")


def input_issue(
    schema: pa.Schema, column: str, spec: InputSpec, *, row_values: int | None = None, flag: str = "--input-column"
) -> str | None:
    """Why the `column` of a Parquet `schema` cannot feed a model of `spec`, or None when it can.

    A row fits when it holds ``prod(spec.input_shape)`` numbers and, when the file stores a
    multi-dimensional per-row shape (``arrow.fixed_shape_tensor``, or the
    ``cascade_ray.image_shape`` metadata of :func:`~cascade_ray.data.parquet.write_parquet`),
    that shape is the run's: an (8, 8, 1) image holds the values of a (1, 8, 8) one in another
    layout, so it is refused, not reshaped. A flat row of the right length is accepted.
    `row_values` is the length of a variable-length list column's rows (read from its data).
    """
    want, size = tuple(spec.input_shape), math.prod(spec.input_shape)
    takes = f"the run takes {want} ({size} values per row)"
    if column not in schema.names:
        names = [n for n in schema.names if not n.startswith("__")]
        return (
            f"no input column {column!r}{did_you_mean(column, names)} (columns: {', '.join(names)}); "
            f"pass {flag} naming the column that holds each row's input"
        )
    kind = schema.field(column).type
    stored: tuple[int, ...] | None = None
    if isinstance(kind, pa.BaseExtensionType):  # arrow.fixed_shape_tensor, Ray's tensor type
        shape = getattr(kind, "shape", None)
        stored = tuple(int(d) for d in shape) if shape is not None and None not in shape else None
        kind = kind.storage_type
    else:
        meta = (schema.metadata or {}).get(SHAPE_METADATA_KEY)
        try:
            stored = tuple(int(d) for d in json.loads(meta)) if meta else None
        except (ValueError, TypeError):
            return f"schema metadata {SHAPE_METADATA_KEY.decode()} is {meta[:80]!r}, not a list of ints"
    if not any(is_list(kind) for is_list in LIST_TYPES):
        return f"input column {column!r} is {kind}; expected a list of numbers or a tensor per row ({takes})"
    if not (pa.types.is_integer(kind.value_type) or pa.types.is_floating(kind.value_type)):
        return f"input column {column!r} holds {kind.value_type} values; expected numbers"
    found = kind.list_size if pa.types.is_fixed_size_list(kind) else row_values
    if stored is not None and found is None:
        found = math.prod(stored)
    if found is not None and found != size:
        held = f"{stored} ({found} values)" if stored else f"{found} values"
        return f"input column {column!r} rows hold {held}; {takes}: predict with the data the run was trained on"
    if stored is not None and len(stored) > 1 and stored != want:
        return (
            f"input column {column!r} rows are shaped {stored}; {takes}: the same number of values in "
            f"another layout; write the rows as {want} (or flat) so they are not silently misread"
        )
    return None


def default_actors(resources: Mapping[str, float]) -> tuple[int, float]:
    """(actors, GPUs per actor) for a cluster's resources: one actor per GPU when it has GPUs, else
    one per CPU (the actors read and write their row groups themselves: no Ray Data task needs a CPU)."""
    gpus = int(resources.get("GPU", 0))
    if gpus:
        return gpus, 1.0
    return max(1, int(resources.get("CPU", 1))), 0.0


@dataclass(frozen=True)
class PredictReport:
    """What a batch prediction did; ``seconds`` / ``rows_per_s`` time the Ray Data run (read,
    predict, write), ``total_s`` everything from loading the run to the last file."""

    rows: int
    seconds: float
    rows_per_s: float
    total_s: float
    actors: int
    gpus_per_actor: float
    files: int
    columns: list[str]
    output: str
    warning: str | None = None  # the first row group's inputs look rescaled (InputSpec.scale_warning)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


# predict's rows must fit the run: the config's data.inputs.shape is not predict's to change
ROWS_FIX = "write every row with the run's input shape (flat, or in that shape)"


class CascadePredictor:
    """Ray Data actor: the run's cascade, rebuilt once from its re-validated config and the
    numpy state in the object store (on the actor's GPU when Ray gave it one), applied to
    work units (one input row group each): read the rows, predict in batches of
    `batch_rows`, write ``part-<first row>.parquet``. The file names carry the row order, so
    it holds whatever order the units finish in."""

    def __init__(
        self,
        raw: dict[str, Any],
        stage: str,
        spec: InputSpec,
        state_ref: list,
        run: str,
        column: str,
        keep: list[str],
        fs: Any,
        out: StorageDir,
        batch_rows: int,
    ):
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0)
        torch.set_num_threads(max(1, int(cpus)))  # N actors x all cores would oversubscribe them
        cfg = usable_config(raw, f"{run}/config.yaml")  # re-checked here, at the process boundary
        device = "cuda" if ray.get_gpu_ids() and torch.cuda.is_available() else "cpu"
        self.cascade = assemble_cascade(cfg, stage, spec, ray.get(state_ref[0]), as_storage(run)).to(device)
        self.column, self.keep, self.fs, self.out, self.batch_rows = column, keep, fs, out, batch_rows

    def __call__(self, units: pa.Table) -> pa.Table:
        names, rows = [], []
        for file, group, first in zip(*(units[k].to_pylist() for k in ("file", "row_group", "start")), strict=True):
            source = pq.ParquetFile(self.fs.open_input_file(file) if self.fs else file)
            table = source.read_row_group(group, columns=[self.column, *self.keep])
            name = f"part-{first:012d}.parquet"
            write_table(self.predict(table, f"{redact(file)} row group {group}"), self.out / name)
            names.append(name)
            rows.append(table.num_rows)
        return pa.table({"file": names, "rows": rows})

    def predict(self, table: pa.Table, at: str) -> pa.Table:
        from cascade_ray.data.stream import input_array

        col = table[self.column].combine_chunks()
        if isinstance(col.type, pa.BaseExtensionType) and not isinstance(col.type, pa.FixedShapeTensorType):
            col = col.storage  # Ray's tensor type: a list of the flat values

        def where(row: int) -> str:
            return f"--data: {at}, row {row}, input column {self.column!r}"

        x = input_array(col, self.cascade.spec.input_shape, self.column, where, ROWS_FIX)
        with warnings.catch_warnings():  # the driver looked at the first row group and says it once
            warnings.simplefilter("ignore", InputScaleWarning)
            out = self.cascade.predict(x, batch_rows=self.batch_rows)
        return pa.table({**{k: table[k] for k in self.keep}, **{k: _arrow(v) for k, v in out.items()}})


def work_units(files: Sequence[str], footers: Sequence[pq.FileMetaData]) -> list[dict[str, Any]]:
    """One ``{file, row_group, start}`` per non-empty row group, `start` its first row over all files."""
    units, start = [], 0
    for file, meta in zip(files, footers, strict=True):
        for group in range(meta.num_row_groups):
            n = meta.row_group(group).num_rows
            if n:
                units.append({"file": file, "row_group": group, "start": start})
            start += n
    return units


def _arrow(values: np.ndarray) -> pa.Array:
    """A prediction column: (N,) values as they are, (N, K) as a fixed-size list of K."""
    if values.ndim == 1:
        return pa.array(values)
    return pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(values).reshape(-1)), values.shape[1])


def _prepare_out(out: StorageDir, files: Sequence[str], overwrite: bool) -> None:
    """Refuse an `out` that holds anything (unless `overwrite` and it holds only Parquet files: an
    earlier prediction, removed here), or one that holds the input files."""
    if not out.exists():
        return
    if out.is_file():
        raise CascadeError(f"--out: {out} is a file; predictions are a folder of Parquet files: name a folder")
    if isinstance(out, UriPath):
        inside, root, held = [p.path for p in out.rglob("*")], out.path, list(files)
    else:
        inside = [str(p) for p in out.rglob("*") if p.is_file()]
        root, held = os.path.abspath(out), [os.path.abspath(f) for f in files]
    if not inside:
        return
    if any(f.startswith(root.rstrip("/") + "/") for f in held):
        raise CascadeError(f"--out: {out} holds the input files of --data; write the predictions somewhere else")
    if not overwrite:
        raise CascadeError(f"--out: {out} is not empty ({len(inside)} files); pass --overwrite to replace them")
    if any(not f.endswith(".parquet") for f in inside):
        raise CascadeError(
            f"--out: {out} holds files that are not Parquet; --overwrite only replaces an earlier prediction's "
            "folder: name a new or empty folder"
        )
    if isinstance(out, UriPath):
        out.fs.delete_dir_contents(out.path)
    else:
        shutil.rmtree(out)


def _footers(files: Sequence[str], fs: Any) -> list[pq.FileMetaData]:
    return [pq.ParquetFile(fs.open_input_file(f) if fs else f).metadata for f in files]


def _row_values(files: Sequence[str], fs: Any, column: str) -> int | None:
    """The length of the first row of a variable-length list column (None when the files hold no row)."""
    for f in files:
        reader = pq.ParquetFile(fs.open_input_file(f) if fs else f)
        if reader.metadata.num_rows:
            col = reader.read_row_group(0, columns=[column])[column].combine_chunks()
            if isinstance(col.type, pa.BaseExtensionType):
                col = col.storage
            return len(col[0].values)
    return None


def check_data(
    files: Sequence[str], fs: Any, column: str, spec: InputSpec, keep: Sequence[str], where: str
) -> list[pq.FileMetaData]:
    """Every file's footer checked against the run's spec and the kept columns; the footers.

    Raises:
        InputError: naming the file, the column, what it holds and what the run takes.
    """
    footers = _footers(files, fs)
    for file, meta in zip(files, footers, strict=True):
        schema = meta.schema.to_arrow_schema()
        at = f"--data={where}: {redact(file)}"
        kind = schema.field(column).type if column in schema.names else None
        variable = kind is not None and (pa.types.is_list(kind) or pa.types.is_large_list(kind))
        issue = input_issue(schema, column, spec, row_values=_row_values([file], fs, column) if variable else None)
        if issue:
            raise InputError(f"{at}: {issue}")
        for name in keep:
            if name not in schema.names:
                raise InputError(f"{at}: no column {name!r} to keep{did_you_mean(name, schema.names)}")
            if name in OUTPUT_COLUMNS:
                raise InputError(f"{at}: a kept column may not be named {name!r} (an output column)")
    return footers


def _first_rows_warning(
    files: Sequence[str], fs: Any, footers: Sequence[pq.FileMetaData], column: str, spec: InputSpec
) -> str | None:
    """:meth:`InputSpec.scale_warning` of the first non-empty row group (at most its first 1024 rows), read
    here before any actor starts; None when they look like the training data."""
    from cascade_ray.data.stream import input_array

    for file, meta in zip(files, footers, strict=True):
        for group in range(meta.num_row_groups):
            if meta.row_group(group).num_rows:
                source = pq.ParquetFile(fs.open_input_file(file) if fs else file)
                col = source.read_row_group(group, columns=[column])[column].combine_chunks()[:1024]
                if isinstance(col.type, pa.BaseExtensionType) and not isinstance(col.type, pa.FixedShapeTensorType):
                    col = col.storage

                def at(row: int, file: str = file, group: int = group) -> str:  # as an actor names a row
                    return f"--data: {redact(file)} row group {group}, row {row}, input column {column!r}"

                # a copy: Arrow's arrays are read-only, which torch.from_numpy warns about (<= 1024 rows)
                x = torch.from_numpy(
                    np.array(input_array(col, spec.input_shape, column, at, ROWS_FIX), dtype=np.float32)
                )
                note = spec.scale_warning(x)
                return f"--data: {redact(file)} row group {group}: {note}" if note else None
    return None


def predict_file(
    run: str | StorageDir,
    data: str | StorageDir,
    out: str | StorageDir,
    *,
    input_column: str | None = None,
    batch_rows: int = PREDICT_BATCH_ROWS,
    actors: int | None = None,
    keep_columns: Sequence[str] = (),
    overwrite: bool = False,
    address: str | None = None,
    stage: str | None = None,
    log_level: str = "warning",
    trust: Sequence[str] = (),
    trust_run: bool = True,
) -> PredictReport:
    """Predict every row of Parquet `data` with the run's cascade; write Parquet to the folder `out`.

    Args:
        run: the finished run ``{storage_path}/{name}`` (or a stage artifact), local or a URI.
        data: a Parquet file, folder / prefix or glob, local or ``s3://`` / ``gs://``.
        out: the output folder (local or a URI): one ``part-<first row>.parquet`` per input
            row group, names sorting in row order; it must not exist or be empty.
        input_column: the column of each row's input (default: the run's ``data.inputs.column``).
        batch_rows: rows per ``map_batches`` batch (and per forward pass).
        actors: predictor actors (default :func:`default_actors` of the cluster: one per GPU, else per CPU).
        keep_columns: input columns copied to the output (an id, say).
        overwrite: replace the Parquet files of an earlier prediction in `out`.
        address: the Ray cluster (default ``RAY_ADDRESS``, else an embedded Ray).
        stage: the stage whose head predicts (default the run's last).
        log_level: as ``--log-level`` of ``cascade-ray run``.
        trust, trust_run: as :func:`load_cascade` (``--trust``, ``--untrusted-run``); the
            actors get the config with the trusted list this settles.

    Returns:
        The :class:`PredictReport`. The output holds, in the input's row order, the kept
        columns, ``prediction`` and, for class / multilabel runs, ``probabilities``
        (a fixed-size list of float32).

    Raises:
        InputError: the input column is missing, or its rows do not fit the run (before Ray starts).
        CascadeError: not a finished run, or `out` holds files (and no `overwrite`).
    """
    t0 = time.perf_counter()
    if batch_rows < 1:
        raise CascadeError(f"--batch-rows: {batch_rows}; give a positive number of rows")
    if actors is not None and actors < 1:
        raise CascadeError(f"--actors: {actors}; give at least 1 (or leave it out: one per GPU, else one per CPU)")
    cascade = load_cascade(run, stage=stage, trust=trust, trust_run=trust_run)
    column, keep = input_column or cascade.cfg.data.inputs.column, list(keep_columns)
    files, fs = _resolve_files(data, "--data")
    footers = check_data(files, fs, column, cascade.spec, keep, redact(str(data)))
    rows = sum(m.num_rows for m in footers)
    warning = _first_rows_warning(files, fs, footers, column, cascade.spec)
    target = as_storage(out, "--out")
    _prepare_out(target, files, overwrite)
    started = init_ray(address, log_level)
    try:
        quiet_ray_data()
        count, gpus = default_actors(ray.cluster_resources())
        count = actors or count
        kwargs = {
            "raw": cascade.cfg.model_dump(mode="json"),
            "stage": cascade.stage,
            "spec": cascade.spec,
            "state_ref": [ray.put(to_numpy_state(cascade.module.cascade.state_dict()))],
            "run": full_uri(cascade.run),
            "column": column,
            "keep": keep,
            "fs": fs,
            "out": target,
            "batch_rows": batch_rows,
        }
        t1 = time.perf_counter()
        # one unit per input row group, numbered by its first row: Ray Data's preserve_order did not
        # hold for an actor pool in Ray 2.60 (a batch now and then came out late), so the order is
        # carried by the output file names instead of the executor
        todo = work_units(files, footers)
        count = max(1, min(count, len(todo)))  # an actor per unit at most: one more would only wait (and warn)
        try:
            with _errors_as_raised(log_level):  # a dataset keeps the context it was made in
                units = ray.data.from_items(todo, override_num_blocks=max(1, len(todo)))  # a block per unit
                mapped = units.map_batches(
                    CascadePredictor,
                    fn_constructor_kwargs=kwargs,
                    batch_size=1,
                    batch_format="pyarrow",
                    compute=ray.data.ActorPoolStrategy(size=count),
                    num_cpus=1,
                    num_gpus=gpus,
                )
                written = mapped.take_all()
        except Exception as exc:  # noqa: BLE001 - one of ours from an actor is the useful message
            raise _ours(exc) or exc from None
        if sum(w["rows"] for w in written) != rows:
            raise CascadeError(f"--data: the files changed while predicting ({rows} rows in their footers)")
        seconds = time.perf_counter() - t1
    finally:
        if started:
            ray.shutdown()
    return PredictReport(
        rows=rows,
        seconds=round(seconds, 3),
        rows_per_s=round(rows / max(seconds, 1e-9), 1),
        total_s=round(time.perf_counter() - t0, 3),
        actors=count,
        gpus_per_actor=gpus,
        files=len(written),
        columns=[*keep, *(c for c in OUTPUT_COLUMNS if c == "prediction" or cascade.spec.target_kind != "regression")],
        output=str(target),
        warning=warning,
    )


# Ray Data 2.60 (_internal/util.py, _annotate_exception_with_retry_context): the note it appends to a UDF's error
_RETRY_NOTE = re.compile(r"\nFailed to [^\n]* after \d+/\d+ attempts \(total backoff")


class _RaisedAnyway(logging.Filter):
    """Drops Ray Data's ERROR records: while :func:`_errors_as_raised` holds, each is about the error that
    ends the prediction, which is raised to the caller anyway (for ours: Ray Data calls it an internal
    error and asks for a bug report). Its warnings (a pool that cannot be scheduled, an actor that died
    starting) still show."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR


@contextlib.contextmanager
def _errors_as_raised(log_level: str) -> Iterator[None]:
    """While the prediction runs: an actor's error (an ``InputError`` / ``DataError`` naming the file, row
    and fix) reaches the driver as itself, not as text inside Ray Data's ``UserCodeException`` (Ray Data's
    public ``DataContext.raise_original_map_exception``); Ray Data's own console log of the error (its
    stack, ~50 lines) is left out unless ``--log-level debug`` (its session log file keeps it)."""
    ctx = ray.data.DataContext.get_current()
    before = ctx.raise_original_map_exception
    ctx.raise_original_map_exception = True
    quiet = _RaisedAnyway()
    console = (
        [h for h in logging.getLogger("ray.data").handlers if not type(h).__name__.endswith("FileHandler")]
        if log_level != "debug"
        else []
    )
    for handler in console:
        handler.addFilter(quiet)
    try:
        yield
    finally:
        ctx.raise_original_map_exception = before
        for handler in console:
            handler.removeFilter(quiet)


def _ours(exc: BaseException) -> CascadeError | None:
    """A CascadeError raised in an actor, from the chain of Ray's wrappers: the innermost one
    (``RayTaskError(DataError)`` is a ``DataError`` too, with the actor's stack in its text)."""
    found = innermost(exc, lambda e: isinstance(e, CascadeError))
    if found is not None and found.args and isinstance(found.args[0], str):
        # Ray Data appends its retry advice ("Failed to apply UDF transform after 1/1 attempts ...") to
        # the message of an error a UDF raised: not ours to give for a bad row, which a retry repeats
        note = _RETRY_NOTE.search(found.args[0])
        if note is not None:
            found.args = (found.args[0][: note.start()], *found.args[1:])
    return found
