"""Where a batched sweep's epoch goes: ``run_batched`` in this process (no Ray) under cProfile,
grouped into what a replica's step is made of.

    flock /tmp/cascade-cpu.lock .venv/bin/python benchmarks/profile_batched.py [--config pipelines/configs/three_stage.yaml] [--configs 16]

Workload: the config's last stage as a batched sweep of `--configs` replicas (lr log-spaced over
1e-3..1e-1, everything else the stage's own), one epoch, on the features of a randomly initialised
upstream (how the weights were trained does not change what a step costs), built by
``common.last_stage_replicas`` as for ``bench_batched_resume.py``. A warm-up epoch, one unprofiled epoch (the wall time
printed as ``plain``), then one under cProfile. Prints the profiled epoch's seconds per group (torch's own
kernels called from Python: the dropout's random draw, the rest of the dropout, backward, the
forward's linear / activation / loss, casts) and the 15 functions with the most
time of their own. The groups are an explanation of the wall time, not a target: cProfile adds
its own overhead to every Python call.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

# group -> (file name, or "~" for a builtin; the start of the function's name as cProfile names it:
# a builtin of torch's own namespace ends in its object's address) whose own time the group sums
GROUPS = {
    "dropout: random draw (random_)": [("~", "<method 'random_' of 'torch._C.TensorBase' objects>")],
    "dropout: mask and scale": [("dropout.py", "fast_dropout"), ("dropout.py", "keep_mask"), ("dropout.py", "_mask")],
    "backward (autograd engine)": [("~", "<method 'run_backward' of 'torch._C._EngineBase' objects>")],
    "forward: linear": [("~", "<built-in method torch._C._nn.linear>")],
    "forward: grouped GEMMs (baddbmm, stage/grouped.py)": [("~", "<built-in method baddbmm of type object")],
    "forward: activation (gelu)": [("~", "<built-in method torch._C._nn.gelu>")],
    "forward: loss": [("~", "<built-in method torch._C._nn.cross_entropy_loss>")],
    "casts (.to: dropout masks, autocast)": [("~", "<method 'to' of 'torch._C.TensorBase' objects>")],
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "pipelines" / "configs" / "three_stage.yaml"))
    parser.add_argument("--configs", type=int, default=16)
    parser.add_argument(
        "--group-size", type=int, default=None, help="replicas per grouped step (default: stage/grouped.py's; 1: none)"
    )
    args = parser.parse_args(argv)
    from cascade_ray.hardware import hardware_line

    print(hardware_line(), flush=True)  # first line: the hardware these figures come from
    import torch
    from common import last_stage_replicas, timed_batched

    cfg, index, data, upstream, features, cfgs, _ = last_stage_replicas(args.config, args.configs, 1)
    name = cfg.stages[index].name

    def epoch() -> float:
        return timed_batched(cfgs, index, data, upstream, features, group_size=args.group_size)[0]

    epoch()  # warm-up: first-call costs (allocations, kernels' first use), not profiled
    plain = epoch()
    profile = cProfile.Profile()
    profile.enable()
    profiled = epoch()
    profile.disable()
    buffer = io.StringIO()
    stats = pstats.Stats(profile, stream=buffer)
    own = {(Path(file).name, func): row[2] for (file, _, func), row in stats.stats.items()}  # tottime
    steps = len(data.y_train) // cfg.stages[index].train.batch_size * args.configs
    print(
        f"profile_batched: {args.config}, stage {name!r}, {args.configs} replicas, 1 epoch of {len(data.y_train)} rows "
        f"(~{steps} replica steps), features {tuple(features['x_train'].shape)}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, group size {args.group_size or 'default'}; epoch {plain:.2f} s plain, {profiled:.2f} s under cProfile"
    )
    for group, keys in GROUPS.items():
        seconds = sum(t for (file, func), t in own.items() for want in keys if (file, func[: len(want[1])]) == want)
        print(f"  {group}: {seconds:.2f} s ({seconds / profiled:.0%}; {seconds / steps * 1e3:.2f} ms per replica step)")
    stats.sort_stats("tottime").print_stats(15)
    print("\n".join(line for line in buffer.getvalue().splitlines() if line.strip())[-2500:])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
