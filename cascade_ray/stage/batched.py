"""The worker side of a batched sweep: K configs of one stage trained at once on its cached features.

Each replica is a full :func:`~cascade_ray.stage.setup.setup_stage` of its own config (model,
param groups, optimizer, lr plan, precision, loss), so a replica trains exactly as that config
would alone. Every shared batch is read once and each replica takes its own optimizer step on
it. The models are not stacked into one with ``torch.func.vmap``: a stacked model needs one
optimizer over ``[K, ...]`` tensors, which torch's optimizers cannot give per-replica lr / weight
decay / betas / schedules / clipping, and on the CPUs measured the vmapped step was ~3x slower
than the loop (``benchmarks/bench_stacked.py``). Instead, replicas of an MLP stage that share a
generator state run their forward and backward in groups (:mod:`.grouped`: one batched GEMM per
layer over their stacked weights, each keeping its own parameters); the rest step one after the
other. What the sweep saves is K-1 TorchTrainer start-ups, and on grouped stages part of the
per-replica arithmetic overhead.

Each replica keeps its own torch RNG state (swapped in around its work), so dropout draws the
same numbers as in a lone run seeded by :func:`~cascade_ray.stage.setup.stage_seed`.

Under DDP (``scaling.num_workers`` > 1) each replica's model has its own DDP wrapper, which
all-reduces that replica's gradients on the last micro-batch of every accumulation window, as
the lone loop's does; every rank steps the replicas in the same order, so the collectives match.

Each replica has its own :class:`~cascade_ray.stage.monitor.HealthMonitor`, run at the lone
loop's points (per optimizer step, per epoch: non-finite loss, frozen drift of the shared
upstream against the digest taken before training, ...). A rule with policy ``error`` fails
that replica only, as Tune marks one trial ERROR: it stops training, keeps its error, cannot
be picked as best, and the others go on. The verdicts that decide it are all-reduced (the
non-finite check) or computed from all-reduced gradients, so every rank fails the same replica.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import itertools
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from cascade_ray.config.metrics import rank, retention_metric
from cascade_ray.config.schema import PipelineConfig
from cascade_ray.data import DataSplits
from cascade_ray.data.batches import ArraySource, accumulation_windows
from cascade_ray.errors import CascadeError, ConfigError, ConfigIssue, FrozenDriftError, HealthError
from cascade_ray.models.dropout import shared_masks
from cascade_ray.models.freeze import DigestMemo, frozen_digest
from cascade_ray.models.metrics import EvalMetrics
from cascade_ray.models.plan import remember_plans
from cascade_ray.models.weights import frozen_views
from cascade_ray.solver import EarlyStopping, clip_gradients
from cascade_ray.stage.batched_resume import ResumeWriter, read_resume
from cascade_ray.stage.grouped import GROUP_SIZE, GroupedSteps
from cascade_ray.stage.loop import Reporter, checkpoint_frozen
from cascade_ray.stage.monitor import HealthMonitor
from cascade_ray.stage.progress import format_trial
from cascade_ray.stage.resume import restore_trainer_state, trainer_state
from cascade_ray.stage.setup import StageSetup, setup_stage, stage_seed
from cascade_ray.stage.startup import StartupClock
from cascade_ray.storage import as_storage


@dataclass
class Replica:
    """One config's training state inside a batched sweep."""

    cfg: PipelineConfig
    setup: StageSetup
    net: nn.Module  # what forward runs on: the model, or its DDP wrapper
    rng: torch.Tensor  # this replica's CPU generator state between its turns
    cuda_rng: torch.Tensor | None  # and its CUDA generator's, on a GPU worker
    stopper: EarlyStopping
    monitor: HealthMonitor
    digest: dict[str, str]  # the frozen upstream's digest before training (checked every epoch)
    checked: tuple[int, dict[str, str] | None] = (-1, None)  # the last check's epoch and the digests it took
    history: list[dict[str, float]] = field(default_factory=list)
    step: int = 0
    done: bool = False
    best_score: float | None = None  # by the stage's checkpoint metric (train.checkpoint.metric)
    best_epoch: int = 0
    best_own: dict[str, torch.Tensor] | None = None  # the stage's own tensors at best_score
    error: str | None = None  # the health rule that failed this replica (then done, never the best)

    def own_state(self) -> dict[str, torch.Tensor]:
        """The stage's own tensors (its module and head; not the frozen upstream), detached copies."""
        own = self.setup.stage.name
        return {n: v.detach().clone() for n, v in self.setup.model.state_dict().items() if n.split(".")[1] == own}

    def resume_state(self, epochs_done: int) -> dict[str, Any]:
        """Everything this replica continues from after `epochs_done` epochs (:mod:`.batched_resume`)."""
        s = self.setup
        with self.turn():  # trainer_state records the process's RNG: this replica's, inside its turn
            trainer = trainer_state(
                s.optimizer,
                s.scheduler,
                s.precision,
                self.stopper,
                epochs_done=epochs_done,
                step=self.step,
                skipped=self.monitor.skipped,
                history=self.history,
            )
        return {
            "own": self.own_state(),
            "trainer": trainer,
            "done": self.done,
            "best_score": self.best_score,
            "best_epoch": self.best_epoch,
            "best_own": self.best_own,
            "error": self.error,
        }

    def restore(self, state: Mapping[str, Any], k: int) -> int:
        """Continue from :meth:`resume_state`; returns the epochs it had done.

        Raises:
            CascadeError: the state's tensors are not this replica's (another architecture).
        """
        s = self.setup
        mine = self.own_state()
        theirs = state["own"]
        if set(theirs) != set(mine) or any(theirs[n].shape != mine[n].shape for n in mine):
            raise CascadeError(
                f"batched replica {k} of stage {s.stage.name!r}: the resume state holds other tensors than the "
                "replica's module and head; rerun without --resume to train the sweep's configs from the start"
            )
        s.model.load_state_dict(theirs, strict=False)  # the frozen upstream stays the hand-off's
        with self.turn():  # the saved RNG state becomes this replica's stream
            epochs, self.step, self.monitor.skipped, self.history = restore_trainer_state(
                state["trainer"], s.optimizer, s.scheduler, s.precision, self.stopper, s.stage.name
            )
        self.monitor.scheduled = s.scheduler.steps
        self.done, self.error = bool(state["done"]), state["error"]
        self.best_score, self.best_epoch, self.best_own = (
            state["best_score"],
            int(state["best_epoch"]),
            state["best_own"],
        )
        return epochs

    def fail(self, exc: CascadeError) -> None:
        """Stop this replica for good: a health rule with policy ``error`` fired."""
        self.error, self.done = str(exc), True

    @contextmanager
    def turn(self) -> Iterator[None]:
        """This replica's RNG stream in, then out again (the process's own stream is left as found)."""
        outer, cuda_outer = torch.get_rng_state(), _cuda_rng(self.setup.device)
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state(self.cuda_rng, self.setup.device)
        try:
            yield
        finally:
            self.rng, self.cuda_rng = torch.get_rng_state(), _cuda_rng(self.setup.device)
            torch.set_rng_state(outer)
            if cuda_outer is not None:
                torch.cuda.set_rng_state(cuda_outer, self.setup.device)


