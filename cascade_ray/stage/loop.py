"""The training loop of one stage, readable top to bottom.

``run_stage`` knows nothing about Ray: a :class:`Reporter` carries metrics and
checkpoints out and does cross-rank sums, so the same loop runs under Ray Train
(:mod:`cascade_ray.stage.worker`) and in-process in tests and tools.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from cascade_ray.config.schema import PipelineConfig, StageConfig
from cascade_ray.data import DataSplits
from cascade_ray.data.batches import ArraySource, accumulation_windows, augment, eval_batches, train_batches
from cascade_ray.errors import ConfigError
from cascade_ray.hardware import Hardware, detect_hardware
from cascade_ray.models.cascade import CascadeModel, build_cascade, module_stage_names
from cascade_ray.models.freeze import TrainablePlan, apply_freeze, frozen_digest, plan_trainable
from cascade_ray.models.plan import require_plans
from cascade_ray.models.weights import load_numpy_state, load_state_file
from cascade_ray.solver import (
    EarlyStopping,
    build_optimizer,
    build_param_groups,
    build_precision,
    build_scheduler,
    clip_gradients,
    stage_step_issues,
    total_optimizer_steps,
)
from cascade_ray.solver.precision import (
    CompileState,
    choose_memory_format,
    compile_stage,
    emulated_bf16_detail,
    probe_slowdown,
)
from cascade_ray.stage.hooks import LoopHooks, LoopState
from cascade_ray.stage.monitor import HealthMonitor
from cascade_ray.stage.resume import restore_trainer_state, trainer_state


class Reporter(Protocol):
    """Where a stage loop sends its results (Ray Train, or a list in tests)."""

    rank: int
    world: int

    def all_sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks."""

    def report(
        self, metrics: dict[str, float], state: Mapping[str, torch.Tensor] | None, trainer: dict[str, Any] | None = None
    ) -> None:
        """Publish one epoch's metrics; rank 0 passes the model and trainer state to checkpoint."""


@dataclass(frozen=True)
class StageOutcome:
    """What rank 0 returns to the driver."""

    trainable_params: int  # excluding the uncertainty-weighting log-variances
    frozen_params: int
    frozen_digest: dict[str, str]
    steps: int
    world_size: int
    history: list[dict[str, float]]
    health_warnings: int = 0
    skipped_steps: int = 0
    precision: dict[str, Any] | None = None  # PrecisionChoice.record(): requested, resolved, reason, hardware
    memory_format: str = "contiguous"
    compile: dict[str, Any] | None = None  # CompileState.record(), when stages[i].compile is true


def stage_seed(cfg: PipelineConfig, index: int) -> int:
    """Seed of stage `index`: distinct per stage, fixed by the pipeline seed."""
    return cfg.seed * 1009 + index


def build_stage_model(
    cfg: PipelineConfig, index: int, data: DataSplits, upstream: Mapping[str, np.ndarray] | None
) -> tuple[CascadeModel, TrainablePlan]:
    """The composed model for stage `index` with upstream weights loaded and frozen."""
    plans = require_plans(cfg, data.image_shape, data.num_classes)
    torch.manual_seed(stage_seed(cfg, index))
    model = build_cascade(cfg, plans, data.num_classes, upto=index)
    stage = cfg.stages[index]
    if stage.pretrained is not None:
        model.blocks[stage.name].load_state_dict(load_state_file(stage.pretrained))
    if upstream is not None:
        own = {k for k in model.state_dict() if k.split(".")[1] == stage.name}
        missing, unexpected = _load_upstream(model, upstream)
        if set(missing) != own or unexpected:
            raise RuntimeError(
                f"upstream weights do not fit stage {stage.name!r}: missing {sorted(set(missing) - own)[:5]}, unexpected {unexpected[:5]}"
            )
    plan = plan_trainable(model, cfg, index)
    apply_freeze(model, plan)
    return model, plan


def _load_upstream(model: nn.Module, upstream: Mapping[str, np.ndarray]) -> tuple[list[str], list[str]]:
    keys = set(model.state_dict())
    load_numpy_state(model, {k: v for k, v in upstream.items() if k in keys}, strict=False)
    missing = [k for k in keys if k not in upstream]
    return missing, [k for k in upstream if k not in keys]


