"""The runtime health monitor: every rule of ``stages[i].health``, cheap enough to leave on.

Per optimizer step it only compares Python floats (the lr plan) and, under fp16, reads
the loss scale. Every ``health.interval`` steps it measures the gradient norm (reusing
the one clipping computed) and the relative update ||dtheta|| / ||theta||, and checks the
running loss sum for NaN/inf, in one device sync (plus one all-reduce of the verdict
under DDP, so every rank raises together). Frozen state is checked once per epoch.

A rule with policy ``error`` raises :class:`HealthError` (``FrozenDriftError`` for frozen
drift); ``warn`` prints on rank 0 (once per rule per epoch) and counts every firing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from cascade_ray.config.schema import StageConfig
from cascade_ray.errors import FrozenDriftError, HealthError
from cascade_ray.models.freeze import DigestMemo, TrainablePlan, check_frozen, frozen_digest
from cascade_ray.solver.schedule import LrSchedule
from cascade_ray.solver.step import Precision, grad_norm, is_dtensor
from cascade_ray.stage.sharding import local

if TYPE_CHECKING:
    from cascade_ray.stage.setup import StageSetup


class HealthMonitor:
    """Applies a stage's health rules; see the module docstring for when each runs."""

    @classmethod
    def for_setup(
        cls, setup: StageSetup, *, rank: int = 0, all_sum: Callable[[list[float]], list[float]] = list
    ) -> HealthMonitor:
        """The monitor of what :func:`~cascade_ray.stage.setup.setup_stage` built (the lone and batched loops)."""
        return cls(
            stage=setup.stage,
            index=setup.index,
            named=setup.named_params,
            optimizer=setup.optimizer,
            scheduler=setup.scheduler,
            precision=setup.precision,
            model=setup.model,
            plan=setup.plan,
            rank=rank,
            all_sum=all_sum,
        )

    def __init__(
        self,
        *,
        stage: StageConfig,
        index: int,
        named: Sequence[tuple[str, nn.Parameter]],
        optimizer: torch.optim.Optimizer,
        scheduler: LrSchedule,
        precision: Precision,
        model: nn.Module,
        plan: TrainablePlan,
        rank: int = 0,
        all_sum: Callable[[list[float]], list[float]] = list,
    ):
        self.stage, self.cfg, self.path = stage, stage.health, f"stages[{index}]"
        self.named, self.params = list(named), [p for _, p in named]
        self.optimizer, self.scheduler, self.precision = optimizer, scheduler, precision
        self.model, self.plan, self.rank, self.all_sum = model, plan, rank, all_sum
        # fsdp: each rank holds shards of the parameters; sums over them are summed over the ranks
        self.sharded = any(is_dtensor(p) for p in self.params)
        self.on = {
            rule: getattr(self.cfg, rule).policy != "off"
            for rule in (
                "nonfinite",
                "grad_flow",
                "stall",
                "clip_saturation",
                "scale_collapse",
                "lr_drift",
                "frozen_drift",
            )
        }
        self.measuring = self.on["nonfinite"] or self.on["stall"] or self.on["clip_saturation"]
        clip = stage.solver.grad_clip
        self.max_norm = clip.max_norm if clip.enabled and clip.mode == "norm" else None
        self.scheduled = 0  # optimizer steps the schedule should have seen (fp16-skipped ones excluded)
        self.skipped = self.consecutive_skips = 0
        self.stall_run = self.saturated_run = 0
        self.suspects: list[str] = []
        self.checked_to = 0  # optimizer steps known to have finite losses
        self.warnings: list[str] = []
        self.warning_count = 0
        self._before: torch.Tensor | None = None
        self._norm: torch.Tensor | None = None
        self.last_measured = (0, math.nan, math.nan)  # (step, grad norm, update ratio) of the latest measurement
        self._reset_epoch()

    # -- firing ------------------------------------------------------------------------------------

    def fire(self, rule: str, step: int, detail: str, key: str, fix: str) -> None:
        """Raise or warn per the rule's policy."""
        detail += f" [rule {self.path}.health.{rule}, policy {getattr(self.cfg, rule).policy}]"
        if getattr(self.cfg, rule).policy == "error":
            if rule == "frozen_drift":
                raise FrozenDriftError(
                    f"stage {self.stage.name!r}, optimizer step {step}: {detail}\n    key: {key}\n    fix: {fix}"
                )
            raise HealthError(rule, self.stage.name, step, detail, key, fix)
        self.warning_count += 1
        self.epoch_warnings += 1
        if rule not in self.warned:
            self.warned.add(rule)
            message = str(HealthError(rule, self.stage.name, step, detail, key, fix))
            self.warnings.append(message)
            if self.rank == 0:
                print(f"WARNING health: {message}", flush=True)

    # -- per epoch ---------------------------------------------------------------------------------

    def _reset_epoch(self) -> None:
        self.warned: set[str] = set()
        self.epoch_warnings = self.epoch_skipped = 0
        self.norms: list[float] = []
        self.ratios: list[float] = []

    def start_epoch(self, step: int) -> None:
        """Reset per-epoch counters; check that every frozen module is in eval mode (after model.train())."""
        self._reset_epoch()
        if not self.on["frozen_drift"]:
            return
        modules = dict(self.model.named_modules())
        training = [n for n in self.plan.frozen_modules if any(m.training for m in modules[n].modules())]
        if training:
            self.fire(
                "frozen_drift",
                step,
                f"{len(training)} frozen module(s) are in train mode at the start of an epoch: {_short(training)}; "
                "their BatchNorm running statistics and dropout would change although they are frozen",
                f"{self.path}.trainable_layers",
                "keep frozen modules in eval mode (CascadeModel.train() does; do not call .train() on a submodule or override train() in a module), "
                f"or train them on purpose by listing their stage in {self.path}.trainable_layers",
            )

    def end_epoch(
        self, step: int, loss_sum: torch.Tensor, digest: dict[str, str] | None, memo: DigestMemo | None = None
    ) -> dict[str, str] | None:
        """Flush the non-finite check and, given `digest`, compare the frozen digest with the one taken
        before training (`memo`: as :meth:`check_frozen_now`'s); return the frozen digests taken, if any."""
        if self.on["nonfinite"] and self.checked_to < step:
            self._check_finite(step, float(self.all_sum([float(not torch.isfinite(loss_sum).all())])[0]), None)
        return self.check_frozen_now(step, digest, memo) if digest is not None else None

    def check_frozen_now(
        self, step: int, digest: dict[str, str], memo: DigestMemo | None = None
    ) -> dict[str, str] | None:
        """Compare the frozen tensors' digests now with `digest` (taken before training); return the
        digests taken, or None when the ``frozen_drift`` rule is off (nothing was hashed). `memo`:
        the digests this pass already took, by the memory they cover (``models.freeze.frozen_digest``)."""
        if not self.on["frozen_drift"]:
            return None
        now = frozen_digest(self.model, self.plan, memo=memo)
        try:
            check_frozen(digest, now, self.stage.name)
        except FrozenDriftError as exc:
            self.fire(
                "frozen_drift",
                step,
                str(exc),
                f"{self.path}.trainable_layers",
                f"find what writes to the frozen tensors, or list their stage in {self.path}.trainable_layers",
            )
        return now

    def epoch_metrics(self) -> dict[str, float]:
        """Mean gradient norm and relative update over the epoch's measurements, warnings, fp16 state."""
        out = {
            "grad_norm": _mean(self.norms),
            "update_ratio": _mean(self.ratios),
            "health_warnings": float(self.epoch_warnings),
        }
        if self.precision.scaler is not None:
            out |= {"loss_scale": self.precision.last_scale, "skipped_steps": float(self.epoch_skipped)}
        return out

    def step_metrics(self, step: int) -> dict[str, float]:
        """Gradient norm and relative update measured at optimizer step `step` (NaN when that step
        was not measured: see ``health.interval``); no device sync."""
        measured, norm, ratio = self.last_measured
        return (
            {"grad_norm": norm, "update_ratio": ratio}
            if measured == step
            else {"grad_norm": math.nan, "update_ratio": math.nan}
        )

    # -- per optimizer step ------------------------------------------------------------------------

    def before_step(self, step: int, clip_norm: torch.Tensor | None) -> None:
        """Gradients are final (unscaled, clipped); `step` is the 1-based index of the step about to run."""
        if self.on["grad_flow"] and (step == 1 or (self.suspects and step == max(2, self.cfg.interval))):
            self._check_grad_flow(step)
        if self.on["lr_drift"]:
            self._check_lr(step)
        if self.measuring and step % self.cfg.interval == 0:
            self._norm = clip_norm if clip_norm is not None else grad_norm(self.params)
            self._before = _flat(self.params) if self.on["stall"] else None  # one copy, one kernel

    def after_step(self, step: int, skipped: bool, loss_sum: torch.Tensor) -> None:
        """After the optimizer step (`skipped`: the fp16 scaler skipped it)."""
        if skipped:
            self.skipped += 1
            self.epoch_skipped += 1
            self.consecutive_skips += 1
        else:
            self.scheduled += 1
            self.consecutive_skips = 0
        if self.precision.scaler is not None and self.on["scale_collapse"]:
            self._check_scale(step)
        if self._norm is None:
            return
        norm, self._norm = self._norm, None
        values = [norm.float(), torch.isfinite(loss_sum).all().float()]
        if self._before is not None:
            before, self._before = self._before, None
            if self.sharded:  # squared norms of this rank's shards, summed over the ranks
                moved, size = self.all_sum(
                    [float(((_flat(self.params) - before) ** 2).sum()), float((before**2).sum())]
                )
                values.append(torch.tensor(math.sqrt(moved) / max(math.sqrt(size), 1e-30)))
            else:
                values.append(
                    (
                        torch.linalg.vector_norm(_flat(self.params) - before)
                        / torch.linalg.vector_norm(before).clamp_min(1e-30)
                    ).float()
                )
        measured = torch.stack([v.detach().float() for v in values]).tolist()  # the one sync of a measured step
        norm_value, ratio = measured[0], (measured[2] if len(measured) > 2 else math.nan)
        self.last_measured = (step, norm_value, ratio)
        if self.on["nonfinite"]:
            self._check_finite(step, float(self.all_sum([1.0 - measured[1]])[0]), norm_value)
        if skipped:
            return  # an fp16 overflow step: infinite norm and no update are expected
        self.norms.append(norm_value)
        if not math.isnan(ratio):
            self.ratios.append(ratio)
        if self.on["clip_saturation"] and self.max_norm is not None:
            self._check_clip(step, norm_value)
        if self.on["stall"] and not math.isnan(ratio):
            self._check_stall(step, ratio, norm_value)

    # -- rules -------------------------------------------------------------------------------------

    def _check_finite(self, step: int, bad_loss_ranks: float, norm: float | None) -> None:
        first = self.checked_to + 1
        self.checked_to = step
        lr_key, lr = f"{self.path}.solver.lr", self.stage.solver.lr
        fix = (
            f"lower {lr_key} (now {lr:g}), enable {self.path}.solver.grad_clip, or check the inputs for NaN; "
            f"with precision {self.precision.name} try fp32"
            if self.precision.name != "fp32"
            else f"lower {lr_key} (now {lr:g}), enable {self.path}.solver.grad_clip (max_norm: 1.0), or check the inputs for NaN"
        )
        if bad_loss_ranks > 0:
            self.fire(
                "nonfinite",
                step,
                f"the training loss became NaN/inf between optimizer steps {first} and {step} (on {int(bad_loss_ranks)} rank(s))",
                lr_key,
                fix,
            )
        elif (
            norm is not None and self.precision.scaler is None and not math.isfinite(norm)
        ):  # fp16 overflows are the scaler's
            self.fire("nonfinite", step, f"the gradient norm is {norm} at optimizer step {step}", lr_key, fix)

    def _any(self, grad: torch.Tensor) -> bool:
        """Whether any element of a gradient is non-zero (sharded: on any rank; every rank calls this
        for the same parameters, as the graph is the same on every rank)."""
        if not self.sharded:
            return bool(grad.any())
        return self.all_sum([float(local(grad).any())])[0] > 0

    def _check_grad_flow(self, step: int) -> None:
        if step == 1:
            none = [n for n, p in self.named if p.grad is None]
            self.suspects = [n for n, p in self.named if p.grad is not None and not self._any(p.grad)]
            if none:  # not in the graph at all: unambiguous (and DDP would fail on it at the next step)
                self._fire_grad_flow(step, none, "None")
            return
        by_name = dict(self.named)
        still = [n for n in self.suspects if by_name[n].grad is None or not self._any(by_name[n].grad)]
        self.suspects = []
        if still:
            self._fire_grad_flow(step, still, "all zero")

    def _fire_grad_flow(self, step: int, names: list[str], what: str) -> None:
        own = (f"blocks.{self.stage.name}.", f"adapters.{self.stage.name}.", f"heads.{self.stage.name}.")
        key = f"{self.path}.model" if all(n.startswith(own) for n in names) else f"{self.path}.trainable_layers"
        self.fire(
            "grad_flow",
            step,
            f"{len(names)} of {len(self.named)} trainable parameter(s) have {what} gradients after {'the first backward' if step == 1 else f'{step} optimizer steps'}: {_short(names, 8)}",
            key,
            "make the module's forward use them (a .detach(), torch.no_grad(), an unused branch or an early return cuts them off from the loss), or remove them from the module",
        )

    def _check_lr(self, step: int) -> None:
        sched, accum = self.scheduler, self.stage.solver.accumulation_steps
        key = f"{self.path}.solver.lr_scheduler"
        fix = (
            "step the schedule once per optimizer step, after optimizer.step(), and not after a step the fp16 scaler skipped; "
            "never per micro-batch. cascade-ray's loop does this: a hook, callback or user code is stepping it (or setting lr) as well"
        )
        if sched.steps != self.scheduled:
            skipped = f" ({self.skipped} more skipped by the fp16 scaler)" if self.skipped else ""
            self.fire(
                "lr_drift",
                step,
                f"the lr schedule was stepped {sched.steps} time(s) before optimizer step {step}, but {self.scheduled} optimizer step(s) were taken{skipped} "
                f"with accumulation_steps {accum}: it is ahead of its plan",
                key,
                fix,
            )
            return
        planned = sched.planned_lrs(self.scheduled)
        for i, (group, want) in enumerate(zip(self.optimizer.param_groups, planned)):
            if abs(group["lr"] - want) > 1e-6 * abs(want) + 1e-30:
                self.fire(
                    "lr_drift",
                    step,
                    f"param group {i} ({group.get('name', i)}) runs optimizer step {step} at lr {group['lr']:.6g}, but the plan says {want:.6g}",
                    key,
                    fix,
                )
                return

    def _check_scale(self, step: int) -> None:
        rule, scale = self.cfg.scale_collapse, self.precision.last_scale
        if scale < rule.min_scale or self.consecutive_skips >= rule.max_skipped_steps:
            self.fire(
                "scale_collapse",
                step,
                f"fp16 loss scale {scale:.3g} (min_scale {rule.min_scale:g}); {self.consecutive_skips} consecutive and {self.skipped} total optimizer steps skipped "
                "for inf/NaN gradients",
                f"{self.path}.solver.precision",
                f"use {self.path}.solver.precision: bf16 (no loss scaling needed), or lower {self.path}.solver.lr and enable grad_clip; "
                "gradients overflow fp16 even at this scale",
            )

    def _check_clip(self, step: int, norm: float) -> None:
        assert self.max_norm is not None
        ratio = norm / self.max_norm
        self.saturated_run = self.saturated_run + 1 if ratio > self.cfg.clip_saturation.max_ratio else 0
        if self.saturated_run * self.cfg.interval >= self.cfg.clip_saturation.patience_steps:
            self.saturated_run = 0
            self.fire(
                "clip_saturation",
                step,
                f"pre-clip gradient norm {norm:.3g} is {ratio:.3g}x grad_clip.max_norm {self.max_norm:g} "
                f"(> {self.cfg.clip_saturation.max_ratio:g}x) at every measurement for {self.cfg.clip_saturation.patience_steps} optimizer steps: every update is scaled down by that much",
                f"{self.path}.solver.grad_clip.max_norm",
                f"raise {self.path}.solver.grad_clip.max_norm to about the typical gradient norm (~{norm:.2g}; 1.0 is common), or disable clipping",
            )

    def _check_stall(self, step: int, ratio: float, norm: float) -> None:
        rule = self.cfg.stall
        if step > (1.0 - rule.tail_fraction) * self.scheduler.total:
            return  # the schedule's tail may anneal to ~0 on purpose
        self.stall_run = self.stall_run + 1 if ratio < rule.min_update_ratio else 0
        if self.stall_run * self.cfg.interval < rule.patience_steps:
            return
        self.stall_run = 0
        lrs = ", ".join(f"{g['lr']:.3g}" for g in self.optimizer.param_groups)
        detail = f"relative update ||dtheta||/||theta|| = {ratio:.3g} < {rule.min_update_ratio:g} at every measurement for {rule.patience_steps} optimizer steps (lr {lrs}, grad norm {norm:.3g})"
        factor = self.scheduler.factor(self.scheduled)
        if self.max_norm is not None and norm > 10 * self.max_norm:
            key, fix = (
                f"{self.path}.solver.grad_clip.max_norm",
                f"raise {self.path}.solver.grad_clip.max_norm (now {self.max_norm:g}; gradients are {norm:.3g}), or disable clipping",
            )
        elif factor < 1e-2:
            key, fix = (
                f"{self.path}.solver.lr_scheduler",
                f"the schedule has decayed the lr to {factor:.3g}x of its base: check {self.path}.solver.lr_scheduler (T_max, step_size/gamma, milestones, total_steps)",
            )
        else:
            key, fix = (
                f"{self.path}.solver.lr",
                f"raise {self.path}.solver.lr (now {self.stage.solver.lr:g}; typical AdamW 1e-4..3e-3, SGD 1e-2..1e-1)",
            )
        self.fire("stall", step, detail, key, fix)


def _flat(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """All parameters (this rank's shards of sharded ones) as one fp32 vector (a copy)."""
    return torch.cat([local(p.detach()).reshape(-1).float() for p in params])


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _short(names: Sequence[str], limit: int = 5) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")