@dataclass(frozen=True)
class BatchedOutcome:
    """What rank 0 returns: every replica's epoch history, and which one won."""

    histories: list[list[dict[str, float]]]
    errors: list[str | None]  # per replica: the health error that failed it, None if it trained through
    best: int
    best_epoch: int
    world_size: int
    startup: dict[str, float] | None = None  # rank 0's start-up phases (stage/startup.py), set by the loop
    resumed_after: int | None = None  # the epochs a resume state had done (None: trained from the start)


def run_batched(
    cfgs: list[PipelineConfig],
    index: int,
    data: DataSplits,
    upstream: Mapping[str, np.ndarray] | None,
    features: Mapping[str, np.ndarray] | None,
    reporter: Reporter,
    device: torch.device,
    *,
    metric: str,
    mode: str,
    wrap: Callable[[nn.Module], nn.Module] | None = None,
    tracking: Mapping[str, Any] | None = None,
    nodes: list[str] | None = None,
    clock: StartupClock | None = None,
    resume: Mapping[str, Any] | None = None,
    save: Callable[[int, list[dict[str, Any]]], None] | None = None,
    fault: Callable[[int], None] | None = None,
    group_size: int = GROUP_SIZE,
    names: list[str] | None = None,
    upstream_digests: Mapping[str, str] | None = None,
) -> BatchedOutcome:
    """Train stage `index` of every config in `cfgs` at once (:func:`train_replicas`), then report
    the best replica.

    The one report (rank 0 checkpoints) carries the best replica's weights at its best epoch by
    ``train.checkpoint.metric``; the best replica is the one whose best epoch by `metric` (`mode`: max/min)
    is best, as Tune's ``get_best_result(scope="all")`` picks a trial.

    `tracking` (rank 0, ``loggers:``): the driver's tracking context; each replica's epoch rows
    then go live to its own trial run (``<stage> trial <name>``, tagged with `nodes`), which
    ends FAILED when a health rule failed the replica or the job raised. `clock` gets the
    ``setup`` and ``first_step`` marks; `resume`, `save`, `fault`, `group_size`, `names` and
    `upstream_digests` as :func:`train_replicas`.
    """
    names = replica_names(cfgs, names)
    trackers = _replica_trackers(tracking, cfgs, index, nodes or [], names) if tracking else []
    try:
        replicas = train_replicas(
            cfgs,
            index,
            data,
            upstream,
            features,
            reporter,
            device,
            metric=metric,
            mode=mode,
            wrap=wrap,
            on_epoch=(lambda k, row: trackers[k].log("epoch", row)) if trackers else None,
            clock=clock,
            resume=resume,
            save=save,
            fault=fault,
            group_size=group_size,
            names=names,
            upstream_digests=upstream_digests,
        )
    except BaseException:
        for t in trackers:
            t.close(True)
        raise
    for t, r in zip(trackers, replicas):
        t.close(r.error is not None)  # a replica failed by a health rule ends FAILED, as a trial would
    best = best_replica([r.history for r in replicas], [r.error for r in replicas], metric, mode)
    if best is None:
        raise HealthError(
            "batched",
            cfgs[0].stages[index].name,
            max(r.step for r in replicas),
            f"every replica of the batched sweep failed or reported no finite {metric}: "
            + "; ".join(f"replica {k}: {r.error or 'no finite ' + metric}" for k, r in enumerate(replicas)),
            f"stages[{index}].solver",
            "narrow the space to values that train (see each replica's error), or run the plain sweep",
        )
    winner = replicas[best]
    state = winner.setup.model.state_dict() | (winner.best_own or {})
    metrics = dict(winner.history[winner.best_epoch - 1]) | {"replica": best}
    # the digests the last epoch's check took of these frozen tensors, when the winner was checked then
    # (nothing has written since); else they are hashed again
    last, taken = winner.checked
    now = taken if last == max(r.checked[0] for r in replicas) else None
    if reporter.rank == 0:  # the unchanged frozen upstream named by digest, as a lone stage's checkpoints do
        reporter.report(metrics, state, frozen=checkpoint_frozen(winner.setup, state, winner.digest, now))
    else:
        reporter.report(metrics, None)
    return BatchedOutcome(
        [r.history for r in replicas],
        [r.error for r in replicas],
        best,
        winner.best_epoch,
        reporter.world,
        resumed_after=int(resume["epochs_done"]) if resume is not None else None,
    )


