"""The training loop of one stage, readable top to bottom.

``run_stage`` knows nothing about Ray: a :class:`Reporter` carries metrics and
checkpoints out and does cross-rank sums, so the same loop runs under Ray Train
(:mod:`cascade_ray.stage.worker`) and in-process in tests and tools.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from cascade_ray.config.schema import PipelineConfig, StageConfig
from cascade_ray.data import DataSplits
from cascade_ray.data.batches import ArraySource, BatchSource, accumulation_windows, augment
from cascade_ray.data.splits import DataInfo
from cascade_ray.errors import ConfigError
from cascade_ray.hardware import Hardware
from cascade_ray.models.cascade import CascadeModel
from cascade_ray.models.freeze import frozen_digest
from cascade_ray.models.metrics import EvalMetrics
from cascade_ray.models.weights import load_numpy_state
from cascade_ray.solver import EarlyStopping, clip_gradients, stage_step_issues
from cascade_ray.solver.precision import emulated_bf16_detail, probe_slowdown
from cascade_ray.stage.hooks import LoopHooks, LoopState
from cascade_ray.stage.monitor import HealthMonitor
from cascade_ray.stage.resume import frozen_reference, restore_trainer_state, trainer_state
from cascade_ray.stage.setup import StageSetup, setup_stage, stage_seed
from cascade_ray.stage.sharding import (
    full_model_state,
    full_optimizer_state,
    is_sharded,
    load_full_model_state,
    load_full_optimizer_state,
    unsharded,
)


class Reporter(Protocol):
    """Where a stage loop sends its results (Ray Train, or a list in tests)."""

    rank: int
    world: int

    def all_sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks."""

    def report(
        self,
        metrics: dict[str, float],
        state: Mapping[str, torch.Tensor] | None,
        trainer: dict[str, Any] | None = None,
        frozen: Mapping[str, str] | None = None,
    ) -> None:
        """Publish one epoch's metrics; rank 0 passes the model and trainer state to checkpoint, and
        `frozen` (key -> digest): the frozen entries of the state a checkpoint may name instead of hold."""


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
    resumed_from_epoch: int | None = None  # epochs done at the checkpoint training last resumed from


