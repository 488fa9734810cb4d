"""Peak memory per worker of one stage under ``scaling.strategy: ddp`` vs ``fsdp`` (2 gloo CPU workers).

    flock /tmp/cascade-cpu.lock timeout 900 .venv/bin/python benchmarks/bench_fsdp.py [--hidden 2048] [--steps 20]

The stage is the debug config's first stage swapped for a wide MLP on the 8x8 digits
(``--hidden`` x ``--layers`` Linear blocks, AdamW, fp32), so the trainable state (weights,
gradients, two AdamW moments) dominates a worker's memory. Each strategy runs in its own Ray
Train ``TorchTrainer`` (2 workers, 1 CPU each): every worker runs cascade-ray's own
``run_stage`` (the loop Ray Train workers run, including the per-epoch full-state gather of a
checkpoint) for ``--steps`` optimizer steps, then reports ``ru_maxrss`` (peak RSS) taken before
the stage is set up and after it ran. Prints one line per figure, fsdp's against ddp's of the
same run, and the CPU model and ``torch.backends.cpu.get_cpu_capability()``.
"""

from __future__ import annotations

import argparse
import platform
import resource
import time
from pathlib import Path
from typing import Any

import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from cascade_ray.checks import validate_config
from cascade_ray.config.yaml_io import read_yaml
from cascade_ray.constants import apply_ray_env_defaults
from cascade_ray.data import load_digits
from cascade_ray.hardware import hardware_line
from cascade_ray.stage.loop import run_stage


class _Reporter:
    """All-reduce over the process group Ray Train set up; checkpoints are gathered, not kept."""

    def __init__(self) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def all_sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t)
        return t.tolist()

    def report(self, metrics: dict[str, float], state: Any, trainer: Any = None, frozen: Any = None) -> None:
        pass


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def _loop(config: dict[str, Any]) -> dict[str, Any] | None:
    torch.set_num_threads(1)
    cfg = validate_config(config["pipeline"], source="bench", preflight=False)
    data = load_digits(train_size=None, val_fraction=0.2, seed=0)
    before = _peak_mib()
    started = time.perf_counter()
    run_stage(cfg, 0, data, None, _Reporter(), torch.device("cpu"))
    loop_s = time.perf_counter() - started
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, {"before_mib": before, "peak_mib": _peak_mib(), "loop_s": loop_s})
    return {"workers": rows} if dist.get_rank() == 0 else None


def _config(strategy: str, hidden: int, layers: int, steps: int) -> dict[str, Any]:
    raw = read_yaml(Path(__file__).resolve().parents[1] / "pipelines" / "configs" / "debug.yaml")
    stage = raw["stages"][0]
    # the images pooled to one value per sample: the input does not matter here, the trainable state does
    stage["model"] = {"type": "mlp", "in_features": 1, "hidden": [hidden] * layers}
    stage["solver"] = {"type": "AdamW", "lr": 1e-4, "precision": "fp32"}
    stage["train"] = {"epochs": 1, "max_steps": steps, "batch_size": 32, "log_interval": 1000, "sanity_val_steps": 0}
    stage["scaling"] = {"num_workers": 2, "use_gpu": False, "strategy": strategy}
    raw["stages"] = [stage]
    return raw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    ray.init(num_cpus=2, runtime_env={"env_vars": apply_ray_env_defaults()}, include_dashboard=False)
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    info = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in lines[:30])}
    cpu = f"{info.get('model name', platform.processor())} (family {info.get('cpu family')}, model {info.get('model')})"
    print(hardware_line())
    print(
        f"cpu: {cpu}; capability {torch.backends.cpu.get_cpu_capability()}; torch {torch.__version__}; ray {ray.__version__}"
    )
    params = args.hidden + (args.layers - 1) * args.hidden**2 + args.hidden * 10
    print(
        f"stage: mlp {args.layers} x {args.hidden} (~{params / 1e6:.1f}M trainable params, AdamW fp32), {args.steps} steps, 2 workers"
    )
    results = {}
    for strategy in ("ddp", "fsdp"):
        cfg = _config(strategy, args.hidden, args.layers, args.steps)
        validate_config(cfg)  # the driver's checks, shapes included
        trainer = ray.train.torch.TorchTrainer(
            _loop,
            train_loop_config={"pipeline": cfg},
            scaling_config=ray.train.ScalingConfig(num_workers=2, use_gpu=False),
        )
        started = time.perf_counter()
        result = trainer.fit()
        results[strategy] = (result.return_value["workers"], time.perf_counter() - started)
    base_peak = max(w["peak_mib"] for w in results["ddp"][0])
    base_loop = max(w["loop_s"] for w in results["ddp"][0])
    for strategy, (workers, fit_s) in results.items():
        for rank, w in enumerate(workers):
            print(
                f"{strategy} rank {rank} peak RSS: {w['peak_mib']:.0f} MiB (before setup {w['before_mib']:.0f} MiB; "
                f"{w['peak_mib'] / base_peak:.2f}x ddp's largest)"
            )
        loop_s = max(w["loop_s"] for w in workers)
        print(f"{strategy} stage loop: {loop_s:.2f} s ({loop_s / base_loop:.2f}x ddp); fit wall {fit_s:.1f} s")
    ray.shutdown()


if __name__ == "__main__":
    main()
