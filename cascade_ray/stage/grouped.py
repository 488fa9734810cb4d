"""Grouped replica steps: a batched sweep's replicas of an MLP stage run as one batched GEMM per layer.

A batched sweep (:mod:`cascade_ray.stage.batched`) steps its replicas one after the other on
every shared batch. When the stage is the builtin ``mlp`` (``Linear -> activation -> Dropout``
blocks) under a linear :class:`~cascade_ray.models.cascade.Head`, and several replicas start the
batch from the same generator state (they share a seed, as a sweep over solver values does), their
forward and backward run together instead: the shared input pooled once, each layer one
``baddbmm`` over the replicas' stacked weights, the dropout masks drawn once (from the same
generator state, so each replica gets the mask it would draw alone) and broadcast over the group,
and the head's GEMM batched the same way. Each replica keeps its own parameters, optimizer,
loss (its own criterion and loss scale) and health checks; only the arithmetic is grouped. The
weights are stacked from the replicas' own parameters on every step, so autograd hands each
replica its own gradient.

What it changes: the batched GEMMs may sum in another order than a replica's lone ``addmm`` /
``mm``, so forward and gradients agree with the lone step to float rounding and a replica ends
*allclose* to its config trained alone (``tests/unit/test_batched_grouped.py``), not always
equal to the bit. ``benchmarks/bench_stacked.py`` measures the step and whole epochs against the replica loop;
groups of :data:`GROUP_SIZE` were fast on every CPU measured (docs/benchmarks.md). Larger
groups' activations outgrow the caches, and their tensors (tens of MB) are past glibc's mmap
threshold, so every step maps and unmaps them: on one Xeon that made groups of 8 slower than no
grouping at all.

Where it does not apply (any other model, an adapter, a head without a linear layer, forward
hooks, activation checkpointing, ``train.compile``, a loss over several heads or with learned
weighting, an fp16 loss scaler, a GPU, DDP, a replica alone in its generator state) the replica
steps alone, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from cascade_ray.models.cascade import Head
from cascade_ray.models.checkpointing import CHECKPOINTED_ATTR
from cascade_ray.models.dropout import Dropout, keep_mask
from cascade_ray.models.mlp import _ACTIVATIONS, MLP
from cascade_ray.stage.setup import StageSetup

GROUP_SIZE = 4  # replicas per grouped step (benchmarks/bench_stacked.py; docs/benchmarks.md, "Batched sweeps")

_ACTIVATION_TYPES = tuple(type(make()) for make in _ACTIVATIONS.values())


class Replica(Protocol):
    """What a grouped step reads and writes of a batched sweep's replica (:class:`.batched.Replica`)."""

    setup: StageSetup
    net: nn.Module
    rng: torch.Tensor
    error: str | None


@dataclass(frozen=True)
class _Layers:
    """One replica's stage, as the grouped step runs it."""

    mlp: MLP
    linears: list[nn.Linear]  # the MLP's, then the head's
    activations: list[nn.Module]
    drops: list[float]  # each MLP block's dropout p, then the head's
    head_pool: str
    key: tuple  # what must agree for replicas to share a grouped step


def grouped_layers(replica: Replica) -> _Layers | None:
    """The replica's layers when its step can be grouped, else None (it steps alone)."""
    s = replica.setup
    name = s.stage.name
    model = s.model
    if s.device.type != "cpu" or replica.net is not model or s.compiled is not None:
        return None
    if list(s.scales) != [name] or s.log_vars is not None or s.precision.scaler is not None:
        return None
    mlp, head = model.blocks[name], model.heads[name]
    if type(mlp) is not MLP or type(head) is not Head or name in model.adapters:
        return None
    if any(m._forward_hooks or m._forward_pre_hooks for m in (model, mlp, head, *mlp.modules(), *head.modules())):
        return None
    linears, activations, drops = [], [], []
    for block in mlp.blocks:
        linear, act, drop = block
        if getattr(block, CHECKPOINTED_ATTR, False) or type(act) not in _ACTIVATION_TYPES:
            return None
        if type(drop) is not Dropout or drop.inplace or linear.bias is None:
            return None
        linears.append(linear)
        activations.append(act)
        drops.append(drop.p)
    if type(head.dropout) is not Dropout or head.dropout.inplace or head.fc.bias is None:
        return None
    linears.append(head.fc)
    drops.append(head.dropout.p)
    trainable = {id(p) for _, p in s.named_params}
    if trainable != {id(p) for lin in linears for p in (lin.weight, lin.bias)}:
        return None  # something else trains too (an unfrozen upstream, learned loss weights)
    key = (
        mlp.pool,
        head.pool,
        tuple(tuple(lin.weight.shape) for lin in linears),
        tuple(type(a) for a in activations),
        tuple(drops),
        s.precision.dtype,
    )
    return _Layers(mlp, linears, activations, drops, head.pool, key)


