"""glibc's allocator in a process that trains: a step's freed memory kept for the next step.

A training step allocates and frees tensors of the same sizes on every step. glibc's malloc
serves a block above its mmap threshold with ``mmap`` and unmaps it on free, and hands the top
of its heap back to the kernel whenever more than its trim threshold lies free there. Both
thresholds start at 128 KiB; the mmap one adapts to the largest block freed so
far (up to 32 MiB) and the trim one follows it. Which steps cross them depends on what the
process happened to free first, so the same training in two processes can differ by millions
of page faults: every crossing maps, faults in (zeroes) and unmaps the same memory again.
docs/benchmarks.md ("The Train job's slower epochs") measured two epochs of the demo's batched
classifier at 0.04-17 million minor faults in different processes, and up to 1.4x slower
where the faults were many, whether in the driver, a Ray task or a Ray Train worker.

:func:`keep_freed_memory` fixes both thresholds for the process (``mallopt``): blocks up to
:data:`MMAP_THRESHOLD_BYTES` (glibc's largest allowed mmap threshold) come from the heap and are
reused, up to :data:`TRIM_THRESHOLD_BYTES` free at the heap's top stays mapped, and a
:data:`TOP_PAD_BYTES` pad keeps a thread's arena from deleting the heaps a step emptied (a
training thread that is not the main thread, as in a Ray Train worker, has its own arena). The process
then holds on to its peak step's memory instead of returning and re-faulting it, as PyTorch's
CUDA caching allocator does on a GPU. :func:`~cascade_ray.stage.setup.setup_stage` calls it for
a CPU stage, in whatever process trains (a Ray Train worker, a batched sweep's worker, a user's
own process calling ``run_stage``), and
:func:`~cascade_ray.pipeline.features.upstream_outputs` in whatever process computes a feature
cache on the CPU (the driver on one node, or a Ray task): there the same adaptive thresholds
cost the demo's two caches up to 1.5 million faults and up to 1.4 s each (docs/benchmarks.md).

Left alone: a C library other than glibc, and a process whose environment already sets glibc's
malloc knobs (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_TOP_PAD_``,
``MALLOC_MMAP_MAX_``, or ``glibc.malloc.*`` in ``GLIBC_TUNABLES``): those are the user's. Set
``CASCADE_RAY_MALLOC=off`` to keep glibc's defaults.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform

MMAP_THRESHOLD_BYTES = 32 * 2**20  # glibc refuses more (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD_BYTES = 256 * 2**20
# a thread's arena (Ray Train's training thread) grows in heaps of at most 64 MiB and deletes a
# heap that falls empty whatever the trim threshold; a 64 MiB pad keeps it
TOP_PAD_BYTES = 64 * 2**20
ENV = "CASCADE_RAY_MALLOC"  # "off" keeps glibc's defaults

# <malloc.h> parameter numbers
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_USER_KNOBS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


@functools.cache
def keep_freed_memory() -> str:
    """Fix glibc's mmap threshold, trim threshold and top pad for this process, once; what was done, for logs and
    tests: ``set``, or why not (``off``, ``environment``, ``not glibc``, ``refused``)."""
    if os.environ.get(ENV, "").strip().lower() in ("off", "0", "false", "no"):
        return "off"
    if any(key in os.environ for key in _USER_KNOBS) or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return "environment"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "not glibc"
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return "not glibc"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success; setting any of these stops glibc adapting the thresholds
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and ok
    ok = mallopt(_M_TOP_PAD, TOP_PAD_BYTES) == 1 and ok
    return "set" if ok else "refused"
