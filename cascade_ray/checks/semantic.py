"""Cross-field rules the schema alone cannot express. Each returns issues, none raises."""

from __future__ import annotations

import math
import os

from pydantic import BaseModel

from cascade_ray.checks.params import param_group_issues
from cascade_ray.config.metrics import epoch_metric_names, metric_mode, retention_metric
from cascade_ray.config.schema import NormalizeStats, PipelineConfig, StageConfig
from cascade_ray.config.trust import import_refusal, module_refusal, trust_fix
from cascade_ray.errors import ConfigError, ConfigIssue
from cascade_ray.models import ModelSpecError, check_kwargs, resolve_factory
from cascade_ray.models.pretrained import file_issue
from cascade_ray.solver import stage_solver_issues
from cascade_ray.storage import parse_uri
from cascade_ray.text import did_you_mean, short_repr


def semantic_issues(cfg: PipelineConfig) -> list[ConfigIssue]:
    """Every cross-field problem in a schema-valid config."""
    issues = _data_issues(cfg) + _storage_issues(cfg.storage_path) + _finite_issues(cfg) + _trust_issues(cfg)
    seen: dict[str, int] = {}
    for i, stage in enumerate(cfg.stages):
        path = f"stages[{i}]"
        if stage.name in seen:
            issues.append(
                ConfigIssue(
                    f"{path}.name",
                    f"duplicate stage name {stage.name!r} (also stages[{seen[stage.name]}])",
                    "give every stage a unique name",
                )
            )
        seen.setdefault(stage.name, i)
        upstream = [s.name for s in cfg.stages[:i]]
        issues += _stage_issues(stage, i, path, upstream, cfg.trusted_modules) + _metric_issues(cfg, stage, path)
    if not issues:  # needs buildable stages: param-group patterns against the real parameter names (meta device)
        issues += param_group_issues(cfg)
    return issues


def _data_issues(cfg: PipelineConfig) -> list[ConfigIssue]:
    data = cfg.data
    issues = []
    if data.source == "parquet":
        for key in ("path", "test_path"):
            if getattr(data, key) is None:
                issues.append(
                    ConfigIssue(
                        f"data.{key}",
                        "required when data.source is parquet",
                        f"set data.{key} to a parquet file, folder or glob",
                    )
                )
    else:
        for key, value in (("path", data.path), ("test_path", data.test_path), ("inputs.shape", data.inputs.shape)):
            if value is not None:
                issues.append(
                    ConfigIssue(
                        f"data.{key}",
                        f"only used with data.source: parquet (source is {data.source!r})"
                        + (" (data.image_shape is its image-case spelling)" if key == "inputs.shape" else ""),
                        f"remove data.{key}",
                    )
                )
        if data.target.kind != "class":
            issues.append(
                ConfigIssue(
                    "data.target.kind",
                    f"{data.source} holds class labels, not {data.target.kind} targets",
                    "remove data.target.kind, or use data.source: parquet",
                )
            )
    if data.streaming is not False and data.source != "parquet":
        issues.append(
            ConfigIssue(
                "data.streaming",
                f"streams Parquet files, but data.source is {data.source!r}",
                "use data.source: parquet",
            )
        )
    if data.streaming is not False and data.target.kind != "regression" and data.target.num_classes is None:
        issues.append(
            ConfigIssue(
                "data.target.num_classes",
                "required with data.streaming: the scan and every streamed batch check the labels against it",
                "set data.target.num_classes (e.g. 10)",
            )
        )
    if data.streaming is True and data.train_size is not None:
        issues.append(
            ConfigIssue("data.train_size", "not used with data.streaming: true (every row is streamed)", "remove it")
        )
    target = data.target
    if target.kind == "regression" and target.num_classes is not None:
        issues.append(
            ConfigIssue("data.target.num_classes", "regression targets have no classes", "use data.target.dim")
        )
    if target.kind != "regression" and target.dim is not None:
        issues.append(
            ConfigIssue(
                "data.target.dim",
                f"only for regression targets (kind is {target.kind!r})",
                "use data.target.num_classes",
            )
        )
    if isinstance(data.normalize, NormalizeStats) and len(data.normalize.mean) != len(data.normalize.std):
        issues.append(
            ConfigIssue(
                "data.normalize.std",
                f"{len(data.normalize.std)} values but data.normalize.mean has {len(data.normalize.mean)}",
                "give mean and std the same length",
            )
        )
    return issues


