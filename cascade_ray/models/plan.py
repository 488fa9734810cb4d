"""Shape preflight: build every stage on the ``meta`` device and push one batch shape
through the whole chain before any Ray resource starts.

A stage whose input does not fit its upstream's output is reported with both stages
and both shapes, and the two ways to fix it (change the width, or add an adapter).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cascade_ray.config.schema import DataConfig, PipelineConfig, StageConfig
from cascade_ray.errors import ConfigError, ConfigIssue
from cascade_ray.models.cascade import StagePlan, build_adapter, build_head
from cascade_ray.models.losses import loss_issue, loss_spec_issue
from cascade_ray.models.meta import meta_device
from cascade_ray.models.pretrained import FINITE_CHECK_MAX_BYTES, preflight_issues
from cascade_ray.models.registry import build_module, module_in_width, tensor_width

_KNOWN_SHAPES = {"fashion_mnist": (1, 28, 28), "digits": (1, 8, 8)}
_WIDTH_KWARGS = ("in_channels", "in_features", "in_dim", "input_dim")
_PREFLIGHT_BATCH = 2


def data_input_shape(data: DataConfig) -> tuple[int, ...] | None:
    """Per-sample input shape of a data source, without loading the data (None if unknown).

    Parquet: ``data.inputs.shape``, else the shape stored in the file (the metadata
    ``write_parquet`` writes, or an Arrow tensor type), else the length of a fixed-size list
    (a flat vector); local files only, the loader reads the rest.
    """
    if data.source in _KNOWN_SHAPES:
        return _KNOWN_SHAPES[data.source]
    if data.inputs.shape is not None:
        return tuple(data.inputs.shape)
    try:
        import pyarrow as pa
        import pyarrow.dataset as ds

        schema = ds.dataset(data.path, format="parquet").schema
        shape = (schema.metadata or {}).get(b"cascade_ray.image_shape")
        if shape:
            dims = json.loads(shape)
            return tuple(int(d) for d in dims) if isinstance(dims, list) else None
        kind = schema.field(data.inputs.column).type
        if isinstance(kind, pa.FixedShapeTensorType):
            return tuple(kind.shape)
        return (kind.list_size,) if pa.types.is_fixed_size_list(kind) else None
    except Exception:  # noqa: BLE001 - unreadable here: the data loader reports it with its own message
        return None


def data_out_width(data: DataConfig) -> int:
    """The last head's output width the config implies, before the data is read: the classes
    (default 10 for the bundled image sets, else 2 as a stand-in), or the regression values (default 1)."""
    target = data.target
    if target.kind == "regression":
        return target.dim or 1
    if target.num_classes is not None:
        return target.num_classes
    return 10 if data.source in _KNOWN_SHAPES else 2


def model_spec_issues(cfg: PipelineConfig) -> list[ConfigIssue]:
    """What the chain's specs get wrong without building a module: each stage's loss against
    the target kind (and ``trusted_modules``), and flips/crops on inputs that are not images."""
    issues = []
    for i, stage in enumerate(cfg.stages):
        problem = loss_spec_issue(stage.loss, cfg.data.target.kind, cfg.trusted_modules)
        if problem is not None:
            key, message, fix = problem
            issues.append(ConfigIssue(f"stages[{i}].{key}", f"stage {stage.name!r}: {message}", fix))
    shape = data_input_shape(cfg.data)
    if shape is not None and len(shape) != 3:
        issues += [
            ConfigIssue(
                f"stages[{i}].train.augment",
                f"flips and crops need (C, H, W) images, but the inputs are {list(shape)}",
                "turn augment off for this data",
            )
            for i, s in enumerate(cfg.stages)
            if s.train.augment.enabled
        ]
    return issues


def shape_issues(cfg: PipelineConfig) -> list[ConfigIssue]:
    """Every shape problem in the chain, and user losses that fail on its outputs (empty when all fit).

    Run once :func:`model_spec_issues` is clean: it builds and runs modules on the meta device.
    """
    width = data_out_width(cfg.data)
    issues = []
    for i, stage in enumerate(cfg.stages):
        problem = loss_issue(stage.loss, cfg.data.target.kind, width, cfg.trusted_modules)
        if problem is not None:
            key, message, fix = problem
            issues.append(ConfigIssue(f"stages[{i}].{key}", f"stage {stage.name!r}: {message}", fix))
    shape = data_input_shape(cfg.data)
    if shape is None:
        return issues
    return issues + plan_chain(cfg, shape, num_classes=width, check_pretrained=False)[1]


def pretrained_issues(cfg: PipelineConfig, *, read_bytes: float = FINITE_CHECK_MAX_BYTES) -> list[ConfigIssue]:
    """Each ``pretrained`` file against its stage's module, built on meta but not run.

    Keys, shapes and dtypes from the file's header, NaN/Inf in files of at most `read_bytes`.
    A module that cannot be built is left to :func:`shape_issues` to report.
    """
    issues = []
    with meta_device():
        for i, stage in enumerate(cfg.stages):
            if stage.type != "module" or stage.model is None or stage.pretrained is None:
                continue
            try:
                module = build_module(stage.model.type, stage.model.kwargs(), cfg.trusted_modules)
            except Exception:  # noqa: BLE001 - reported with the shapes, in the module's own words
                continue
            issues += preflight_issues(stage.pretrained, module, f"stages[{i}].pretrained", read_bytes=read_bytes)
    return issues


@dataclass(frozen=True)
class ModuleFacts:
    """What the strategy checks need of a stage's module, kept once the module (meta) is gone."""

    type_name: str  # the module's class
    has_blocks: bool  # defines cascade_layers()
    has_params: bool


