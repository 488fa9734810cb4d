"""The frozen-feature cache of streamed data: computed by Ray Data, stored as Parquet shards, streamed back.

With ``data.streaming`` the rows never sit in the driver, so the cache of stage `i` (same rule
and same key as :mod:`cascade_ray.pipeline.features`) is computed by ``map_batches`` over the
train and val streams with an actor pool of the frozen upstream (``stages[i].scaling.num_workers``
actors with the stage's per-worker resources: GPU actors on GPU stages, CPU otherwise). Each
actor loads the upstream weights once from the object store and maps a batch of raw inputs
to the stage's inputs (eval mode, no grad, fp32). The outputs go to
``{run}/cache/<stage>/<key>/{train,val}/*.parquet`` (column ``x`` flattened float32, the
target column unchanged) and ``_cache.json`` is written last: it names the key, the feature
shape, the rows per split and the sha256 of every shard (the row-order key is the shards'
names in order with their digests), and it is sealed by the sha256 of its own fields. A
folder without it (an interrupted computation) is computed; one whose counts, shard list or
shard bytes differ from it is damaged: recomputed with a warning naming it under ``auto``,
an :class:`~cascade_ray.errors.ArtifactError` naming it under ``on``. The stage's workers then stream those shards
(:meth:`StreamedCache.datasets`) and start at the stage's own adapter/module.

A stage after a cached stage computes its cache from that cache's shards (one module, not
the whole chain), as the in-memory cache does.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray
import torch

from cascade_ray.config.schema import PipelineConfig
from cascade_ray.errors import ArtifactError
from cascade_ray.logs import quiet_ray_data
from cascade_ray.pipeline.features import CACHE_DIR, CACHE_VERSION, EVAL_BATCH, SPLITS, cache_decision, cache_key
from cascade_ray.pipeline.records import FeatureCacheRecord
from cascade_ray.storage import StorageDir, UriPath, not_regular_reason, redact

META_FILE = "_cache.json"
FEATURES_COLUMN = "x"


@dataclass(frozen=True)
class StreamedCache:
    """Stage `stage`'s inputs for every streamed train/val row, as Parquet shards in storage.

    It stands in for :class:`~cascade_ray.pipeline.streaming.StreamedData` in the stage's fit
    (:meth:`datasets`, :meth:`loop_config`): the rows are its features, already normalized.
    """

    stage: str
    folder: StorageDir
    key: str
    shape: tuple[int, ...]
    rows: dict[str, int]
    target_column: str
    status: str
    seconds: float
    data: Any  # the StreamedData the features were computed from (target, output width, seed)

    def record(self) -> FeatureCacheRecord:
        return FeatureCacheRecord(
            status=self.status, shape=list(self.shape), path=str(self.folder), seconds=round(self.seconds, 2)
        )

    def datasets(self) -> dict[str, Any]:
        """Lazy Ray Datasets of the cached train and val features (train file order reshuffled per epoch)."""
        from ray.data import FileShuffleConfig

        out = {}
        for split in SPLITS:
            files, fs = _files(self.folder / split)
            shuffle = FileShuffleConfig(seed=self.data.seed, reseed_after_execution=True) if split == "train" else None
            out[split] = ray.data.read_parquet(files, filesystem=fs, shuffle=shuffle).select_columns(
                [FEATURES_COLUMN, self.target_column]
            )
        return out

    def loop_config(self) -> dict[str, Any]:
        """What the stage's workers build their stream sources from: the features, unnormalized."""
        return self.data.loop_config() | {
            "train_rows": self.rows["train"],
            "val_rows": self.rows["val"],
            "source_shape": list(self.shape),  # the rows are features; the model's plan keeps the data's shape
            "input_column": FEATURES_COLUMN,
            "mean": 0.0,
            "std": 1.0,
            "stats_shape": [],
            "input_stage": self.stage,
        }