def train_replicas(
    cfgs: list[PipelineConfig],
    index: int,
    data: DataSplits,
    upstream: Mapping[str, np.ndarray] | None,
    features: Mapping[str, np.ndarray] | None,
    reporter: Reporter,
    device: torch.device,
    *,
    metric: str,
    mode: str,
    wrap: Callable[[nn.Module], nn.Module] | None = None,
    on_epoch: Callable[[int, dict[str, float]], None] | None = None,
    clock: StartupClock | None = None,
    resume: Mapping[str, Any] | None = None,
    save: Callable[[int, list[dict[str, Any]]], None] | None = None,
    fault: Callable[[int], None] | None = None,
    group_size: int = GROUP_SIZE,
    names: list[str] | None = None,
    upstream_digests: Mapping[str, str] | None = None,
) -> list[Replica]:
    """Every config's replica of stage `index`, trained for the stage's epochs on shared batches.

    The configs differ only in per-replica values (solver, loss); the batches, epochs and
    accumulation windows are the first config's. `metric` / `mode` pick the replica the
    per-epoch progress line names; `on_epoch(k, metrics)` gets replica k's epoch row (the
    live trackers, on rank 0). `clock` is marked ``setup`` once every replica is built and
    ``first_step`` once every replica has taken its first optimizer step.

    `resume` (:meth:`Replica.resume_state` of every replica, as :mod:`.batched_resume` keeps it)
    continues each replica after the epochs it records; `save(epochs_done, states)` gets every
    replica's state at each epoch end (rank 0's writer); `fault(step)` is called after each
    optimizer step (the fault-injection test hook). Replicas that can step together run as
    groups of up to `group_size` (:mod:`.grouped`; 1: every replica steps alone). `names`: what
    the progress lines call each replica, the trial ids of the sweep's results table (default
    ``replica-<k>``). `upstream_digests`: `upstream`'s tensor digests as the driver's hand-off carries
    them: the digests every replica's frozen upstream is checked against. Every replica holds the
    first one's frozen upstream tensors (``setup_stage(frozen=)``): on the CPU views of the same
    arrays, on a GPU one device copy for all replicas; each epoch's check hashes them once for all.

    Raises:
        ConfigError: `features` is missing (the stage must train on cached upstream outputs).
        CascadeError: `resume` holds another number of replicas, or other tensors.
    """
    if features is None:
        raise ConfigError(
            [ConfigIssue(f"stages[{index}].freeze.cache_features", "a batched sweep trains on cached features only")]
        )
    base = cfgs[0].stages[index]
    shown = replica_names(cfgs, names)
    memo: DigestMemo = {}  # the frozen tensors the replicas share are hashed once, not once per replica
    replicas: list[Replica] = []
    frozen = None  # every replica holds the first one's frozen upstream (on a GPU: one device copy, not K)
    for cfg in cfgs:
        replicas.append(_replica(cfg, index, data, upstream, reporter, device, wrap, upstream_digests, memo, frozen))
        frozen = frozen_views(replicas[0].setup.model) if frozen is None else frozen
    grouped = GroupedSteps(replicas, group_size)
    if clock is not None:
        clock.mark("setup")
    train_src = ArraySource(features["x_train"], data.y_train, 0.0, 1.0, device)
    val_src = ArraySource(features["x_val"], data.y_val, 0.0, 1.0, device)
    ckpt_metric, ckpt_mode = retention_metric(cfgs[0], base)  # as a lone stage picks its artifact
    better = (lambda a, b: a > b) if ckpt_mode == "max" else (lambda a, b: a < b)
    if base.train.sanity_val_steps:  # a broken evaluation fails now, not after the first epoch
        _evaluate(replicas, val_src, reporter, prefix="sanity_", max_batches=base.train.sanity_val_steps)
    start = 0
    if resume is not None:
        if len(resume["replicas"]) != len(replicas):
            raise CascadeError(
                f"stage {base.name!r}: the batched sweep's resume state holds {len(resume['replicas'])} replicas, "
                f"the sweep has {len(replicas)}; rerun without --resume to train its configs from the start"
            )
        start = min(r.restore(state, k) for k, (r, state) in enumerate(zip(replicas, resume["replicas"])))
        if reporter.rank == 0:
            print(f"[{base.name}] batched sweep resumed after epoch {start}: {len(replicas)} replicas", flush=True)

    def stepped(step: int) -> None:
        if clock is not None:
            clock.mark("first_step")
        if fault is not None:
            fault(step)

    trained = None  # the last epoch this job trained
    for epoch in range(start, base.train.epochs):
        live = [r for r in replicas if not r.done]
        if not live:
            break
        seen, sums, train_s = _train_epoch(
            live,
            train_src,
            reporter,
            seed=stage_seed(cfgs[0], index),
            epoch=epoch,
            on_step=stepped,
            grouped=grouped,
        )
        totals = reporter.all_sum([float(seen), *sums])  # one collective for every replica
        memo = {}  # this check's pass: the arrays every replica views are hashed once
        for r, loss_sum in zip(live, sums):
            if r.error is None:  # as the lone loop's epoch end: the non-finite flush, the frozen digest
                _guarded(r, functools.partial(_end_epoch, r, loss_sum, epoch, memo))
        failed = [(k, r) for k, r in enumerate(live) if r.error is not None]
        for _, r in failed:
            if reporter.rank == 0:
                k = replicas.index(r)
                print(f"WARNING [{base.name}] batched replica {k} ({shown[k]}) failed: {r.error}", flush=True)
        kept = [(k, r) for k, r in enumerate(live) if r.error is None]
        val = dict(zip((k for k, _ in kept), _evaluate([r for _, r in kept], val_src, reporter))) if kept else {}
        live = [r for _, r in kept]
        for k, r in kept:
            metrics = {
                "epoch": epoch + 1,
                "step": r.step,
                "train_loss": totals[1 + k] / totals[0],
                "lr": r.setup.scheduler.get_last_lr()[0],
                "samples_per_s": totals[0] * len(live) / train_s,
                **val[k],
                **r.monitor.epoch_metrics(),
            }
            r.history.append(metrics)
            score = metrics[ckpt_metric]
            if r.best_score is None or better(score, r.best_score):
                r.best_score, r.best_epoch, r.best_own = score, epoch + 1, r.own_state()
            r.setup.scheduler.step_epoch(metrics)
            r.done = r.stopper.update(metrics)
            if on_epoch is not None:
                on_epoch(replicas.index(r), metrics)
        if save is not None:  # every replica as it stands now: a killed job resumes after this epoch
            save(epoch + 1, [r.resume_state(epoch + 1) for r in replicas])
        if reporter.rank == 0 and kept:
            _print_replicas(base.name, replicas, shown, epoch + 1, base.train.epochs, metric, mode)
        trained = epoch + 1
    if save is not None and resume is not None and trained is None:  # nothing left to train: this job
        save(start, [r.resume_state(start) for r in replicas])  # keeps the state it continued, as its own
    return replicas


