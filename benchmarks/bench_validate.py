"""Time to a clear error: ``cascade-ray validate`` on every malformed config, each in a fresh process.

    /work/venv/bin/python benchmarks/bench_validate.py [--repeats 1] [--only 108,130]

Every ``tests/bad_configs/*.yaml`` (``{FIXTURES}`` filled in, as the test does) is validated by
``python -m cascade_ray.cli validate FILE`` in a new interpreter, as a user runs it, and the wall
time to its exit is measured; each must exit 2. Baselines in the same run: a fresh interpreter that
only imports torch (the floor of any check that builds a module), and ``validate`` of the good
``pipelines/configs/debug.yaml`` (every pass, the shape preflight included). Prints the
distribution, the slowest cases, and ratios against the baselines.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BAD = ROOT / "tests" / "bad_configs"
sys.path.insert(0, str(ROOT))


def timed(argv: list[str]) -> tuple[float, int]:
    """(wall seconds, exit code) of one fresh process."""
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, check=False)
    return time.perf_counter() - start, proc.returncode


def best_of(argv: list[str], repeats: int) -> tuple[float, int]:
    runs = [timed(argv) for _ in range(repeats)]
    return min(t for t, _ in runs), runs[-1][1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1, help="runs per file (the fastest counts)")
    parser.add_argument("--only", default="", help="comma-separated NN prefixes (default: every file)")
    args = parser.parse_args()
    from cascade_ray.hardware import hardware_line

    print(hardware_line(), flush=True)
    py = sys.executable
    validate = [py, "-m", "cascade_ray.cli", "validate"]
    floor, _ = best_of([py, "-c", "import torch"], 3)
    good, rc = best_of([*validate, str(ROOT / "pipelines" / "configs" / "debug.yaml")], 3)
    assert rc == 0, f"debug.yaml did not validate (exit {rc})"
    print(f"baseline: import torch {floor:.2f} s; validate debug.yaml (all passes) {good:.2f} s", flush=True)

    wanted = {p for p in args.only.split(",") if p}
    files = [f for f in sorted(BAD.glob("*.yaml")) if not wanted or f.name.split("-")[0] in wanted]
    times: dict[str, float] = {}
    wrong: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for src in files:
            text = src.read_bytes()
            path = src
            if b"{FIXTURES}" in text:
                path = Path(tmp) / src.name
                path.write_bytes(text.replace(b"{FIXTURES}", str(BAD / "fixtures").encode()))
            took, rc = best_of([*validate, str(path)], args.repeats)
            times[src.stem] = took
            if rc != 2:
                wrong.append(f"{src.stem} (exit {rc})")
    values = sorted(times.values())
    p90 = values[min(len(values) - 1, int(0.9 * len(values)))]
    print(
        f"malformed configs: {len(values)}; exit 2: {len(values) - len(wrong)}; "
        f"median {statistics.median(values):.2f} s, p90 {p90:.2f} s, max {values[-1]:.2f} s"
    )
    print(f"over 2 s: {sum(v > 2.0 for v in values)}; over 3 s: {sum(v > 3.0 for v in values)}")
    for stem, took in sorted(times.items(), key=lambda kv: -kv[1])[:5]:
        print(f"  slowest: {stem} {took:.2f} s ({took / floor:.2f}x import torch, {took / good:.2f}x debug.yaml)")
    print(f"max / import torch: {values[-1] / floor:.2f}x; max / validate debug.yaml: {values[-1] / good:.2f}x")
    if wrong:
        print("did not exit 2: " + ", ".join(wrong))
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
