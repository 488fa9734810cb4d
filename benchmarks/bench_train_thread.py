"""Why a Ray Train worker's CPU steps are slower than the same steps in one process: one loop of
small OpenMP-parallel torch ops, timed where a stage's code can run.

    flock /tmp/cascade-cpu.lock .venv/bin/python benchmarks/bench_train_thread.py [--iters 5000] [--repeats 3] [--cpus 2]

The loop: ``a.mul(1.5).add_(a).abs_().sqrt_()`` on a float32 (10, 6272) tensor, the shape of the
demo classifier's head weight: 62,720 elements, over ATen's grain size, so each op is one OpenMP
parallel region when torch has more than one thread, and so short that the region's start and
end (waking the team's other thread, the barrier) are most of its cost, as in a small stage's
optimizer step and elementwise ops. Timed with ``torch.set_num_threads(1)`` and ``(--cpus)`` in:

1. **process, main thread** (the baseline: where ``benchmarks/bench_stacked.py`` and the unit
   tests run a stage);
2. **process, new thread**: a ``threading.Thread``, as Ray Train runs ``train_loop_per_worker``
   (timed first, before the main thread has run anything in parallel);
3. **process, new thread after a main-thread op**: the main thread ran one parallel op first,
   so two OpenMP thread pools exist;
4. **Ray task** (``num_cpus=--cpus``): the task runs on its worker's main thread;
5. **Ray Train worker** (a ``TorchTrainer``, 1 worker x ``--cpus`` CPUs): Ray's ``TrainingThread``,
   with the Ray env defaults cascade-ray's driver passes (``constants.RAY_ENV_DEFAULTS``; `--ray-defaults
   off`: Ray's own).

Prints each place's median microseconds per iteration over `--repeats` blocks and its ratio
against the process's main thread with the same thread count (> 1: slower). Embedded
``ray.init(num_cpus=--cpus)``, started once, not timed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def small_ops(iters: int, repeats: int, threads: int) -> list[float]:
    """Microseconds per iteration of the small-op loop, one figure per block, on this thread."""
    import torch

    torch.set_num_threads(threads)
    a = torch.randn(10, 6272)
    for _ in range(100):  # warm-up: the team started, first-call costs paid
        a.mul(1.5).add_(a).abs_().sqrt_()
    out = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(iters):
            a.mul(1.5).add_(a).abs_().sqrt_()
        out.append((time.perf_counter() - started) / iters * 1e6)
    return out


def both(iters: int, repeats: int, cpus: int) -> dict[int, list[float]]:
    return {n: small_ops(iters, repeats, n) for n in sorted({1, cpus})}


def in_thread(fn, *args):
    box: dict[str, object] = {}
    worker = threading.Thread(target=lambda: box.setdefault("out", fn(*args)))
    worker.start()
    worker.join()
    return box["out"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cpus", type=int, default=2)
    parser.add_argument("--ray-defaults", choices=("on", "off"), default="on", help="cascade-ray's Ray env defaults")
    args = parser.parse_args(argv)
    from cascade_ray.hardware import hardware_line

    print(hardware_line(), flush=True)  # first line: the hardware these figures come from
    import ray
    import torch
    from common import in_train_worker, ship_by_value

    from cascade_ray.constants import apply_ray_env_defaults

    work = (args.iters, args.repeats, args.cpus)
    places: dict[str, dict[int, list[float]]] = {}
    places["process, new thread"] = in_thread(both, *work)  # first: no other thread has a pool yet
    places["process, main thread"] = both(*work)
    # the main thread has run parallel ops above: its OpenMP pool exists from here on
    torch.set_num_threads(args.cpus)
    torch.randn(512, 512) @ torch.randn(512, 512)
    places["process, new thread after a main-thread op"] = in_thread(both, *work)

    ray.init(
        num_cpus=args.cpus,
        runtime_env={"env_vars": apply_ray_env_defaults() if args.ray_defaults == "on" else {}},
        log_to_driver=False,
        include_dashboard=False,
    )
    try:
        ship_by_value()
        places["Ray task"] = ray.get(ray.remote(num_cpus=args.cpus)(both).remote(*work))

        worker = in_train_worker(both, *work, cpus=args.cpus)
        places["Ray Train worker"] = {int(n): v for n, v in worker.items()}  # JSON made the keys strings
    finally:
        ray.shutdown()

    print(
        f"bench_train_thread: {args.iters} iterations of 4 ops on a (10, 6272) float32 tensor per block, "
        f"{args.repeats} blocks, medians; torch {torch.__version__}, ray {ray.__version__}, {args.cpus} CPUs, "
        f"cascade-ray's Ray env defaults {args.ray_defaults}"
    )
    base = {n: statistics.median(v) for n, v in places["process, main thread"].items()}
    for place in ("process, main thread", *(p for p in places if p != "process, main thread")):
        per = places[place]
        cells = []
        for n, blocks in per.items():
            med = statistics.median(blocks)
            cells.append(f"{n} thread{'s' if n > 1 else ''} {med:.1f} us ({med / base[n]:.2f}x)")
        print(f"{place}: " + "; ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