def best_replica(histories: list[list[dict[str, Any]]], errors: list[str | None], metric: str, mode: str) -> int | None:
    """The replica whose best epoch by `metric` (`mode`: max/min) is best among those that trained
    through (the lowest index on a tie), ranked as a plain sweep's trials are
    (:func:`cascade_ray.config.metrics.rank`; the sweep's table lists it first); None when every
    replica failed, none finished an epoch or none reported a finite value."""
    bests = {
        k: min(rank(h.get(metric), mode) for h in histories[k])
        for k, h in enumerate(histories)
        if errors[k] is None and h
    }
    ok = [k for k, best in bests.items() if not best[0]]  # a finite value
    return min(ok, key=lambda k: (bests[k], k)) if ok else None


def replica_names(cfgs: list[PipelineConfig], names: list[str] | None) -> list[str]:
    """What each replica is called (its trial id in the sweep's table), ``replica-<k>`` by default."""
    return list(names) if names is not None else [f"replica-{k}" for k in range(len(cfgs))]


def _print_replicas(
    stage: str, replicas: list[Replica], names: list[str], epoch: int, epochs: int, metric: str, mode: str
) -> None:
    """The sweep's progress lines at an epoch end: one per replica, as a Tune sweep's one per trial
    (:func:`cascade_ray.stage.progress.format_trial`), prefixed with the stage (``--log-level warning`` hides them)."""
    sign = 1.0 if mode == "max" else -1.0
    bests = {id(r): max((h[metric] for h in r.history), key=lambda v: sign * v, default=None) for r in replicas}
    scored = [r for r in replicas if bests[id(r)] is not None]
    leader = max(scored, key=lambda r: sign * bests[id(r)], default=None)
    for k, r in enumerate(replicas):
        state = "ERROR" if r.error is not None else "TERMINATED" if r.done or epoch == epochs else "RUNNING"
        last = r.history[-1] if r.history else {}
        line = format_trial(
            names[k],
            state,
            metric=metric,
            epoch=last.get("epoch"),
            epochs=epochs,
            value=last.get(metric),
            best=bests[id(r)],
            leader=r is leader,
        )
        print(f"[{stage}] {line}", flush=True)


