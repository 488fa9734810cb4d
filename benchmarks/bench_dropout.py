"""CPU dropout: cascade-ray's ``Dropout`` (models/dropout.py) vs ``torch.nn.Dropout``, same process.

    /work/venv/bin/python benchmarks/bench_dropout.py [--threads 2] [--repeats 5] [--dtype bfloat16]

Forward + backward (``y.sum().backward()``) of one dropout on the activation shapes of the
demo's downstream stages (``pipelines/configs/three_stage.yaml``, batch 128): the
classifier's per-token MLP output and flattened head input, and the encoder's feed-forward
hidden, in float32 or (``--dtype bfloat16``) in bf16, the dtype of those activations under the
demo's bf16 autocast. Each case times both modules in alternating blocks of 50 calls and reports the
median block. Also checks, on 10M elements, the kept fraction and the mean (both ~1 - p
and ~1.0). Prints ``figure: value (ratio vs baseline)``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cascade_ray.models.dropout import Dropout

CASES = [
    ("classifier MLP output (128 x 49 x 128), p=0.1", (128, 49, 128), 0.1),
    ("classifier head input (128 x 6272), p=0.2", (128, 6272), 0.2),
    ("encoder feed-forward hidden (128 x 49 x 256), p=0.1", (128, 49, 256), 0.1),
]


def block(module: nn.Module, x: torch.Tensor, calls: int = 50) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        module(x).sum().backward()
    return (time.perf_counter() - t0) / calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5, help="alternating blocks of 50 calls per module")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the activations' dtype")
    args = parser.parse_args()
    from cascade_ray.hardware import hardware_line

    print(hardware_line(), flush=True)  # first line: the hardware these figures come from
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    print(
        f"bench_dropout: torch {torch.__version__}, {args.threads} thread(s), {args.dtype}, forward + backward, {args.repeats} alternating blocks of 50 calls, medians"
    )
    for name, shape, p in CASES:
        x = torch.randn(shape, dtype=dtype, requires_grad=True)
        base, fast = nn.Dropout(p).train(), Dropout(p).train()
        block(base, x, 5), block(fast, x, 5)
        times: dict[str, list[float]] = {"torch": [], "cascade": []}
        for r in range(args.repeats):
            for kind in ("torch", "cascade") if r % 2 == 0 else ("cascade", "torch"):
                times[kind].append(block(base if kind == "torch" else fast, x))
        b, c = statistics.median(times["torch"]), statistics.median(times["cascade"])
        print(f"{name}, torch.nn.Dropout: {b * 1e3:.2f} ms (1.000 vs baseline)")
        print(f"{name}, cascade_ray Dropout: {c * 1e3:.2f} ms ({b / c:.2f}x faster)")
    with torch.no_grad():
        for p in (0.1, 0.2, 0.5):
            y = Dropout(p).train()(torch.ones(10_000_000, dtype=dtype)).float()
            print(
                f"check p={p}: kept fraction {(y > 0).float().mean().item():.5f} (expected {1 - p:.5f}), mean {y.mean().item():.5f} (expected 1)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
