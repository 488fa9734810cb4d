"""Streaming at scale (issue 16): a streamed run over more data than the object store, and
streamed vs in-memory test accuracy.

Part ``scale``: Fashion-MNIST train (60k) **replicated** ``--replicas`` times, every copy
with seeded random pixel shifts (``np.roll`` by -2..2 in H and W per row), written as one
Parquet file per copy with ``--row-group-rows`` row groups (``image``: fixed-size list of
uint8, schema metadata ``cascade_ray.image_shape`` = ``[1, 28, 28]``, as ``write_parquet``
writes it), and the official 10k test split as the test file. A Ray head is started with
``cluster/local_head.sh`` (token auth, dashboard on 127.0.0.1) in a state folder of its own,
with its object store shrunk to about ``--object-store-bytes`` through
``RAY_DEFAULT_OBJECT_STORE_MEMORY_PROPORTION`` (local_head.sh has no store option for the head;
the size Ray chose is measured and printed). A one-stage streamed pipeline (MLP, 1 epoch,
batch 256, 1 worker x 1 CPU, 1 CPU left to Ray Data) runs against it with ``--address``. A side
thread samples every 0.5 s: the driver's RSS, the RSS of the head's ``RayTrainWorker`` (only
processes in the head's session: other engineers' Ray runs are left out), of every other
process of the head, and the size of the spill folders under the head's temp dir. After the
run: ``ray memory --stats-only`` on the head (cumulative spill / restore), then
``local_head.sh stop`` (this head's processes only). The baseline of each memory figure is the
dataset's own size, measured in the same run.

Part ``equiv``: scikit-learn's digits written to Parquet (train+val file, test file), the same
one-stage config run in memory (stratified val split) and streamed (content-hash val split) for
each ``--seeds`` seed, embedded Ray. The val splits differ by design, so the comparison is on
the test file: accuracy per run, mean difference, seed-to-seed spread; tolerance
|mean(stream) - mean(memory)| <= 2 x the pooled seed-to-seed std (or 1 test image if that is
smaller than one image).

    flock /tmp/cascade-cpu.lock env PYTHONPATH=. .venv/bin/python benchmarks/bench_streaming_scale.py
    ... benchmarks/bench_streaming_scale.py --part scale --replicas 6
    ... benchmarks/bench_streaming_scale.py --part equiv --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
SHAPE_KEY = b"cascade_ray.image_shape"


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def _proc_mem(pid: int) -> tuple[int, int]:
    """(RSS, its shared part: file + shmem pages) of a process in bytes, from /proc (no psutil in the venv)."""
    kb = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("VmRSS", "RssFile", "RssShmem"):
            kb[k] = int(v.split()[0])
    return kb.get("VmRSS", 0) * 1024, (kb.get("RssFile", 0) + kb.get("RssShmem", 0)) * 1024


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def _mib(b: float) -> str:
    return f"{b / 2**20:.1f} MiB"


def _table(x: np.ndarray, y: np.ndarray) -> pa.Table:
    flat = pa.array(np.ascontiguousarray(x).reshape(-1))
    table = pa.table(
        {
            "image": pa.FixedSizeListArray.from_arrays(flat, int(np.prod(x.shape[1:]))),
            "label": pa.array(y.astype(np.int64)),
        }
    )
    return table.replace_schema_metadata({SHAPE_KEY: json.dumps([int(d) for d in x.shape[1:]]).encode()})


def shifted_copy(x: np.ndarray, rng: np.random.Generator, max_shift: int = 2) -> np.ndarray:
    """Every row rolled by its own seeded (dh, dw) in [-max_shift, max_shift]."""
    out = np.empty_like(x)
    dh = rng.integers(-max_shift, max_shift + 1, len(x))
    dw = rng.integers(-max_shift, max_shift + 1, len(x))
    for a in range(-max_shift, max_shift + 1):
        for b in range(-max_shift, max_shift + 1):
            m = (dh == a) & (dw == b)
            out[m] = np.roll(x[m], (a, b), axis=(-2, -1))
    return out


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN")}
    env["PYTHONPATH"] = str(ROOT)
    env.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
    env.update(extra)
    return env


def _write_yaml(path: Path, cfg: dict) -> None:
    path.write_text(json.dumps(cfg, indent=1))  # JSON is YAML


def _stage(model: dict, epochs: int, batch: int, lr: float) -> dict:
    return {
        "name": "net",
        "model": model,
        "solver": {"type": "Adam", "lr": lr},
        "train": {"epochs": epochs, "batch_size": batch, "log_interval": 100000},
        "scaling": {"num_workers": 1, "resources_per_worker": {"CPU": 1}},
    }


# ----------------------------------------------------------------------------- scale


class Lines(list):
    """Lines printed as they are added, so a run cut short shows how far it got."""

    def append(self, line: str) -> None:
        print(line, flush=True)
        super().append(line)


class Sampler(threading.Thread):
    """Peak RSS of the driver, the head's RayTrainWorker(s) and its other processes; spill bytes."""

    def __init__(self, driver_pid: int, session_id: int, temp_dir: Path, interval: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.driver_pid, self.sid, self.temp_dir, self.interval = driver_pid, session_id, temp_dir, interval
        self.stop_flag = threading.Event()
        self.driver_peak = self.worker_peak = self.worker_peak_shared = self.other_peak = self.spill_peak = 0
        self.worker_pids: set[int] = set()
        self.samples = 0

    def _spill_bytes(self) -> int:
        total = 0
        for dirpath, dirnames, filenames in os.walk(self.temp_dir):
            if "ray_spilled_objects" in dirpath:
                for f in filenames:
                    with contextlib.suppress(OSError):
                        total += os.stat(os.path.join(dirpath, f)).st_size
            if "logs" in dirnames:
                dirnames.remove("logs")
        return total

    def run(self) -> None:
        while not self.stop_flag.is_set():
            with contextlib.suppress(OSError):
                self.driver_peak = max(self.driver_peak, _proc_mem(self.driver_pid)[0])
            for name in filter(str.isdigit, os.listdir("/proc")):
                pid = int(name)
                try:
                    if os.getsid(pid) != self.sid:
                        continue
                    rss, shared = _proc_mem(pid)
                    if b"RayTrainWorker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                        self.worker_pids.add(pid)
                        if rss > self.worker_peak:
                            self.worker_peak, self.worker_peak_shared = rss, shared
                    else:
                        self.other_peak = max(self.other_peak, rss)
                except OSError:
                    continue
            self.spill_peak = max(self.spill_peak, self._spill_bytes())
            self.samples += 1
            self.stop_flag.wait(self.interval)


def write_scale_data(work: Path, replicas: int, row_group_rows: int) -> tuple[Path, Path, dict]:
    from cascade_ray.data import load_fashion_mnist, write_parquet

    splits = load_fashion_mnist("/usr/share/datasets/fashion-mnist", train_size=None, val_fraction=0.1, seed=0)
    x = np.concatenate([splits.x_train, splits.x_val])
    y = np.concatenate([splits.y_train, splits.y_val])
    train_dir = work / "train"
    train_dir.mkdir(parents=True)
    rng = np.random.default_rng(0)
    t = time.perf_counter()
    for r in range(replicas):
        pq.write_table(
            _table(shifted_copy(x, rng), y), train_dir / f"part-{r:02d}.parquet", row_group_size=row_group_rows
        )
    write_s = time.perf_counter() - t
    test = work / "test.parquet"
    write_parquet(test, splits.x_test, splits.y_test)
    files = sorted(train_dir.glob("*.parquet"))
    rows = replicas * len(y)
    info = {
        "rows": rows,
        "files": len(files),
        "row_groups": sum(pq.ParquetFile(f).metadata.num_row_groups for f in files),
        "disk": sum(f.stat().st_size for f in files),
        "mem_uint8": rows * x[0].nbytes + rows * 8,  # images as stored + int64 labels
        "mem_float32": rows * x[0].size * 4 + rows * 8,  # as a training array after normalisation
        "write_s": write_s,
        "shape": list(x.shape[1:]),
        "test_rows": len(splits.y_test),
    }
    return train_dir, test, info


def _read_env_file(path: Path) -> dict:
    out = {}
    for line in path.read_text().splitlines():
        k, _, v = line.partition("=")
        out[k] = v
    return out


def part_scale(args: argparse.Namespace, work: Path) -> list[str]:
    lines = Lines()
    train_dir, test, info = write_scale_data(work / "data", args.replicas, args.row_group_rows)
    lines.append(
        f"scale data: Fashion-MNIST train 60000 rows REPLICATED {args.replicas}x with seeded random pixel shifts "
        f"(np.roll -2..2 in H and W per row): {info['rows']} rows x {info['shape']} uint8 in {info['files']} files, "
        f"{info['row_groups']} row groups of <= {args.row_group_rows} rows (written in {info['write_s']:.1f} s); "
        f"test: the official {info['test_rows']} rows"
    )
    lines.append(f"dataset on disk (parquet): {_mib(info['disk'])}")
    lines.append(
        f"dataset in memory: {_mib(info['mem_uint8'])} as uint8 + int64 labels, {_mib(info['mem_float32'])} as float32"
    )

    state = work / "head"
    proportion = args.object_store_bytes / _mem_available()
    head_env = _env(RAY_DEFAULT_OBJECT_STORE_MEMORY_PROPORTION=f"{proportion:.6f}")
    t = time.perf_counter()
    start = subprocess.run(
        ["bash", str(ROOT / "cluster/local_head.sh"), "start", "--num-cpus", "2", "--state-dir", str(state)],
        env=head_env | {"RAY": str(Path(PY).parent / "ray")},
        capture_output=True,
        text=True,
    )
    if start.returncode != 0:
        raise SystemExit(f"local_head.sh start failed:\n{start.stderr[-3000:]}")
    head = _read_env_file(state / "head.env")
    head_s = time.perf_counter() - t
    port, temp_dir, sid = head["GCS_PORT"], Path(head["TEMP_DIR"]), int(head["SESSION_ID"])
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": head["TOKEN_PATH"]}
    try:
        probe = subprocess.run(
            [
                PY,
                "-c",
                f"import ray; ray.init(address='127.0.0.1:{port}', log_to_driver=False); "
                "r = ray.cluster_resources(); print(int(r['object_store_memory']), r['CPU'])",
            ],
            env=_env(**auth),
            capture_output=True,
            text=True,
        )
        store_bytes, cpus = probe.stdout.split()[-2:]
        store_bytes = int(store_bytes)
        lines.append(
            f"ray head: cluster/local_head.sh start --num-cpus 2 (token auth, GCS 127.0.0.1:{port}, up in {head_s:.1f} s), "
            f"RAY_DEFAULT_OBJECT_STORE_MEMORY_PROPORTION={proportion:.6f} -> object store {_mib(store_bytes)} "
            f"({store_bytes} bytes), {cpus} CPU"
        )
        lines.append(
            f"dataset / object store: {info['mem_uint8'] / store_bytes:.2f}x (uint8), "
            f"{info['mem_float32'] / store_bytes:.2f}x (float32)"
        )

        runs = [("1x (baseline: part-00 only)", train_dir / "part-00.parquet", info["rows"] // args.replicas)]
        runs.append((f"{args.replicas}x (all files)", train_dir, info["rows"]))
        results = []
        for label, path, rows in runs:
            r = _streamed_run(work, label, path, test, port, sid, temp_dir, auth, len(results))
            r["rows"] = rows
            results.append(r)
            _print_run(lines, r, info, results[0])
            if r["rc"] != 0:
                break
    finally:
        stop = subprocess.run(
            ["bash", str(ROOT / "cluster/local_head.sh"), "stop", "--state-dir", str(state)],
            env=_env(RAY=str(Path(PY).parent / "ray")),
            capture_output=True,
            text=True,
        )
        lines.append(f"ray head stopped with cluster/local_head.sh stop: rc {stop.returncode}")
    return lines


def _streamed_run(work, label, path, test, port, sid, temp_dir, auth, index) -> dict:
    storage = work / f"runs-{index}"
    cfg = {
        "name": "scale",
        "seed": 0,
        "storage_path": str(storage),
        "data": {
            "source": "parquet",
            "path": str(path),
            "test_path": str(test),
            "val_fraction": 0.1,
            "streaming": True,
            "target": {"num_classes": 10},
        },
        "stages": [_stage({"type": "mlp", "in_features": 784, "hidden": [256], "pool": "flatten"}, 1, 256, 1e-3)],
    }
    cfg_path = work / f"scale-{index}.yaml"
    _write_yaml(cfg_path, cfg)
    cmd = [
        PY,
        str(ROOT / "pipelines/three_stage.py"),
        "--config",
        str(cfg_path),
        "--overwrite",
        "--address",
        f"127.0.0.1:{port}",
    ]
    log_path = work / f"scale-driver-{index}.log"
    t = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=_env(**auth), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        sampler = Sampler(proc.pid, sid, temp_dir)
        sampler.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except KeyboardInterrupt:
            proc.terminate()
            raise
        wall = time.perf_counter() - t
        proc.returncode = os.waitstatus_to_exitcode(status)
    sampler.stop_flag.set()
    sampler.join()
    mem = subprocess.run(
        [str(Path(PY).parent / "ray"), "memory", "--stats-only", "--address", f"127.0.0.1:{port}"],
        env=_env(**auth),
        capture_output=True,
        text=True,
    )
    mem_text = mem.stdout + mem.stderr
    (work / f"ray-memory-stats-{index}.txt").write_text(mem_text)
    out = log_path.read_text()
    r = {
        "label": label,
        "cmd": cmd,
        "rc": proc.returncode,
        "wall": wall,
        "out": out,
        "mem_text": mem_text,
        "driver_maxrss": usage.ru_maxrss * 1024,
        "sampler": sampler,
    }
    if proc.returncode == 0:
        where = re.search(r"summary=(\S+)", out)
        r["summary"] = json.loads(Path(where.group(1) if where else storage / "scale" / "summary.json").read_text())
    return r


def _print_run(lines, r, info, base) -> None:
    label, wall, out, mem_text, sampler = r["label"], r["wall"], r["out"], r["mem_text"], r["sampler"]
    data_mem = info["mem_uint8"] * r["rows"] // info["rows"]
    data_disk = info["disk"] * r["rows"] // info["rows"]
    lines.append(f"[{label}] command: {' '.join(r['cmd'])}")
    if r["rc"] != 0:
        lines.append(f"[{label}] FAILED: rc {r['rc']} after {wall:.1f} s; driver log tail:\n{out[-4000:]}")
        return
    stage = r["summary"]["stages"][0]
    m = re.search(r"train (\d+), val (\d+)", out)
    train_rows, val_rows = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
    r["train_rows"], r["stage_s"] = train_rows, stage["wall_s"]
    lines.append(
        f"[{label}] finished, rc 0; {r['rows']} rows ({_mib(data_mem)} uint8, {_mib(data_disk)} parquet); split train "
        f"{train_rows} / val {val_rows} (content-hash); 1 epoch MLP 784-256-10, batch 256; test accuracy "
        f"{r['summary']['test_metrics']['accuracy']:.4f}"
    )
    lines.append(
        f"[{label}] wall time (driver start to exit): {wall:.1f} s ({wall / base['wall']:.2f} vs baseline); "
        f"stage wall {stage['wall_s']:.1f} s ({stage['wall_s'] / base['stage_s']:.2f} vs baseline)"
    )
    tput = train_rows / stage["wall_s"]
    base_tput = base["train_rows"] / base["stage_s"]
    lines.append(
        f"[{label}] throughput: {tput:.0f} train samples/s over the stage wall (start-up, 1 train epoch, val, "
        f"checkpoint; {tput / base_tput:.2f} vs baseline), {(r['rows'] + info['test_rows']) / wall:.0f} rows/s over the "
        "whole run (data + test rows / driver wall; the driver's pre-Ray scan reads every row once more)"
    )
    lines.append(
        f"[{label}] driver peak RSS: {_mib(r['driver_maxrss'])} (wait4 ru_maxrss; sampled {_mib(sampler.driver_peak)}; "
        f"{r['driver_maxrss'] / base['driver_maxrss']:.3f} vs baseline) = {r['driver_maxrss'] / data_mem:.3f} x the "
        f"dataset in memory (uint8), {r['driver_maxrss'] / data_disk:.3f} x its parquet size; growth over the 1x run "
        f"{_mib(r['driver_maxrss'] - base['driver_maxrss'])} for {_mib(data_mem - base['rows'] * info['mem_uint8'] // info['rows'])} more data"
    )
    lines.append(
        f"[{label}] RayTrainWorker peak RSS: {_mib(sampler.worker_peak)} (of it shared pages "
        f"{_mib(sampler.worker_peak_shared)}; {len(sampler.worker_pids)} process(es), {sampler.samples} samples at "
        f"0.5 s; {sampler.worker_peak / max(base['sampler'].worker_peak, 1):.3f} vs baseline) = "
        f"{sampler.worker_peak / data_mem:.3f} x the dataset in memory (uint8)"
    )
    lines.append(
        f"[{label}] largest other process of the head (Ray Data workers, raylet, GCS, ...): peak RSS "
        f"{_mib(sampler.other_peak)} ({sampler.other_peak / max(base['sampler'].other_peak, 1):.3f} vs baseline)"
    )
    spilled = re.search(r"Spilled (\d+) MiB, (\d+) objects", mem_text)
    restored = re.search(r"Restored (\d+) MiB, (\d+) objects", mem_text)
    lines.append(
        f"[{label}] bytes spilled (ray memory --stats-only, cumulative since the head started): "
        + (f"{spilled.group(1)} MiB in {spilled.group(2)} objects" if spilled else "none reported")
        + (f"; restored {restored.group(1)} MiB in {restored.group(2)} objects" if restored else "")
        + f"; spill folders' peak size (sampled): {_mib(sampler.spill_peak)}"
    )
    plasma = re.search(r"Plasma memory usage.*", mem_text)
    if plasma:
        lines.append(f"[{label}] object store after the run: {plasma.group(0).strip()}")


# ----------------------------------------------------------------------------- equivalence


def part_equiv(args: argparse.Namespace, work: Path) -> list[str]:
    from cascade_ray.data import load_digits, write_parquet

    lines = Lines()
    splits = load_digits(train_size=None, val_fraction=0.2, seed=0)
    d = work / "digits"
    d.mkdir(parents=True)
    x = np.concatenate([splits.x_train, splits.x_val])
    y = np.concatenate([splits.y_train, splits.y_val])
    write_parquet(d / "train.parquet", x, y)
    write_parquet(d / "test.parquet", splits.x_test, splits.y_test)
    n_test = len(splits.y_test)
    lines.append(
        f"equivalence data: scikit-learn digits, {len(y)} train+val rows and {n_test} test rows ({list(x.shape[1:])} "
        f"{x.dtype}) in Parquet; val_fraction 0.2 (in memory: stratified; streamed: content hash)"
    )
    cfg = {
        "name": "equiv",
        "seed": 0,
        "storage_path": str(work / "equiv-runs"),
        "data": {
            "source": "parquet",
            "path": str(d / "train.parquet"),
            "test_path": str(d / "test.parquet"),
            "val_fraction": 0.2,
            "target": {"num_classes": 10},
        },
        "stages": [
            _stage(
                {"type": "resnet", "in_channels": 1, "widths": [8, 16], "blocks": [1, 1]}, args.equiv_epochs, 32, 1e-2
            )
        ],
    }
    cfg_path = work / "equiv.yaml"
    _write_yaml(cfg_path, cfg)
    lines.append(
        f"equivalence config: one stage resnet widths [8, 16] blocks [1, 1], Adam lr 1e-2, {args.equiv_epochs} epochs, "
        "batch 32, 1 worker x 1 CPU, embedded Ray per run"
    )
    acc: dict[str, list[float]] = {"memory": [], "stream": []}
    for seed in args.seeds:
        for mode in ("memory", "stream"):
            cmd = [
                PY,
                str(ROOT / "pipelines/three_stage.py"),
                "--config",
                str(cfg_path),
                "--overwrite",
                f"seed={seed}",
                f"name=equiv-{mode}-{seed}",
                f"data.streaming={'true' if mode == 'stream' else 'false'}",
            ]
            t = time.perf_counter()
            r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, cwd=ROOT)
            wall = time.perf_counter() - t
            m = re.search(r"test_accuracy=([0-9.]+)", r.stdout)
            if r.returncode != 0 or not m:
                lines.append(
                    f"equivalence run {mode} seed {seed} FAILED rc {r.returncode}: {(r.stdout + r.stderr)[-2000:]}"
                )
                continue
            acc[mode].append(float(m.group(1)))
            lines.append(f"test accuracy {mode:6s} seed {seed}: {float(m.group(1)):.4f} ({wall:.1f} s)")
    if min(len(v) for v in acc.values()) < 2:
        lines.append("equivalence: too few finished runs for a spread")
        return lines
    mm, ms = statistics.mean(acc["memory"]), statistics.mean(acc["stream"])
    sm, ss = statistics.stdev(acc["memory"]), statistics.stdev(acc["stream"])
    pooled = ((sm**2 + ss**2) / 2) ** 0.5
    tol = max(2 * pooled, 1 / n_test)
    diff = ms - mm
    lines.append(f"in-memory test accuracy: mean {mm:.4f}, seed-to-seed std {sm:.4f} (1.000 vs baseline)")
    lines.append(f"streamed test accuracy: mean {ms:.4f}, seed-to-seed std {ss:.4f} ({ms / mm:.4f} vs baseline)")
    lines.append(
        f"equivalence: mean diff stream - memory {diff:+.4f} ({diff * n_test:+.1f} test images); tolerance "
        f"|diff| <= max(2 x pooled std, 1 image) = {tol:.4f} -> {'met' if abs(diff) <= tol else 'NOT met'}"
    )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("all", "scale", "equiv"), default="all")
    parser.add_argument("--replicas", type=int, default=6)
    parser.add_argument("--row-group-rows", type=int, default=4096)
    parser.add_argument("--object-store-bytes", type=int, default=150_000_000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--equiv-epochs", type=int, default=4)
    parser.add_argument("--keep", action="store_true", help="keep the temp folder (data, logs, runs)")
    args = parser.parse_args()

    import ray
    import torch

    work = Path(tempfile.mkdtemp(prefix="bss-"))
    print(
        f"bench_streaming_scale: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; cpu: {_cpu_model()} "
        f"({os.cpu_count()} cores); torch {torch.__version__} capability {torch.backends.cpu.get_cpu_capability()}; "
        f"ray {ray.__version__}; work dir {work}",
        flush=True,
    )
    try:
        for name, fn in (("scale", part_scale), ("equiv", part_equiv)):
            if args.part in ("all", name):
                t = time.perf_counter()
                fn(args, work)
                print(f"part {name}: {time.perf_counter() - t:.1f} s", flush=True)
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