def prepare_streamed_cache(
    cfg: PipelineConfig,
    index: int,
    *,
    out: StorageDir,
    stream: Any,
    in_shape: tuple[int, ...],
    upstream: Any,
    previous: StreamedCache | None,
    log: Callable[[str], None],
) -> StreamedCache | None:
    """Stage `index`'s cached inputs of streamed data, read from storage or computed; None when off.

    Args:
        cfg: the pipeline config.
        index: the stage about to train.
        out: the run folder.
        stream: the run's :class:`~cascade_ray.pipeline.streaming.StreamedData`.
        in_shape: one row's shape at stage `index`'s input (its shape plan).
        upstream: the previous stage's :class:`~cascade_ray.pipeline.stages.Handoff`.
        previous: the previous stage's streamed cache, when it trained on one.
        log: where the decision goes.
    """
    from cascade_ray.models.cascade import module_stage_names

    stage = cfg.stages[index]
    wanted, reason = cache_decision(cfg, index)
    if not wanted:
        if stage.freeze.cache_features == "auto":
            log(f"  {stage.name}: feature cache off: {reason}")
        return None
    names = module_stage_names(cfg, index - 1)
    key = cache_key(upstream.fingerprint, upstream.state, names, upstream.digests)
    folder = out / CACHE_DIR / stage.name / key[:16]
    t0 = time.perf_counter()
    rows = _stored_rows(folder, key, in_shape, log, stage.name, strict=stage.freeze.cache_features == "on")
    status = "read"
    if rows is None:
        start = previous.stage if previous is not None and previous.stage in names else None
        rows = _compute(cfg, index, stream, upstream.ref, folder, in_shape, previous if start else None, start)
        write_meta(folder, key, in_shape, rows)
        status = "computed"
    cache = StreamedCache(
        stage.name,
        folder,
        key,
        tuple(in_shape),
        rows,
        cfg.data.target.column,
        status,
        time.perf_counter() - t0,
        stream,
    )
    shape = "x".join(map(str, in_shape))
    log(
        f"  {stage.name}: feature cache {status} (streamed, Ray Data): upstream outputs {shape} for "
        f"{sum(rows.values())} rows in {cache.seconds:.1f} s ({folder})"
    )
    return cache


def _files(folder: StorageDir) -> tuple[list[str], Any]:
    """The Parquet shards of a cache split and their filesystem (None: local)."""
    files = sorted(f for f in folder.rglob("*.parquet"))
    if isinstance(folder, UriPath):
        return [f.path for f in files], folder.fs
    return [str(f) for f in files], None


def _shards(folder: StorageDir) -> dict[str, dict[str, str]]:
    """Split -> shard name (relative to the split's folder, sorted) -> sha256 of the shard's bytes."""
    from cascade_ray.pipeline.artifacts import file_sha256

    out: dict[str, dict[str, str]] = {}
    for split in SPLITS:
        base = folder / split
        files = sorted(base.rglob("*.parquet"), key=str) if base.exists() else []
        prefix = len(base.path if isinstance(base, UriPath) else str(base)) + 1
        out[split] = {}
        for f in files:
            reason = not_regular_reason(f)
            if reason is not None:  # a FIFO would block the hash
                raise ValueError(f"shard {redact(str(f))} {reason}")
            out[split][(f.path if isinstance(f, UriPath) else str(f))[prefix:]] = file_sha256(f)
    return out


