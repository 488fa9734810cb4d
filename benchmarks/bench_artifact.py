"""Writing and verifying a stage's artifact: one hashed read and threaded digests vs two passes.

    flock /tmp/cascade-cpu.lock .venv/bin/python benchmarks/bench_artifact.py [--repeats 7] [--width 2]

The state is bench_handoff.py's wide-ResNet-50-shaped state dict (320 tensors, ~409 MB at
``--width 2``: the P3 stage), written once as an artifact to a temporary folder on local disk.
The page cache is not dropped: both paths read from memory, which is what a stage resumed,
served or predicted from a just-written run reads; on a slower disk the read counts for more,
and the one-read path saves a whole read of the file.

- **read_artifact** (cascade-ray now): the weights file read once, into one block, its sha256
  computed on a second thread as each chunk arrives (``load_safetensors_hashed``); the tensor
  digests hashed in place on ``torch.get_num_threads()`` threads; the NaN/Inf check.
- **read, two passes** (the baseline: ``read_artifact`` before): ``file_sha256`` of the file,
  then ``load_safetensors``, then each tensor digest serially over a ``tobytes()`` copy, then
  the same NaN/Inf check.
- **write_artifact** (now): the file written, then hashed on one thread while the tensor digests
  are hashed on the others; the manifest; the rename.
- **write, serial** (the baseline): the same writes with ``file_sha256`` then the copying serial
  digests.

The remote read (``s3://`` / ``gs://``: the object read straight into the block, no temporary
download) is not timed here: moto's server, the only S3 API on these machines, serves reads
superlinearly in the object's size (64 MB in 8.5 s, 8 MB in 0.1 s), so it would time moto.
Its correctness is tested in ``tests/unit/test_artifacts.py``.

Both paths check the same things and must agree: the baseline's digests and file hash are
compared with the manifest the new path wrote, once, before timing. Alternating, medians.
Prints ``figure: value (ratio vs baseline)``.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def copying_digests(state: dict[str, np.ndarray]) -> dict[str, str]:
    """Each tensor's digest over a ``tobytes()`` copy, one after another (the package before)."""
    out = {}
    for key in sorted(state):
        arr = np.asarray(state[key])
        h = hashlib.sha256(f"{arr.dtype.str}{arr.shape}".encode())
        h.update(arr.tobytes(order="C"))
        out[key] = h.hexdigest()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--width", type=int, default=2, help="bench_handoff's width multiplier (2: ~409 MB)")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench-artifact-"))
    try:
        return _run(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run(args: argparse.Namespace, root: Path) -> int:
    import torch

    from cascade_ray.hardware import hardware_line
    from cascade_ray.models.weights import load_safetensors, save_safetensors
    from cascade_ray.pipeline.artifacts import MANIFEST, WEIGHTS, file_sha256, non_finite, read_artifact, write_artifact
    from cascade_ray.pipeline.records import read_manifest

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from bench_handoff import make_state, resnet50_shapes
    from support.run_records import manifest_fields

    print(hardware_line(), flush=True)
    state = make_state(resnet50_shapes(args.width, 2000))
    size = sum(a.nbytes for a in state.values())
    print(
        f"bench_artifact: {len(state)} tensors, {size / 1e6:.1f} MB; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; {args.repeats} alternating rounds, medians",
        flush=True,
    )
    fields = manifest_fields("a")
    stage = root / "stage"
    written = write_artifact(stage, state, fields).manifest

    def read_two_passes() -> None:
        manifest = read_manifest(stage / MANIFEST)
        if file_sha256(stage / WEIGHTS) != manifest.weights_sha256:
            raise AssertionError("file hash differs")
        loaded = load_safetensors(stage / WEIGHTS)
        if copying_digests(loaded) != manifest.tensor_digests:
            raise AssertionError("digests differ")
        if non_finite(loaded):
            raise AssertionError("non-finite")

    def write_serial(path: Path) -> None:
        path.mkdir()
        save_safetensors(state, path / WEIGHTS)
        sha, digests = file_sha256(path / WEIGHTS), copying_digests(state)
        if sha != written.weights_sha256 or digests != written.tensor_digests:
            raise AssertionError("the serial write hashed differently")

    read_two_passes()  # the baseline agrees with what write_artifact recorded
    read_artifact(stage)
    pairs = [("read", "read2", "read and verify"), ("write", "write2", "write")]
    times: dict[str, list[float]] = {k: [] for now, base, _ in pairs for k in (now, base)}
    for r in range(args.repeats):
        for now, base, _ in pairs:
            for name in (now, base) if r % 2 == 0 else (base, now):
                target = root / f"{name}-{r}"
                start = time.perf_counter()
                if name == "read":
                    read_artifact(stage)
                elif name == "read2":
                    read_two_passes()
                elif name == "write":
                    write_artifact(target, state, fields)
                else:
                    write_serial(target)
                times[name].append(time.perf_counter() - start)
                shutil.rmtree(target, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    for now, base, label in pairs:
        print(f"{label}, two passes / serial (baseline): {med[base]:.3f} s (1.00x)")
        print(
            f"{label}, cascade-ray: {med[now]:.3f} s ({med[base] / med[now]:.2f}x faster; "
            f"rounds {', '.join(f'{t:.3f}' for t in times[now])})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
