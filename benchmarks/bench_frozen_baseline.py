"""A batched sweep of a stage on a large frozen upstream: its frozen-drift checks with the upstream's
digests taken from the driver's hand-off and hashed once per check for all replicas (now) vs
hashed by every replica before training and at every epoch's end (before).

    flock /tmp/cascade-cpu.lock .venv/bin/python benchmarks/bench_frozen_baseline.py [--width 10000] [--configs 16] [--epochs 3] [--repeats 3]

The stages are those of ``bench_checkpoint.py``: a ``backbone`` MLP (64 -> W -> W; W = 10000:
~100M parameters, ~400 MB), randomly initialised, its arrays read-only as a ``ray.get`` from the
object store gives them, and a small ``head`` MLP (W -> 64 -> 10) trained on the backbone's
cached features by ``run_batched`` (what the batched job's workers run), in this process, on the
CPU, with ``--configs`` replicas (lr log-spaced) for ``--epochs`` epochs. The two ways alternate
(before, now, now, before, ...) and the medians are printed. Before is the same code given what
it had before: no digests from the hand-off (``upstream_digests`` None), every replica hashing
for itself (the digest memo dropped) and the one checkpoint's listing hashing again. Both ways' replicas are checked to end with the same
metrics. Also timed, once each way per round: the frozen digest a lone stage's worker takes
before training, and the feature cache's key on the driver, with and without the hand-off's
digests.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_checkpoint import _config  # noqa: E402  the same two stages
from common import timed_batched  # noqa: E402


@contextlib.contextmanager
def _as_before():
    """``frozen_digest`` as it was: every entry hashed, by every caller (no `known`, no memo), and the
    job's one checkpoint listing hashed again (not the last check's digests)."""
    import cascade_ray.stage.batched as batched
    import cascade_ray.stage.monitor as monitor

    real, listing = batched.frozen_digest, batched.checkpoint_frozen
    plain = lambda model, plan, known=None, memo=None: real(model, plan)  # noqa: E731
    batched.frozen_digest = monitor.frozen_digest = plain
    batched.checkpoint_frozen = lambda setup, state, before, now=None: listing(setup, state, before)
    try:
        yield
    finally:
        batched.frozen_digest = monitor.frozen_digest = real
        batched.checkpoint_frozen = listing


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=10000, help="the backbone's hidden width W")
    parser.add_argument("--configs", type=int, default=16, help="replicas in the batched sweep")
    parser.add_argument("--epochs", type=int, default=3, help="the head's epochs")
    parser.add_argument("--repeats", type=int, default=3, help="timed sweeps per way")
    args = parser.parse_args()

    import numpy as np
    import torch

    from cascade_ray.checks import validate_config
    from cascade_ray.data import load_digits
    from cascade_ray.hardware import hardware_line
    from cascade_ray.models.freeze import frozen_digest
    from cascade_ray.models.weights import state_digests, to_numpy_state
    from cascade_ray.pipeline.features import cache_key, upstream_outputs
    from cascade_ray.stage.setup import build_stage_model
    from cascade_ray.tune.sweep import trial_config

    print(hardware_line(), flush=True)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    cfg = validate_config(_config("/tmp/unused", args.width, args.epochs), source="bench_frozen_baseline")
    data = load_digits(train_size=None, val_fraction=0.2, seed=0)
    torch.manual_seed(0)
    backbone, _ = build_stage_model(cfg, 0, data, None)
    upstream = to_numpy_state(backbone.state_dict())
    del backbone
    for array in upstream.values():
        array.flags.writeable = False  # as the object store hands it to a worker
    out = upstream_outputs(cfg, 1, data, upstream)
    features = {"x_train": out["train"], "x_val": out["val"]}
    known = state_digests(upstream)  # what the backbone's artifact manifest records (Handoff.digests)
    cfgs = [trial_config(cfg, "head", {"solver.lr": float(lr)}) for lr in np.logspace(-4, -2, args.configs)]
    head, plan = build_stage_model(cfg, 1, data, upstream)
    print(
        f"head (W -> 64 -> 10) on a frozen backbone 64 -> {args.width} -> {args.width}: {len(plan.frozen_keys)} "
        f"frozen tensors, {sum(upstream[k].nbytes for k in plan.frozen_keys) / 1e6:.1f} MB; "
        f"{args.configs} replicas x {args.epochs} epochs of {len(data.y_train)} rows, batch 32",
        flush=True,
    )

    def sweep(way: str) -> tuple[float, list]:
        with _as_before() if way == "before" else contextlib.nullcontext():
            wall, reporter = timed_batched(
                cfgs, 1, data, upstream, features, upstream_digests=known if way == "now" else None
            )
        return wall, [{k: v for k, v in m.items() if not k.endswith("_per_s")} for m in reporter.reports]  # no timings

    def lone_baseline(way: str) -> float:
        t0 = time.perf_counter()
        frozen_digest(head, plan, known if way == "now" else None)
        return time.perf_counter() - t0

    def key(way: str) -> float:
        t0 = time.perf_counter()
        cache_key("f" * 64, upstream, ["backbone"], known if way == "now" else None)
        return time.perf_counter() - t0

    sweep("now")  # warm: the first replicas of the process
    walls: dict[str, list[float]] = {"before": [], "now": []}
    lone: dict[str, list[float]] = {"before": [], "now": []}
    keys: dict[str, list[float]] = {"before": [], "now": []}
    reports: dict[str, list] = {}
    for i in range(args.repeats):
        for way in ("before", "now") if i % 2 == 0 else ("now", "before"):
            wall, reports[way] = sweep(way)
            walls[way].append(wall)
            lone[way].append(lone_baseline(way))
            keys[way].append(key(way))
    same = reports["before"] == reports["now"]
    print(f"the best replica's metrics (its timings left out) the same both ways: {same}")
    assert same, "both ways must train the same replicas"
    for way in ("before", "now"):
        print(f"  {way}: sweeps {', '.join(f'{w:.2f}' for w in walls[way])} s")
    before, now = statistics.median(walls["before"]), statistics.median(walls["now"])
    print(f"batched sweep, every replica hashing the upstream (before): {before:.2f} s (1.000 vs baseline)")
    print(f"batched sweep, hand-off digests and one hash per check (now): {now:.2f} s ({before / now:.2f}x faster)")
    print(f"saved per sweep: {before - now:.2f} s")
    lb, ln = statistics.median(lone["before"]), statistics.median(lone["now"])
    print(f"a lone stage's frozen baseline digest: {lb:.3f} s hashed (before), {ln:.4f} s from the hand-off (now)")
    kb, kn = statistics.median(keys["before"]), statistics.median(keys["now"])
    print(f"the feature cache's key on the driver: {kb:.3f} s hashed (before), {kn:.4f} s from the hand-off (now)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