def run_stage(
    cfg: PipelineConfig,
    index: int,
    data: DataSplits,
    upstream: Mapping[str, np.ndarray] | None,
    reporter: Reporter,
    device: torch.device,
    wrap=None,
    hooks: LoopHooks | None = None,
    resume: Mapping[str, Any] | None = None,
    features: Mapping[str, np.ndarray] | None = None,
    hardware: Hardware | None = None,
) -> StageOutcome:
    """Train stage `index` on top of the frozen `upstream` weights.

    Args:
        cfg: the validated pipeline config.
        index: which stage to train.
        data: the splits (arrays may be read-only object-store views).
        upstream: numpy state dict of every earlier stage, or None for the first.
        reporter: receives per-epoch metrics and checkpoints.
        device: where to train.
        wrap: optional callable that wraps the model for distributed training (DDP).
        hooks: optional callbacks for tools and failure simulations (:mod:`cascade_ray.stage.hooks`).
        resume: ``{"model": numpy state, "trainer": trainer_state}`` of the last checkpoint when
            a restarted worker group continues the stage (:mod:`cascade_ray.stage.resume`).
        features: ``{"x_train", "x_val"}``: the frozen upstream's outputs for every sample
            (:mod:`cascade_ray.pipeline.features`); the model then starts at this stage's own
            adapter/module and the upstream is not run.
        hardware: what `device` runs natively (precision auto, memory format); default detected.

    Raises:
        ConfigError: a schedule length or the precision does not fit this run.
        HealthError: a health rule with policy ``error`` fired (``FrozenDriftError`` for frozen drift).
    """
    stage, path = cfg.stages[index], f"stages[{index}]"
    solver, train = stage.solver, stage.train
    hooks = hooks or LoopHooks()
    _check_step_counts(stage, index, len(data.y_train), reporter)

    # the model with its frozen upstream, and the solver over what this stage trains
    model, plan = build_stage_model(cfg, index, data, upstream)
    model.to(device)
    hw = hardware if hardware is not None else detect_hardware(device)
    precision = build_precision(solver, device, f"{path}.solver", hooks.make_scaler, hw)
    memory_format, format_why = choose_memory_format(stage, hw, precision.name, model)
    if memory_format == "channels_last":
        model.to(memory_format=torch.channels_last)  # in place: the same Parameter objects
    compiled = _compile(model, stage, path, device) if stage.compile else None
    if reporter.rank == 0:
        assert precision.choice is not None
        print(f"{precision.choice.line(stage.name)}; memory format {memory_format} ({format_why})", flush=True)
        if compiled is not None and compiled.status == "eager":
            print(f"WARNING {compiled.message}", flush=True)
    digest = frozen_digest(model, plan)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    log_vars = (
        nn.Parameter(torch.zeros(len(model.order), device=device)) if stage.loss.weighting == "uncertainty" else None
    )
    if log_vars is not None:
        named.append(("loss.log_vars", log_vars))
    params = [p for _, p in named]
    optimizer = build_optimizer(build_param_groups(named, solver, f"{path}.solver", stage.name), solver)
    total_steps = total_optimizer_steps(stage, len(data.y_train), reporter.world)
    scheduler = build_scheduler(optimizer, solver.lr_scheduler, total_steps)
    net = wrap(model) if wrap is not None else model
    monitor = HealthMonitor(
        stage, index, named, optimizer, scheduler, precision, model, plan, reporter.rank, reporter.all_sum
    )
    state = LoopState(
        stage,
        index,
        model,
        net,
        plan,
        named,
        optimizer,
        scheduler,
        precision,
        monitor,
        rank=reporter.rank,
        world=reporter.world,
        total_steps=total_steps,
    )
    if precision.choice is not None and precision.choice.emulated and stage.health.emulated_bf16.policy != "off":
        monitor.fire("emulated_bf16", 0, *emulated_bf16_detail(hw, path, probe_slowdown(hw)))
    hooks.on_setup(state)

    train_src, val_src = _sources(model, stage.name, data, features, device)
    heads = module_stage_names(cfg, index) if stage.type == "joint" else [stage.name]
    weights = stage.loss.weights or {}
    scales = {n: weights.get(n, cfg.stages[cfg.stage_index(n)].loss.scale) for n in heads}
    if train.sanity_val_steps:  # a broken evaluation fails now, not after the first epoch
        evaluate(model, val_src, heads[-1], stage, reporter, prefix="sanity_", max_batches=train.sanity_val_steps)
    stopper = EarlyStopping(train.early_stopping)
    start_epoch, step, stop, history = 0, 0, False, []
    if resume is not None:  # a restarted worker group: continue after its last checkpoint
        load_numpy_state(model, resume["model"])
        start_epoch, step, monitor.skipped, history = restore_trainer_state(
            resume["trainer"], optimizer, scheduler, precision, stopper, stage.name
        )
        monitor.scheduled = scheduler.steps
        if reporter.rank == 0:
            print(f"[{stage.name}] resumed after epoch {start_epoch} at optimizer step {step}", flush=True)
    for epoch in range(start_epoch, train.epochs):
        model.train()
        monitor.start_epoch(step)
        state.epoch = epoch
        started, seen, epoch_steps, loss_sum = time.perf_counter(), 0, 0, torch.zeros(len(heads) + 1, device=device)
        step_rows, logged = [], (0, 0.0)  # rank 0's per-step rows of this epoch; (samples, loss sum) at the last row
        batches = list(
            train_batches(
                len(train_src),
                train.batch_size,
                rank=reporter.rank,
                world=reporter.world,
                seed=stage_seed(cfg, index),
                epoch=epoch,
            )
        )
        for batch, window, last in accumulation_windows(batches, solver.accumulation_steps):
            x, y = train_src.batch(batch)
            if train.augment.enabled:
                x = augment(x, train.augment)
            # under DDP, all-reduce gradients only once per window, on its last micro-batch
            with net.no_sync() if not last and isinstance(net, DistributedDataParallel) else nullcontext():
                with precision.autocast():
                    loss, terms = stage_loss(net, x, y, stage, scales, log_vars)
                precision.backward(loss / window)  # the window's gradient is the mean of its micro-batches'
            seen += len(y)
            loss_sum += torch.stack([loss.detach(), *[t.detach() for t in terms]]).float() * len(y)
            state.loss = loss
            hooks.after_backward(state)
            if not last:
                continue
            # one optimizer step per window: unscale (fp16), clip, step, then the schedule
            precision.unscale(optimizer)
            hooks.before_optimizer_step(state)
            clip_norm = clip_gradients(params, solver.grad_clip)
            monitor.before_step(step + 1, clip_norm)
            skipped = precision.step(optimizer)
            if not skipped:  # a step the fp16 scaler skipped does not advance the lr plan
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step, epoch_steps = step + 1, epoch_steps + 1
            state.step = step
            monitor.after_step(step, skipped, loss_sum)
            hooks.after_optimizer_step(state)
            if reporter.rank == 0 and step % train.log_interval == 0:
                elapsed = time.perf_counter() - started
                loss_total = loss_sum[0].item()  # the one device sync of a logged step
                state.row = {
                    "kind": "step",
                    "epoch": epoch + 1,
                    "step": step,
                    "train_loss": (loss_total - logged[1]) / max(seen - logged[0], 1),  # mean since the last row
                    "lr": scheduler.get_last_lr()[0],
                    **monitor.step_metrics(step),
                    "samples_per_s": seen * reporter.world / elapsed,
                }
                step_rows.append(state.row)
                logged = (seen, loss_total)
                if hooks.on_log is not None:
                    hooks.on_log(state)
                else:
                    eta = (total_steps - step) * elapsed / epoch_steps  # at this epoch's optimizer-step rate
                    print(
                        f"[{stage.name}] epoch {epoch + 1}/{train.epochs} step {step}/{total_steps} loss {state.row['train_loss']:.4f} "
                        f"lr {state.row['lr']:.3g} {state.row['samples_per_s']:.0f} samples/s ETA {eta:.0f} s",
                        flush=True,
                    )
            if train.max_steps is not None and step >= train.max_steps:
                stop = True
                break
        train_s = time.perf_counter() - started
        monitor.end_epoch(step, loss_sum, digest)
        sums = reporter.all_sum([float(seen), *loss_sum.tolist()])
        metrics = {
            "epoch": epoch + 1,
            "step": step,
            "optimizer_steps": epoch_steps,
            "train_loss": sums[1] / sums[0],
            "lr": scheduler.get_last_lr()[0],
            "samples_per_s": sums[0] / train_s,
        }
        if stage.type == "joint":
            metrics |= {f"loss/{n}": sums[2 + i] / sums[0] for i, n in enumerate(heads)}
        metrics |= evaluate(model, val_src, heads[-1], stage, reporter, prefix="val_")
        metrics |= monitor.epoch_metrics()
        # the reported metrics stay flat; the history (summary, artifact manifest, resume state) also
        # carries this epoch's per-step rows, so they survive a reused stage (--resume)
        history.append(metrics | {"steps": step_rows} if step_rows else metrics)
        resumable = trainer_state(
            optimizer,
            scheduler,
            precision,
            stopper,
            epochs_done=epoch + 1,
            step=step,
            skipped=monitor.skipped,
            history=history,
        )
        reporter.report(
            metrics, model.state_dict() if reporter.rank == 0 else None, resumable if reporter.rank == 0 else None
        )
        if scheduler.step_epoch(metrics) and reporter.rank == 0:
            print(
                f"[{stage.name}] {solver.lr_scheduler.monitor} plateaued: lr now {scheduler.get_last_lr()[0]:.3g}",
                flush=True,
            )
        if stopper.update(metrics):
            if reporter.rank == 0:
                print(f"[{stage.name}] {stopper.reason()}", flush=True)
            break
        if stop:
            break
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if compiled is not None:
        compiled.finish()
    return StageOutcome(
        trainable,
        sum(p.numel() for p in model.parameters()) - trainable,
        digest,
        step,
        reporter.world,
        history,
        monitor.warning_count,
        monitor.skipped,
        precision.choice.record() if precision.choice is not None else None,
        memory_format,
        compiled.record() if compiled is not None else None,
    )