def _metric_issues(cfg: PipelineConfig, stage: StageConfig, path: str) -> list[ConfigIssue]:
    """Every epoch metric a stage watches must be one the data's target kind reports."""
    kind = cfg.data.target.kind
    known = epoch_metric_names(kind, cfg.data.target.num_classes)
    watched = [
        (f"{path}.train.metric", stage.train.metric),
        (f"{path}.train.checkpoint.metric", stage.train.checkpoint.metric),
    ]
    if stage.train.early_stopping is not None:
        watched.append((f"{path}.train.early_stopping.metric", stage.train.early_stopping.metric))
    if stage.solver.lr_scheduler.type == "ReduceLROnPlateau":
        watched.append((f"{path}.solver.lr_scheduler.monitor", stage.solver.lr_scheduler.monitor))
    issues = []
    for key, metric in watched:
        scored = key.endswith(("train.metric", "checkpoint.metric"))  # checkpoint scores: validation metrics only
        valid = [m for m in known if m != "train_loss"] if scored else known
        if metric == "auto" and scored:
            continue
        if metric not in valid:
            issues.append(
                ConfigIssue(
                    key,
                    f"{short_repr(metric)} is not reported for data.target.kind {kind!r}{did_you_mean(metric, valid)}",
                    f"use one of: {', '.join(valid)}",
                )
            )
    return issues + _retention_issues(cfg, stage, path, known)


def _retention_issues(cfg: PipelineConfig, stage: StageConfig, path: str, known: list[str]) -> list[ConfigIssue]:
    """``train.checkpoint``: a mode against its metric's known direction, more checkpoints kept than epochs."""
    retention, key = stage.train.checkpoint, f"{path}.train.checkpoint"
    issues = []
    metric, mode = retention_metric(cfg, stage)
    if retention.mode != "auto" and metric in known and mode != metric_mode(metric):
        issues.append(
            ConfigIssue(
                f"{key}.mode",
                f"{mode!r} ranks {metric} the wrong way: {metric} improves as it gets "
                f"{'smaller' if metric_mode(metric) == 'min' else 'larger'}, so the worst checkpoints would be kept "
                "and the worst one become the artifact",
                f"set {key}.mode: {metric_mode(metric)} (or auto)",
            )
        )
    if 0 < stage.train.epochs < retention.top_k:
        issues.append(
            ConfigIssue(
                f"{key}.top_k",
                f"{retention.top_k} checkpoints kept, but the stage trains {stage.train.epochs} epoch(s) and "
                "checkpoints once per epoch",
                f"set {key}.top_k: {stage.train.epochs} or less (or raise {path}.train.epochs)",
            )
        )
    return issues


def _trust_issues(cfg: PipelineConfig) -> list[ConfigIssue]:
    """``trusted_modules`` entries that are not module names, or are in the standard library."""
    issues = []
    for i, name in enumerate(cfg.trusted_modules):
        problem = module_refusal(name)
        if problem is not None:
            issues.append(
                ConfigIssue(
                    f"trusted_modules[{i}]",
                    problem,
                    "remove it; list only your own (or vetted) packages whose factories the config names",
                )
            )
    return issues


