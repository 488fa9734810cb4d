"""P3 hand-off: a >= 400 MB frozen stage to N consumers; shared views vs copies vs a checkpoint directory.

    flock /tmp/cascade-cpu.lock .venv/bin/python benchmarks/bench_handoff.py [--repeats 5] [--consumers 1 2 4 8]

The frozen state is a wide-ResNet-50-shaped state dict built without torchvision: the 320
entries of torchvision's ``resnet50().state_dict()`` with every width doubled (``--width 2``)
and a 2000-way fc (``--classes 2000``): 53 convolutions, 53 BatchNorms with running statistics
and ``num_batches_tracked``, random float32, ~102M parameters, ~390 MiB (> 400 MB). The producer
(this driver) holds it as numpy arrays, as cascade-ray's driver holds a finished stage.

Consumers are Ray actors (``num_cpus=0.1`` each), all started and warmed up (torch, safetensors
and cascade_ray imported, modules built) before any timing. Timed: from the moment the producer
has the state until all N consumers report it loaded into a module (an ``nn.Module`` tree with
the state dict's keys: parameters, and buffers for the BatchNorm statistics):

- **checkpoint directory** (baseline): the producer writes ``weights.safetensors`` into a fresh
  directory (no fsync); each consumer ``load_file``s it and copies into the module it has built
  (as ``load_state_dict`` does). The page cache is not dropped: the directory's best case.
- **object store, copied** (cascade-ray's hand-off before issue 19): one ``ray.put``; each
  consumer ``ray.get``s (read-only views of shared memory) and copies into its module.
- **object store, shared** (cascade-ray's hand-off now): one ``ray.put`` of the state as the
  pipeline's driver holds it, read from the stage's safetensors file by
  ``cascade_ray.models.weights.load_safetensors`` (one block, the arrays views of it: it
  travels as one buffer); each consumer ``ray.get``s and makes the module's tensors views of
  the arrays with ``cascade_ray.models.weights.share_numpy_state``, the function Train workers
  use for frozen upstream tensors. No copy: N consumers on the node read the object store's one copy.
- **object store, shared, 320 buffers** (the same before the one-block read): the producer's
  plain dict of arrays (as ``safetensors.numpy.load_file`` returns it), each array one buffer
  of the put and one array rebuilt by every ``ray.get``; consumers as above.

The copying paths' consumers hold a module built before timing (its tensors allocated and
written); the shared path's consumers build theirs (``torch.empty``, untouched: a Train worker's
random init would touch it) before each round, untimed, since the share replaces those tensors.
Once, untimed, a consumer of each path returns a sha256 of every tensor it holds, checked against
the producer's. Each N runs ``--repeats`` times, the paths rotating which goes first; medians.

The producer's read of the stage's file is timed in the driver's process, alternating, medians
of 7: ``load_safetensors`` (one block) against ``safetensors.numpy.load_file``. The consumer's
own part of the shared path is also timed in the driver's process, one thread: ``share_numpy_state`` of the read-only arrays into a freshly built module, against torch's
``load_state_dict(assign=True)`` of the same views (which makes the same views, through
``Module.__setattr__`` and the module's state-dict machinery), alternating, medians of 31.

Memory: after the last round at the largest N, every consumer reads each of its tensors (a
forward would), then reports ``/proc/self/smaps_rollup``: RSS, PSS (shared pages divided by the
processes that map them) and USS (private pages: ``Private_Clean + Private_Dirty``). Shared
object-store pages count fully in RSS, so RSS overstates a sharing worker; USS is what the worker
alone costs, PSS its fair share. "Flat in N" is read as at most 1.5x from the smallest to the
largest N. Prints ``figure: value (ratio vs baseline)``.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
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
MIB = 2**20
SHARE_REPEATS = 31  # in-process share timings per variant (alternating)


def resnet50_shapes(width: int = 1, classes: int = 1000) -> dict[str, tuple[tuple[int, ...], str]]:
    """Key -> (shape, dtype) of torchvision's resnet50 state dict with widths x `width`, in its order."""
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}

    def conv(name: str, out: int, inp: int, k: int) -> None:
        shapes[f"{name}.weight"] = ((out, inp, k, k), "float32")

    def bn(name: str, c: int) -> None:
        for part in ("weight", "bias", "running_mean", "running_var"):
            shapes[f"{name}.{part}"] = ((c,), "float32")
        shapes[f"{name}.num_batches_tracked"] = ((), "int64")

    conv("conv1", 64 * width, 3, 7)
    bn("bn1", 64 * width)
    inp = 64 * width
    for layer, (blocks, base) in enumerate(zip(RESNET50_BLOCKS, RESNET50_WIDTHS), start=1):
        w = base * width
        for b in range(blocks):
            p = f"layer{layer}.{b}"
            conv(f"{p}.conv1", w, inp, 1)
            bn(f"{p}.bn1", w)
            conv(f"{p}.conv2", w, w, 3)
            bn(f"{p}.bn2", w)
            conv(f"{p}.conv3", w * 4, w, 1)
            bn(f"{p}.bn3", w * 4)
            if b == 0:
                conv(f"{p}.downsample.0", w * 4, inp, 1)
                bn(f"{p}.downsample.1", w * 4)
            inp = w * 4
    shapes["fc.weight"] = ((classes, inp), "float32")
    shapes["fc.bias"] = ((classes,), "float32")
    return shapes