def _compile(model: CascadeModel, stage: StageConfig, path: str, device: torch.device) -> CompileState:
    """``stages[i].compile``: the stage's own module (every block for a joint stage), in place."""
    modules = [model.blocks[stage.name]] if stage.name in model.blocks else list(model.blocks.values())
    return compile_stage(modules, path, device)


def _sources(
    model: CascadeModel, stage: str, data: DataSplits, features: Mapping[str, np.ndarray] | None, device: torch.device
) -> tuple[ArraySource, ArraySource]:
    """Train and validation batches: raw images, or the cached upstream features of each sample
    (then `model` starts at `stage`)."""
    if features is None:
        return ArraySource(data.x_train, data.y_train, data.mean, data.std, device), ArraySource(
            data.x_val, data.y_val, data.mean, data.std, device
        )
    for split, labels in (("train", data.y_train), ("val", data.y_val)):
        if len(features[f"x_{split}"]) != len(labels):
            raise RuntimeError(
                f"stage {stage!r}: the feature cache holds {len(features[f'x_{split}'])} {split} samples, the data {len(labels)}"
            )
    model.input_stage = stage
    return ArraySource(features["x_train"], data.y_train, 0.0, 1.0, device), ArraySource(
        features["x_val"], data.y_val, 0.0, 1.0, device
    )


