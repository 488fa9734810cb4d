"""A batched sweep's step three ways: the replica loop cascade-ray runs, ``torch.func`` stacking
(``stack_module_state``-style stacked parameters + ``vmap``), and one grouped GEMM per layer.

    flock /tmp/cascade-cpu.lock .venv/bin/python benchmarks/bench_stacked.py [--config pipelines/configs/three_stage.yaml] [--configs 16] [--steps 20] [--repeats 5]

Workload: the config's last stage (the demo's classifier by default: a per-token
``Linear -> GELU -> Dropout`` MLP over the cached (B, 49, 64) encoder tokens, then a flattening
``Dropout -> Linear`` head) as `--configs` replicas with one seed, on cached features of a
randomly initialised upstream (``common.last_stage_replicas``), in the precision the stage picks
on this machine (bf16 autocast where bf16 is native, fp32 elsewhere). One "step" is forward,
backward and AdamW step of every replica on one shared batch of ``train.batch_size`` rows.

- **loop** (the baseline: a batched sweep's step with grouping off, ``group_size=1``): each
  replica's own model and optimizer, one after the other, inside ``shared_masks()`` (the replicas
  share a seed, so the dropout masks are drawn once per batch).
- **vmap**: the replicas' trainable parameters stacked into ``[K, ...]`` tensors and the stage
  model run through ``torch.func.functional_call`` under ``vmap`` (``randomness="same"``: one
  mask per batch, as the loop), one AdamW over the stacked tensors. One optimizer has one lr, so
  this is a lower bound on what per-replica hyper-parameters would cost.
- **grouped by G** (``stage/grouped.py``, what a batched sweep of an MLP stage runs; `--groups`):
  the same step as the loop, health checks and per-replica optimizers included, with the
  forward and backward of up to G replicas as one ``baddbmm`` per layer. Skipped, with the
  reason, for a stage it does not apply to.

Each way runs `--steps` steps per block, in alternating blocks, `--repeats` blocks each; prints
the median ms per step of all replicas and each way's ratio against the loop.

``--epochs N`` then times whole epochs of the batched sweep itself (``run_batched``: data
windows, per-replica health checks, evaluation and the report included), N alternating rounds of
one epoch per group size (1, then each of `--groups`), and prints replica-samples per second,
each size's ratio against 1, and the winning replica with its metric (which must not change).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402


def replica_step(replicas, x, y, grouped) -> Callable[[], None]:
    """One shared batch through ``stage/batched.py``'s own step: forward, backward and optimizer
    step of every replica (grouped where `grouped` groups them)."""
    from cascade_ray.models.dropout import shared_masks
    from cascade_ray.stage.batched import _step_replicas

    sums = {id(r): torch.zeros(1) for r in replicas}

    def step() -> None:
        with shared_masks():
            _step_replicas(replicas, x, y, 1, True, sums, grouped)

    return step


def stacked_params(setups) -> dict[str, nn.Parameter]:
    names = [n for n, _ in setups[0].named_params]
    return {n: nn.Parameter(torch.stack([dict(s.named_params)[n].detach() for s in setups])) for n in names}


def vmap_step(setups, x, y, rng, lr: float) -> Callable[[], None]:
    from torch.func import functional_call, vmap

    s0 = setups[0]
    params = stacked_params(setups)
    optimizer = torch.optim.AdamW(list(params.values()), lr=lr)
    head = s0.model.order[-1]
    k = len(setups)

    def logits(p: dict[str, torch.Tensor], inputs: torch.Tensor) -> torch.Tensor:
        return functional_call(s0.model, p, (inputs,), strict=False)[head]

    def step() -> None:
        torch.set_rng_state(rng)
        with s0.precision.autocast():
            out = vmap(logits, in_dims=(0, None), randomness="same")(params, x)  # (K, B, classes)
        loss = s0.criterion(out.float().flatten(0, 1), y.repeat(k)) * k  # the sum of the K means
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "pipelines" / "configs" / "three_stage.yaml"))
    parser.add_argument("--configs", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20, help="steps per timed block")
    parser.add_argument("--repeats", type=int, default=5, help="alternating blocks per way")
    parser.add_argument(
        "--groups",
        default="4,8,16",
        help="grouped: replicas per group (comma-separated; K/G groups run one after another)",
    )
    parser.add_argument(
        "--epochs", type=int, default=0, help="then N alternating rounds of one whole batched epoch per group size"
    )
    args = parser.parse_args(argv)
    from cascade_ray.hardware import hardware_line

    print(hardware_line(), flush=True)  # first line: the hardware these figures come from
    from common import ListReporter, last_stage_replicas

    from cascade_ray.stage.batched import _replica
    from cascade_ray.stage.grouped import GroupedSteps

    cfg, index, data, upstream, features, cfgs, _ = last_stage_replicas(args.config, args.configs, 1)
    stage = cfg.stages[index]
    cpu = torch.device("cpu")

    def replicas():  # a fresh set per way: its own weights, optimizers and generator states
        made = [_replica(c, index, data, upstream, ListReporter(), cpu, None) for c in cfgs]
        for r in made:
            r.setup.model.train()
        return made

    bs = stage.train.batch_size
    x = torch.as_tensor(features["x_train"][:bs])
    y = torch.as_tensor(data.y_train[:bs]).long()
    vmapped = replicas()
    ways: dict[str, Callable[[], None]] = {
        "loop": replica_step(replicas(), x, y, None),
        "vmap": vmap_step([r.setup for r in vmapped], x, y, vmapped[0].rng, stage.solver.lr),
    }
    for size in sorted({min(int(g), len(cfgs)) for g in args.groups.split(",")}):
        mine = replicas()
        grouped = GroupedSteps(mine, size)
        if not grouped.groups(mine):
            print(f"grouped by {size}: not run (stage/grouped.py does not group this stage's replicas)")
            continue
        ways[f"grouped by {size}"] = replica_step(mine, x, y, grouped)
    precision = vmapped[0].setup.precision.name
    print(
        f"bench_stacked: stage {stage.name!r} of {args.config}, {args.configs} replicas, batch {bs}, input "
        f"{tuple(x.shape)}, precision {precision}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; {args.repeats} alternating blocks of {args.steps} steps, medians",
        flush=True,
    )
    for step in ways.values():  # warm-up: first-call allocations and kernel choices
        for _ in range(3):
            step()
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, step in ways.items():
            started = time.perf_counter()
            for _ in range(args.steps):
                step()
            times[name].append((time.perf_counter() - started) / args.steps)
    base = statistics.median(times["loop"])
    for name, seconds in times.items():
        med = statistics.median(seconds)
        spread = ", ".join(f"{t * 1e3:.1f}" for t in seconds)
        print(
            f"{name}: {med * 1e3:.1f} ms per step of {args.configs} replicas "
            f"({base / med:.2f}x the loop's speed; blocks {spread} ms)"
        )
    if args.epochs:
        epochs_ab(args, cfgs, index, data, upstream, features)
    return 0


def epochs_ab(args, cfgs, index, data, upstream, features) -> None:
    """Whole epochs of ``run_batched`` per group size, alternating; ratios against group size 1."""
    from common import timed_batched

    sizes = [1, *sorted({min(int(g), len(cfgs)) for g in args.groups.split(",")} - {1})]
    samples = len(data.y_train) * len(cfgs)
    timed_batched(cfgs, index, data, upstream, features, group_size=sizes[-1])  # warm-up
    rates: dict[int, list[float]] = {g: [] for g in sizes}
    winners: dict[int, set[tuple]] = {g: set() for g in sizes}
    for _ in range(args.epochs):
        for g in sizes:
            seconds, reporter = timed_batched(cfgs, index, data, upstream, features, group_size=g)
            rates[g].append(samples / seconds)
            won = reporter.reports[-1]
            winners[g].add((won["replica"], round(won["val_accuracy"], 6)))
    print(
        f"epochs: {args.epochs} alternating rounds of one epoch of {len(data.y_train)} rows x {len(cfgs)} replicas "
        "per group size (run_batched), medians"
    )
    base = statistics.median(rates[1])
    for g in sizes:
        med = statistics.median(rates[g])
        spread = ", ".join(f"{r:.0f}" for r in rates[g])
        won = "; ".join(f"replica {k} val_accuracy {v}" for k, v in sorted(winners[g]))
        print(
            f"group size {g}: {med:.0f} replica-samples/s ({med / base:.2f}x group size 1; rounds {spread}); best {won}"
        )


if __name__ == "__main__":
    raise SystemExit(main())
