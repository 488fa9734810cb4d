"""Precision and memory format of the demo ResNet step on this machine: fp32/bf16 x contiguous/channels_last
(and, with --compile, torch.compile), each against fp32 contiguous measured in the same run.

    python benchmarks/bench_precision.py                 # this CPU as it is
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python benchmarks/bench_precision.py   # an AVX2-only CPU
    python benchmarks/bench_precision.py --compile

Workload: pipelines/configs/three_stage.yaml stage 0 (features) as built by cascade-ray, on
Fashion-MNIST batches of `--batch` (64), AdamW, label smoothing as configured, forward + loss
under the variant's autocast, backward, step. Variants run interleaved, `--repeats` times,
`--steps` timed steps each after warm-up steps; the median samples/s is printed with its
ratio to fp32 contiguous from the same run. The memory-format table in
cascade_ray/solver/precision.py (CHANNELS_LAST_FASTER) is read from this script's output.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "pipelines" / "configs" / "three_stage.yaml"


def build(cfg, data, memory_format: torch.memory_format, compiled: bool):
    from cascade_ray.stage.setup import build_stage_model

    model, _ = build_stage_model(cfg, 0, data, None)
    model.train()
    model.to(memory_format=memory_format)
    if compiled:
        model.blocks[cfg.stages[0].name].compile()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return model, optimizer


def run(cfg, data, variant: tuple[str, str, bool], steps: int, warmup: int, batch: int) -> tuple[float, float]:
    """(samples/s over the timed steps, seconds of the warm-up steps) for one variant."""
    precision, fmt, compiled = variant
    memory_format = torch.channels_last if fmt == "channels_last" else torch.contiguous_format
    model, optimizer = build(cfg, data, memory_format, compiled)
    stage = cfg.stages[0]
    x_all = (torch.from_numpy(data.x_train[: batch * 8]).float() - torch.as_tensor(data.mean)) / torch.as_tensor(
        data.std
    )
    y_all = torch.from_numpy(data.y_train[: batch * 8])
    amp = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if precision == "bf16" else contextlib.nullcontext

    def step(i: int) -> None:
        j = (i % 8) * batch
        x = x_all[j : j + batch].contiguous(memory_format=memory_format)
        with amp():
            loss = F.cross_entropy(
                model(x, heads=[stage.name])[stage.name],
                y_all[j : j + batch],
                label_smoothing=stage.loss.label_smoothing,
            )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    for i in range(warmup):
        step(i)
    warm_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(steps):
        step(i)
    return steps * batch / (time.perf_counter() - t0), warm_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant and repeat")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (compile happens here)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="also time torch.compile (fp32 and bf16, channels_last)")
    args = parser.parse_args(argv)
    from cascade_ray.hardware import hardware_line

    print(hardware_line(), flush=True)  # first line: the hardware these figures come from
    torch.set_num_threads(args.threads)

    from cascade_ray.checks import load_config
    from cascade_ray.data.source import load_data

    cfg = load_config(args.config)
    data = load_data(cfg.data, cfg.seed)
    variants = [(p, f, False) for p in ("fp32", "bf16") for f in ("contiguous", "channels_last")]
    if args.compile:
        variants += [("fp32", "channels_last", True), ("bf16", "channels_last", True)]
    print(
        f"bench_precision: {args.config.name} stage {cfg.stages[0].name} ({cfg.stages[0].model.type}), batch {args.batch}, "
        f"{args.threads} thread(s), {args.steps} timed steps after {args.warmup} warm-up, {args.repeats} interleaved repeats + 1 untimed run each, "
        f"torch {torch.__version__}",
        flush=True,
    )
    for v in variants:  # one untimed run of each first (allocator, oneDNN primitives, lazy init)
        run(cfg, data, v, args.steps, args.warmup, args.batch)
    rates: dict[tuple[str, str, bool], list[float]] = {v: [] for v in variants}
    warm: dict[tuple[str, str, bool], list[float]] = {v: [] for v in variants}
    for rep in range(args.repeats):
        for v in variants if rep % 2 == 0 else variants[::-1]:
            rate, warm_s = run(cfg, data, v, args.steps, args.warmup, args.batch)
            rates[v].append(rate)
            warm[v].append(warm_s)
        print(f"  repeat {rep + 1}: " + ", ".join(f"{_name(v)} {rates[v][-1]:.0f}" for v in variants), flush=True)
    base = statistics.median(rates[variants[0]])
    for v in variants:
        med = statistics.median(rates[v])
        ratios = [r / b for r, b in zip(rates[v], rates[variants[0]])]
        extra = f", warm-up {statistics.median(warm[v]):.1f} s incl. compile" if v[2] else ""
        print(
            f"{_name(v)}: {med:.0f} samples/s ({med / base:.2f}x fp32 contiguous; per-repeat {min(ratios):.2f}..{max(ratios):.2f}{extra})"
        )
    return 0


def _name(v: tuple[str, str, bool]) -> str:
    return f"{v[0]} {v[1]}" + (" compiled" if v[2] else "")


if __name__ == "__main__":
    sys.exit(main())
