"""Serving latency and throughput: `cascade-ray serve` over loopback HTTP vs the model called in-process.

    flock /tmp/cascade-cpu.lock .venv/bin/python benchmarks/bench_serve.py [--run RUN] [--requests 400]

Without ``--run`` the debug pipeline is trained first (1 epoch per stage, a temp folder, the
real CLI in a subprocess). Then one embedded Ray (``num_cpus=2``) serves it with one replica
(``--max-batch-size 32 --batch-wait-ms 5``, the CLI defaults). Measured, one row per request:

- baseline: ``Cascade.predict`` of one row in this process (the model's own cost);
- 1 client: sequential requests on one keep-alive connection;
- 16 clients: 16 threads, each with its own connection, `requests` in all.

Printed per side: p50 / p99 latency, throughput, and the ratio to the baseline (p50 latency,
throughput). The clients run on the same 2 cores as the replica and Serve's proxy, so the
16-client figures include the client threads' own CPU use.
"""

from __future__ import annotations

import argparse
import http.client
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "pipelines" / "configs" / "debug.yaml"


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _train(folder: str) -> str:
    overrides = [f"storage_path={folder}"] + [f"stages[{i}].train.epochs=1" for i in range(3)]
    cmd = [sys.executable, "-m", "cascade_ray.cli", "run", str(CONFIG), *overrides, "--log-level", "warning"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=900)
    return f"{folder}/debug"


def _summary(name: str, latencies: list[float], wall: float, base: tuple[float, float] | None) -> tuple[float, float]:
    ms = sorted(1000 * x for x in latencies)
    p50, p99 = statistics.median(ms), ms[min(len(ms) - 1, int(0.99 * len(ms)))]
    rate = len(ms) / wall
    ratio = f"  ({p50 / base[0]:.1f}x baseline p50, {rate / base[1]:.2f}x its throughput)" if base else ""
    print(f"{name:<22} p50 {p50:7.2f} ms  p99 {p99:7.2f} ms  {rate:8.1f} req/s  n={len(ms)}{ratio}")
    return p50, rate


def _client(port: int, bodies: list[bytes], out: list[float], errors: list[int]) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    for body in bodies:
        t = time.perf_counter()
        conn.request("POST", "/predict", body, {"content-type": "application/json"})
        response = conn.getresponse()
        response.read()
        out.append(time.perf_counter() - t)
        if response.status != 200:
            errors.append(response.status)
    conn.close()


def _load(port: int, bodies: list[bytes], clients: int) -> tuple[list[float], float, list[int]]:
    latencies: list[float] = []
    errors: list[int] = []
    shares = [bodies[i::clients] for i in range(clients)]
    threads = [threading.Thread(target=_client, args=(port, share, latencies, errors)) for share in shares]
    t = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return latencies, time.perf_counter() - t, errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default=None, help="a finished run (default: train the debug pipeline first)")
    parser.add_argument("--requests", type=int, default=400, help="requests per measured side (default 400)")
    parser.add_argument("--port", type=int, default=18631)
    parser.add_argument(
        "--batch-wait-ms", type=float, default=5.0, help="the deployment's batch wait (default 5, as the CLI)"
    )
    args = parser.parse_args()

    import torch
    from ray import serve

    from cascade_ray.tools.inference import load_cascade
    from cascade_ray.tools.serve_control import start_serving

    print(f"CPU: {_cpu()}; torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}")
    tmp = tempfile.TemporaryDirectory()
    run = args.run or _train(tmp.name)
    from sklearn.datasets import load_digits

    rows = load_digits().data.reshape(-1, 1, 8, 8).astype(np.float32)
    bodies = [json.dumps({"inputs": rows[i % len(rows)][None].tolist()}).encode() for i in range(args.requests)]

    torch.set_num_threads(1)  # as a replica with num_cpus=1 runs (Ray sets OMP_NUM_THREADS=1)
    cascade = load_cascade(run)
    for i in range(50):
        cascade.predict(rows[i : i + 1])
    latencies = []
    t0 = time.perf_counter()
    for i in range(args.requests):
        t = time.perf_counter()
        cascade.predict(rows[i % len(rows)][None])
        latencies.append(time.perf_counter() - t)
    base = _summary("baseline in-process", latencies, time.perf_counter() - t0, None)

    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        serving = start_serving(run, port=args.port, log_level="warning", batch_wait_ms=args.batch_wait_ms)
        _load(args.port, bodies[:50], 4)  # warm-up: connections, the first batches
        for clients in (1, 16):
            latencies, wall, errors = _load(args.port, bodies, clients)
            assert not errors, f"non-200 answers: {sorted(set(errors))}"
            _summary(f"serve, {clients} client(s)", latencies, wall, base)
        info = serve.get_app_handle(serving.name).info.remote().result()
        stats = info["stats"]
        print(
            f"replica: {stats['requests']} requests in {stats['batches']} batches "
            f"(largest {stats['largest_batch']}; max_batch_size {info['config']['max_batch_size']}, "
            f"batch_wait_ms {info['config']['batch_wait_ms']})"
        )
    finally:
        serve.shutdown()
        ray.shutdown()
        tmp.cleanup()


if __name__ == "__main__":
    main()