def _stage_issues(
    stage: StageConfig, index: int, path: str, upstream: list[str], trusted: list[str]
) -> list[ConfigIssue]:
    issues = stage_solver_issues(stage, path)  # solver, precision, early stopping
    if stage.type == "module":
        if stage.model is None:
            issues.append(
                ConfigIssue(f"{path}.model", "a stage of type 'module' needs a model", "add model: {type: resnet, ...}")
            )
        else:
            issues += _model_issues(stage, path, trusted)
        if stage.loss.weighting != "static":
            issues.append(
                ConfigIssue(
                    f"{path}.loss.weighting",
                    f"{stage.loss.weighting!r} only applies to a joint stage",
                    "remove it or set type: joint",
                )
            )
        if stage.loss.weights is not None:
            issues.append(
                ConfigIssue(
                    f"{path}.loss.weights",
                    "only applies to a joint stage (a module stage weighs its loss with loss.scale)",
                    "remove it or use loss.scale",
                )
            )
    else:
        for name, weight in (stage.loss.weights or {}).items():
            if name not in upstream:
                issues.append(
                    ConfigIssue(
                        f"{path}.loss.weights.{name}",
                        f"{short_repr(name)} is not an upstream stage{did_you_mean(name, upstream)} (upstream: {', '.join(upstream)})",
                    )
                )
            elif not weight > 0:
                issues.append(
                    ConfigIssue(
                        f"{path}.loss.weights.{name}",
                        f"weight {weight} must be > 0",
                        "drop the term by weighting it small, e.g. 0.01",
                    )
                )
        issues += _joint_weight_issues(stage, path, upstream)
        if index == 0:
            issues.append(
                ConfigIssue(f"{path}.type", "a joint stage needs trained stages before it", "put the joint stage last")
            )
        if (
            index > 0 and not stage.trainable_layers
        ):  # torch refuses an optimizer over no parameters, inside the Ray worker
            issues.append(
                ConfigIssue(
                    f"{path}.trainable_layers",
                    "a joint stage trains only what trainable_layers opens, and it opens nothing",
                    f"list upstream stages, e.g. trainable_layers: {{{upstream[-1]}: -1}}",
                )
            )
        for key in ("model", "pretrained", "adapter"):
            if getattr(stage, key) is not None:
                issues.append(ConfigIssue(f"{path}.{key}", "a joint stage adds no module", f"remove {path}.{key}"))
    for name, count in stage.trainable_layers.items():
        key = f"{path}.trainable_layers.{name}"
        if name not in upstream:
            hint = did_you_mean(name, upstream)
            valid = ", ".join(upstream) or "none: this is the first stage"
            issues.append(ConfigIssue(key, f"{short_repr(name)} is not an upstream stage{hint} (upstream: {valid})"))
        if count == 0 or count < -1:
            issues.append(ConfigIssue(key, f"{count} layers", "use a positive count, or -1 for all layers"))
    if stage.freeze.cache_features == "on":
        issues += [
            ConfigIssue(
                f"{path}.freeze.cache_features",
                f"'on', but {reason}",
                f"{fix}, or set cache_features: auto (caches only when possible) or off",
            )
            for reason, fix in cache_refusals(stage, index, path)
        ]
    if stage.pretrained is not None:
        problem = file_issue(stage.pretrained, f"{path}.pretrained")
        issues += [problem] if problem is not None else []
    issues += _import_only_issues(stage, path)
    issues += _scaling_issues(stage, f"{path}.scaling")
    return issues


# A joint loss whose weights sum below this is zero in fp32 (and in any precision that trains).
MIN_JOINT_WEIGHT_SUM = 1e-12


def _joint_weight_issues(stage: StageConfig, path: str, upstream: list[str]) -> list[ConfigIssue]:
    """``loss.weights`` so small that the summed loss is ~0: training would not move."""
    weights = stage.loss.weights or {}
    listed = [w for name, w in weights.items() if name in upstream and w > 0]
    if not weights or len(listed) < len(weights) or len(listed) < len(upstream):
        return []  # a bad name or weight is reported on its own; an unlisted stage keeps its loss.scale (> 0)
    if sum(listed) >= MIN_JOINT_WEIGHT_SUM:
        return []
    return [
        ConfigIssue(
            f"{path}.loss.weights",
            f"the weights sum to {sum(listed):.3g}, below {MIN_JOINT_WEIGHT_SUM:g}: the joint loss is zero and nothing trains",
            "give the terms weights near 1, e.g. 1.0 and 0.5",
        )
    ]


def cache_refusals(stage: StageConfig, index: int, path: str) -> list[tuple[str, str]]:
    """Why stage `index` cannot train on cached upstream features: ``(reason, fix)`` pairs, none when it can.

    The cache holds the frozen upstream's outputs for every training and validation sample,
    computed once; that is exact only when the upstream never changes (nothing upstream
    trains) and neither do its inputs (no random augmentation).
    """
    refusals = []
    if index == 0:
        refusals.append(("the first stage has no upstream to cache", f"remove {path}.freeze"))
    if stage.type == "joint":
        refusals.append(
            ("a joint stage trains its upstream, so the upstream outputs change every step", f"remove {path}.freeze")
        )
    elif stage.trainable_layers:
        names = ", ".join(sorted(stage.trainable_layers))
        refusals.append(
            (
                f"{path}.trainable_layers opens upstream layers ({names}), so the upstream outputs change every step",
                f"remove {path}.trainable_layers",
            )
        )
    if stage.train.augment.enabled:
        refusals.append(
            (f"{path}.train.augment randomizes this stage's inputs every epoch", f"turn off {path}.train.augment")
        )
    return refusals


