"""One stage's setup: everything a stage trains with, built in one place.

``run_stage``, ``cascade-ray lr-find`` and ``cascade-ray diagnose`` (which runs
``run_stage``) all call :func:`setup_stage`, so the model they train, its parameter
groups, the loss (``loss.scale``, ``loss.weights``, uncertainty weighting) and the
precision cannot drift apart between the loop and the tools.

The order of the steps matters for reproducibility: the model is built right after
seeding torch (:func:`build_stage_model`), and nothing after it draws random numbers.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from cascade_ray.config.schema import PipelineConfig, StageConfig
from cascade_ray.data import DataSplits
from cascade_ray.data.splits import DataInfo
from cascade_ray.hardware import Hardware, detect_hardware
from cascade_ray.models.cascade import CascadeModel, build_cascade, module_stage_names
from cascade_ray.models.checkpointing import checkpoint_blocks
from cascade_ray.models.freeze import TrainablePlan, apply_freeze, plan_trainable
from cascade_ray.models.losses import build_loss
from cascade_ray.models.plan import require_plans
from cascade_ray.models.pretrained import load_pretrained
from cascade_ray.models.weights import SHARED_KEYS_ATTR, load_numpy_state, share_numpy_state, share_tensors
from cascade_ray.solver import (
    LrSchedule,
    Precision,
    build_optimizer,
    build_param_groups,
    build_precision,
    build_scheduler,
    total_optimizer_steps,
)
from cascade_ray.solver.precision import CompileState, choose_memory_format, compile_stage
from cascade_ray.solver.step import ScalerFactory
from cascade_ray.stage.allocator import keep_freed_memory
from cascade_ray.stage.sharding import shard_trainable


@dataclass(frozen=True, kw_only=True)
class StageSetup:
    """What stage `index` trains, and with what; built by :func:`setup_stage`.

    Frozen: the fields are never reassigned (the optimizer, schedule and precision
    objects themselves keep their running state).

    Attributes:
        stage: the stage's config; index: its position in ``cfg.stages``.
        device: where the model and the loss's log-variances live.
        model: the composed model, upstream loaded and frozen, on `device`.
        plan: what the stage trains and what is frozen.
        named_params: the trainable (name, parameter) pairs in optimizer order, the
            uncertainty-weighting log-variances last (``loss.log_vars``).
        optimizer: over ``build_param_groups(named_params)``.
        total_steps: optimizer steps the stage plans on `world` ranks (all epochs).
        scheduler: the lr plan over `total_steps` (it has set each group's lr to step 0's).
        precision: autocast, backward, loss scaling and the optimizer step.
        scales: head -> loss multiplier, in head order (``loss.weights`` over each stage's
            ``loss.scale``); the last head is the one evaluated.
        log_vars: the learned log-variances of ``loss.weighting: uncertainty``, else None.
        hardware: what `device` runs natively (it decided precision auto and memory_format auto).
        memory_format: ``channels_last`` or ``contiguous``, and memory_format_reason why.
        compiled: the torch.compile state when ``stages[i].compile`` is true, else None.
        criterion: the training loss module (``stages[i].loss.type``), eval_loss the same
            without label smoothing; target_kind and out_width describe what the heads predict.
        checkpointed_blocks: the blocks ``train.activation_checkpointing`` recomputes in backward
            (0: off).
    """

    stage: StageConfig
    index: int
    device: torch.device
    model: CascadeModel
    plan: TrainablePlan
    named_params: list[tuple[str, nn.Parameter]]
    optimizer: torch.optim.Optimizer
    total_steps: int
    scheduler: LrSchedule
    precision: Precision
    scales: dict[str, float]
    log_vars: nn.Parameter | None
    hardware: Hardware
    memory_format: str
    memory_format_reason: str
    compiled: CompileState | None
    criterion: nn.Module
    eval_loss: nn.Module
    target_kind: str
    out_width: int
    checkpointed_blocks: int = 0

    def precision_line(self) -> str:
        """``features: precision auto -> fp32 (CPU AVX2: bf16 would be emulated); memory format ...``"""
        choice = self.precision.choice
        head = (
            choice.line(self.stage.name)
            if choice is not None
            else f"{self.stage.name}: precision {self.precision.name}"
        )
        line = f"{head}; memory format {self.memory_format} ({self.memory_format_reason})"
        if self.checkpointed_blocks:
            line += f"; activation checkpointing: {self.checkpointed_blocks} blocks recomputed in backward"
        return line

    @property
    def params(self) -> list[nn.Parameter]:
        """The trainable parameters (what is clipped and measured), in optimizer order."""
        return [p for _, p in self.named_params]

    @property
    def heads(self) -> list[str]:
        """The heads the loss is taken on (one, or every module stage of a joint stage)."""
        return list(self.scales)

    def loss(self, net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The training loss of one micro-batch and its per-head terms (see :func:`stage_loss`).

        `net` is what forward runs on: the model, or its DDP wrapper.
        """
        return stage_loss(net, x, y, self.criterion, self.scales, self.log_vars)