def _replica(cfg, index, data, upstream, reporter, device, wrap, known=None, memo=None, frozen=None) -> Replica:
    # seeds torch as a lone stage; `frozen`: the first replica's frozen upstream, held instead of a copy
    setup = setup_stage(cfg, index, data, upstream, device, world=reporter.world, frozen=frozen)
    rng = torch.get_rng_state()  # the lone stage's generators right after its setup
    setup.model.input_stage = setup.stage.name  # forward starts at the stage's own adapter/module
    digest = frozen_digest(setup.model, setup.plan, known, memo)  # as the lone loop: before the wrap, before training
    net = wrap(setup.model) if wrap is not None else setup.model
    monitor = HealthMonitor.for_setup(setup, rank=reporter.rank, all_sum=reporter.all_sum)
    stopper = EarlyStopping(setup.stage.train.early_stopping)
    return Replica(cfg, setup, net, rng, _cuda_rng(device), stopper, monitor, digest)


def _end_epoch(replica: Replica, loss_sum: float, epoch: int, memo: DigestMemo) -> None:
    """`replica`'s epoch-end checks (the non-finite flush, the frozen digest), the digests kept."""
    replica.checked = epoch, replica.monitor.end_epoch(replica.step, torch.tensor([loss_sum]), replica.digest, memo)


