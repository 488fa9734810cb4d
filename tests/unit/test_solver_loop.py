"""The solver inside run_stage: accumulation windows, DDP no_sync, bf16, early stopping, sanity validation."""

from __future__ import annotations

import math
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from fakes import ListReporter
from paths import CONFIGS
from torch.nn.parallel import DistributedDataParallel

from cascade_ray.checks import load_config
from cascade_ray.data.batches import num_train_batches
from cascade_ray.hardware import detect_hardware
from cascade_ray.stage.hooks import LoopHooks
from cascade_ray.stage.loop import run_stage

CPU = torch.device("cpu")


class Counter:
    """Hooks that count micro-batches, optimizer steps and schedule steps per epoch."""

    def __init__(self):
        self.micro: dict[int, int] = {}
        self.steps: dict[int, int] = {}
        self.sched: list[int] = []

    def backward(self, s):
        self.micro[s.epoch] = self.micro.get(s.epoch, 0) + 1

    def stepped(self, s):
        self.steps[s.epoch] = self.steps.get(s.epoch, 0) + 1
        self.sched.append(s.scheduler.steps)

    def hooks(self) -> LoopHooks:
        return LoopHooks(after_backward=self.backward, after_optimizer_step=self.stepped)


def test_accumulation_4_steps_optimizer_and_schedule_once_per_window(digits):
    # batch_size 40: 29 micro-batches per epoch, so the last window of each epoch holds 1
    cfg = load_config(
        CONFIGS / "debug.yaml",
        [
            "stages[0].solver.accumulation_steps=4",
            "stages[0].train.batch_size=40",
            "stages[0].solver.lr_scheduler={type: cosine, warmup_steps: 2}",
        ],
    )
    count, reporter = Counter(), ListReporter()
    outcome = run_stage(cfg, 0, digits, None, reporter, CPU, hooks=count.hooks())
    micro = num_train_batches(len(digits.y_train), 40, 1)
    assert micro % 4 == 1
    assert count.micro == {0: micro, 1: micro}
    assert count.steps == {0: math.ceil(micro / 4), 1: math.ceil(micro / 4)}
    assert count.sched == list(
        range(1, 2 * math.ceil(micro / 4) + 1)
    )  # the schedule moved exactly once per optimizer step
    assert [r["optimizer_steps"] for r in reporter.reports] == [8, 8] and outcome.steps == 16
    # the reported lr is the one set for the next step: plan step 8 (warmup 2, then cosine over 14), then the end
    assert [r["lr"] for r in reporter.reports] == pytest.approx(
        [0.01 * 0.5 * (1 + math.cos(math.pi * 6 / 14)), 0.0], abs=1e-12
    )
    assert outcome.health_warnings == 0


def test_metrics_include_grad_norm_update_ratio_and_optimizer_steps(digits):
    cfg = load_config(CONFIGS / "debug.yaml", ["stages[0].solver.grad_clip={enabled: true, max_norm: 5.0}"])
    reporter = ListReporter()
    run_stage(cfg, 0, digits, None, reporter, CPU)
    for m in reporter.reports:
        assert m["optimizer_steps"] == 36 and m["health_warnings"] == 0
        assert 0 < m["grad_norm"] < 50 and 1e-5 < m["update_ratio"] < 1, m


@pytest.fixture
def gloo_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_ddp_skips_gradient_sync_on_all_but_the_last_micro_batch_of_a_window(digits, gloo_group):
    class CountingDDP(DistributedDataParallel):
        entered = 0

        @contextmanager
        def no_sync(self):
            CountingDDP.entered += 1
            with super().no_sync():
                yield

    cfg = load_config(CONFIGS / "debug.yaml", ["stages[0].solver.accumulation_steps=4", "stages[0].train.epochs=1"])
    count = Counter()
    run_stage(cfg, 0, digits, None, ListReporter(), CPU, wrap=CountingDDP, hooks=count.hooks())
    assert CountingDDP.entered == count.micro[0] - count.steps[0]


def test_bf16_trains_on_cpu(digits):
    cfg = load_config(CONFIGS / "debug.yaml", ["stages[0].solver.precision=bf16", "stages[0].train.epochs=1"])
    reporter = ListReporter()
    outcome = run_stage(cfg, 0, digits, None, reporter, CPU)
    # measured 0.66 in fp32 and bf16 after one epoch; chance is 0.1
    assert reporter.reports[-1]["val_accuracy"] > 0.4
    # a CPU without native bf16 (AVX2 only: emulated, several times slower) gets the
    # health.emulated_bf16 warning (policy warn) for an explicit bf16, and trains on
    native = detect_hardware("cpu").native_bf16
    assert outcome.health_warnings == (0 if native else 1), outcome


def test_early_stopping_ends_the_stage(digits):
    cfg = load_config(
        CONFIGS / "debug.yaml",
        [
            "stages[0].train.epochs=4",
            "stages[0].train.early_stopping={metric: val_accuracy, patience: 1, min_delta: 1.0}",
        ],
    )
    reporter = ListReporter()
    run_stage(cfg, 0, digits, None, reporter, CPU)
    assert len(reporter.reports) == 2  # epoch 1 sets the best, epoch 2 cannot improve by 1.0


def test_sanity_validation_fails_a_broken_eval_before_any_training(digits):
    def break_eval(s):
        def hook(module, args, out):
            if not module.training:
                raise RuntimeError("broken eval")

        s.model.heads[s.stage.name].register_forward_hook(hook)

    count = Counter()
    cfg = load_config(CONFIGS / "debug.yaml")
    with pytest.raises(RuntimeError, match="broken eval"):
        run_stage(
            cfg,
            0,
            digits,
            None,
            ListReporter(),
            CPU,
            hooks=LoopHooks(on_setup=break_eval, after_optimizer_step=count.stepped),
        )
    assert count.steps == {}


def test_reduce_on_plateau_lowers_the_lr_between_epochs(digits):
    cfg = load_config(
        CONFIGS / "debug.yaml",
        [
            "stages[0].train.epochs=3",
            "stages[0].solver.lr_scheduler={type: ReduceLROnPlateau, monitor: val_accuracy, threshold: 10.0, patience: 0, factor: 0.5}",
        ],
    )
    reporter = ListReporter()
    run_stage(cfg, 0, digits, None, reporter, CPU)
    # threshold 10: no epoch counts as an improvement after the first, so every later epoch halves lr
    assert [r["lr"] for r in reporter.reports] == pytest.approx([0.01, 0.01, 0.005])