def _seal(meta: dict[str, Any]) -> str:
    """sha256 of `meta`'s canonical JSON without its own ``sha256`` field."""
    fields = {k: v for k, v in meta.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_meta(folder: StorageDir, key: str, shape: tuple[int, ...], rows: dict[str, int]) -> None:
    """``_cache.json``, written last: key, shape, rows, every shard's sha256, sealed by its own digest."""
    meta = {"key": key, "shape": list(shape), "rows": rows, "version": CACHE_VERSION, "shards": _shards(folder)}
    (folder / META_FILE).write_text(json.dumps({**meta, "sha256": _seal(meta)}, sort_keys=True))


def _stored_rows(
    folder: StorageDir, key: str, shape: tuple[int, ...], log: Callable[[str], None], stage: str, *, strict: bool
) -> dict[str, int] | None:
    """Rows per split of a complete stored cache that matches `key`, its shape and its shards'
    digests; None to compute. A damaged cache is recomputed with a warning naming it, or with
    `strict` (``cache_features: on``) is an error naming it.

    Raises:
        ArtifactError: `strict` and the stored cache is damaged or does not match.
    """
    meta_file = folder / META_FILE
    if not meta_file.exists():
        return None
    try:
        return _checked_rows(folder, key, shape)
    except Exception as exc:  # noqa: BLE001 - a damaged cache is recomputed (it is a cache, never the source)
        where = redact(str(folder))
        if strict:
            raise ArtifactError(
                f"stored feature cache {where} of stage {stage!r} is damaged ({exc}); delete the folder to recompute "
                "it, or set freeze.cache_features: auto to recompute damaged caches with a warning"
            ) from None
        log(f"  WARNING: {stage}: stored feature cache {where} is damaged ({exc}); recomputing it")
        return None


def _checked_rows(folder: StorageDir, key: str, shape: tuple[int, ...]) -> dict[str, int]:
    """Rows per split of a stored cache; ValueError saying what does not match."""
    meta_file = folder / META_FILE
    reason = not_regular_reason(meta_file)
    if reason is not None:
        raise ValueError(f"{META_FILE} {reason}")
    meta = json.loads(meta_file.read_text())
    if not isinstance(meta, dict) or "sha256" not in meta:
        raise ValueError(f"{META_FILE} is not a JSON object with a sha256")
    if _seal(meta) != meta["sha256"]:
        raise ValueError(f"{META_FILE} does not match its sha256 (edited after it was written)")
    if meta.get("key") != key or meta.get("version") != CACHE_VERSION:
        raise ValueError("its key does not match the upstream")
    if [int(d) for d in meta["shape"]] != list(shape):
        raise ValueError(f"its features are {meta['shape']}, the stage takes {list(shape)}")
    held = _shards(folder)
    for split in SPLITS:
        if list(held[split]) != list(meta["shards"][split]):
            raise ValueError(f"its {split} shards differ from those {META_FILE} lists (missing, added or renamed)")
        changed = [name for name, digest in held[split].items() if meta["shards"][split][name] != digest]
        if changed:
            shard = redact(str(folder / split / changed[0]))
            raise ValueError(f"{split} shard {shard} does not match its sha256 in {META_FILE}")
        files, fs = _files(folder / split)
        rows = sum(pq.ParquetFile(fs.open_input_file(f) if fs else f).metadata.num_rows for f in files)
        if rows != int(meta["rows"][split]):
            raise ValueError(f"{split} holds {rows} rows, its {META_FILE} says {meta['rows'][split]}")
    return {s: int(meta["rows"][s]) for s in SPLITS}


def _clear(folder: StorageDir) -> None:
    """Remove the shards of an earlier, incomplete computation (new shards get new names)."""
    for split in SPLITS:
        for f in list((folder / split).rglob("*.parquet")) if (folder / split).exists() else []:
            f.unlink(missing_ok=True)


def _compute(
    cfg: PipelineConfig,
    index: int,
    stream: Any,
    upstream_ref: ray.ObjectRef,
    folder: StorageDir,
    in_shape: tuple[int, ...],
    previous: StreamedCache | None,
    start: str | None,
) -> dict[str, int]:
    """Map each split through the frozen upstream with an actor pool; write the shards; rows per split."""
    from ray.data import ActorPoolStrategy

    from cascade_ray.pipeline.fit import worker_resources

    stage = cfg.stages[index]
    resources = worker_resources(stage)
    quiet_ray_data()  # the driver runs this dataset (the write)
    _clear(folder)
    source = previous.datasets() if previous is not None else stream.datasets()
    if previous is not None:
        spec = {"column": FEATURES_COLUMN, "shape": list(previous.shape), "mean": 0.0, "std": 1.0}
    else:
        spec = {
            "column": cfg.data.inputs.column,
            "shape": list(stream.input_shape),
            "mean": np.asarray(stream.mean).tolist(),
            "std": np.asarray(stream.std).tolist(),
        }
    kwargs = {
        "raw": cfg.model_dump(mode="json"),
        "index": index,
        "upstream_ref": [upstream_ref],
        "start": start,
        "spec": spec,
        "info": stream.loop_config(),
        "target_column": cfg.data.target.column,
    }
    rows = {}
    for split in SPLITS:
        mapped = source[split].map_batches(
            UpstreamFeatures,
            fn_constructor_kwargs=kwargs,
            batch_size=EVAL_BATCH,
            batch_format="pyarrow",
            compute=ActorPoolStrategy(size=max(1, stage.scaling.num_workers)),
            num_cpus=resources.get("CPU", 1.0),
            num_gpus=resources.get("GPU", 0.0),
        )
        target = folder / split
        if isinstance(target, UriPath):
            mapped.write_parquet(target.path, filesystem=target.fs)
        else:
            mapped.write_parquet(str(target))
        files, fs = _files(target)
        rows[split] = sum(pq.ParquetFile(fs.open_input_file(f) if fs else f).metadata.num_rows for f in files)
    return rows


class UpstreamFeatures:
    """Ray Data actor: the frozen stages before `index` (from `start` on) applied to a batch.

    Built once per actor: the config re-validated, the upstream weights read from the object
    store once, the model in eval mode on the actor's device (a GPU when it was given one).
    """

    def __init__(
        self,
        raw: dict[str, Any],
        index: int,
        upstream_ref: list,
        start: str | None,
        spec: dict[str, Any],
        info: dict[str, Any],
        target_column: str,
    ):
        from cascade_ray.checks import validate_config
        from cascade_ray.models.cascade import build_cascade
        from cascade_ray.models.plan import require_plans
        from cascade_ray.models.weights import load_numpy_state

        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0)
        torch.set_num_threads(max(1, int(cpus)))
        cfg = validate_config(raw, source="streamed feature cache", preflight=False)
        self.device = torch.device("cuda") if torch.cuda.is_available() and ray.get_gpu_ids() else torch.device("cpu")
        plans = require_plans(cfg, tuple(info["input_shape"]), int(info["out_width"]))
        model = build_cascade(cfg, plans, int(info["out_width"]), upto=index - 1)
        state = ray.get(upstream_ref[0])
        load_numpy_state(model, {k: v for k, v in state.items() if k in model.state_dict()})
        self.model = model.to(self.device).eval()
        self.names = model.order[model.order.index(start) :] if start is not None else model.order
        self.column, self.shape = spec["column"], tuple(spec["shape"])
        self.mean = torch.as_tensor(np.asarray(spec["mean"], dtype=np.float32).reshape(_stats_shape(spec, self.shape)))
        self.std = torch.as_tensor(np.asarray(spec["std"], dtype=np.float32).reshape(_stats_shape(spec, self.shape)))
        self.target_column = target_column

    @torch.no_grad()
    def __call__(self, table: pa.Table) -> pa.Table:
        from cascade_ray.data.stream import input_array

        def where(row: int) -> str:
            return f"feature cache input, row {row} of a streamed batch"

        x = torch.from_numpy(input_array(table[self.column], self.shape, self.column, where).astype(np.float32))
        x = ((x - self.mean) / self.std).to(self.device)
        for name in self.names:
            x = self.model.run_block(name, x)
        flat = x.float().cpu().numpy().reshape(len(table), -1)
        features = pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), math.prod(flat.shape[1:]))
        return pa.table({FEATURES_COLUMN: features, self.target_column: table[self.target_column]})


def _stats_shape(spec: dict[str, Any], shape: tuple[int, ...]) -> tuple[int, ...]:
    """How the spec's statistics broadcast to one row (a scalar for cached features)."""
    from cascade_ray.data.splits import stats_shape

    return () if np.ndim(spec["mean"]) == 0 else stats_shape(shape)