def _guarded(replica: Replica, check: Callable[[], None]) -> None:
    """Run one of `replica`'s health checks; a rule with policy ``error`` fails that replica only."""
    try:
        check()
    except (HealthError, FrozenDriftError) as exc:
        replica.fail(exc)


def _cuda_rng(device: torch.device) -> torch.Tensor | None:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _train_epoch(
    live: list[Replica],
    source: ArraySource,
    reporter: Reporter,
    *,
    seed: int,
    epoch: int,
    on_step: Callable[[int], None] | None = None,
    grouped: GroupedSteps | None = None,
) -> tuple[int, list[float], float]:
    """One epoch: every batch read once and stepped by every live replica. Returns (samples
    seen on this rank, each replica's sample-weighted loss sum, wall seconds). `on_step(step)` is
    called after each window every live replica has stepped (`step`: the furthest replica's count)."""
    train, solver = live[0].setup.stage.train, live[0].setup.stage.solver
    for r in live:
        r.setup.model.train()
        _guarded(r, lambda r=r: r.monitor.start_epoch(r.step))
    sums = {id(r): torch.zeros(1, device=source.device) for r in live}
    started, seen = time.perf_counter(), 0
    batches = source.train_epoch(train.batch_size, rank=reporter.rank, world=reporter.world, seed=seed, epoch=epoch)
    n_batches = source.num_train_batches(train.batch_size, reporter.world)
    for (x, y), window, last in accumulation_windows(batches, n_batches, solver.accumulation_steps):
        seen += len(y)
        with shared_masks():  # replicas that share a seed draw this batch's dropout masks once
            _step_replicas(live, x, y, window, last, sums, grouped)
        if last and on_step is not None:
            on_step(max(r.step for r in live))
    return seen, [sums[id(r)].item() for r in live], time.perf_counter() - started


