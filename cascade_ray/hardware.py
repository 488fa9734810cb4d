"""What the device a stage runs on computes natively: the input of ``precision: auto`` and of
the memory-format choice.

:func:`detect_hardware` looks at the *running* process, so it honours the restrictions a
user (or a test of the other CPU kind) puts on the kernels: ``ATEN_CPU_CAPABILITY`` (seen in
``torch.backends.cpu.get_cpu_capability()``) and oneDNN's ``ONEDNN_MAX_CPU_ISA`` (seen in
``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` and read here as well). A CPU runs bf16
natively when all of these hold:

- ATen's capability is an AVX512 one (AVX2 kernels emulate bf16 arithmetic in fp32),
- oneDNN reports bf16 support and is not capped below ``AVX512_CORE_BF16``,
- the CPU has the AVX512-BF16 or AMX-BF16 instructions (cpuinfo, via torch or /proc/cpuinfo).

oneDNN reports bf16 "supported" on plain AVX512 too (emulated there), so its flag alone is
not enough. When the instruction flags cannot be read, a tiny timed probe decides:
bf16 is native only if a small conv step runs faster in bf16 than in fp32.

Everything that decides from a :class:`Hardware` takes it as an argument, so tests inject
``Hardware.cpu("AVX2")`` or ``Hardware.cuda(7, 5)`` instead of needing those machines.
"""

from __future__ import annotations

import functools
import os
import platform
import time
from dataclasses import dataclass

import torch

# oneDNN ISA caps (ONEDNN_MAX_CPU_ISA) that still include native bf16 dot products.
_ONEDNN_BF16_ISAS = {
    "AVX512_CORE_BF16",
    "AVX512_CORE_FP16",
    "AVX512_CORE_AMX",
    "AVX512_CORE_AMX_FP16",
    "AVX10_1_512",
    "AVX10_1_512_AMX",
    "AVX10_1_512_AMX_FP16",
    "AVX10_2_512",
    "AVX10_2_512_AMX_2",
    "ALL",
    "DEFAULT",
}


@dataclass(frozen=True)
class Hardware:
    """The device of a stage, as far as precision and memory format care.

    Attributes:
        kind: ``cpu`` or ``cuda``.
        name: CPU model or GPU name.
        capability: CPU: ATen's ``get_cpu_capability()`` (``AVX2``, ``AVX512``, ``DEFAULT``, ...);
            GPU: ``sm_XY``.
        native_bf16: bf16 matmuls/convolutions run on bf16 hardware (not emulated in fp32).
        bf16_note: how ``native_bf16`` was decided, for messages (e.g. ``no AVX512-BF16/AMX``).
        cuda_capability: (major, minor) on GPUs, else None.
    """

    kind: str
    name: str
    capability: str
    native_bf16: bool
    bf16_note: str = ""
    cuda_capability: tuple[int, int] | None = None

    @classmethod
    def cpu(cls, capability: str, name: str = "injected CPU") -> Hardware:
        """A CPU by a capability label, for tests and tools: ``AVX2``, ``AVX512``, ``AVX512_BF16`` or ``AMX``."""
        label = capability.upper()
        native = label in ("AVX512_BF16", "AMX")
        aten = "AVX512" if label.startswith("AVX512") or label == "AMX" else label
        note = f"{label.replace('_', '-')}" if native else "no AVX512-BF16/AMX"
        return cls("cpu", name, aten, native, note)

    @classmethod
    def cuda(cls, major: int, minor: int = 0, name: str = "injected GPU") -> Hardware:
        """A CUDA GPU by compute capability (bf16 is native from 8.0, Ampere)."""
        native = major >= 8
        return cls(
            "cuda",
            name,
            f"sm_{major}{minor}",
            native,
            "" if native else "no bf16 before compute capability 8.0",
            (major, minor),
        )

    @property
    def label(self) -> str:
        """Short description for messages: ``CPU AVX2``, ``CPU AVX512 + AVX512-BF16``, ``GPU <name> sm_75``."""
        if self.kind == "cuda":
            return f"GPU {self.name} {self.capability}"
        return f"CPU {self.capability}" + (f" + {self.bf16_note}" if self.native_bf16 and self.bf16_note else "")


def detect_hardware(device: torch.device | str = "cpu") -> Hardware:
    """The :class:`Hardware` of `device` in this process (cached per device; see the module docstring)."""
    device = torch.device(device)
    if device.type == "cuda":
        return _detect_cuda(device.index if device.index is not None else torch.cuda.current_device())
    return _detect_cpu()


