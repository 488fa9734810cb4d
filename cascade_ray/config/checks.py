"""Cross-field rules the schema alone cannot express. Each returns issues, none raises."""

from __future__ import annotations

from pathlib import Path

from cascade_ray.config.schema import PipelineConfig, StageConfig
from cascade_ray.errors import ConfigIssue

PRETRAINED_SUFFIXES = (".safetensors", ".pt", ".pth")


def semantic_issues(cfg: PipelineConfig) -> list[ConfigIssue]:
    """Every cross-field problem in a schema-valid config."""
    issues = _data_issues(cfg)
    seen: dict[str, int] = {}
    for i, stage in enumerate(cfg.stages):
        path = f"stages[{i}]"
        if stage.name in seen:
            issues.append(
                ConfigIssue(f"{path}.name", f"duplicate stage name {stage.name!r} (also stages[{seen[stage.name]}])", "give every stage a unique name")
            )
        seen.setdefault(stage.name, i)
        issues += _stage_issues(stage, i, path, [s.name for s in cfg.stages[:i]])
    return issues


def _data_issues(cfg: PipelineConfig) -> list[ConfigIssue]:
    data = cfg.data
    issues = []
    if data.source == "parquet":
        for key in ("path", "test_path"):
            if getattr(data, key) is None:
                issues.append(ConfigIssue(f"data.{key}", "required when data.source is parquet", f"set data.{key} to a parquet file, folder or glob"))
    else:
        for key in ("path", "test_path", "image_shape"):
            if getattr(data, key) is not None:
                issues.append(ConfigIssue(f"data.{key}", f"only used with data.source: parquet (source is {data.source!r})", f"remove data.{key}"))
    return issues


def _stage_issues(stage: StageConfig, index: int, path: str, upstream: list[str]) -> list[ConfigIssue]:
    from cascade_ray.solver import solver_issues

    issues = solver_issues(stage.solver, f"{path}.solver")
    if stage.type == "module":
        if stage.model is None:
            issues.append(ConfigIssue(f"{path}.model", "a stage of type 'module' needs a model", "add model: {type: resnet, ...}"))
        else:
            issues += _model_issues(stage, path)
        if stage.loss.weighting != "static":
            issues.append(ConfigIssue(f"{path}.loss.weighting", f"{stage.loss.weighting!r} only applies to a joint stage", "remove it or set type: joint"))
    else:
        if index == 0:
            issues.append(ConfigIssue(f"{path}.type", "a joint stage needs trained stages before it", "put the joint stage last"))
        for key in ("model", "pretrained", "adapter"):
            if getattr(stage, key) is not None:
                issues.append(ConfigIssue(f"{path}.{key}", "a joint stage adds no module", f"remove {path}.{key}"))
    for name, count in stage.trainable_layers.items():
        key = f"{path}.trainable_layers.{name}"
        if name not in upstream:
            from cascade_ray.config.loader import did_you_mean

            hint = did_you_mean(name, upstream)
            valid = ", ".join(upstream) or "none: this is the first stage"
            issues.append(ConfigIssue(key, f"{name!r} is not an upstream stage{hint} (upstream: {valid})"))
        if count == 0 or count < -1:
            issues.append(ConfigIssue(key, f"{count} layers", "use a positive count, or -1 for all layers"))
    if stage.pretrained is not None:
        issues += _pretrained_issues(stage.pretrained, f"{path}.pretrained")
    return issues


def _model_issues(stage: StageConfig, path: str) -> list[ConfigIssue]:
    from cascade_ray.models import ModelSpecError, check_kwargs, resolve_factory

    assert stage.model is not None
    try:
        factory = resolve_factory(stage.model.type)
    except ModelSpecError as exc:
        return [ConfigIssue(f"{path}.model.type", str(exc))]
    return [ConfigIssue(f"{path}.model", message) for message in check_kwargs(factory, stage.model.kwargs())]


def _pretrained_issues(file: str, key: str) -> list[ConfigIssue]:
    p = Path(file).expanduser()
    if p.suffix not in PRETRAINED_SUFFIXES:
        return [ConfigIssue(key, f"{file!r} is not a .safetensors or .pt state-dict file", "export the state dict with safetensors.torch.save_file")]
    if not p.is_file():
        return [ConfigIssue(key, f"file {str(p)!r} does not exist", "use an absolute path to an existing state-dict file")]
    return []