def make_state(shapes: dict, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        key: np.array(int(rng.integers(0, 1000)), dtype=np.int64)
        if dtype == "int64"
        else rng.standard_normal(shape, dtype=np.float32)
        for key, (shape, dtype) in shapes.items()
    }


def digest(arrays) -> str:
    """sha256 over every entry's key, dtype, shape and bytes (numpy arrays or torch tensors)."""
    h = hashlib.sha256()
    for key in sorted(arrays):
        a = arrays[key]
        a = a.detach().numpy() if hasattr(a, "detach") else np.asarray(a)
        h.update(f"{key}|{a.dtype.str}|{a.shape}|".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def smaps_rollup(pid: int | str = "self") -> dict[str, int]:
    """RSS, PSS and USS of a process in bytes, from /proc/<pid>/smaps_rollup."""
    fields: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return {"rss": fields["Rss"], "pss": fields["Pss"], "uss": fields["Private_Clean"] + fields["Private_Dirty"]}


def build_module(shapes: dict, written: bool):
    """The module a worker has just built: parameters, BatchNorm statistics as buffers."""
    import torch
    from torch import nn

    root = nn.Module()
    for key, (shape, dtype) in shapes.items():
        *path, leaf = key.split(".")
        node = root
        for part in path:
            if not hasattr(node, part):
                node.add_module(part, nn.Module())
            node = getattr(node, part)
        t = torch.empty(shape, dtype=getattr(torch, dtype))
        if written:
            t.fill_(1)
        if "running" in leaf or leaf == "num_batches_tracked":
            node.register_buffer(leaf, t)
        else:
            node.register_parameter(leaf, nn.Parameter(t, requires_grad=False))
    return root


def time_share_in_process(shapes: dict, state: dict[str, np.ndarray], repeats: int) -> tuple[float, float]:
    """Medians (s) of one consumer's share of read-only arrays into a freshly built module, in this
    process with one thread: ``share_numpy_state`` vs torch's ``load_state_dict(assign=True)`` of
    the same views (the baseline), alternating."""
    import torch

    from cascade_ray.models.weights import _READ_ONLY_WARNING, share_numpy_state

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    read_only = {k: a.view() for k, a in state.items()}
    for array in read_only.values():
        array.setflags(write=False)
    keys = list(read_only)
    times: dict[str, list[float]] = {"share": [], "assign": []}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_READ_ONLY_WARNING, category=UserWarning)
            for i in range(repeats):
                for kind in ("share", "assign") if i % 2 else ("assign", "share"):
                    module = build_module(shapes, False)
                    t0 = time.perf_counter()
                    if kind == "share":
                        share_numpy_state(module, read_only, keys)
                    else:
                        module.load_state_dict({k: torch.from_numpy(read_only[k]) for k in keys}, assign=True)
                    times[kind].append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return statistics.median(times["share"]), statistics.median(times["assign"])