def _in_cwd_only(type_name: str) -> str | None:
    """The current folder's ``pkg/`` or ``pkg.py`` for a ``pkg.module:factory`` that failed to import because
    the current folder is not on ``sys.path`` (a console script's is its own bin folder); else None."""
    import sys

    top = type_name.partition(":")[0].partition(".")[0]
    if ":" not in type_name or not top.isidentifier() or any(p in ("", ".", os.getcwd()) for p in sys.path):
        return None
    if os.path.isdir(top):
        return f"{top}/"
    return f"{top}.py" if os.path.isfile(f"{top}.py") else None


def _model_issues(stage: StageConfig, path: str, trusted: list[str]) -> list[ConfigIssue]:
    assert stage.model is not None
    if ":" in stage.model.type:
        refusal = import_refusal(stage.model.type, trusted)
        if refusal is not None:  # decided from the string: nothing is imported
            return [ConfigIssue(f"{path}.model.type", refusal, trust_fix(stage.model.type))]
    try:
        factory = resolve_factory(stage.model.type, trusted)
    except ModelSpecError as exc:
        fix = (
            "check the spelling; the module must be importable on the driver and on every Ray worker (installed, or in the job's working_dir)"
            if ":" in stage.model.type
            else ""
        )
        top = stage.model.type.partition(":")[0].partition(".")[0]
        # the package itself not found (not one of its own imports failing)
        here = _in_cwd_only(stage.model.type) if f"No module named '{top}'" in str(exc) else None
        if here is not None:
            fix = (
                f"{here} is in the current folder, which the cascade-ray command does not import from: run it as "
                "PYTHONPATH=. cascade-ray ... (the embedded Ray's workers inherit it), or pip install -e your "
                "package; with ray job submit, pass --working-dir ."
            )
        return [ConfigIssue(f"{path}.model.type", str(exc), fix)]
    return [ConfigIssue(f"{path}.model", message) for message in check_kwargs(factory, stage.model.kwargs())]


def _import_only_issues(stage: StageConfig, path: str) -> list[ConfigIssue]:
    """``train.epochs: 0`` (an import-only stage) needs weights to import and has nothing to train."""
    if stage.train.epochs != 0:
        return []
    if stage.pretrained is None:
        return [
            ConfigIssue(
                f"{path}.train.epochs",
                "0 epochs makes an import-only stage, but the stage has no pretrained weights to import",
                f"set {path}.pretrained to the state-dict file, or train at least one epoch (train.epochs: 1)",
            )
        ]
    if stage.trainable_layers:
        return [
            ConfigIssue(
                f"{path}.trainable_layers",
                "an import-only stage (train.epochs: 0) trains nothing, so it cannot open upstream layers",
                f"remove {path}.trainable_layers, or train the stage (train.epochs >= 1)",
            )
        ]
    return []


def _storage_issues(storage_path: str) -> list[ConfigIssue]:
    """An empty storage_path, or a URI the driver would refuse (before Ray) only at run time."""
    if not storage_path.strip():
        return [
            ConfigIssue(
                "storage_path",
                "is empty: artifacts would land in whatever directory the driver starts in",
                "set an absolute path (/shared/cascade-runs) or a URI (s3://bucket/runs)",
            )
        ]
    try:
        parse_uri(storage_path)
    except ConfigError as exc:
        return list(exc.issues)
    return []


# Floats where infinity means something: grad_clip.norm_type .inf is the max-abs norm.
_INFINITE_OK = frozenset({"norm_type"})


def _finite_issues(node: BaseModel, path: str = "") -> list[ConfigIssue]:
    """Every float field that is inf (NaN already fails the range checks); `lr: .inf` parses as a float."""
    issues = []
    for key in type(node).model_fields:
        issues += _finite_value(getattr(node, key), f"{path}.{key}" if path else key, key)
    return issues


def _finite_value(value: object, path: str, key: str) -> list[ConfigIssue]:
    if isinstance(value, BaseModel):
        return _finite_issues(value, path)
    if isinstance(value, list):
        return [issue for j, item in enumerate(value) for issue in _finite_value(item, f"{path}[{j}]", key)]
    if isinstance(value, dict):
        return [issue for k, item in value.items() for issue in _finite_value(item, f"{path}.{k}", key)]
    if isinstance(value, float) and not math.isfinite(value) and key not in _INFINITE_OK:
        return [ConfigIssue(path, f"{value} is not a finite number", "use a finite value")]
    return []