def setup_stage(
    cfg: PipelineConfig,
    index: int,
    data: DataSplits | DataInfo,
    upstream: Mapping[str, np.ndarray] | None,
    device: torch.device,
    *,
    world: int = 1,
    make_scaler: ScalerFactory | None = None,
    hardware: Hardware | None = None,
    shard: bool = False,
    frozen: Mapping[str, torch.Tensor] | None = None,
) -> StageSetup:
    """Build stage `index`'s model, solver and loss for a run on `world` ranks.

    Args:
        cfg: the validated pipeline config.
        index: which stage.
        data: the splits (for shapes and the number of training samples).
        upstream: numpy state dict of every earlier stage, or None (freshly initialized).
        device: where to train.
        world: ranks the stage runs on (the lr plan's length depends on it).
        make_scaler: replaces the CUDA GradScaler under fp16 (``LoopHooks.make_scaler``).
        hardware: what `device` runs natively; default detected (tests inject a capability).
        shard: a worker of a distributed run (process group up): with ``scaling.strategy: fsdp``
            and `world` > 1 the trainable layers are sharded (:mod:`cascade_ray.stage.sharding`).
        frozen: another model's frozen upstream tensors from the same `upstream`, already on `device`
            (``models.weights.frozen_views``): this model holds those instead of its own copies (a
            batched sweep's replicas on a GPU: one host-to-device copy for all of them).

    Raises:
        ConfigError: the precision does not fit `device`.
    """
    stage, path = cfg.stages[index], f"stages[{index}]"
    solver = stage.solver

    # the model: upstream loaded and frozen, then moved (the frozen digest is taken on `device`).
    # On the CPU frozen upstream tensors stay views of `upstream` (no copy: .to is a no-op);
    # on a GPU .to makes the one host-to-device copy per worker
    model, plan = build_stage_model(cfg, index, data, upstream)
    if frozen:  # the same bytes (both views of `upstream`), already on `device`: .to leaves them there
        share_tensors(model, {k: frozen[k] for k in getattr(model, SHARED_KEYS_ATTR, frozenset()) if k in frozen})
    model.to(device)
    if device.type == "cpu":
        keep_freed_memory()  # every step's tensors reused, not unmapped and faulted in again (stage/allocator.py)

    # precision (auto: what `device` runs natively), then the memory format and torch.compile it
    # implies; both act in place, so the parameters below are the ones the optimizer steps
    hw = hardware if hardware is not None else detect_hardware(device)
    precision = build_precision(solver, device, f"{path}.solver", make_scaler, hw, stage.scaling.strategy == "fsdp")
    # decided by the stage's own module (a Transformer over frozen ResNet features has no convolution
    # of its own); a joint stage trains every module, so all of them count
    own = model.blocks[stage.name] if stage.name in model.blocks else model  # noqa: SIM401 - ModuleDict has no get()
    memory_format, format_why = choose_memory_format(stage, hw, precision.name, own)
    if memory_format == "channels_last":
        # in place: the same Parameter objects. A module stage converts only its own (trainable)
        # module, so the frozen upstream stays shared with the object store; a joint stage
        # converts everything, and converting a frozen 4-d conv weight makes it a private copy
        # (a format change cannot be a view), still frozen and still in the digest
        own.to(memory_format=torch.channels_last)
    checkpointed = (
        sum(checkpoint_blocks(block) for block in _trained_blocks(model, cfg, index))
        if stage.train.activation_checkpointing
        else 0
    )
    compiled = _compile(model, stage, path, device) if stage.compile else None
    sharded = stage.scaling.strategy == "fsdp" and world > 1 and shard
    if sharded:  # after every in-place change, before the optimizer: the trainable Parameters become DTensors
        shard_trainable(model, plan, device, world)

    # the loss: which heads, how each is weighted, and the learned log-variances of
    # uncertainty weighting (trained with the model, so they join its parameter list)
    scales = loss_scales(cfg, index)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    log_vars = (
        nn.Parameter(torch.zeros(len(model.order), device=device)) if stage.loss.weighting == "uncertainty" else None
    )
    if log_vars is not None:
        named.append(("loss.log_vars", log_vars))

    # the solver over what this stage trains
    optimizer = build_optimizer(build_param_groups(named, solver, f"{path}.solver", stage.name), solver)
    total_steps = total_optimizer_steps(stage, data.n_train, world)
    scheduler = build_scheduler(optimizer, solver.lr_scheduler, total_steps)

    return StageSetup(
        stage=stage,
        index=index,
        device=device,
        model=model,
        plan=plan,
        named_params=named,
        optimizer=optimizer,
        total_steps=total_steps,
        scheduler=scheduler,
        precision=precision,
        scales=scales,
        log_vars=log_vars,
        hardware=hw,
        memory_format=memory_format,
        memory_format_reason=format_why,
        compiled=compiled,
        criterion=build_loss(stage.loss, data.target_kind, trusted=cfg.trusted_modules),
        eval_loss=build_loss(stage.loss, data.target_kind, training=False, trusted=cfg.trusted_modules),
        target_kind=data.target_kind,
        out_width=data.out_width,
        checkpointed_blocks=checkpointed,
    )


