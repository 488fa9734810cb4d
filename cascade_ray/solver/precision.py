"""Choices made from the stage's hardware: ``precision: auto``, emulated-bf16 checks, memory
format and ``torch.compile``.

Everything here takes a :class:`~cascade_ray.hardware.Hardware` (detected on the worker's
device by :func:`~cascade_ray.hardware.detect_hardware`, or injected by tests), so the same
config picks fp32 on an AVX2 CPU and bf16 on an AVX512-BF16 CPU or an Ampere GPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cascade_ray.config.schema import PipelineConfig, StageConfig
from cascade_ray.errors import ConfigIssue
from cascade_ray.hardware import Hardware, bf16_probe_ratio, detect_hardware

# What emulated bf16 cost where it was measured (docs/benchmarks.md, "CPU kinds"): the demo
# ResNet step on an AVX2-only AMD EPYC Zen 3, 2 threads, bf16 autocast vs fp32 (125 vs 1049 samples/s).
MEASURED_AVX2_SLOWDOWN = "8.4x slower than fp32 for the demo ResNet step on an AVX2 CPU (docs/benchmarks.md)"

# channels_last vs contiguous for the demo ResNet step, by (device kind, capability, precision):
# True where benchmarks/bench_precision.py measured channels_last faster (docs/benchmarks.md, P7).
# A combination not listed (other CPUs, GPUs: not measured here) stays contiguous.
CHANNELS_LAST_FASTER: dict[tuple[str, str, str], bool] = {
    ("cpu", "AVX2", "fp32"): True,
    ("cpu", "AVX512", "fp32"): False,
    ("cpu", "AVX512", "bf16"): False,
}


@dataclass(frozen=True)
class PrecisionChoice:
    """What ``solver.precision`` became on one device, and why.

    Attributes:
        requested: the configured value (``auto``, ``fp32``, ``bf16``, ``fp16``).
        resolved: ``fp32``, ``bf16`` or ``fp16``.
        reason: for the per-stage line, e.g. ``CPU AVX2: bf16 would be emulated``.
        hardware: :attr:`Hardware.label` of the device.
        emulated: the resolved precision is bf16 on hardware that emulates it (only when set explicitly).
    """

    requested: str
    resolved: str
    reason: str
    hardware: str
    emulated: bool = False

    def line(self, stage: str) -> str:
        """``features: precision auto -> fp32 (CPU AVX2: bf16 would be emulated)``."""
        arrow = f"{self.requested} -> {self.resolved}" if self.requested != self.resolved else self.resolved
        return f"{stage}: precision {arrow} ({self.reason})"

    def record(self) -> dict[str, Any]:
        """The stage record's and manifest's ``precision`` entry."""
        return {
            "requested": self.requested,
            "resolved": self.resolved,
            "reason": self.reason,
            "hardware": self.hardware,
        }


def resolve_precision(requested: str, hw: Hardware, sharded: bool = False) -> PrecisionChoice:
    """The precision a stage with ``solver.precision: requested`` runs in on `hw`.

    `sharded` (``scaling.strategy: fsdp``): ``auto`` never picks fp16 there, because its loss
    scaler would skip overflow steps on each worker's own shard (explicit fp16 is refused by
    validation); a GPU without native bf16 runs fp32 instead.
    """
    if requested != "auto":
        emulated = requested == "bf16" and not hw.native_bf16
        reason = f"set explicitly; {hw.label}" + (f": bf16 is emulated ({hw.bf16_note})" if emulated else "")
        return PrecisionChoice(requested, requested, reason, hw.label, emulated)
    if hw.native_bf16:
        return PrecisionChoice("auto", "bf16", f"{hw.label}: native bf16", hw.label)
    if hw.kind == "cuda" and sharded:
        return PrecisionChoice(
            "auto", "fp32", f"{hw.label}: no native bf16, and fp16 loss scaling is not sharded under fsdp", hw.label
        )
    if hw.kind == "cuda":
        return PrecisionChoice("auto", "fp16", f"{hw.label}: no native bf16, fp16 with a loss scaler", hw.label)
    detail = f" ({hw.bf16_note})" if hw.capability.startswith("AVX512") else ""
    return PrecisionChoice("auto", "fp32", f"{hw.label}: bf16 would be emulated{detail}", hw.label)


def emulated_bf16_detail(hw: Hardware, path: str, measured: float | None) -> tuple[str, str, str]:
    """(detail, key, fix) of the ``health.emulated_bf16`` rule; `measured`: the probe's bf16/fp32 time ratio."""
    probe = f"a probe conv step here ran {measured:.1f}x slower in bf16 than in fp32; " if measured else ""
    detail = (
        f"{path}.solver.precision is bf16, but {hw.label} emulates bf16 ({hw.bf16_note}): expect the stage to "
        f"train several times slower than in fp32 ({probe}measured {MEASURED_AVX2_SLOWDOWN})"
    )
    fix = f"set {path}.solver.precision: auto (picks fp32 on this hardware, bf16 where it is native) or fp32"
    return detail, f"{path}.solver.precision", fix