def run_stage(
    cfg: PipelineConfig,
    index: int,
    data: DataSplits | DataInfo,
    upstream: Mapping[str, np.ndarray] | None,
    reporter: Reporter,
    device: torch.device,
    wrap=None,
    hooks: LoopHooks | None = None,
    resume: Mapping[str, Any] | None = None,
    features: Mapping[str, np.ndarray] | None = None,
    hardware: Hardware | None = None,
    sources: tuple[BatchSource, BatchSource] | None = None,
    input_stage: str | None = None,
    upstream_digests: Mapping[str, str] | None = None,
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
        sources: (train, val) batch sources when the rows are streamed (``data`` is then a
            :class:`~cascade_ray.data.splits.DataInfo`); default the in-memory arrays of `data`.
        input_stage: with `sources` streaming a stage's cached upstream features
            (:mod:`cascade_ray.pipeline.stream_cache`): the stage the model's forward starts at.
        upstream_digests: `upstream`'s tensor digests as the driver's hand-off carries them (its
            verified artifact manifest's): the frozen digest every epoch is checked against takes
            them for the entries the model shares with `upstream` instead of hashing them.

    Raises:
        ConfigError: a schedule length or the precision does not fit this run.
        HealthError: a health rule with policy ``error`` fired (``FrozenDriftError`` for frozen drift).
    """
    stage, train = cfg.stages[index], cfg.stages[index].train
    hooks = hooks or LoopHooks()
    _check_step_counts(stage, index, data.n_train, reporter)  # before anything is built

    # model, solver and loss, built exactly as lr-find builds them (cascade_ray.stage.setup)
    setup = setup_stage(
        cfg,
        index,
        data,
        upstream,
        device,
        world=reporter.world,
        make_scaler=hooks.make_scaler,
        hardware=hardware,
        shard=reporter.world > 1,
    )
    model = setup.model
    if reporter.rank == 0:  # what precision auto and memory_format auto chose here, and why
        print(setup.precision_line(), flush=True)
        if is_sharded(model):
            print(f"{stage.name}: fsdp: trainable layers sharded over {reporter.world} workers", flush=True)
        if setup.compiled is not None and setup.compiled.status == "eager":
            print(f"WARNING {setup.compiled.message}", flush=True)
    # the frozen weights as they must still be at every epoch's end: the hand-off's own, where shared
    digest = frozen_digest(model, setup.plan, upstream_digests)
    # DDP wraps the model; FSDP sharded it in place (setup_stage), so forward runs on the model itself
    net = wrap(model) if wrap is not None and not is_sharded(model) else model
    monitor = HealthMonitor.for_setup(setup, rank=reporter.rank, all_sum=reporter.all_sum)
    state = LoopState(
        stage=stage,
        index=index,
        model=model,
        net=net,
        plan=setup.plan,
        named_params=setup.named_params,
        optimizer=setup.optimizer,
        scheduler=setup.scheduler,
        precision=setup.precision,
        monitor=monitor,
        rank=reporter.rank,
        world=reporter.world,
        total_steps=setup.total_steps,
    )
    choice = setup.precision.choice
    if choice is not None and choice.emulated and stage.health.emulated_bf16.policy != "off":
        hw = setup.hardware
        monitor.fire("emulated_bf16", 0, *emulated_bf16_detail(hw, f"stages[{index}]", probe_slowdown(hw)))
    hooks.on_setup(state)

    train_src, val_src = sources if sources is not None else _sources(model, stage.name, data, features, device)
    if input_stage is not None:
        model.input_stage = input_stage
    if train.sanity_val_steps:  # a broken evaluation fails now, not after the first epoch
        evaluate(setup, val_src, reporter, prefix="sanity_", max_batches=train.sanity_val_steps)
    stopper = EarlyStopping(train.early_stopping)
    start_epoch, step, history = 0, 0, []
    if resume is not None:  # a restarted worker group: continue after its last checkpoint
        sharded = is_sharded(model)
        (load_full_model_state if sharded else load_numpy_state)(model, resume["model"])
        start_epoch, step, monitor.skipped, history = restore_trainer_state(
            resume["trainer"],
            setup.optimizer,
            setup.scheduler,
            setup.precision,
            stopper,
            stage.name,
            load_optimizer=(lambda o: load_full_optimizer_state(model, setup.optimizer, o)) if sharded else None,
        )
        monitor.scheduled = setup.scheduler.steps
        if reporter.rank == 0:
            print(f"[{stage.name}] resumed after epoch {start_epoch} at optimizer step {step}", flush=True)

    for epoch in range(start_epoch, train.epochs):
        run = _train_epoch(
            setup, state, hooks, reporter, train_src, seed=stage_seed(cfg, index), epoch=epoch, step=step
        )
        step = run.step
        metrics, frozen_now = _end_epoch(setup, state, reporter, run, val_src, digest, epoch=epoch)
        state.metrics = metrics
        hooks.on_epoch(state)
        # the reported metrics stay flat; the history (summary, artifact manifest, resume state) also
        # carries this epoch's per-step rows, so they survive a reused stage (--resume)
        history.append(metrics | {"steps": run.step_rows} if run.step_rows else metrics)
        _report(
            setup,
            stopper,
            reporter,
            metrics,
            history,
            epochs_done=epoch + 1,
            step=step,
            skipped=monitor.skipped,
            frozen=(digest, frozen_now),
        )
        if setup.scheduler.step_epoch(metrics) and reporter.rank == 0:
            print(
                f"[{stage.name}] {stage.solver.lr_scheduler.monitor} plateaued: lr now {setup.scheduler.get_last_lr()[0]:.3g}",
                flush=True,
            )
        if stopper.update(metrics):
            if reporter.rank == 0:
                print(f"[{stage.name}] {stopper.reason()}", flush=True)
            break
        if run.reached_max_steps:
            break

    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if setup.compiled is not None:
        setup.compiled.finish()
    return StageOutcome(
        trainable_params=trainable,
        frozen_params=sum(p.numel() for p in model.parameters()) - trainable,
        frozen_digest=digest,
        steps=step,
        world_size=reporter.world,
        history=history,
        health_warnings=monitor.warning_count,
        skipped_steps=monitor.skipped,
        precision=setup.precision.choice.record() if setup.precision.choice is not None else None,
        memory_format=setup.memory_format,
        compile=setup.compiled.record() if setup.compiled is not None else None,
        resumed_from_epoch=start_epoch if resume is not None else None,
    )


@dataclass
class _EpochRun:
    """What one epoch of steps leaves behind, on this rank."""

    step: int  # optimizer steps taken so far, all epochs
    optimizer_steps: int  # this epoch's
    seen: int  # samples this rank trained on
    loss_sum: torch.Tensor  # sample-weighted sums: [loss, *per-head terms]
    train_s: float  # wall time of the steps
    step_rows: list[dict[str, Any]]  # rank 0's per-step rows
    reached_max_steps: bool


def _train_epoch(
    setup: StageSetup,
    state: LoopState,
    hooks: LoopHooks,
    reporter: Reporter,
    source: BatchSource,
    *,
    seed: int,
    epoch: int,
    step: int,
) -> _EpochRun:
    """One epoch of optimizer steps, each over a window of ``solver.accumulation_steps`` micro-batches."""
    stage, net, monitor = setup.stage, state.net, state.monitor
    solver, train = stage.solver, stage.train
    optimizer, scheduler, precision, params = setup.optimizer, setup.scheduler, setup.precision, setup.params
    setup.model.train()  # CascadeModel keeps its frozen modules in eval mode
    sharded = is_sharded(net)
    monitor.start_epoch(step)
    state.epoch = epoch
    started, seen, epoch_steps = time.perf_counter(), 0, 0
    loss_sum = torch.zeros(len(setup.heads) + 1, device=setup.device)  # summed on the device: no sync per step
    step_rows, logged = [], (0, 0.0)  # (samples, loss sum) at the last logged row
    batches = source.train_epoch(train.batch_size, rank=reporter.rank, world=reporter.world, seed=seed, epoch=epoch)
    n_batches = source.num_train_batches(train.batch_size, reporter.world)
    for (x, y), window, last in accumulation_windows(batches, n_batches, solver.accumulation_steps):
        if train.augment.enabled:
            x = augment(x, train.augment)
        # under DDP, all-reduce gradients only once per window, on its last micro-batch (FSDP: reduce-scatter)
        if sharded:
            net.set_requires_gradient_sync(last)
        with net.no_sync() if not last and isinstance(net, DistributedDataParallel) else nullcontext():
            with precision.autocast():
                loss, terms = setup.loss(net, x, y)
            # the window's gradient is the mean of its micro-batches' (no divide, a kernel, for a window of 1)
            precision.backward(loss / window if window > 1 else loss)
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
            hooks.on_row(state)
            _log_step(state, hooks, eta=(setup.total_steps - step) * elapsed / epoch_steps)
        if train.max_steps is not None and step >= train.max_steps:
            return _EpochRun(step, epoch_steps, seen, loss_sum, time.perf_counter() - started, step_rows, True)
    return _EpochRun(step, epoch_steps, seen, loss_sum, time.perf_counter() - started, step_rows, False)


def _log_step(state: LoopState, hooks: LoopHooks, eta: float) -> None:
    """Hand `state.row` to ``hooks.on_log`` (a driver-side progress board), or print the progress line.

    `eta`: seconds left at this epoch's optimizer-step rate.
    """
    if hooks.on_log is not None:
        hooks.on_log(state)
        return
    row, train = state.row, state.stage.train
    assert row is not None
    print(
        f"[{state.stage.name}] epoch {row['epoch']}/{train.epochs} step {row['step']}/{state.total_steps} loss {row['train_loss']:.4f} "
        f"lr {row['lr']:.3g} {row['samples_per_s']:.0f} samples/s ETA {eta:.0f} s",
        flush=True,
    )


def _end_epoch(
    setup: StageSetup,
    state: LoopState,
    reporter: Reporter,
    run: _EpochRun,
    val_source: BatchSource,
    digest: dict[str, str],
    *,
    epoch: int,
) -> tuple[dict[str, float], dict[str, str] | None]:
    """The epoch's health checks, then its metrics: training (summed over ranks), validation, health.

    The frozen tensors are checked after validation, so the digests returned (None: the
    ``frozen_drift`` rule is off) are those of the weights the epoch's checkpoint holds.
    """
    state.monitor.end_epoch(run.step, run.loss_sum, None)
    sums = reporter.all_sum([float(run.seen), *run.loss_sum.tolist()])
    metrics = {
        "epoch": epoch + 1,
        "step": run.step,
        "optimizer_steps": run.optimizer_steps,
        "train_loss": sums[1] / sums[0],
        "lr": setup.scheduler.get_last_lr()[0],
        "samples_per_s": sums[0] / run.train_s,
    }
    if setup.stage.type == "joint":
        metrics |= {f"loss/{n}": sums[2 + i] / sums[0] for i, n in enumerate(setup.heads)}
    metrics |= evaluate(setup, val_source, reporter, prefix="val_")
    frozen_now = state.monitor.check_frozen_now(run.step, digest)
    metrics |= state.monitor.epoch_metrics()
    return metrics, frozen_now


def _report(
    setup: StageSetup,
    stopper: EarlyStopping,
    reporter: Reporter,
    metrics: dict[str, float],
    history: list[dict[str, Any]],
    *,
    epochs_done: int,
    step: int,
    skipped: int,
    frozen: tuple[dict[str, str], dict[str, str] | None],
) -> None:
    """Publish the epoch's metrics; rank 0 also checkpoints the model and everything a restart resumes from.

    Sharded (fsdp), every rank first gathers the full model and optimizer state (a collective); rank 0
    checkpoints them, so checkpoints and the artifact are ordinary full state dicts. `frozen`: the
    frozen digests before training and now (None: not taken this epoch); with
    ``train.checkpoint.frozen: reference`` the unchanged frozen entries are named by digest, not written.
    """
    sharded = is_sharded(setup.model)
    if sharded:
        model_state = full_model_state(setup.model)
        optimizer_state = full_optimizer_state(setup.model, setup.optimizer)
    if reporter.rank != 0:
        reporter.report(metrics, None, None)
        return
    if not sharded:
        model_state, optimizer_state = setup.model.state_dict(), None
    resumable = trainer_state(
        setup.optimizer,
        setup.scheduler,
        setup.precision,
        stopper,
        epochs_done=epochs_done,
        step=step,
        skipped=skipped,
        history=history,
        optimizer_state=optimizer_state,
    )
    reporter.report(metrics, model_state, resumable, frozen=checkpoint_frozen(setup, model_state, *frozen))


def checkpoint_frozen(
    setup: StageSetup,
    model_state: Mapping[str, torch.Tensor],
    before: dict[str, str],
    now: dict[str, str] | None = None,
) -> dict[str, str] | None:
    """What rank 0's checkpoint of `model_state` names by digest (``train.checkpoint.frozen: reference``),
    else None; `now`: the frozen digests already taken for these weights (None: hashed here)."""
    if setup.stage.train.checkpoint.frozen != "reference" or not before:
        return None
    return frozen_reference(model_state, before, now if now is not None else frozen_digest(setup.model, setup.plan))


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


@torch.no_grad()
def evaluate(
    setup: StageSetup, source: BatchSource, reporter: Reporter, prefix: str, max_batches: int | None = None
) -> dict[str, float]:
    """The target kind's metrics of the stage's last head over a split (its first `max_batches`
    batches), summed across ranks: loss and accuracy (class), micro-F1 and mAP (multilabel),
    MAE, RMSE and R² (regression); see :mod:`cascade_ray.models.metrics`."""
    model = setup.model
    was_training = model.training
    model.eval()
    head = setup.heads[-1]
    metrics = EvalMetrics(setup.target_kind, setup.out_width, setup.eval_loss)
    batches = source.eval_epoch(setup.stage.train.eval_batch_size, rank=reporter.rank, world=reporter.world)
    # sharded: the weights are gathered once for the split, as ranks may hold different batch counts
    with unsharded(model) if is_sharded(model) else nullcontext():
        for x, y in itertools.islice(batches, max_batches):
            metrics.update(model(x, heads=[head])[head], y)
    model.train(was_training)
    return metrics.compute(reporter.all_sum, prefix)