def module_facts(modules: dict[str, torch.nn.Module]) -> dict[str, ModuleFacts]:
    """:class:`ModuleFacts` of each built module."""
    return {
        name: ModuleFacts(
            type(m).__name__, callable(getattr(m, "cascade_layers", None)), any(True for _ in m.parameters())
        )
        for name, m in modules.items()
    }


PlanKey = tuple[str, tuple[int, ...], int]
_PLANS: dict[PlanKey, tuple[list[StagePlan], dict[str, ModuleFacts]]] = {}


def _plan_key(cfg: PipelineConfig, input_shape: Sequence[int], num_classes: int) -> PlanKey:
    """What a plan depends on: each stage's architecture and pretrained file (checked from its header
    on the way), not its solver, training or scaling; the trusted import roots, the input shape
    and the output width."""
    arch = [
        s.model_dump(mode="json", include={"name", "type", "model", "adapter", "head", "pretrained"})
        for s in cfg.stages
    ]
    text = json.dumps([arch, list(cfg.trusted_modules)], sort_keys=True)
    return text, tuple(int(d) for d in input_shape), int(num_classes)


def require_plans(cfg: PipelineConfig, input_shape: Sequence[int], num_classes: int) -> list[StagePlan]:
    """:func:`plan_chain`, raising :class:`ConfigError` on any issue.

    Successful plans are remembered per architecture (:func:`_plan_key`), input shape and
    classes: the driver asks for them several times per stage, every Tune trial of a stage has the
    same ones, and each plan builds every stage on the meta device (the first one in a process
    also imports torch's compiler stack, about a second). The strategy checks are run again for
    every config, from the remembered :class:`ModuleFacts`. :func:`known_plans` /
    :func:`remember_plans` carry them into Ray workers.
    """
    key = _plan_key(cfg, input_shape, num_classes)
    if key not in _PLANS:
        plans, issues, facts = _plan_chain(cfg, input_shape, num_classes)
        if issues:
            raise ConfigError(issues)
        if len(_PLANS) >= 64:
            _PLANS.clear()
        _PLANS[key] = (plans, facts)
    plans, facts = _PLANS[key]
    issues = _strategy_issues(cfg, facts)
    if issues:
        raise ConfigError(issues)
    return list(plans)