@functools.cache
def _detect_cuda(index: int) -> Hardware:
    major, minor = torch.cuda.get_device_capability(index)
    hw = Hardware.cuda(major, minor, torch.cuda.get_device_name(index))
    return hw


@functools.cache
def _detect_cpu() -> Hardware:
    capability = cpu_capability()
    name = cpu_model()
    onednn = _mkldnn_bf16_supported()
    cap_env = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    if not capability.startswith("AVX512"):
        return Hardware("cpu", name, capability, False, f"ATen kernels are {capability}, bf16 is emulated")
    if onednn is False:
        return Hardware("cpu", name, capability, False, "oneDNN has no bf16 on this CPU")
    if cap_env and cap_env not in _ONEDNN_BF16_ISAS:
        return Hardware("cpu", name, capability, False, f"ONEDNN_MAX_CPU_ISA={cap_env} excludes AVX512-BF16")
    flags = cpu_bf16_flags()
    if flags is None:  # instruction flags unreadable: measure
        ratio = bf16_probe_ratio()
        native = ratio < 1.0
        return Hardware("cpu", name, capability, native, f"probe: bf16 step {ratio:.2f}x the fp32 time")
    if not flags:
        return Hardware("cpu", name, capability, False, "no AVX512-BF16/AMX")
    return Hardware("cpu", name, capability, True, "+".join(flags))


def cpu_capability() -> str:
    """ATen's CPU capability (honours ``ATEN_CPU_CAPABILITY``), ``unknown`` if torch cannot say."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # noqa: BLE001 - an old or unusual build: treat as unknown (no bf16)
        return "unknown"


def cpu_model() -> str:
    """The CPU model name (/proc/cpuinfo, else platform)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _mkldnn_bf16_supported() -> bool | None:
    """oneDNN's bf16 flag (a private torch op, honours ONEDNN_MAX_CPU_ISA); None when unavailable."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:  # noqa: BLE001 - private op: missing or renamed in other torch builds
        return None


def cpu_bf16_flags() -> list[str] | None:
    """The CPU's bf16 instruction sets present (``AVX512-BF16``, ``AMX-BF16``); None if unreadable.

    These are the hardware's, not restricted by environment variables (the callers check those).
    """
    try:  # torch's cpuinfo (private; a dict of flags in torch 2.x)
        info = torch._C._cpu._get_cpu_capability()
        if isinstance(info, dict) and "avx512_bf16" in info:
            return [n for k, n in (("avx512_bf16", "AVX512-BF16"), ("amx_bf16", "AMX-BF16")) if info.get(k)]
    except Exception:  # noqa: BLE001 - private API: fall back to /proc/cpuinfo
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return [n for k, n in (("avx512_bf16", "AVX512-BF16"), ("amx_bf16", "AMX-BF16")) if k in flags]
    except OSError:
        pass
    return None


def bf16_probe_ratio(repeats: int = 3) -> float:
    """bf16-autocast time / fp32 time of a small conv forward+backward on this CPU (best of `repeats`).

    Below 1 bf16 is faster (native); emulated bf16 is several times slower. About 0.1-0.5 s.
    """
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 32, 14, 14, generator=gen)
    w = torch.randn(32, 32, 3, 3, generator=gen, requires_grad=True)

    def step(dtype: torch.dtype | None) -> float:
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            out = torch.nn.functional.conv2d(x, w, padding=1)
        out.float().sum().backward()
        return time.perf_counter() - start

    times = {}
    for dtype in (None, torch.bfloat16):
        step(dtype)  # warm-up (oneDNN primitive creation)
        times[dtype] = min(step(dtype) for _ in range(repeats))
    return times[torch.bfloat16] / times[None]


def hardware_line() -> str:
    """One line naming this machine: CPU model, ATen capability, bf16 verdict, and the GPU when present."""
    cpu = _detect_cpu()
    line = f"hardware: CPU {cpu.name}, get_cpu_capability() {cpu.capability}, bf16 {'native' if cpu.native_bf16 else 'emulated'} ({cpu.bf16_note})"
    if torch.cuda.is_available():
        gpu = detect_hardware("cuda")
        line += f"; GPU {gpu.name} ({gpu.capability})"
    for env in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"):
        if os.environ.get(env):
            line += f"; {env}={os.environ[env]}"
    return line
