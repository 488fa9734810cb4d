"""The frozen-feature cache: a stage trains on its frozen upstream's outputs, computed once.

When nothing upstream of stage `i` trains and its inputs are not augmented, the upstream
maps every training and validation sample to the same tensor in every epoch, every step
and every Tune trial. With ``stages[i].freeze.cache_features`` (``auto`` by default) the
driver computes those outputs once (in Ray tasks with the stage's own per-worker resources,
one task per worker, each on a contiguous shard; on a single-node CPU cluster in the
driver itself), puts them in the object
store once, writes them as Parquet under ``{storage_path}/{name}/cache/<stage>/`` and
hands the ref to the stage's workers (and to every trial of a sweep). The workers'
:class:`~cascade_ray.models.cascade.CascadeModel` then starts at the stage's own
adapter/module (``input_stage``); the frozen upstream weights stay in the model, so the
frozen digests and the artifact are exactly what they are without the cache.

The Parquet file is keyed by the upstream hand-off's fingerprint (every upstream config,
the data and the seed) and the digest of the upstream weights that compute the features,
so a retrained upstream never reads stale features. Its schema metadata also holds the
sha256 of the feature bytes (``cascade_ray.sha256``, :func:`features_digest`) and the row-order
key (``cascade_ray.rows``, :func:`rows_key`: the digest of the labels in the order the rows
follow); both are checked on read. A damaged file (truncated, edited, reordered, its digest
missing) is recomputed with a warning naming it under ``auto`` and is an
:class:`~cascade_ray.errors.ArtifactError` naming it under ``on``. When the previous stage itself
trained on cached features, the next cache is computed from those (one module instead of
the whole chain).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray
import torch

from cascade_ray.checks.semantic import cache_refusals
from cascade_ray.config.schema import PipelineConfig
from cascade_ray.errors import ArtifactError, ResourceError
from cascade_ray.pipeline.records import FeatureCacheRecord
from cascade_ray.storage import StorageDir, not_regular_reason, redact, write_table

CACHE_VERSION = 2  # 2: content digest and row-order key in the metadata
CACHE_DIR = "cache"
SPLITS = ("train", "val")
EVAL_BATCH = 512
OBJECT_STORE_SHARE = 0.5  # `auto` caches only features that fit in this share of the object store


@dataclass(frozen=True)
class FeatureCache:
    """Stage `stage`'s inputs for every train/val sample, in the object store.

    Attributes:
        stage: the stage these features feed (its adapter/module comes next).
        ref: object ref of ``{"x_train": float32 array, "x_val": float32 array}``.
        key: what the features depend on (upstream fingerprint, weights, format version).
        shape: one sample's feature shape.
        path: the Parquet copy in storage.
        status: ``computed`` or ``read`` (from the Parquet copy).
        seconds: wall time to compute or read.
        nodes: Ray node ids that computed them (one per task, or the driver's node); empty when read.
    """

    stage: str
    ref: ray.ObjectRef
    key: str
    shape: tuple[int, ...]
    path: StorageDir
    status: str
    seconds: float
    nodes: tuple[str, ...] = ()

    def record(self) -> FeatureCacheRecord:
        """The summary entry of this cache."""
        return FeatureCacheRecord(
            status=self.status,
            shape=list(self.shape),
            path=str(self.path),
            seconds=round(self.seconds, 2),
            nodes=list(self.nodes) or None,
        )


def cache_decision(cfg: PipelineConfig, index: int) -> tuple[bool, str]:
    """(cache wanted, why not) for stage `index` from its config alone (size is checked later)."""
    stage = cfg.stages[index]
    if stage.freeze.cache_features == "off":
        return False, f"stages[{index}].freeze.cache_features is off"
    refusals = cache_refusals(stage, index, f"stages[{index}]")
    if refusals:  # `on` with a refusal never validates; this is `auto`
        return False, refusals[0][0]
    return True, ""


def cache_key(
    upstream_fingerprint: str,
    upstream_state: Mapping[str, np.ndarray],
    module_names: list[str],
    known: Mapping[str, str] | None = None,
) -> str:
    """Hash of what the features are a function of: upstream configs/data/seed (its fingerprint)
    and the weights of the upstream modules and adapters. `known`: the upstream's tensor digests
    (``Handoff.digests``, its verified manifest's), taken instead of hashing those weights again."""
    from cascade_ray.models.weights import state_digests

    keys = [k for k in upstream_state if k.split(".")[0] in ("blocks", "adapters") and k.split(".")[1] in module_names]
    known = known or {}
    weights = state_digests(upstream_state, [k for k in keys if k not in known]) | {
        k: known[k] for k in keys if k in known
    }
    blob = json.dumps({"upstream": upstream_fingerprint, "weights": weights, "version": CACHE_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def prepare_feature_cache(
    cfg: PipelineConfig,
    index: int,
    *,
    out: StorageDir,
    data_ref: ray.ObjectRef,
    sizes: dict[str, int],
    in_shape: tuple[int, ...],
    upstream: Any,
    previous: FeatureCache | None,
    log: Callable[[str], None],
) -> FeatureCache | None:
    """The cached inputs of stage `index`, read from storage or computed; None when the cache is off.

    Args:
        cfg: the pipeline config.
        index: the stage about to train.
        out: the run folder (``{storage_path}/{name}``).
        data_ref: the data splits in the object store.
        sizes: samples per split (``{"train": n, "val": n}``).
        in_shape: one sample's shape at stage `index`'s input (its shape plan), the features' shape.
        upstream: the previous stage's :class:`~cascade_ray.pipeline.stages.Handoff`.
        previous: the previous stage's own cache, when it trained on one (computed from it).
        log: where the decision goes.

    Raises:
        ResourceError: ``cache_features: on`` and the features do not fit in the object store.
    """
    from cascade_ray.models.cascade import module_stage_names

    stage = cfg.stages[index]
    wanted, reason = cache_decision(cfg, index)
    if not wanted:
        if stage.freeze.cache_features == "auto" and index > 0:
            log(f"  {stage.name}: feature cache off: {reason}")
        return None
    upstream_names = module_stage_names(cfg, index - 1)
    key = cache_key(upstream.fingerprint, upstream.state, upstream_names, upstream.digests)
    path = out / CACHE_DIR / stage.name / f"{key[:16]}.parquet"
    t0 = time.perf_counter()
    rows = rows_key(ray.get(data_ref))
    arrays = _read_parquet(path, key, sizes, log, stage.name, rows=rows, strict=stage.freeze.cache_features == "on")
    status, nodes, devices = "read", [], []
    if arrays is None:
        need = 4 * math.prod(in_shape) * sum(sizes.values())
        capacity = ray.cluster_resources().get("object_store_memory", 0.0)
        if need > OBJECT_STORE_SHARE * capacity:
            message = f"the features of {stage.name!r} take {need / 2**30:.2f} GiB, more than half the object store ({capacity / 2**30:.2f} GiB)"
            if stage.freeze.cache_features == "on":
                raise ResourceError(
                    f"stages[{index}].freeze.cache_features is on, but {message}. Set it to auto or off, or start Ray with a larger object store (ray start --object-store-memory)."
                )
            log(f"  {stage.name}: feature cache off: {message}")
            return None
        start = previous.stage if previous is not None and previous.stage in upstream_names else None
        arrays, nodes, devices = compute_features(
            cfg, index, data_ref, upstream.ref, previous.ref if start else None, start, sizes
        )
        _write_parquet(path, key, arrays, rows)
        status = "computed"
    shape = tuple(arrays["x_train"].shape[1:])
    cache = FeatureCache(stage.name, ray.put(arrays), key, shape, path, status, time.perf_counter() - t0, tuple(nodes))
    where = (
        f" on {' + '.join(sorted(set(devices)))} ({len(devices)} {'task' if len(devices) == 1 else 'tasks'})"
        if devices
        else ""
    )
    log(
        f"  {stage.name}: feature cache {status}{where}: upstream outputs {'x'.join(map(str, shape))} for {sum(sizes.values())} samples in {cache.seconds:.1f} s ({path})"
    )
    return cache


def compute_features(
    cfg: PipelineConfig,
    index: int,
    data_ref: ray.ObjectRef,
    upstream_ref: ray.ObjectRef,
    previous_ref: ray.ObjectRef | None,
    start: str | None,
    sizes: dict[str, int],
    *,
    where: str = "auto",
) -> tuple[dict[str, np.ndarray], list[str], list[str]]:
    """Upstream outputs of every train/val sample, the Ray node ids that computed them (one per
    task, in shard order; the driver's node when the driver computed them), and the device type
    each task computed on (``cuda`` when its task was given a GPU; empty from the driver).

    On a GPU stage or a multi-node cluster: one Ray task per worker of stage `index` (each
    with the stage's per-worker resources) over contiguous shards. On a single-node CPU
    cluster the driver computes them itself, on all its cores: the node is idle between
    stages, and a task would first spend seconds starting a Python process and importing
    torch. `where` (``tasks`` or ``driver``) overrides that choice.
    """
    from cascade_ray.data import DataSplits
    from cascade_ray.pipeline.fit import worker_resources

    stage = cfg.stages[index]
    resources = worker_resources(stage)
    if where == "auto":
        where = "driver" if not resources.get("GPU") and sum(1 for n in ray.nodes() if n.get("Alive")) == 1 else "tasks"
    if where == "driver":
        previous = ray.get(previous_ref) if previous_ref is not None else None
        parts = upstream_outputs(
            cfg, index, DataSplits.from_arrays(ray.get(data_ref)), ray.get(upstream_ref), previous=previous, start=start
        )
        return {f"x_{s}": parts[s] for s in SPLITS}, [ray.get_runtime_context().get_node_id()], []
    options = {
        "num_cpus": resources.get("CPU", 0.0),
        "num_gpus": resources.get("GPU", 0.0),
        "resources": {k: v for k, v in resources.items() if k not in ("CPU", "GPU")},
    }
    shards = stage.scaling.num_workers
    bounds = {s: np.linspace(0, sizes[s], shards + 1).astype(int) for s in SPLITS}
    raw = cfg.model_dump(mode="json")
    tasks = [
        _features_task.options(**options).remote(
            raw,
            index,
            [data_ref],
            [upstream_ref],
            [previous_ref] if previous_ref is not None else [],
            start,
            {s: (int(b[w]), int(b[w + 1])) for s, b in bounds.items()},
        )
        for w in range(shards)
    ]
    done = ray.get(tasks)
    arrays = {f"x_{s}": np.concatenate([p[s] for _, _, p in done]) for s in SPLITS}
    return arrays, [node for node, _, _ in done], [kind for _, kind, _ in done]


@ray.remote
def _features_task(
    raw: dict[str, Any],
    index: int,
    data_ref: list,
    upstream_ref: list,
    previous_ref: list,
    start: str | None,
    ranges: dict[str, tuple[int, int]],
) -> tuple[str, str, dict[str, np.ndarray]]:
    """(this task's node id, the device type it computed on, its shard of the features)."""
    from cascade_ray.checks import validate_config
    from cascade_ray.data import DataSplits

    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0)
    torch.set_num_threads(max(1, int(cpus)))
    cfg = validate_config(raw, source="feature cache", preflight=False)
    device = torch.device("cuda") if torch.cuda.is_available() and ray.get_gpu_ids() else torch.device("cpu")
    previous = ray.get(previous_ref[0]) if previous_ref else None
    return (
        ray.get_runtime_context().get_node_id(),
        device.type,
        upstream_outputs(
            cfg,
            index,
            DataSplits.from_arrays(ray.get(data_ref[0])),
            ray.get(upstream_ref[0]),
            previous=previous,
            start=start,
            ranges=ranges,
            device=device,
        ),
    )


def upstream_outputs(
    cfg: PipelineConfig,
    index: int,
    data: Any,
    upstream_state: dict[str, np.ndarray],
    *,
    previous: dict[str, np.ndarray] | None = None,
    start: str | None = None,
    ranges: dict[str, tuple[int, int]] | None = None,
    device: torch.device | None = None,
) -> dict[str, np.ndarray]:
    """The frozen stages before `index` applied (eval mode, no grad) to each split's samples.

    Args:
        cfg: the pipeline config.
        index: the stage the outputs feed.
        data: the :class:`~cascade_ray.data.DataSplits`.
        upstream_state: numpy state dict holding every upstream stage's weights.
        previous: the previous stage's cached inputs (``{"x_train", "x_val"}``); with `start`,
            only the modules from `start` on are applied to them.
        start: the first stage module to apply (None: from the raw images).
        ranges: ``{split: (lo, hi)}`` sample ranges (default: every train and val sample).
        device: where to compute (default CPU).

    Returns:
        ``{split: float32 array}`` for each split of `ranges`.
    """
    from cascade_ray.data.batches import ArraySource
    from cascade_ray.models.cascade import build_cascade
    from cascade_ray.models.plan import require_plans
    from cascade_ray.models.weights import load_numpy_state
    from cascade_ray.stage.allocator import keep_freed_memory

    device = device or torch.device("cpu")
    if device.type == "cpu":
        # every batch's activations reused, not unmapped and faulted in again (stage/allocator.py):
        # the demo's two caches took 1.9-2.0 and 3.0-3.1 s with it, 2.7-3.1 and 3.1-4.5 s without
        keep_freed_memory()
    ranges = ranges or {s: (0, len(getattr(data, f"y_{s}"))) for s in SPLITS}
    plans = require_plans(cfg, data.input_shape, data.out_width)
    model = build_cascade(cfg, plans, data.out_width, upto=index - 1)
    load_numpy_state(model, {k: v for k, v in upstream_state.items() if k in model.state_dict()})
    model.to(device).eval()
    names = model.order[model.order.index(start) :] if start is not None else model.order
    out = {}
    for split, (lo, hi) in ranges.items():
        labels = getattr(data, f"y_{split}")[lo:hi]
        if previous is not None and start is not None:
            source = ArraySource(previous[f"x_{split}"][lo:hi], labels, 0.0, 1.0, device)
        else:
            source = ArraySource(getattr(data, f"x_{split}")[lo:hi], labels, data.mean, data.std, device)
        chunks = []
        with torch.no_grad():
            for x, _ in source.eval_epoch(EVAL_BATCH, rank=0, world=1):
                for name in names:
                    x = model.run_block(name, x)
                chunks.append(x.float().cpu().numpy())
        out[split] = (
            np.concatenate(chunks)
            if chunks
            else np.zeros((0, *next(p for p in plans if p.name == names[-1]).out_shape), np.float32)
        )
    _check_unchanged(model, upstream_state, cfg.stages[index].name)
    return out


def _check_unchanged(model: torch.nn.Module, upstream_state: dict[str, np.ndarray], stage: str) -> None:
    """The frozen upstream is the same after computing the cache as the state it was loaded from: a module
    whose forward updates its state (in eval mode) would give each row features from another state than
    the artifact's, which the workers' drift check never sees on cached features. A bytewise compare in the
    module's dtype (a bf16 tensor's state is widened to float32 in numpy; NaN equals itself), no hashing
    (the artifact's digests stay the reference)."""
    from cascade_ray.models.freeze import check_frozen

    def same(now: torch.Tensor, loaded: np.ndarray) -> bool:
        with warnings.catch_warnings():  # the object store's arrays are read-only; nothing writes them here
            warnings.simplefilter("ignore", UserWarning)
            then = torch.from_numpy(np.asarray(loaded)).to(now.dtype)
        now = now.detach().cpu().contiguous().reshape(-1)
        return torch.equal(now.view(torch.uint8), then.contiguous().reshape(-1).view(torch.uint8))

    state = model.state_dict()
    changed = [k for k, v in upstream_state.items() if k in state and not same(state[k], v)]
    check_frozen(dict.fromkeys(changed, "loaded"), dict.fromkeys(changed, "after the feature cache"), stage)


def features_digest(arrays: dict[str, np.ndarray]) -> str:
    """sha256 of the cached features: per split (in :data:`SPLITS` order) its name, shape and float32 bytes."""
    h = hashlib.sha256()
    for split in SPLITS:
        x = np.ascontiguousarray(arrays[f"x_{split}"], dtype=np.float32)
        h.update(f"{split}{x.shape}".encode())
        h.update(x.tobytes())
    return h.hexdigest()


def rows_key(data: dict[str, Any]) -> str:
    """The row-order key: sha256 of the train and val labels in the order the cached rows follow
    (data splits as :meth:`~cascade_ray.data.DataSplits.to_arrays` holds them)."""
    h = hashlib.sha256()
    for split in SPLITS:
        y = np.ascontiguousarray(data[f"y_{split}"])
        h.update(f"{split}{y.dtype.str}{y.shape}".encode())
        h.update(y.tobytes())
    return h.hexdigest()


def _write_parquet(path: StorageDir, key: str, arrays: dict[str, np.ndarray], rows: str) -> None:
    """One row per sample (``split``, flattened ``x``); shapes, the key, the features' sha256 and the
    row-order key `rows` in the schema metadata. Local files are written to a temporary name and
    renamed into place (:func:`write_table`)."""
    shape = arrays["x_train"].shape[1:]
    width = math.prod(shape)
    columns = {"split": [], "x": []}
    for split in SPLITS:
        x = np.ascontiguousarray(arrays[f"x_{split}"], dtype=np.float32).reshape(-1)
        columns["split"].append(pa.array(np.full(len(x) // width if width else 0, split)))
        columns["x"].append(pa.FixedSizeListArray.from_arrays(pa.array(x), width))
    table = pa.table({"split": pa.concat_arrays(columns["split"]), "x": pa.concat_arrays(columns["x"])})
    table = table.replace_schema_metadata(
        {
            "cascade_ray.key": key,
            "cascade_ray.shape": json.dumps(list(shape)),
            "cascade_ray.version": str(CACHE_VERSION),
            "cascade_ray.sha256": features_digest(arrays),
            "cascade_ray.rows": rows,
        }
    )
    write_table(table, path)


def _read_parquet(
    path: StorageDir,
    key: str,
    sizes: dict[str, int],
    log: Callable[[str], None],
    stage: str,
    *,
    rows: str,
    strict: bool,
) -> dict[str, np.ndarray] | None:
    """The stored features when the file exists and matches the key, the split sizes, its own
    sha256 and the row-order key `rows`; None to compute them.

    A damaged or mismatched file is recomputed with a warning naming it (it is a cache, never
    the source), or, with `strict` (``cache_features: on``), an error naming it.

    Raises:
        ArtifactError: `strict` and the stored file is damaged or does not match.
    """
    if not path.exists():
        return None
    try:
        return _checked_features(path, key, sizes, rows)
    except Exception as exc:  # noqa: BLE001 - any unreadable cache file is recomputed (or, strict, reported)
        where = redact(str(path))
        if strict:
            raise ArtifactError(
                f"stored feature cache {where} of stage {stage!r} is damaged ({exc}); delete the file to recompute "
                "it, or set freeze.cache_features: auto to recompute damaged caches with a warning"
            ) from None
        log(f"  WARNING: {stage}: stored feature cache {where} is damaged ({exc}); recomputing it")
        return None


def _checked_features(path: StorageDir, key: str, sizes: dict[str, int], rows: str) -> dict[str, np.ndarray]:
    """The features of a stored cache file; ValueError saying what does not match."""
    reason = not_regular_reason(path)
    if reason is not None:  # a FIFO would block the open
        raise ValueError(f"it {reason}")
    with path.open("rb") as source:
        table = pq.read_table(source)
    meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
    missing = [f"cascade_ray.{k}" for k in ("key", "shape", "sha256", "rows") if f"cascade_ray.{k}" not in meta]
    if missing:
        raise ValueError(f"its metadata lacks {', '.join(missing)}")
    if meta["cascade_ray.key"] != key:
        raise ValueError("its key does not match the upstream")
    if meta["cascade_ray.rows"] != rows:
        raise ValueError("its row-order key does not match the data's rows (reordered or other rows)")
    shape = json.loads(meta["cascade_ray.shape"])
    if not isinstance(shape, list) or not all(type(d) is int and d > 0 for d in shape):
        raise ValueError(f"its shape metadata {meta['cascade_ray.shape'][:60]!r} is not a list of positive ints")
    width = table.schema.field("x").type.list_size if pa.types.is_fixed_size_list(table.schema.field("x").type) else -1
    if width != math.prod(shape):
        raise ValueError(f"its shape metadata {shape} does not fit its rows of {width} values")
    splits = table.column("split").to_numpy(zero_copy_only=False)
    x = table.column("x").combine_chunks().flatten().to_numpy().reshape(len(splits), *shape)
    arrays = {f"x_{s}": x[splits == s] for s in SPLITS}
    counts = {s: len(arrays[f"x_{s}"]) for s in SPLITS}
    if counts != sizes:
        raise ValueError(f"it holds {counts} samples, the data has {sizes}")
    if features_digest(arrays) != meta["cascade_ray.sha256"]:
        raise ValueError("its features do not match their sha256 (altered or corrupted)")
    return arrays