def make_consumer_class():
    import ray

    @ray.remote(num_cpus=0.1)
    class Consumer:
        """Holds a module with the frozen state's keys; loads a hand-off into it."""

        def ready(self, shapes: dict, written: bool) -> int:
            import safetensors.torch  # noqa: F401  (imports are not part of any timed round)
            import torch

            import cascade_ray.models.weights  # noqa: F401

            torch.set_num_threads(1)
            self.shapes = shapes
            self.build(written)
            return os.getpid()

        def build(self, written: bool) -> None:
            self.module = None  # drop the last round's tensors (and its object-store views) first
            self.module = build_module(self.shapes, written)

        def _copy_in(self, source) -> int:
            import torch

            with torch.no_grad():
                for key, dst in self.module.state_dict().items():
                    dst.copy_(source[key])
            return len(source)

        def from_dir(self, path: str) -> int:
            from safetensors.torch import load_file

            return self._copy_in(load_file(path))  # mmap-backed tensors (the page cache), copied in

        def from_store_copied(self, wrapped: list) -> int:
            import torch

            state = ray.get(wrapped[0])  # read-only numpy views of the shared object
            with warnings.catch_warnings():  # read-only source, copied from: never written
                warnings.simplefilter("ignore", UserWarning)
                return self._copy_in({k: torch.from_numpy(v) for k, v in state.items()})

        def from_store_shared(self, wrapped: list) -> int:  # a block of views or a dict of arrays
            from cascade_ray.models.weights import share_numpy_state

            state = ray.get(wrapped[0])
            return len(share_numpy_state(self.module, state, list(state)))

        def check(self) -> str:
            return digest(self.module.state_dict())

        def touch_and_measure(self) -> dict[str, int]:
            """Read every tensor (as a forward would), then this process's memory."""
            total = 0.0
            for t in self.module.state_dict().values():
                total += float(t.double().sum()) if t.dim() == 0 else float(t.sum())
            return smaps_rollup() | {"checksum": int(total) & 1}

    return Consumer


def run_path(kind: str, state, consumers, root: Path) -> tuple[float, float]:
    """(total s, producer s): the producer hands `state` on, every consumer loads it into its module."""
    import ray
    from safetensors.numpy import save_file

    t0 = time.perf_counter()
    if kind == "dir":
        ckpt = Path(tempfile.mkdtemp(prefix="ckpt-", dir=root))
        save_file(state, str(ckpt / "weights.safetensors"))
        t_prod = time.perf_counter() - t0
        ray.get([c.from_dir.remote(str(ckpt / "weights.safetensors")) for c in consumers])
        total = time.perf_counter() - t0
        shutil.rmtree(ckpt)
        return total, t_prod
    ref = ray.put(state)
    t_prod = time.perf_counter() - t0
    method = "from_store_copied" if kind == "copied" else "from_store_shared"
    ray.get([getattr(c, method).remote([ref]) for c in consumers])
    total = time.perf_counter() - t0
    del ref
    return total, t_prod


PATHS = {
    "dir": "checkpoint directory",
    "copied": "object store, copied",
    "shared_dict": "object store, shared, 320 buffers",
    "shared": "object store, shared",
}
SHARING = ("shared", "shared_dict")
READ_REPEATS = 7  # in-process reads of the stage's file per reader (alternating)


