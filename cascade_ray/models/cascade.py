"""The composed cascade: stage modules chained in order, each with its own head.

State-dict keys are ``blocks.<stage>.*`` (stage modules), ``adapters.<stage>.*`` and
``heads.<stage>.*``, so every stage's weights can be found, frozen and digested by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from cascade_ray.config.schema import AdapterConfig, HeadConfig, PipelineConfig
from cascade_ray.models.dropout import Dropout
from cascade_ray.models.registry import build_module, module_in_width, tensor_width


@dataclass(frozen=True)
class StagePlan:
    """Shapes of one module stage, per sample (no batch dimension)."""

    name: str
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    adapter_width: int | None  # output width of the adapter, None when there is none


class Adapter(nn.Module):
    """Learned projection of the width dimension (1x1 conv on maps, Linear otherwise)."""

    def __init__(self, in_width: int, out_width: int, rank: int):
        super().__init__()
        self.proj = nn.Conv2d(in_width, out_width, 1) if rank == 4 else nn.Linear(in_width, out_width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class Head(nn.Module):
    """Pool a stage output to one vector per sample and map it to class logits."""

    def __init__(self, cfg: HeadConfig, in_shape: Sequence[int], num_classes: int):
        super().__init__()
        self.pool = cfg.pool
        flat = int(torch.Size(in_shape).numel()) if cfg.pool == "flatten" else in_shape[0 if len(in_shape) == 3 else -1]
        self.dropout = Dropout(cfg.dropout)
        self.fc = nn.Linear(flat, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.dropout(pool(x, self.pool)))


def pool(x: torch.Tensor, how: str) -> torch.Tensor:
    """Reduce a (B, C, H, W), (B, T, D) or (B, D) tensor to (B, features)."""
    if how == "flatten" or x.dim() == 2:
        return x.flatten(1)
    return x.mean(dim=(2, 3)) if x.dim() == 4 else x.mean(dim=1)


def build_head(cfg: HeadConfig, in_shape: Sequence[int], num_classes: int) -> nn.Module:
    """The head a stage config asks for (identity when ``type: none``)."""
    return nn.Identity() if cfg.type == "none" else Head(cfg, in_shape, num_classes)


def build_adapter(cfg: AdapterConfig | None, in_shape: Sequence[int], width: int | None) -> nn.Module | None:
    """The adapter for a stage, or None when it has none or the widths already agree."""
    if cfg is None or width is None:
        return None
    return Adapter(tensor_width((0, *in_shape)), width, len(in_shape) + 1)


class CascadeModel(nn.Module):
    """Stage modules applied in order; any subset of stage heads can be read out."""

    def __init__(
        self,
        order: Sequence[str],
        blocks: dict[str, nn.Module],
        adapters: dict[str, nn.Module],
        heads: dict[str, nn.Module],
    ):
        super().__init__()
        self.order = list(order)
        self.blocks = nn.ModuleDict(blocks)
        self.adapters = nn.ModuleDict(adapters)
        self.heads = nn.ModuleDict(heads)
        # Frozen submodules stay in eval mode whatever .train() is called with, so
        # BatchNorm running statistics and dropout of frozen stages never move.
        self._frozen: list[nn.Module] = []
        # Stage whose adapter/module the inputs of forward() feed: None for raw inputs, or the
        # stage trained on cached upstream features (cascade_ray.pipeline.features).
        self.input_stage: str | None = None

    def set_frozen_modules(self, modules: Sequence[nn.Module]) -> None:
        """Pin these submodules to eval mode (re-applied on every ``train()`` call)."""
        self._frozen = list(modules)
        self.train(self.training)

    def train(self, mode: bool = True) -> CascadeModel:
        super().train(mode)
        for module in self._frozen:
            module.eval()
        return self

    def forward(self, x: torch.Tensor, heads: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """Run the chain up to the last requested stage; return ``{stage: logits}``.

        Args:
            x: a batch of inputs for the first stage.
            heads: the stages whose head outputs to return; default the last stage.
        """
        wanted = list(heads) if heads is not None else [self.order[-1]]
        last = max(self.order.index(name) for name in wanted)
        first = self.order.index(self.input_stage) if self.input_stage is not None else 0
        if min(self.order.index(name) for name in wanted) < first:
            raise ValueError(
                f"heads {wanted} include a stage before {self.input_stage!r}, whose inputs are cached features"
            )
        out: dict[str, torch.Tensor] = {}
        for name in self.order[first : last + 1]:
            x = self.run_block(name, x)
            if name in wanted:
                out[name] = self.heads[name](x)
        return out

    def run_block(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """Stage `name`'s adapter (if any) and module on `x`, without its head."""
        if name in self.adapters:
            x = self.adapters[name](x)
        return self.blocks[name](x)


def module_stage_names(cfg: PipelineConfig, upto: int) -> list[str]:
    """Names of the module stages among ``stages[0..upto]`` (joint stages add no module)."""
    return [s.name for s in cfg.stages[: upto + 1] if s.type == "module"]


def build_cascade(cfg: PipelineConfig, plans: Sequence[StagePlan], num_classes: int, upto: int) -> CascadeModel:
    """Build the composed model of ``stages[0..upto]`` on the current default device.

    Args:
        cfg: the validated pipeline config.
        plans: shapes from :func:`cascade_ray.models.plan.plan_chain`.
        num_classes: classes of the data set (head output size).
        upto: index of the last stage to include.
    """
    by_name = {p.name: p for p in plans}
    blocks, adapters, heads = {}, {}, {}
    names = module_stage_names(cfg, upto)
    for name in names:
        stage = cfg.stages[cfg.stage_index(name)]
        plan = by_name[name]
        assert stage.model is not None  # validated: module stages have a model
        blocks[name] = build_module(stage.model.type, stage.model.kwargs(), cfg.trusted_modules)
        adapter = build_adapter(stage.adapter, plan.in_shape, plan.adapter_width)
        if adapter is not None:
            adapters[name] = adapter
        heads[name] = build_head(stage.head, plan.out_shape, num_classes)
    return CascadeModel(names, blocks, adapters, heads)


__all__ = [
    "Adapter",
    "CascadeModel",
    "Head",
    "StagePlan",
    "build_cascade",
    "build_head",
    "module_in_width",
    "module_stage_names",
    "pool",
]