def _trained_blocks(model: CascadeModel, cfg: PipelineConfig, index: int) -> list[nn.Module]:
    """The stage modules whose blocks ``train.activation_checkpointing`` checkpoints: a module stage's
    own; a joint stage's, every module with a trainable parameter."""
    stage = cfg.stages[index]
    if stage.name in model.blocks:
        return [model.blocks[stage.name]]
    return [m for m in model.blocks.values() if any(p.requires_grad for p in m.parameters())]


def _compile(model: CascadeModel, stage: StageConfig, path: str, device: torch.device) -> CompileState:
    """``stages[i].compile``: the stage's own module (every block for a joint stage), in place."""
    modules = [model.blocks[stage.name]] if stage.name in model.blocks else list(model.blocks.values())
    return compile_stage(modules, path, device)


def stage_seed(cfg: PipelineConfig, index: int) -> int:
    """Seed of stage `index`'s batch order: distinct per stage, fixed by the pipeline seed."""
    return cfg.seed * 1009 + index


def init_seed(cfg: PipelineConfig, index: int) -> int:
    """Seed of stage `index`'s initialization and training random streams: ``stages[i].seed`` when
    set, else :func:`stage_seed` (so a stage without one trains exactly as before the key existed)."""
    own = cfg.stages[index].seed
    return stage_seed(cfg, index) if own is None else own


