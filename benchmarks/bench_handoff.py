"""P3 hand-off: a ~100 MB frozen stage to N consumers, object store vs checkpoint directory.

    /work/venv/bin/python benchmarks/bench_handoff.py [--repeats 9] [--consumers 1 2 4 8]

The frozen state is a ResNet-50-shaped state dict built without torchvision: the 320 entries
of torchvision's ``resnet50().state_dict()`` (53 convolutions, 53 BatchNorms with their
running statistics and ``num_batches_tracked``, the 1000-way fc), random float32 values,
25.6M parameters, ~102 MB. The producer (this driver) holds it as numpy arrays, which is
what cascade-ray's driver holds after reading a stage's best checkpoint.

Consumers are Ray actors (``num_cpus=0.25`` each, so 8 fit on ``ray.init(num_cpus=2)``),
all started and warmed up (torch and safetensors imported, destination tensors allocated)
before any timing. Timed: from the moment the producer has the state until all N consumers
report it loaded; every consumer ends with the same thing, torch tensors it owns:

- **object store** (candidate, cascade-ray's hand-off): one ``ray.put``; each consumer
  ``ray.get``s the ref (zero-copy read-only numpy views of shared memory) and copies.
- **checkpoint directory** (baseline): the producer writes ``weights.safetensors`` into a
  fresh directory (no fsync); each consumer reads it. Nothing is dropped from the page
  cache: the file is read back from memory, the directory path's best case (a checkpoint on
  cold disk or network storage is slower).

Each path is timed in two modes that end in the same state:

- **fresh tensors**: the consumer allocates them (``np.array`` copy of each view, vs
  ``safetensors.torch.load_file(..., backend="pread")``; the default ``mmap`` backend returns
  tensors backed by the file mapping, not a copy, so it would not be the same final state);
- **into a pre-built module**: ``copy_`` into tensors allocated and written before timing, as
  a Train worker loads upstream weights into the model it has just built (from the views, vs
  from ``load_file``'s mmap-backed tensors).

Once, untimed, a consumer of each path and mode returns a sha256 of every tensor it loaded,
checked against the producer's. Each N and mode runs ``--repeats`` times, the two paths
alternating which goes first; medians are reported. One extra, *not equal-state*, line per N
shows the object store with no copy (read-only numpy views only), to separate transport
from copy cost. "Flat in N" is read as at most 1.5x from the smallest to the largest N.
Prints ``figure: value (ratio vs baseline)``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

RESNET50_BLOCKS = (3, 4, 6, 3)
RESNET50_WIDTHS = (64, 128, 256, 512)


def resnet50_shapes() -> dict[str, tuple[tuple[int, ...], str]]:
    """Key -> (shape, dtype) of torchvision's resnet50 state dict, in its order."""
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}

    def conv(name: str, out: int, inp: int, k: int) -> None:
        shapes[f"{name}.weight"] = ((out, inp, k, k), "float32")

    def bn(name: str, c: int) -> None:
        for part in ("weight", "bias", "running_mean", "running_var"):
            shapes[f"{name}.{part}"] = ((c,), "float32")
        shapes[f"{name}.num_batches_tracked"] = ((), "int64")

    conv("conv1", 64, 3, 7)
    bn("bn1", 64)
    inp = 64
    for layer, (blocks, width) in enumerate(zip(RESNET50_BLOCKS, RESNET50_WIDTHS), start=1):
        for b in range(blocks):
            p = f"layer{layer}.{b}"
            conv(f"{p}.conv1", width, inp, 1)
            bn(f"{p}.bn1", width)
            conv(f"{p}.conv2", width, width, 3)
            bn(f"{p}.bn2", width)
            conv(f"{p}.conv3", width * 4, width, 1)
            bn(f"{p}.bn3", width * 4)
            if b == 0:
                conv(f"{p}.downsample.0", width * 4, inp, 1)
                bn(f"{p}.downsample.1", width * 4)
            inp = width * 4
    shapes["fc.weight"] = ((1000, 2048), "float32")
    shapes["fc.bias"] = ((1000,), "float32")
    return shapes


