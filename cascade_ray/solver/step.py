"""What surrounds one optimizer step: autocast, fp16 loss scaling, clipping, skip detection.

``auto`` is resolved on the stage's device (:mod:`cascade_ray.solver.precision`). fp16 needs
CUDA (a config error otherwise, suggesting bf16); bf16 runs under ``torch.autocast`` on CPU
and on Ampere+ GPUs without a scaler. Under fp16 a step whose
gradients overflowed is skipped by the GradScaler; :meth:`Precision.step` reports it so
the loop does not advance the lr schedule for it.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from cascade_ray.config.schema import GradClipConfig, ScalerConfig, SolverConfig, StageConfig
from cascade_ray.errors import ConfigError, ConfigIssue
from cascade_ray.hardware import Hardware, detect_hardware
from cascade_ray.solver.precision import PrecisionChoice, resolve_precision

_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# A factory for the fp16 scaler (tests pass a CPU GradScaler to simulate fp16 without a GPU).
ScalerFactory = Callable[[ScalerConfig], Any]


@dataclass
class Precision:
    """Autocast and (fp16) loss scaling for one stage.

    Attributes:
        name: ``fp32``, ``bf16`` or ``fp16``.
        device_type: the autocast device type (``cpu``, ``cuda``).
        dtype: the autocast dtype, None for fp32.
        scaler: a ``torch.amp.GradScaler`` under fp16, else None.
        choice: how ``solver.precision`` was resolved on this device (None when built directly).
    """

    name: str
    device_type: str
    dtype: torch.dtype | None
    scaler: Any | None = None
    choice: PrecisionChoice | None = None
    last_scale: float = math.nan  # the fp16 scale after the last step (read once per step, in step())

    def autocast(self) -> AbstractContextManager[Any]:
        """The context to run forward and loss under."""
        return torch.autocast(self.device_type, dtype=self.dtype) if self.dtype is not None else nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of the (scaled, under fp16) loss."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring fp16 gradients back to true scale, so norms and clipping see real numbers."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Take the optimizer step; True when the fp16 scaler skipped it (inf/NaN gradients)."""
        if self.scaler is None:
            optimizer.step()
            return False
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        self.last_scale = float(self.scaler.get_scale())
        return self.last_scale < before  # the scale only shrinks after an overflow

    @property
    def scale(self) -> float | None:
        """The fp16 loss scale now (None without a scaler)."""
        return float(self.scaler.get_scale()) if self.scaler is not None else None


def precision_issues(stage: StageConfig, path: str) -> list[ConfigIssue]:
    """fp16 on a stage that runs without a GPU (``use_gpu: auto`` is checked where the device is known)."""
    if stage.solver.precision == "fp16" and stage.scaling.use_gpu is False:
        return [
            ConfigIssue(
                f"{path}.precision",
                "fp16 needs a CUDA GPU, but scaling.use_gpu is false",
                f"set {path}.precision: bf16 (runs on CPU, no loss scaler needed), or scaling.use_gpu: true",
            )
        ]
    return []


def build_precision(
    solver: SolverConfig,
    device: torch.device,
    path: str,
    make_scaler: ScalerFactory | None = None,
    hardware: Hardware | None = None,
    sharded: bool = False,
) -> Precision:
    """The :class:`Precision` of a solver section on `device`.

    Args:
        solver: the validated solver section.
        device: where the stage trains.
        path: the solver's key path, for errors.
        make_scaler: stands in for the CUDA GradScaler under fp16 (simulations and tests);
            when given, fp16 is allowed off CUDA.
        hardware: what `device` runs natively (``precision: auto``); default detected
            (:func:`cascade_ray.hardware.detect_hardware`); tests inject one.
        sharded: the stage runs ``scaling.strategy: fsdp`` (``auto`` then never resolves to fp16).

    Raises:
        ConfigError: fp16 off CUDA, or bf16 on a GPU without bf16 support.
    """
    hw = hardware if hardware is not None else detect_hardware(device)
    choice = resolve_precision(solver.precision, hw, sharded)
    name = choice.resolved
    if name == "fp16":
        if make_scaler is None and device.type != "cuda":
            raise ConfigError(
                [
                    ConfigIssue(
                        f"{path}.precision",
                        f"fp16 needs a CUDA device; this stage runs on {device.type}",
                        f"set {path}.precision: bf16 (runs on CPU, no loss scaler needed)",
                    )
                ]
            )
        cfg = solver.scaler or ScalerConfig()
        scaler = (
            make_scaler(cfg)
            if make_scaler is not None
            else torch.amp.GradScaler("cuda", init_scale=cfg.init_scale, growth_interval=cfg.growth_interval)
        )
        return Precision(name, device.type, torch.float16, scaler, choice)
    if name == "bf16" and device.type == "cuda" and hardware is None and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            [
                ConfigIssue(
                    f"{path}.precision",
                    f"bf16 is not supported by {torch.cuda.get_device_name(device)}",
                    f"set {path}.precision: fp16 (with a loss scaler) or fp32",
                )
            ]
        )
    return Precision(name, device.type, _DTYPES[name], choice=choice)


def clip_gradients(params: Sequence[torch.nn.Parameter], clip: GradClipConfig) -> torch.Tensor | None:
    """Clip in place; return the pre-clip global norm in norm mode (None otherwise).

    The norm is over every trainable parameter at once (one vector), not per parameter.
    """
    if not clip.enabled:
        return None
    if clip.mode == "norm":
        return _whole(torch.nn.utils.clip_grad_norm_(params, clip.max_norm, clip.norm_type))
    assert clip.clip_value is not None  # validated by clip_issues
    torch.nn.utils.clip_grad_value_(params, clip.clip_value)
    return None


def grad_norm(params: Sequence[torch.nn.Parameter], norm_type: float = 2.0) -> torch.Tensor:
    """Global gradient norm of `params` (parameters without a gradient count as zero)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), device=params[0].device if params else None)
    if hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6: one foreach kernel
        return _whole(torch.nn.utils.get_total_norm(grads, norm_type))
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, norm_type) for g in grads]), norm_type)


def is_dtensor(tensor: object) -> bool:
    """Whether `tensor` is a DTensor (an FSDP shard), without importing ``torch.distributed.tensor``
    (~0.8 s in a fresh process): no DTensor exists until something (FSDP) has imported it."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def _whole(norm: torch.Tensor) -> torch.Tensor:
    """A norm over sharded (FSDP) gradients as a plain tensor: summed over the shards (a collective,
    reached by every rank at the same step) instead of a DTensor."""
    return norm.full_tensor() if is_dtensor(norm) else norm
