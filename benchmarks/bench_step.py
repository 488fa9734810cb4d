"""P1 step overhead: ``run_stage``'s training throughput vs a bare PyTorch loop, same process.

    /work/venv/bin/python benchmarks/bench_step.py [--repeats 3] [--max-steps 300] [--threads 1] [--device cpu|cuda]

Stage 0 (``features``, a narrow ResNet) of ``pipelines/configs/three_stage.yaml`` on the real
Fashion-MNIST subset (``cascade_ray.data.source.load_data``), with ``stages[0].train.max_steps``
set so each run takes a few hundred optimizer steps (over several epochs: 141 steps per epoch).

- **candidate**: ``cascade_ray.stage.loop.run_stage`` in-process, exactly as it runs by default
  (health monitor, accumulation windows, precision wrapper, per-step loss bookkeeping, progress
  prints every ``log_interval`` steps to a discarded stdout), with a minimal list reporter.
- **baseline**: a hand-written PyTorch loop on the same model (built by ``build_stage_model``,
  same seed), same data arrays, batch order (the same seeded permutation), per-batch
  normalization, augmentation (flip + 1-px shift, same tensor ops), the same loss (label
  smoothing, scale) and precision (bf16 autocast of forward and loss when the stage asks
  for it), AdamW with the same two parameter groups (no decay on 1-D), the same cosine lr
  plan and torch thread count. Both
  runs end with the same loss to the last bit (printed as a check that the work is identical).

What is timed: the **steady-state step throughput** of both, as the sum of the wall-clock
gaps between consecutive optimizer steps *within an epoch* (each gap = one step's data
slicing, augmentation, forward, backward, optimizer and lr step, plus whatever per-step
work the loop adds), and the samples of those steps. Per-epoch work (shuffling, validation,
the report, the monitor's frozen digest) and setup (model build, sanity validation) are
excluded from both. A second figure counts them the same way in both: samples trained /
wall time of the whole call, the baseline also validating once before training (2 batches)
and after each epoch (the full validation split) and taking a ``state_dict()`` per epoch.

On ``--device cuda`` (GPU throughput vs a bare loop) both loops train on the GPU: batches are
normalized on the host and copied per batch (as ``ArraySource`` does), augmentation draws on the
device, and every step mark synchronizes the device first, in both loops alike, so a gap is the
step's GPU time and not only its launch. The loss then matches to float tolerance, not to the bit
(cuDNN picks its kernels per run).

Runs alternate (candidate, baseline, baseline, candidate, ...) after one unmeasured warm-up
each (the candidate's warm-up comes first: on CPU its ``setup_stage`` fixes glibc's malloc
thresholds for the whole process, ``stage/allocator.py``, so every measured run of both loops has
the same allocator settings and the ratio is the loop's overhead alone); the figure is the median over repetitions of the per-repetition ratio. CPU-time
figures (``time.process_time``) are printed too: on a shared machine they are far less
disturbed by other processes than wall time. Prints ``figure: value (ratio vs baseline)``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ListReporter

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "pipelines" / "configs" / "three_stage.yaml"
INDEX = 0  # the benchmarked stage: features (trained from scratch, no upstream)


@dataclass
class _Clock:
    """Step marks (epoch, samples of this step, wall, cpu) and the whole call's times."""

    marks: list[tuple[int, int, float, float]] = field(default_factory=list)
    call_wall: float = 0.0
    call_cpu: float = 0.0
    samples: int = 0
    final_loss: float = math.nan

    sync: bool = False  # CUDA: wait for the device's queued work before each mark

    def mark(self, epoch: int, samples: int) -> None:
        if self.sync:
            torch.cuda.synchronize()
        self.marks.append((epoch, samples, time.perf_counter(), time.process_time()))

    def steady(self) -> tuple[int, float, float]:
        """(samples, wall s, cpu s) over step-to-step gaps inside an epoch."""
        n, wall, cpu = 0, 0.0, 0.0
        for (ea, _, wa, ca), (eb, sb, wb, cb) in zip(self.marks, self.marks[1:]):
            if ea == eb:
                n, wall, cpu = n + sb, wall + wb - wa, cpu + cb - ca
        return n, wall, cpu


def _batch_sizes(n: int, batch_size: int) -> list[int]:
    return [min(batch_size, n - i) for i in range(0, n, batch_size)]


def _finish(clock: _Clock, w0: float, c0: float) -> None:
    if clock.sync:
        torch.cuda.synchronize()
    clock.call_wall, clock.call_cpu = time.perf_counter() - w0, time.process_time() - c0