def known_plans() -> dict[PlanKey, tuple[list[StagePlan], dict[str, ModuleFacts]]]:
    """This process's remembered plans (small: shapes and flags), for a worker's loop config."""
    return dict(_PLANS)


def remember_plans(entries: dict[PlanKey, tuple[list[StagePlan], dict[str, ModuleFacts]]] | None) -> None:
    """Adopt plans a driver computed (:func:`known_plans`), so a worker does not plan again."""
    for key, value in (entries or {}).items():
        if len(_PLANS) < 64:
            _PLANS.setdefault(key, value)


def plan_chain(
    cfg: PipelineConfig,
    input_shape: Sequence[int],
    num_classes: int,
    *,
    read_bytes: float = 0,
    check_pretrained: bool = True,
) -> tuple[list[StagePlan], list[ConfigIssue]]:
    """Per-stage input/output shapes of the chain, computed on the meta device.

    Pretrained files are checked from their headers (keys, shapes, dtypes); files of at most
    `read_bytes` are also read for NaN/Inf (the driver before Ray: all of them; the repeated
    planning of a run: none). Validation checks them first, without running the chain
    (:func:`pretrained_issues`), and plans with ``check_pretrained=False``.
    """
    plans, issues, facts = _plan_chain(
        cfg, input_shape, num_classes, read_bytes=read_bytes, check_pretrained=check_pretrained
    )
    return plans, issues + _strategy_issues(cfg, facts)


def _plan_chain(
    cfg: PipelineConfig,
    input_shape: Sequence[int],
    num_classes: int,
    *,
    read_bytes: float = 0,
    check_pretrained: bool = True,
) -> tuple[list[StagePlan], list[ConfigIssue], dict[str, ModuleFacts]]:
    """:func:`plan_chain` without the strategy checks; with the modules' :class:`ModuleFacts`."""
    plans: list[StagePlan] = []
    issues: list[ConfigIssue] = []
    shape = tuple(input_shape)
    producer = "the data"
    modules: dict[str, torch.nn.Module] = {}  # built stage modules (meta), for the strategy checks
    with meta_device():
        for i, stage in enumerate(cfg.stages):
            if stage.type != "module" or stage.model is None:
                continue
            plan, issue, module = _plan_stage(stage, i, shape, producer, num_classes, cfg.trusted_modules)
            if issue is not None:
                issues.append(issue)
                break  # downstream shapes are unknown once one stage does not fit
            if check_pretrained and stage.pretrained is not None and module is not None:
                # keys, shapes, dtypes of the file against the module; shapes downstream still hold
                issues += preflight_issues(stage.pretrained, module, f"stages[{i}].pretrained", read_bytes=read_bytes)
            plans.append(plan)
            if module is not None:
                modules[stage.name] = module
            shape, producer = plan.out_shape, f"stage {stage.name!r}"
    return plans, issues, module_facts(modules)


def _strategy_issues(cfg: PipelineConfig, modules: dict[str, ModuleFacts]) -> list[ConfigIssue]:
    """``train.activation_checkpointing`` needs blocks (``cascade_layers()``) in every module the stage
    trains; ``scaling.strategy: fsdp`` on several workers needs parameters to shard."""
    issues = []
    for i, stage in enumerate(cfg.stages):
        path = f"stages[{i}]"
        trained = [stage.name] if stage.type == "module" else [n for n in stage.trainable_layers if n in modules]
        if stage.train.activation_checkpointing:
            for name in trained:
                module = modules.get(name)
                if module is not None and not module.has_blocks:
                    issues.append(
                        ConfigIssue(
                            f"{path}.train.activation_checkpointing",
                            f"stage {stage.name!r} checkpoints activations per block, but the module of stage "
                            f"{name!r} ({module.type_name}) defines no cascade_layers() listing its blocks",
                            f"set {path}.train.activation_checkpointing: false, or give the module a "
                            "cascade_layers() method returning its blocks in forward order",
                        )
                    )
        module = modules.get(stage.name)
        if (
            stage.scaling.strategy == "fsdp"
            and stage.scaling.num_workers > 1
            and stage.type == "module"
            and module is not None
            and not module.has_params
            and stage.adapter is None
            and stage.head.type == "none"
        ):
            issues.append(
                ConfigIssue(
                    f"{path}.scaling.strategy",
                    f"stage {stage.name!r} has no trainable parameters (a parameter-free module, no adapter, "
                    "no head): fsdp has nothing to shard",
                    f"set {path}.scaling.strategy: ddp, or give the stage parameters to train",
                )
            )
    return issues