def _check_step_counts(stage: StageConfig, index: int, n_train: int, reporter: Reporter) -> None:
    """Schedule lengths against the real number of optimizer steps: errors raise, warnings print."""
    errors, warnings = stage_step_issues(stage, index, n_train, reporter.world)
    if errors:
        raise ConfigError(errors, source=f"stage {stage.name!r} ({n_train} training samples)")
    if reporter.rank == 0:
        for issue in warnings:
            print(f"WARNING config: {issue.render()}", flush=True)


def stage_loss(
    net: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    stage: StageConfig,
    scales: Mapping[str, float],
    log_vars: torch.Tensor | None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The stage's training loss and its per-head terms (`scales`: head -> loss.scale, in order).

    One head: ``scale * CE``. A joint stage sums ``scale_i * CE_i`` over its heads, or with
    learned uncertainty weighting ``exp(-s_i) * scale_i * CE_i + s_i``.
    """
    outs = net(x, heads=list(scales))
    terms = [F.cross_entropy(outs[n], y, label_smoothing=stage.loss.label_smoothing) for n in scales]
    if log_vars is None:
        return sum(s * t for s, t in zip(scales.values(), terms)), terms  # type: ignore[return-value]
    return sum(
        torch.exp(-log_vars[i]) * s * t + log_vars[i] for i, (s, t) in enumerate(zip(scales.values(), terms))
    ), terms  # type: ignore[return-value]


@torch.no_grad()
def evaluate(
    model: CascadeModel,
    source: ArraySource,
    head: str,
    stage: StageConfig,
    reporter: Reporter,
    prefix: str,
    max_batches: int | None = None,
) -> dict[str, float]:
    """Loss and accuracy of `head` over a split (its first `max_batches` batches), summed across ranks."""
    was_training = model.training
    model.eval()
    loss, correct, count = 0.0, 0.0, 0.0
    for batch in itertools.islice(
        eval_batches(len(source), stage.train.eval_batch_size, rank=reporter.rank, world=reporter.world), max_batches
    ):
        x, y = source.batch(batch)
        logits = model(x, heads=[head])[head]
        loss += F.cross_entropy(logits, y, reduction="sum").item()
        correct += (logits.argmax(1) == y).sum().item()
        count += len(y)
    model.train(was_training)
    loss, correct, count = reporter.all_sum([loss, correct, count])
    return {
        f"{prefix}loss": loss / count if count else math.nan,
        f"{prefix}accuracy": correct / count if count else math.nan,
    }