def run_candidate(cfg, data, device: torch.device) -> _Clock:
    """``run_stage`` as it runs by default; a hook only records the time after each step."""
    from cascade_ray.stage.hooks import LoopHooks
    from cascade_ray.stage.loop import run_stage

    clock = _Clock(sync=device.type == "cuda")
    sizes = _batch_sizes(len(data.y_train), cfg.stages[INDEX].train.batch_size)
    counts: dict[int, int] = {}

    def after_step(state) -> None:
        i = counts[state.epoch] = counts.get(state.epoch, -1) + 1
        clock.mark(state.epoch, sizes[i])

    reporter = ListReporter()
    w0, c0 = time.perf_counter(), time.process_time()
    with contextlib.redirect_stdout(io.StringIO()):  # its progress lines still get formatted
        outcome = run_stage(cfg, INDEX, data, None, reporter, device, hooks=LoopHooks(after_optimizer_step=after_step))
    _finish(clock, w0, c0)
    clock.samples = sum(sum(sizes[: last + 1]) for last in counts.values())
    clock.final_loss = float(np.float32(reporter.reports[-1]["train_loss"]))
    if outcome.steps != cfg.stages[INDEX].train.max_steps:
        raise RuntimeError(f"run_stage took {outcome.steps} steps, expected {cfg.stages[INDEX].train.max_steps}")
    return clock