def probe_slowdown(hw: Hardware) -> float | None:
    """The bf16/fp32 probe ratio on this CPU when `hw` is the detected CPU, else None (injected or GPU)."""
    if hw.kind != "cpu" or hw != detect_hardware("cpu"):
        return None
    return bf16_probe_ratio()


def precision_config_issues(
    cfg: PipelineConfig, hardware: Hardware | None = None
) -> tuple[list[ConfigIssue], list[ConfigIssue]]:
    """Validate-time check of explicit ``precision: bf16`` against this machine's CPU.

    Only stages that will run on CPU here are checked (``use_gpu: false``, or ``auto`` without a
    local GPU); a GPU stage is checked in the stage, on its device. The policy is
    ``stages[i].health.emulated_bf16.policy``.

    Args:
        cfg: the validated config.
        hardware: the CPU to check against; default the detected one (then a probe measures the slowdown).

    Returns:
        ``(errors, warnings)``.
    """
    errors: list[ConfigIssue] = []
    warnings: list[ConfigIssue] = []
    for i, stage in enumerate(cfg.stages):
        policy = stage.health.emulated_bf16.policy
        if stage.solver.precision != "bf16" or policy == "off" or not _runs_on_cpu_here(stage):
            continue
        hw = hardware if hardware is not None else detect_hardware("cpu")
        if hw.native_bf16:
            continue
        detail, key, fix = emulated_bf16_detail(hw, f"stages[{i}]", probe_slowdown(hw))
        issue = ConfigIssue(key, f"{detail} [rule stages[{i}].health.emulated_bf16, policy {policy}]", fix)
        (errors if policy == "error" else warnings).append(issue)
    return errors, warnings


def _runs_on_cpu_here(stage: StageConfig) -> bool:
    use_gpu = stage.scaling.use_gpu
    return use_gpu is False or (use_gpu == "auto" and not torch.cuda.is_available())


def has_conv2d(model: nn.Module) -> bool:
    """The model runs 2-D convolutions (the stages channels_last can speed up)."""
    return any(isinstance(m, nn.Conv2d) for m in model.modules())


def choose_memory_format(stage: StageConfig, hw: Hardware, precision: str, model: nn.Module) -> tuple[str, str]:
    """(``channels_last`` | ``contiguous``, why) for a stage: its ``memory_format`` key, or the measured table."""
    if stage.memory_format != "auto":
        return stage.memory_format, "set explicitly"
    if not has_conv2d(model):
        return "contiguous", "no 2-D convolutions"
    key = (hw.kind, hw.capability if hw.kind == "cpu" else "any", precision)
    faster = CHANNELS_LAST_FASTER.get(key)
    if faster is None:
        return "contiguous", f"not measured for {hw.label} {precision}"
    return ("channels_last", "measured faster") if faster else ("contiguous", "channels_last measured slower")


@dataclass
class CompileState:
    """``stages[i].compile`` as it turned out: for the stage record."""

    enabled: bool
    status: str = "off"  # off | compiled | eager (fallback)
    message: str = ""
    compile_s: float | None = None  # seconds spent compiling (dynamo's own timer), filled in after the stage
    _base: float = 0.0

    def record(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "status": self.status, "compile_s": self.compile_s, "message": self.message}

    def finish(self) -> None:
        """Read the compile time spent since :func:`compile_stage` (torch._dynamo's counters)."""
        if self.status == "compiled":
            total = _dynamo_compile_seconds()
            self.compile_s = round(total - self._base, 2) if total is not None else None


def compile_stage(modules: list[nn.Module], path: str, device: torch.device, backend: str = "inductor") -> CompileState:
    """Compile `modules` in place (``nn.Module.compile``: names and weights unchanged) after checking
    that `backend` works on `device` with a tiny function; on failure leave them eager and say why."""
    state = CompileState(True)
    base = _dynamo_compile_seconds()
    started = time.perf_counter()
    try:
        probe = torch.compile(lambda t: t * 2 + 1, backend=backend)
        probe(torch.ones(4, device=device))
    except Exception as exc:  # noqa: BLE001 - any backend failure means: train eagerly, and say so
        reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        state.status = "eager"
        state.message = (
            f"{path}.compile: torch.compile backend {backend!r} is unavailable on {device.type} ({reason[:300]}); "
            f"training eagerly. Fix: install what the backend needs (inductor on CPU needs a C++ compiler, e.g. g++), "
            f"or set {path}.compile: false"
        )
        return state
    for module in modules:
        module.compile(backend=backend)
    state.status = "compiled"
    state._base = base if base is not None else 0.0
    if base is None:  # no dynamo timer in this torch: count the probe only, say so
        state.message = "compile time unavailable in this torch (no torch._dynamo compilation metrics)"
        state.compile_s = round(time.perf_counter() - started, 2)
    return state


def _dynamo_compile_seconds() -> float | None:
    """Total seconds dynamo spent compiling frames in this process (a private torch counter), or None."""
    try:
        from torch._dynamo.utils import compilation_time_metrics

        return float(sum(compilation_time_metrics.get("_compile.compile_inner", [])))
    except Exception:  # noqa: BLE001 - private API: may move between torch versions
        return None