def time_reads(path: Path, repeats: int) -> tuple[float, float]:
    """Medians (s) of reading the stage's safetensors file: cascade-ray's ``load_safetensors``
    (one block) vs ``safetensors.numpy.load_file`` (the baseline), alternating."""
    from safetensors.numpy import load_file

    from cascade_ray.models.weights import load_safetensors

    times: dict[str, list[float]] = {"block": [], "load_file": []}
    for i in range(repeats):
        for kind in ("block", "load_file") if i % 2 else ("load_file", "block"):
            t0 = time.perf_counter()
            state = load_safetensors(path) if kind == "block" else load_file(str(path))
            times[kind].append(time.perf_counter() - t0)
            del state
    return statistics.median(times["block"]), statistics.median(times["load_file"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--consumers", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--width", type=int, default=2, help="ResNet-50 width multiplier (2: ~390 MiB)")
    parser.add_argument("--classes", type=int, default=2000, help="fc outputs")
    parser.add_argument("--dir", type=Path, default=None, help="where checkpoint directories go (default: $TMPDIR)")
    args = parser.parse_args(argv)
    from cascade_ray.hardware import hardware_line

    print(hardware_line(), flush=True)  # first line: the hardware these figures come from

    os.environ.pop("RAY_ADDRESS", None)  # an embedded Ray of our own, never someone else's cluster
    import ray
    from safetensors.numpy import save_file

    shapes_np = resnet50_shapes(args.width, args.classes)
    state = make_state(shapes_np)
    n_bytes = sum(a.nbytes for a in state.values())
    n_params = sum(a.size for k, a in state.items() if a.dtype == np.float32 and "running" not in k)
    root = Path(tempfile.mkdtemp(prefix="bench-handoff-", dir=args.dir))
    n_max = max(args.consumers)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        Consumer = make_consumer_class()
        shapes = {k: (shape, dtype) for k, (shape, dtype) in shapes_np.items()}
        copying = [Consumer.remote() for _ in range(n_max)]  # a built, written module each: dir and copied
        sharing = [Consumer.remote() for _ in range(n_max)]
        ray.get([c.ready.remote(shapes, True) for c in copying] + [c.ready.remote(shapes, False) for c in sharing])
        print(
            f"bench_handoff: wide-ResNet-50-shaped state (widths x{args.width}, {args.classes}-way fc), {len(state)} tensors, "
            f"{n_params / 1e6:.1f}M params, {n_bytes / MIB:.1f} MiB ({n_bytes / 1e6:.0f} MB); 2 x {n_max} actors (num_cpus=0.1) "
            f"started before timing; ray {ray.__version__}, ray.init(num_cpus=2); checkpoint dirs under {root} (page cache "
            f"not dropped); {args.repeats} repeats per N, rotating order, medians",
            flush=True,
        )

        want = digest(state)  # untimed: every path delivers exactly the producer's state
        path = root / "check.safetensors"
        save_file(state, str(path))
        read_s, load_file_s = time_reads(path, READ_REPEATS)
        from cascade_ray.models.weights import load_safetensors

        packed = load_safetensors(path)  # the state as the pipeline's driver reads it from the stage's file
        if type(packed).__name__ != "PackedState":
            raise RuntimeError(f"load_safetensors returned a {type(packed).__name__}, not one block of views")
        held = {"dir": state, "copied": state, "shared_dict": state, "shared": packed}
        ray.get([copying[0].from_dir.remote(str(path))])
        got = {"dir": ray.get(copying[0].check.remote())}
        ray.get(copying[0].from_store_copied.remote([ray.put(state)]))
        got["copied"] = ray.get(copying[0].check.remote())
        for kind in SHARING:
            ray.get(sharing[0].build.remote(False))
            ray.get(sharing[0].from_store_shared.remote([ray.put(held[kind])]))
            got[kind] = ray.get(sharing[0].check.remote())
        if set(got.values()) != {want}:
            raise RuntimeError(f"a consumer's loaded state differs from the producer's: {got}")
        ray.get(sharing[0].build.remote(False))
        path.unlink()
        print(f"identical state check: every path delivers the producer's {len(state)} tensors bit for bit (sha256)")
        print(
            f"producer's read of the stage's file (medians of {READ_REPEATS}, alternating): load_safetensors (one block) "
            f"{read_s * 1e3:.1f} ms vs safetensors.numpy.load_file {load_file_s * 1e3:.1f} ms "
            f"({load_file_s / read_s:.2f}x faster than baseline)",
            flush=True,
        )
        share_s, assign_s = time_share_in_process(shapes_np, state, SHARE_REPEATS)
        print(
            f"consumer's share in one process (1 thread, medians of {SHARE_REPEATS}): share_numpy_state {share_s * 1e3:.2f} ms vs "
            f"load_state_dict(assign=True) {assign_s * 1e3:.2f} ms ({assign_s / share_s:.2f}x faster than baseline)",
            flush=True,
        )

        def one(kind: str, n: int) -> tuple[float, float]:
            if kind in SHARING:
                ray.get([c.build.remote(False) for c in sharing[:n]])  # untimed: the model a worker builds
            return run_path(kind, held[kind], (sharing if kind in SHARING else copying)[:n], root)

        for kind in PATHS:  # warm-up, not measured
            one(kind, n_max)
        orders = itertools.cycle(itertools.permutations(PATHS))
        results: dict[tuple[str, int], float] = {}
        for n in args.consumers:
            runs: dict[str, list[float]] = {k: [] for k in PATHS}
            prod: dict[str, list[float]] = {k: [] for k in PATHS}
            for _ in range(args.repeats):
                for kind in next(orders):
                    total, part = one(kind, n)
                    runs[kind].append(total), prod[kind].append(part)
            base = statistics.median(runs["dir"])
            for kind, label in PATHS.items():
                med = results[(kind, n)] = statistics.median(runs[kind])
                what = "producer write" if kind == "dir" else "put"
                print(
                    f"N={n} {label}: {med:.3f} s ({base / med:.2f}x faster than baseline; {what} "
                    f"{statistics.median(prod[kind]):.3f} s; runs {min(runs[kind]):.3f}..{max(runs[kind]):.3f})",
                    flush=True,
                )
        first, last = min(args.consumers), n_max
        for kind, label in PATHS.items():
            a, b = results[(kind, first)], results[(kind, last)]
            print(f"growth N={first}->{last}, {label}: {a:.3f} s -> {b:.3f} s ({b / a:.2f}x)")
        for n in args.consumers:
            block, buffers = results[("shared", n)], results[("shared_dict", n)]
            print(
                f"N={n} shared hand-off, one block vs 320 buffers: {block:.3f} vs {buffers:.3f} s ({buffers / block:.2f}x)"
            )

        # memory at the largest N: the sharing actors still hold the last round's views
        one("shared", last)
        ref = ray.put(state)  # the copying actors end holding their own copy (the last round's)
        ray.get([c.from_store_copied.remote([ref]) for c in copying[:last]])
        del ref
        mem = {
            "copied": ray.get([c.touch_and_measure.remote() for c in copying[:last]]),
            "shared": ray.get([c.touch_and_measure.remote() for c in sharing[:last]]),
        }
        for kind, label in (
            ("copied", "checkpoint directory / object store, copied"),
            ("shared", "object store, shared"),
        ):
            m = {k: statistics.median(r[k] for r in mem[kind]) / MIB for k in ("rss", "pss", "uss")}
            print(
                f"memory per worker at N={last}, {label} (median of {last}): USS {m['uss']:.0f} MiB, PSS {m['pss']:.0f} MiB, "
                f"RSS {m['rss']:.0f} MiB; frozen stage {n_bytes / MIB:.0f} MiB"
            )
        uss_copy = statistics.median(r["uss"] for r in mem["copied"])
        uss_shared = statistics.median(r["uss"] for r in mem["shared"])
        print(
            f"private memory (USS) per worker, shared vs copied: {uss_shared / MIB:.0f} vs {uss_copy / MIB:.0f} MiB "
            f"({uss_shared / uss_copy:.3f}x); shared USS minus an idle worker's is what the stage costs it"
        )
        speedup = results[("dir", last)] / results[("shared", last)]
        growth = results[("shared", last)] / results[("shared", first)]
        print(
            f"P3 target: object store (shared) >= 5x faster than a checkpoint directory at N={last}: {speedup:.2f}x -> "
            f"{'met' if speedup >= 5 else 'NOT met'}; flat in N (<= 1.5x from N={first} to N={last}): {growth:.2f}x -> "
            f"{'met' if growth <= 1.5 else 'NOT met'}"
        )
    finally:
        ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