def _step_replicas(
    live: list[Replica],
    x: torch.Tensor,
    y: torch.Tensor,
    window: int,
    last: bool,
    sums: dict[int, torch.Tensor],
    grouped: GroupedSteps | None = None,
) -> None:
    """Every live replica's forward and backward on one micro-batch (grouped where `grouped` has
    a group for it), and its optimizer step after the window's `last` one, each in its own RNG stream."""
    done: set[int] = set()  # replicas whose forward and backward ran in a group
    for group in grouped.groups(live) if grouped is not None else []:
        grouped.forward_backward(group, x, y, window, sums)
        done.update(id(r) for r in group)
    for r in live:
        if r.error is not None:  # failed by a health rule this epoch: it steps no more
            continue
        s = r.setup
        with r.turn():
            if id(r) not in done:
                sync = not last and isinstance(r.net, DistributedDataParallel)
                with r.net.no_sync() if sync else nullcontext():
                    with s.precision.autocast():
                        loss, _ = s.loss(r.net, x, y)
                    s.precision.backward(loss / window)
                sums[id(r)] += loss.detach().float() * len(y)
            if last:  # the lone loop's optimizer step, with its health checks around it
                s.precision.unscale(s.optimizer)
                clip_norm = clip_gradients(s.params, s.stage.solver.grad_clip)
                _guarded(r, lambda r=r, clip_norm=clip_norm: r.monitor.before_step(r.step + 1, clip_norm))
                if r.error is not None:
                    continue
                skipped = s.precision.step(s.optimizer)
                if not skipped:
                    s.scheduler.step()
                s.optimizer.zero_grad(set_to_none=True)
                r.step += 1
                _guarded(r, lambda r=r, skipped=skipped: r.monitor.after_step(r.step, skipped, sums[id(r)]))


@torch.no_grad()
def _evaluate(
    live: list[Replica], source: ArraySource, reporter: Reporter, prefix: str = "val_", max_batches: int | None = None
) -> list[dict[str, float]]:
    """The val metrics of every live replica (over the first `max_batches` batches), each val batch read once."""
    metrics = [EvalMetrics(r.setup.target_kind, r.setup.out_width, r.setup.eval_loss) for r in live]
    for r in live:
        r.setup.model.eval()
    eval_bs = live[0].setup.stage.train.eval_batch_size
    for x, y in itertools.islice(source.eval_epoch(eval_bs, rank=reporter.rank, world=reporter.world), max_batches):
        for r, m in zip(live, metrics):
            head = r.setup.heads[-1]
            m.update(r.setup.model(x, heads=[head])[head], y)
    return [m.compute(reporter.all_sum, prefix) for m in metrics]