def _plan_stage(
    stage: StageConfig,
    index: int,
    in_shape: tuple[int, ...],
    producer: str,
    num_classes: int,
    trusted: Sequence[str] = (),
) -> tuple[StagePlan, ConfigIssue | None, torch.nn.Module | None]:
    """The stage's shapes, or the issue that stops the chain; and its module (on meta) when it fits."""
    assert stage.model is not None
    path = f"stages[{index}]"
    try:
        module = build_module(stage.model.type, stage.model.kwargs(), trusted)
    except Exception as exc:  # noqa: BLE001 - user factories fail in their own words
        return (
            _fail(stage, in_shape),
            ConfigIssue(f"{path}.model", f"stage {stage.name!r}: building {stage.model.type} failed: {exc}"),
            None,
        )
    expected = module_in_width(module)
    got = tensor_width((_PREFLIGHT_BATCH, *in_shape)) if len(in_shape) in (1, 2, 3) else None
    adapter_width = expected if stage.adapter is not None and expected is not None and expected != got else None
    if stage.adapter is not None and expected is None:
        return (
            _fail(stage, in_shape),
            ConfigIssue(
                f"{path}.adapter",
                f"stage {stage.name!r}: the module has no `in_width` attribute, so the adapter's output width is unknown",
                "give the module an `in_width` attribute",
            ),
            None,
        )
    if expected is not None and got is not None and expected != got and adapter_width is None:
        kwarg = next(
            (k for k, v in stage.model.kwargs().items() if k in _WIDTH_KWARGS and v == expected), "in_channels"
        )
        fix = f"set {path}.model.{kwarg}: {got}, or add {path}.adapter: {{type: linear}} to learn a projection"
        if index == 0 and len(in_shape) == 3 and in_shape[-1] == expected and in_shape[0] != expected:
            # (H, W, C) declared where stages take (C, H, W): matching the width would train on scrambled images
            chw = [in_shape[-1], *in_shape[:-1]]
            store = (
                " (with one channel a flat row is the same in both orders)"
                if expected == 1
                else " and write the rows as (C, H, W) (numpy: x.transpose(0, 3, 1, 2))"
            )
            fix = (
                f"data.inputs.shape {list(in_shape)} puts the channels last, but stages take (C, H, W): if the rows "
                f"are channels-last images, set data.inputs.shape: {chw}{store}; if they really are (C, H, W), {fix}"
            )
        return (
            _fail(stage, in_shape),
            ConfigIssue(
                f"{path}.model.{kwarg}",
                f"stage {stage.name!r} ({stage.model.type}) expects input width {expected}, but {producer} outputs "
                f"shape {_fmt(in_shape)} (width {got})",
                fix,
            ),
            None,
        )
    x = torch.empty((_PREFLIGHT_BATCH, *in_shape))
    try:
        adapter = build_adapter(stage.adapter, in_shape, adapter_width)
        try:
            out = module(adapter(x) if adapter is not None else x)
        except Exception as exc:  # retried on the CPU when meta was the cause
            if not _needs_values(exc):
                raise
            # data-dependent control flow (`if y.mean() > 0:`) needs values: one real batch of zeros on the CPU
            with torch.device("cpu"):
                module = build_module(stage.model.type, stage.model.kwargs(), trusted)
                adapter = build_adapter(stage.adapter, in_shape, adapter_width)
                x = torch.zeros((_PREFLIGHT_BATCH, *in_shape))
                with torch.no_grad():
                    out = module(adapter(x) if adapter is not None else x)
    except Exception as exc:  # noqa: BLE001 - user modules fail in their own words: report them with the shapes
        return (
            _fail(stage, in_shape),
            ConfigIssue(
                f"{path}.model",
                f"stage {stage.name!r} ({stage.model.type}) fails on input shape {_fmt(in_shape)} from {producer}: {exc}",
                f"make the module accept {_fmt(in_shape)}"
                + (f", add {path}.adapter" if expected is not None else "")  # an adapter needs the module's in_width
                + (", or set data.inputs.shape" if index == 0 else ""),
            ),
            None,
        )
    issue = _output_issue(stage, path, out)
    if issue is not None:
        return _fail(stage, in_shape), issue, None
    out_shape = tuple(out.shape[1:])
    try:
        with torch.device(out.device):  # meta, or the CPU after a module that needed values
            logits = build_head(stage.head, out_shape, num_classes)(out)
    except Exception as exc:  # noqa: BLE001 - the head's own error on an output it cannot reduce
        logits, head_error = None, exc
    if logits is None or tuple(logits.shape) != (_PREFLIGHT_BATCH, num_classes):
        got = f"fails ({head_error})" if logits is None else f"outputs {_fmt(tuple(logits.shape[1:]))}"
        said = f"stage {stage.name!r}: the head on the module's output {_fmt(out_shape)} {got}, not ({num_classes},)"
        if stage.head.type == "none":
            return (
                _fail(stage, in_shape),
                ConfigIssue(
                    f"{path}.head.type",
                    f"{said}: with head.type none the module must output one value per class / regression value",
                    f"use {path}.head.type: linear",
                ),
                None,
            )
        return (
            _fail(stage, in_shape),
            ConfigIssue(
                f"{path}.head.pool",
                f"{said}: head.pool {stage.head.pool} reduces (B, D), (B, T, D) and (B, C, H, W) outputs only",
                f"set {path}.head.pool: flatten (any shape), or make the module output (B, D), (B, T, D) or "
                "(B, C, H, W)",
            ),
            None,
        )
    return StagePlan(stage.name, in_shape, out_shape, adapter_width), None, module