def build_stage_model(
    cfg: PipelineConfig,
    index: int,
    data: DataSplits | DataInfo,
    upstream: Mapping[str, np.ndarray] | None,
    log: Callable[[str], None] = print,
) -> tuple[CascadeModel, TrainablePlan]:
    """The composed model for stage `index` with upstream weights loaded and frozen (on the CPU).

    Frozen upstream parameters and buffers are views of `upstream`'s arrays, not copies
    (``models.weights.share_numpy_state``): the caller must not write those arrays while the
    model lives (a ``ray.get`` result is read-only shared memory).

    The stage's ``pretrained`` weights are mapped, checked (NaN/Inf too) and loaded into its
    module; `log` gets the notes (dtype casts, keys ``strict: false`` left out).
    """
    plans = require_plans(cfg, data.input_shape, data.out_width)
    torch.manual_seed(init_seed(cfg, index))
    model = build_cascade(cfg, plans, data.out_width, upto=index)
    stage = cfg.stages[index]
    if stage.pretrained is not None:
        for note in load_pretrained(model.blocks[stage.name], stage.pretrained, f"stages[{index}].pretrained"):
            log(f"note: {note}")
    plan = plan_trainable(model, cfg, index)  # from the model's structure only: no values read
    if upstream is not None:
        own = {k for k in model.state_dict() if k.split(".")[1] == stage.name}
        missing, unexpected = _load_upstream(model, upstream, plan.frozen_keys)
        if set(missing) != own or unexpected:
            raise RuntimeError(
                f"upstream weights do not fit stage {stage.name!r}: missing {sorted(set(missing) - own)[:5]}, unexpected {unexpected[:5]}"
            )
    apply_freeze(model, plan)
    return model, plan


def _load_upstream(
    model: nn.Module, upstream: Mapping[str, np.ndarray], frozen_keys: tuple[str, ...]
) -> tuple[list[str], list[str]]:
    """Frozen upstream entries become views of `upstream`'s arrays (the object store's shared
    memory in a Ray worker: one copy per node); upstream layers the stage trains
    (``trainable_layers``) are copied, as the optimizer writes them."""
    keys = set(model.state_dict())
    present = {k: v for k, v in upstream.items() if k in keys}
    shared = set(share_numpy_state(model, present, [k for k in frozen_keys if k in present]))
    load_numpy_state(model, {k: v for k, v in present.items() if k not in shared}, strict=False)
    missing = [k for k in keys if k not in upstream]
    return missing, [k for k in upstream if k not in keys]


def loss_scales(cfg: PipelineConfig, index: int) -> dict[str, float]:
    """Head -> loss multiplier of stage `index`, in head order.

    A module stage has its own head at its ``loss.scale``. A joint stage has every module
    stage's head; its ``loss.weights`` name a multiplier per head, and a head it does not
    name keeps that stage's own ``loss.scale``.
    """
    stage = cfg.stages[index]
    heads = module_stage_names(cfg, index) if stage.type == "joint" else [stage.name]
    weights = stage.loss.weights or {}
    return {n: weights.get(n, cfg.stages[cfg.stage_index(n)].loss.scale) for n in heads}


def stage_loss(
    net: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    criterion: nn.Module,
    scales: Mapping[str, float],
    log_vars: torch.Tensor | None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The stage's training loss and its per-head terms (`scales`: head -> multiplier, in order).

    One head: ``scale * L`` with `criterion` L (``stages[i].loss.type``). A joint stage sums
    ``scale_i * L_i`` over its heads, or with learned uncertainty weighting
    ``exp(-s_i) * scale_i * L_i + s_i``.
    """
    outs = net(x, heads=list(scales))
    terms = [criterion(outs[n].float(), y) for n in scales]
    if log_vars is None:
        parts = [s * t for s, t in zip(scales.values(), terms)]
    else:
        parts = [torch.exp(-log_vars[i]) * s * t + log_vars[i] for i, (s, t) in enumerate(zip(scales.values(), terms))]
    # summed from the first part, not from 0: the same value to the bit (0 + a == a) without an
    # extra add kernel per step, which a GPU step pays for in launch time
    return functools.reduce(operator.add, parts), terms