class GroupedSteps:
    """Which of a sweep's replicas step together, and their grouped forward and backward."""

    def __init__(self, replicas: Sequence[Replica], group_size: int = GROUP_SIZE) -> None:
        self.group_size = group_size
        self.layers = {id(r): grouped_layers(r) for r in replicas} if group_size > 1 else {}

    def groups(self, live: Sequence[Replica]) -> list[list[Replica]]:
        """Runs of consecutive live replicas (no error) with the same layers' key and generator state,
        at most ``group_size`` each; only groups of two or more."""
        out: list[list[Replica]] = []
        current: list[Replica] = []
        for r in live:
            layers = self.layers.get(id(r))
            if r.error is not None or layers is None:
                continue
            if current and (
                len(current) == self.group_size
                or layers.key != self.layers[id(current[0])].key
                or not torch.equal(r.rng, current[0].rng)
            ):
                out.append(current)
                current = []
            current.append(r)
        out.append(current)
        return [g for g in out if len(g) > 1]

    def forward_backward(
        self, group: list[Replica], x: torch.Tensor, y: torch.Tensor, window: int, sums: dict[int, torch.Tensor]
    ) -> None:
        """The group's forward and backward of one micro-batch: each replica's gradients accumulate
        into its own parameters' ``.grad``, its loss into ``sums``, and its generator moves on as one
        lone forward would move it."""
        first = self.layers[id(group[0])]
        layers = [self.layers[id(r)] for r in group]
        s0 = group[0].setup
        k = len(group)
        outer = torch.get_rng_state()
        torch.set_rng_state(group[0].rng)
        try:
            with s0.precision.autocast():
                h = first.mlp._pooled(x)  # the shared input, pooled once
                lead = h.shape[:-1]  # one replica's batch dims: (B,) or (B, T)
                h = h.reshape(1, -1, h.shape[-1]).expand(k, -1, -1)  # (K, rows, C), not copied
                for i, act in enumerate(first.activations):
                    weight, bias = _stacked(layers, i)
                    h = act(torch.baddbmm(bias.unsqueeze(1), h, weight.transpose(1, 2)))
                    if first.drops[i] > 0.0:
                        mask = keep_mask(h[0].view(*lead, h.shape[-1]), first.drops[i])
                        h = h * mask.view(1, -1, h.shape[-1])
                per = h.view(k, *lead, h.shape[-1])  # each replica's block output
                # the head's pool (models.cascade.pool) on each replica's (B, ...) slice
                if first.head_pool == "flatten" or per.dim() == 3:
                    flat = per.flatten(2)
                else:  # a replica's (B, T, D) is averaged over T, its (B, C, H, W) over H and W
                    flat = per.mean(dim=2) if per.dim() == 4 else per.mean(dim=(3, 4))
                if first.drops[-1] > 0.0:
                    flat = flat * keep_mask(flat[0], first.drops[-1])
                weight, bias = _stacked(layers, -1)
                out = torch.baddbmm(bias.unsqueeze(1), flat, weight.transpose(1, 2))  # (K, B, classes)
                total = None
                for j, r in enumerate(group):
                    s = r.setup
                    # stage_loss of one head: scale * criterion(logits.float(), y)
                    loss = s.scales[s.stage.name] * s.criterion(out[j].float(), y)
                    sums[id(r)] += loss.detach().float() * len(y)
                    part = loss / window
                    total = part if total is None else total + part
            assert total is not None
            total.backward()
            after = torch.get_rng_state()
            for r in group:
                r.rng = after
        finally:
            torch.set_rng_state(outer)


def _stacked(layers: list[_Layers], i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `i`'s weights and biases of every replica, stacked (autograd routes each slice's
    gradient back to that replica's own parameter)."""
    return (
        torch.stack([lay.linears[i].weight for lay in layers]),
        torch.stack([lay.linears[i].bias for lay in layers]),
    )