# what torch says when a module needs the values of a meta tensor (Tensor.item(), bool(), .tolist(), ...)
_META_VALUES = ("meta tensor", "on meta", "meta device")


def _needs_values(exc: Exception) -> bool:
    """`exc` came from running a module on the meta device, which has shapes but no values."""
    return any(said in str(exc) for said in _META_VALUES)


def _output_issue(stage: StageConfig, path: str, out: Any) -> ConfigIssue | None:
    """What is wrong with a stage module's output as the next stage and the head take it: one tensor of
    shape (B, features...); None when it is one."""
    if not isinstance(out, torch.Tensor):
        return ConfigIssue(
            f"{path}.model",
            f"stage {stage.name!r} ({stage.model.type}) returns a {type(out).__name__}, not a tensor: the stage's "
            "head and the next stage take one tensor of shape (B, ...)",
            "make the module's forward return one tensor (e.g. the features element of a tuple)",
        )
    if out.dim() < 2:
        return ConfigIssue(
            f"{path}.model",
            f"stage {stage.name!r} ({stage.model.type}) returns "
            + ("shape (B,): one number per sample" if out.dim() == 1 else "one number for the whole batch")
            + ", with no feature dimension",
            "make the module's forward return (B, D), (B, T, D) or (B, C, H, W) (e.g. x.unsqueeze(1) for one feature)",
        )
    return None


def _fail(stage: StageConfig, in_shape: tuple[int, ...]) -> StagePlan:
    return StagePlan(stage.name, in_shape, in_shape, None)


def _fmt(shape: Sequence[int]) -> str:
    return "(B, " + ", ".join(str(s) for s in shape) + ")"