def run_baseline(cfg, data, device: torch.device) -> _Clock:
    """The same training written as a plain PyTorch loop."""
    from cascade_ray.stage.setup import build_stage_model, stage_seed

    stage = cfg.stages[INDEX]
    train, solver, aug = stage.train, stage.solver, stage.train.augment
    from cascade_ray.hardware import detect_hardware
    from cascade_ray.solver.precision import choose_memory_format, resolve_precision

    hw = detect_hardware(device)
    precision = resolve_precision(solver.precision, hw).resolved  # what run_stage makes of precision auto here
    if precision not in ("bf16", "fp32"):
        raise SystemExit(
            f"bench_step: the bare loop writes bf16 and fp32 only, not {precision}: set the stage's precision"
        )
    amp = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if precision == "bf16" else contextlib.nullcontext
    clock = _Clock(sync=device.type == "cuda")
    w0, c0 = time.perf_counter(), time.process_time()
    model, _ = build_stage_model(cfg, INDEX, data, None)  # seeds torch like run_stage does
    model.to(device)
    if choose_memory_format(stage, hw, precision, model)[0] == "channels_last":  # as run_stage decides it
        model.to(memory_format=torch.channels_last)
    head = stage.name
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=solver.lr, weight_decay=solver.weight_decay
    )
    base_lrs = [g["lr"] for g in optimizer.param_groups]
    n = len(data.y_train)
    total = min(train.epochs * math.ceil(n / train.batch_size), train.max_steps)
    x_all, y_all = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    # per-channel statistics, broadcastable to a batch row, as the loop uses them
    mean, std = torch.from_numpy(data.mean), torch.from_numpy(data.std)
    xv, yv = torch.from_numpy(data.x_val), torch.from_numpy(data.y_val)

    @torch.no_grad()
    def validate(max_batches: int | None = None) -> float:
        model.eval()
        correct, seen = 0, 0
        for i, start in enumerate(range(0, len(yv), train.eval_batch_size)):
            if max_batches is not None and i >= max_batches:
                break
            xb = ((xv[start : start + train.eval_batch_size].float() - mean) / std).to(device, non_blocking=True)
            yb = yv[start : start + train.eval_batch_size].to(device, non_blocking=True)
            logits = model(xb, heads=[head])[head]
            F.cross_entropy(logits, yb, reduction="sum").item()
            correct += (logits.argmax(1) == yb).sum().item()
            seen += len(yb)
        model.train()
        return correct / seen

    validate(train.sanity_val_steps)
    step, samples, last_loss = 0, 0, math.nan
    for epoch in range(train.epochs):
        model.train()
        g = torch.Generator()
        g.manual_seed(stage_seed(cfg, INDEX) + epoch)
        order = torch.randperm(n, generator=g)
        loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        seen = 0
        for idx in order.split(train.batch_size):
            x = ((x_all[idx].float() - mean) / std).to(device, non_blocking=True)
            y = y_all[idx].to(device, non_blocking=True)
            b = len(y)
            if aug.hflip:
                flip = torch.rand(b, device=device) < 0.5
                x = torch.where(flip[:, None, None, None], x.flip(3), x)
            if aug.crop_padding:
                p, (_, c, h, w) = aug.crop_padding, x.shape
                padded = F.pad(x, (p, p, p, p))
                oy = torch.randint(0, 2 * p + 1, (b, 1), device=device)
                ox = torch.randint(0, 2 * p + 1, (b, 1), device=device)
                rows = (oy + torch.arange(h, device=device))[:, None, :, None]
                cols = (ox + torch.arange(w, device=device))[:, None, None, :]
                x = padded[
                    torch.arange(b, device=device)[:, None, None, None],
                    torch.arange(c, device=device)[None, :, None, None],
                    rows,
                    cols,
                ]
            with amp():  # the stage's precision (bf16 autocast in the demo config), forward and loss
                loss = stage.loss.scale * F.cross_entropy(
                    model(x, heads=[head])[head], y, label_smoothing=stage.loss.label_smoothing
                )
            loss.backward()
            optimizer.step()
            step += 1
            factor = 0.5 * (1.0 + math.cos(math.pi * min(1.0, step / total)))
            for group, base in zip(optimizer.param_groups, base_lrs):
                group["lr"] = base * factor
            optimizer.zero_grad(set_to_none=True)
            loss_sum += loss.detach() * b
            seen += b
            samples += b
            clock.mark(epoch, b)
            if step >= train.max_steps:
                break
        last_loss = float(loss_sum / seen)
        validate()
        model.state_dict()  # what the loop hands its reporter each epoch
        if step >= train.max_steps:
            break
    _finish(clock, w0, c0)
    clock.samples, clock.final_loss = samples, float(np.float32(last_loss))
    return clock


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--repeats", type=int, default=3, help="measured runs of each loop (interleaved)")
    parser.add_argument("--max-steps", type=int, default=300, help="optimizer steps per run")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for both loops")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where both loops train")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_step: --device cuda needs a CUDA build of torch and a visible GPU")
    from cascade_ray.hardware import hardware_line

    print(hardware_line(), flush=True)  # first line: the hardware these figures come from
    torch.set_num_threads(args.threads)

    from cascade_ray.checks import load_config
    from cascade_ray.data.source import load_data

    cfg = load_config(args.config, [f"stages[{INDEX}].train.max_steps={args.max_steps}"])
    data = load_data(cfg.data, cfg.seed)
    stage = cfg.stages[INDEX]
    print(
        f"bench_step: {args.config.name} stage {stage.name} ({stage.model.type}), {data.source}: {len(data.y_train)} train / {len(data.y_val)} val, "
        f"batch {stage.train.batch_size}, {args.max_steps} steps per run, {args.repeats} interleaved repeats + 1 warm-up each, "
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {args.device}",
        flush=True,
    )
    run_candidate(cfg, data, device), run_baseline(cfg, data, device)  # warm-up (allocator, lazy init): not measured
    cand: list[_Clock] = []
    base: list[_Clock] = []
    for rep in range(args.repeats):
        pair = (
            (("c", run_candidate), ("b", run_baseline)) if rep % 2 == 0 else (("b", run_baseline), ("c", run_candidate))
        )
        for kind, fn in pair:
            (cand if kind == "c" else base).append(fn(cfg, data, device))
        c, b = cand[-1].steady(), base[-1].steady()
        print(
            f"  repeat {rep + 1}: run_stage {c[0] / c[1]:.0f} samples/s, bare {b[0] / b[1]:.0f} samples/s (wall, steady)",
            flush=True,
        )

    def rate(clocks: list[_Clock], how: str) -> list[float]:
        if how == "wall":
            return [n / w for n, w, _ in (k.steady() for k in clocks)]
        if how == "cpu":
            return [n / c for n, _, c in (k.steady() for k in clocks)]
        return [k.samples / k.call_wall for k in clocks]

    same = all(c.final_loss == b.final_loss for c, b in zip(cand, base))
    print(
        f"identical work check: final train loss run_stage {cand[-1].final_loss:.6f}, bare {base[-1].final_loss:.6f} ({'bit-identical' if same else 'DIFFERENT'})"
    )
    for label, how in (
        ("step throughput (wall)", "wall"),
        ("step throughput (CPU time)", "cpu"),
        ("whole call incl. setup/validation/report (wall)", "call"),
    ):
        rc, rb = rate(cand, how), rate(base, how)
        ratios = [c / b for c, b in zip(rc, rb)]
        spread = f"ratios {min(ratios):.3f}..{max(ratios):.3f}"
        print(f"bare loop {label}: {statistics.median(rb):.0f} samples/s (1.000 vs baseline)")
        print(
            f"run_stage {label}: {statistics.median(rc):.0f} samples/s ({statistics.median(ratios):.3f} vs baseline; median of per-repeat ratios, {spread})"
        )
    ratio = statistics.median(c / b for c, b in zip(rate(cand, "wall"), rate(base, "wall")))
    print(
        f"P1 target: run_stage step throughput >= 0.97 x bare loop: {ratio:.3f} -> {'met' if ratio >= 0.97 else 'NOT met'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
