"""stage/allocator.py: a process that trains keeps a step's freed memory (glibc's thresholds
fixed), unless its environment already sets glibc's malloc knobs or turns it off."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from paths import CONFIGS

from cascade_ray.stage import allocator

# A step that frees three 12 MiB tensors at once. With glibc's adaptive thresholds (mmap
# threshold raised to 12 MiB by the first free, trim threshold twice that) the 36 MiB left free
# at the heap's top is handed back to the kernel on every step and faulted in again on the next
# in some processes and not in others (Debian 12's glibc 2.36, the same script run after run:
# ~6,100 faults a step, or none), which is the problem the module removes: with its settings the
# steps fault nothing once the heap has grown (every run measured).
STEPS = 20
STEP_PAGES = 3 * 12 * 2**20 // 4096
CHURN = textwrap.dedent(
    f"""
    import resource
    import torch
    torch.set_num_threads(1)
    from cascade_ray.stage.allocator import keep_freed_memory
    print(keep_freed_memory())
    def step():
        kept = [torch.empty(3 * 2**20).fill_(1.0) for _ in range(3)]  # 12 MiB each
        del kept
    for _ in range(10):  # the heap grows to its working size first
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range({STEPS}):
        step()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)
GLIBC = sys.platform == "linux" and os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")


def _churn(**env: str) -> tuple[str, int]:
    """(what keep_freed_memory did, minor page faults of STEPS steps) in a fresh interpreter."""
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", allocator.ENV)
    }
    out = subprocess.run(
        [sys.executable, "-c", CHURN], env=clean | env, capture_output=True, text=True, timeout=120, check=True
    )
    status, faults = out.stdout.split()
    return status, int(faults)


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc is what the module tunes")
def test_freed_tensors_are_reused_not_faulted_in_again():
    status, faults = _churn()
    assert status == "set"
    assert faults < STEP_PAGES, f"{faults} minor faults in {STEPS} steps: the freed memory was handed back"


@pytest.mark.parametrize(
    "env",
    [{"MALLOC_TRIM_THRESHOLD_": "1000000"}, {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}],
    ids=["MALLOC_", "GLIBC_TUNABLES"],
)
def test_the_users_own_malloc_settings_are_left_alone(monkeypatch, env):
    allocator.keep_freed_memory.cache_clear()
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    try:
        assert allocator.keep_freed_memory() == "environment"
    finally:
        allocator.keep_freed_memory.cache_clear()


def test_another_c_library_is_left_alone(monkeypatch):
    allocator.keep_freed_memory.cache_clear()
    for key in [k for k in os.environ if k.startswith("MALLOC_")] + ["GLIBC_TUNABLES", allocator.ENV]:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(allocator.platform, "libc_ver", lambda: ("musl", "1.2"))
    try:
        assert allocator.keep_freed_memory() == "not glibc"
    finally:
        allocator.keep_freed_memory.cache_clear()


def test_a_cpu_stage_setup_keeps_freed_memory(digits, monkeypatch):
    import cascade_ray.stage.setup as setup_mod
    from cascade_ray.checks import load_config

    calls: list[int] = []
    monkeypatch.setattr(setup_mod, "keep_freed_memory", lambda: calls.append(1) or "set")
    cfg = load_config(CONFIGS / "debug.yaml", [])
    setup_mod.setup_stage(cfg, 0, digits, None, torch.device("cpu"))
    assert calls == [1]


def test_a_feature_cache_computed_on_the_cpu_keeps_freed_memory(digits, monkeypatch):
    """The driver (or a Ray task) running the frozen upstream over every sample allocates the same
    batch activations again and again, as a training step does."""
    from cascade_ray.checks import load_config
    from cascade_ray.models.weights import to_numpy_state
    from cascade_ray.pipeline.features import upstream_outputs
    from cascade_ray.stage.setup import build_stage_model

    cfg = load_config(CONFIGS / "debug.yaml", [])
    model, _ = build_stage_model(cfg, 0, digits, None)
    upstream = to_numpy_state(model.state_dict())
    calls: list[int] = []
    monkeypatch.setattr(allocator, "keep_freed_memory", lambda: calls.append(1) or "set")
    out = upstream_outputs(cfg, 1, digits, upstream)
    assert calls == [1]
    assert len(out["train"]) == len(digits.y_train)