def make_state(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    state = {}
    for key, (shape, dtype) in resnet50_shapes().items():
        state[key] = (
            np.array(int(rng.integers(0, 1000)), dtype=np.int64)
            if dtype == "int64"
            else rng.standard_normal(shape, dtype=np.float32)
        )
    return state


def digest(arrays) -> str:
    """sha256 over every entry's key, dtype, shape and bytes (numpy arrays or torch tensors)."""
    h = hashlib.sha256()
    for key in sorted(arrays):
        a = arrays[key]
        a = a.numpy() if hasattr(a, "numpy") else np.asarray(a)
        h.update(f"{key}|{a.dtype.str}|{a.shape}|".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def make_consumer_class():
    import ray

    @ray.remote(num_cpus=0.25)
    class Consumer:
        """Receives a frozen state and ends with torch tensors it owns.

        ``into_module=False``: new tensors each time (the consumer allocates them).
        ``into_module=True``: copied into tensors allocated and written before any timing,
        as a Train worker loads upstream weights into the model it has just built
        (``load_state_dict`` does the same per-tensor ``copy_``).
        """

        def ready(self, shapes: dict) -> int:
            import safetensors.torch  # noqa: F401  (imports are not part of any timed round)
            import torch

            torch.set_num_threads(1)
            self.module = {
                k: torch.empty(shape, dtype=getattr(torch, dtype)).fill_(1) for k, (shape, dtype) in shapes.items()
            }
            return os.getpid()

        def _finish(self, tensors, check: bool):
            return digest(tensors) if check else sum(t.numel() for t in tensors.values())

        def _copy_in(self, source) -> dict:
            import torch

            with torch.no_grad():
                for key, dst in self.module.items():
                    dst.copy_(source[key])
            return self.module

        def from_store(self, wrapped: list, into_module: bool, check: bool = False):
            import torch

            state = ray.get(wrapped[0])  # read-only numpy views of the shared object
            if into_module:
                with warnings.catch_warnings():  # read-only source, copied from: never written
                    warnings.simplefilter("ignore", UserWarning)
                    return self._finish(self._copy_in({k: torch.from_numpy(v) for k, v in state.items()}), check)
            return self._finish(
                {k: torch.from_numpy(np.array(v)) for k, v in state.items()}, check
            )  # own, writable copies

        def from_store_views(self, wrapped: list) -> int:
            state = ray.get(wrapped[0])  # attribution only: no copy, not the same final state
            return sum(v.size for v in state.values())

        def from_dir(self, path: str, into_module: bool, check: bool = False):
            from safetensors.torch import load_file

            if into_module:  # mmap-backed tensors (the page cache), copied into the module
                return self._finish(self._copy_in(load_file(path)), check)
            return self._finish(load_file(path, backend="pread"), check)  # read into tensors it owns

    return Consumer


def via_store(state, consumers, into_module: bool = False, views: bool = False) -> tuple[float, float]:
    """(total s, put s): one put, every consumer gets and copies."""
    import ray

    t0 = time.perf_counter()
    ref = ray.put(state)
    t_put = time.perf_counter() - t0
    calls = [c.from_store_views.remote([ref]) if views else c.from_store.remote([ref], into_module) for c in consumers]
    ray.get(calls)
    total = time.perf_counter() - t0
    del ref, calls
    return total, t_put


def via_dir(state, consumers, root: Path, into_module: bool = False) -> tuple[float, float]:
    """(total s, write s): the producer writes a checkpoint directory, every consumer reads it."""
    import ray
    from safetensors.numpy import save_file

    t0 = time.perf_counter()
    ckpt = Path(tempfile.mkdtemp(prefix="ckpt-", dir=root))
    save_file(state, str(ckpt / "weights.safetensors"))
    t_write = time.perf_counter() - t0
    ray.get([c.from_dir.remote(str(ckpt / "weights.safetensors"), into_module) for c in consumers])
    total = time.perf_counter() - t0
    shutil.rmtree(ckpt)
    return total, t_write


MODES = (("fresh tensors", False), ("into a pre-built module", True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--consumers", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="where checkpoint directories go (default: a temp dir under $TMPDIR or /tmp)",
    )
    args = parser.parse_args(argv)
    from cascade_ray.hardware import hardware_line

    print(hardware_line(), flush=True)  # first line: the hardware these figures come from

    os.environ.pop("RAY_ADDRESS", None)  # an embedded Ray of our own, never someone else's cluster
    import ray
    from safetensors.numpy import save_file

    state = make_state()
    n_bytes = sum(a.nbytes for a in state.values())
    n_params = sum(a.size for k, a in state.items() if a.dtype == np.float32 and "running" not in k)
    root = Path(tempfile.mkdtemp(prefix="bench-handoff-", dir=args.dir))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        Consumer = make_consumer_class()
        consumers = [Consumer.remote() for _ in range(max(args.consumers))]
        shapes = {k: (v.shape, str(v.dtype)) for k, v in state.items()}
        ray.get([c.ready.remote(shapes) for c in consumers])
        print(
            f"bench_handoff: ResNet-50-shaped state, {len(state)} tensors, {n_params / 1e6:.1f}M params, {n_bytes / 2**20:.1f} MiB; "
            f"{len(consumers)} actors (num_cpus=0.25) started before timing; ray {ray.__version__}, ray.init(num_cpus=2); "
            f"checkpoint dirs under {root} (page cache not dropped); {args.repeats} repeats per N, alternating, medians",
            flush=True,
        )

        # untimed: every path delivers exactly the producer's state
        want = digest(state)
        ref = ray.put(state)
        path = root / "check.safetensors"
        save_file(state, str(path))
        for _, into_module in MODES:
            got_store = ray.get(consumers[0].from_store.remote([ref], into_module, check=True))
            got_dir = ray.get(consumers[0].from_dir.remote(str(path), into_module, check=True))
            if not (got_store == want == got_dir):
                raise RuntimeError("a consumer's loaded state differs from the producer's")
        del ref
        path.unlink()
        print(
            f"identical state check: every path delivers the producer's {len(state)} tensors bit for bit (sha256)",
            flush=True,
        )
        for _, into_module in MODES:  # warm-up, not measured
            via_store(state, consumers, into_module), via_dir(state, consumers, root, into_module)

        results: dict[tuple[str, int], dict[str, float]] = {}
        for n in args.consumers:
            group = consumers[:n]
            for mode, into_module in MODES:
                runs: dict[str, list[float]] = {"store": [], "put": [], "dir": [], "write": []}
                for rep in range(args.repeats):
                    for kind in ("store", "dir") if rep % 2 == 0 else ("dir", "store"):
                        if kind == "store":
                            total, part = via_store(state, group, into_module)
                            runs["store"].append(total), runs["put"].append(part)
                        else:
                            total, part = via_dir(state, group, root, into_module)
                            runs["dir"].append(total), runs["write"].append(part)
                med = {k: statistics.median(v) for k, v in runs.items()}
                results[(mode, n)] = med
                print(
                    f"N={n} {mode}, checkpoint directory: {med['dir']:.3f} s (1.000 vs baseline; producer write {med['write']:.3f} s; "
                    f"runs {min(runs['dir']):.3f}..{max(runs['dir']):.3f})",
                    flush=True,
                )
                print(
                    f"N={n} {mode}, object store: {med['store']:.3f} s ({med['dir'] / med['store']:.2f}x faster than baseline; put {med['put']:.3f} s; "
                    f"runs {min(runs['store']):.3f}..{max(runs['store']):.3f})",
                    flush=True,
                )
            views = statistics.median(via_store(state, group, views=True)[0] for _ in range(args.repeats))
            results[("views", n)] = {"store": views}
            print(
                f"N={n} object store, read-only views only (no copy; NOT the same final state, attribution only): {views:.3f} s "
                f"({results[(MODES[1][0], n)]['dir'] / views:.2f}x faster than the pre-built-module baseline)",
                flush=True,
            )
        first, last = min(args.consumers), max(args.consumers)
        for mode, _ in MODES:
            for kind, label in (("dir", "checkpoint directory"), ("store", "object store")):
                a, b = results[(mode, first)][kind], results[(mode, last)][kind]
                print(f"growth N={first}->{last}, {mode}, {label}: {a:.3f} s -> {b:.3f} s ({b / a:.2f}x)")
        a, b = results[("views", first)]["store"], results[("views", last)]["store"]
        print(f"growth N={first}->{last}, object store views only: {a:.3f} s -> {b:.3f} s ({b / a:.2f}x)")
        for mode, _ in MODES:
            speedup = results[(mode, last)]["dir"] / results[(mode, last)]["store"]
            growth = results[(mode, last)]["store"] / results[(mode, first)]["store"]
            print(
                f"P3 target ({mode}): object store >= 5x faster at N={last}: {speedup:.2f}x -> {'met' if speedup >= 5 else 'NOT met'}; "
                f"flat in N (taken as <= 1.5x from N={first} to N={last}): {growth:.2f}x -> {'met' if growth <= 1.5 else 'NOT met'}"
            )
    finally:
        ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