def batched_train_loop_per_worker(loop_config: dict[str, Any]) -> dict[str, Any] | None:
    """Entry point Ray Train runs on every worker of a batched sweep (``loop_config`` as a stage
    fit's, plus ``replicas``: each replica's pipeline config, ``select``: metric and mode, and
    ``resume``: where this job keeps its resume state, its key, and the verified state of an
    earlier attempt to continue from, if any)."""
    import ray
    import ray.train.torch

    from cascade_ray.checks import validate_config
    from cascade_ray.stage.worker import FaultInjection, RayReporter, _ddp_wrapper

    base = loop_config["pipeline"]
    index = int(loop_config["stage_index"])
    remember_plans(loop_config.get("plans"))  # the driver's shape plans, shared by every replica
    cfgs = []
    for k, raw in enumerate(loop_config["replicas"]):
        raw["stages"][index]["scaling"] = base["stages"][index]["scaling"]  # the fit's use_gpu decision
        cfgs.append(validate_config(raw, source=f"batched replica {k}", preflight=False))
    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0)
    torch.set_num_threads(max(1, int(cpus)))  # Ray pins OMP threads to the assigned CPUs
    if cfgs[0].deterministic:  # as a lone stage's worker (stage/worker.py)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    device = ray.train.torch.get_device()
    clock = StartupClock(loop_config.get("fit_started"))  # as a lone stage's worker: where start-up goes
    (data_ref,) = loop_config["data_ref"]
    data = DataSplits.from_arrays(ray.get(data_ref))
    upstream = ray.get(loop_config["upstream_ref"][0]) if loop_config["upstream_ref"] else None
    features = ray.get(loop_config["features_ref"][0]) if loop_config.get("features_ref") else None
    clock.mark("inputs")
    reporter = RayReporter(device)
    wrap = _ddp_wrapper(cfgs[0].stages[index], device) if reporter.world > 1 else None
    select = loop_config["select"]
    resume, save = None, None
    if (keep := loop_config.get("resume")) is not None:
        folder = as_storage(keep["dir"])
        # a restarted worker group (max_failures) continues this job's own newest epoch; a fresh
        # one the earlier attempt the driver found and verified (tune --resume)
        point = read_resume(folder)
        if point is not None and point.key == keep["key"]:
            resume = point.load()
        elif keep.get("ref"):
            resume = torch.load(io.BytesIO(ray.get(keep["ref"][0])), weights_only=True, map_location="cpu")
        same_resume_on_every_rank(reporter, resume, folder)
        if reporter.rank == 0:
            save = ResumeWriter(folder, keep["key"]).save
    fault = FaultInjection(loop_config.get("fault_once", ""), cfgs[0].stages[index].name, reporter.rank)
    outcome = run_batched(
        cfgs,
        index,
        data,
        upstream,
        features,
        reporter,
        device,
        metric=select["metric"],
        mode=select["mode"],
        wrap=wrap,
        tracking=loop_config.get("tracking") if reporter.rank == 0 else None,
        nodes=reporter.nodes,
        clock=clock,
        resume=resume,
        save=save,
        fault=fault.at_step,
        names=loop_config.get("names"),
        upstream_digests=loop_config.get("upstream_digests"),
    )
    return dataclasses.asdict(dataclasses.replace(outcome, startup=clock.record())) if reporter.rank == 0 else None


def same_resume_on_every_rank(reporter: Any, resume: Mapping[str, Any] | None, folder: Any) -> None:
    """Stop a job whose ranks would continue from different epochs (DDP would silently diverge).

    Each rank reads the resume state itself; they differ when `folder` is a local path that is
    not shared between the nodes. One all-reduce of (epoch, epoch**2), the epoch -1 for none:
    the ranks agree exactly when both sums are the world size times this rank's values.

    Raises:
        CascadeError: the ranks found different states (the message names the folder and the fix).
    """
    if reporter.world == 1:
        return
    epoch = float(resume["epochs_done"]) if resume is not None else -1.0
    total, squares = reporter.all_sum([epoch, epoch * epoch])
    if total != reporter.world * epoch or squares != reporter.world * epoch * epoch:
        mine = f"after epoch {int(epoch)}" if resume is not None else "no state"
        raise CascadeError(
            f"the batched job's {reporter.world} ranks found different resume states under {folder} "
            f"(rank {reporter.rank}: {mine}): the folder is not the same on every node. Set storage_path to "
            "shared storage (a path every node mounts, or s3://bucket/prefix, gs://bucket/prefix)"
        )


def _replica_trackers(
    tracking: Mapping[str, Any], cfgs: list[PipelineConfig], index: int, nodes: list[str], names: list[str]
) -> list[Any]:
    """``loggers:``: one set of live loggers per replica, each replica a trial run named
    ``<stage> trial <name>`` under the pipeline's run."""
    from cascade_ray.tracking import TrackingContext
    from cascade_ray.tracking.stage_runs import open_stage_loggers  # imports a tracker only when configured

    context = TrackingContext.from_dict(tracking)
    return [
        open_stage_loggers(cfg, index, dataclasses.replace(context, trial=name), nodes)
        for cfg, name in zip(cfgs, names, strict=True)
    ]