def _fsdp_issues(stage: StageConfig, path: str) -> list[ConfigIssue]:
    """``scaling.strategy: fsdp`` with settings that need whole (unsharded) parameters on every worker."""
    if stage.scaling.strategy != "fsdp":
        return []
    key, fix = f"{path}.strategy", f"set {path}.strategy: ddp"
    issues = []
    if stage.scaling.sync_batchnorm:
        issues.append(
            ConfigIssue(
                key,
                "fsdp shards the trainable layers, and SyncBatchNorm is a DDP conversion that FSDP does not do",
                f"{fix}, or set {path}.sync_batchnorm: false",
            )
        )
    solver_path = path.rsplit(".", 1)[0] + ".solver"
    if stage.solver.precision == "fp16" and stage.scaling.num_workers > 1:  # one worker: unsharded, one scaler
        issues.append(
            ConfigIssue(
                key,
                "fp16 loss scaling is not sharded: each worker would skip overflow steps on its own shard's "
                "gradients alone",
                f"{fix}, or set {solver_path}.precision: bf16 (no loss scaling) or fp32",
            )
        )
    if stage.loss.weighting == "uncertainty":
        loss_path = path.rsplit(".", 1)[0] + ".loss"
        issues.append(
            ConfigIssue(
                key,
                "uncertainty weighting trains log-variances outside the model, which fsdp cannot shard "
                "with it (its full optimizer state is keyed by the model's parameter names)",
                f"{fix}, or set {loss_path}.weighting: static",
            )
        )
    return issues


def _scaling_issues(stage: StageConfig, path: str) -> list[ConfigIssue]:
    """Per-worker requests that are wrong on any cluster (cluster-dependent fits are checked after ray.init)."""
    sc, key = stage.scaling, f"{path}.resources_per_worker"
    issues = []
    if sc.sync_batchnorm and sc.use_gpu is False and sc.num_workers > 1:  # one worker has nothing to sync
        issues.append(
            ConfigIssue(
                f"{path}.sync_batchnorm",
                f"torch's SyncBatchNorm needs CUDA workers, but use_gpu is false ({sc.num_workers} CPU workers)",
                f"set {path}.sync_batchnorm: false, or {path}.use_gpu: true",
            )
        )
    issues += _fsdp_issues(stage, path)
    res = sc.resources_per_worker
    if res is None:
        return issues
    for name, amount in res.items():
        if name.upper() in ("CPU", "GPU") and name not in ("CPU", "GPU"):
            issues.append(
                ConfigIssue(
                    f"{key}.{name}",
                    f"Ray's resource is {short_repr(name.upper())}; {short_repr(name)} would be a custom resource no node advertises",
                    f"write {name.upper()}: {amount:g}",
                )
            )
        if amount < 0:
            issues.append(
                ConfigIssue(f"{key}.{name}", f"{name}: {amount:g} is negative", f"request 0 or more, e.g. {name}: 1")
            )
    gpu = res.get("GPU")
    if sc.use_gpu is False and gpu is not None and gpu > 0:
        issues.append(
            ConfigIssue(
                f"{key}.GPU",
                f"asks for {gpu:g} GPU per worker, but use_gpu: false trains on CPU (the GPU would sit idle)",
                f"set {path}.use_gpu: true (or auto), or remove GPU from {key}",
            )
        )
    if sc.use_gpu is True and gpu == 0:
        issues.append(
            ConfigIssue(
                f"{key}.GPU",
                "GPU: 0 contradicts use_gpu: true (one GPU per worker; Ray Train would ignore the 0)",
                f"remove GPU from {key}, or set {path}.use_gpu: false",
            )
        )
    on_cpu = sc.use_gpu is False or (sc.use_gpu == "auto" and gpu == 0)
    if on_cpu and res.get("CPU", 0) == 0:
        issues.append(
            ConfigIssue(
                f"{key}.CPU" if "CPU" in res else key,
                "a CPU worker that holds no CPU: Ray would pack any number of them onto one node's cores",
                f"request at least part of a core, e.g. {key}: {{CPU: 1}}",
            )
        )
    return issues
