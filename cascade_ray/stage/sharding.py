"""``scaling.strategy: fsdp``: the stage's trainable layers sharded with FSDP2 (``fully_shard``).

What is sharded: every trainable part of the freeze plan (adapter, each layer of
``cascade_layers()``, head) is its own FSDP unit, and the composed model is the root with
every frozen parameter ignored. Frozen upstream weights therefore stay plain tensors on every
rank: still read-only views of the object store's hand-off (``models.weights.share_numpy_state``),
still digested every epoch. The optimizer must be built after :func:`shard_trainable`, which
replaces the trainable Parameters with sharded DTensor ones.

Checkpoints and the stage artifact hold the full, unsharded state: gathered on every rank with
``torch.distributed.checkpoint.state_dict`` (a collective), kept on rank 0 (CPU offload), and
loaded back on every rank as full state dicts (each rank reads the checkpoint).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from cascade_ray.models.freeze import TrainablePlan
from cascade_ray.models.weights import SHARED_KEYS_ATTR, load_numpy_state
from cascade_ray.solver.step import is_dtensor

# torch.distributed's FSDP, DTensor and distributed-checkpoint modules are imported where a
# sharded stage uses them, not here: together they cost a fresh process ~0.8 s, and every stage
# worker imports this module. Nothing can be sharded before they are imported, so the checks
# below look them up in sys.modules instead of importing them.
_FSDP = "torch.distributed.fsdp"


def _options(**kw: bool) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kw)


def _gather() -> Any:
    return _options(full_state_dict=True, cpu_offload=True)  # rank 0 gets it, on the CPU


def shard_trainable(model: nn.Module, plan: TrainablePlan, device: torch.device, world: int) -> int:
    """Shard `model`'s trainable parts over `world` ranks, in place; return the number of units.

    Call on every rank, after the model is on `device` and before the optimizer is built.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    modules = dict(model.named_modules())
    units = [
        modules[name] for name in plan.trainable_modules if any(p.requires_grad for p in modules[name].parameters())
    ]
    for unit in units:
        fully_shard(unit, mesh=mesh)
    frozen = {p for p in model.parameters() if not p.requires_grad}
    fully_shard(model, mesh=mesh, ignored_params=frozen)
    return len(units)


def is_sharded(model: nn.Module) -> bool:
    """Whether `model` is an FSDP root (:func:`shard_trainable` ran)."""
    fsdp = sys.modules.get(_FSDP)
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded tensor; the tensor itself otherwise."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict, on rank 0 (other ranks: empty). A collective: call on every rank."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_gather())


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The full optimizer state keyed by parameter name, on rank 0 (others: empty). A collective."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=_gather())


def load_full_model_state(model: nn.Module, state: Mapping[str, np.ndarray]) -> None:
    """Load a full numpy state dict into a sharded model, on every rank.

    Frozen entries shared with the upstream hand-off are compared, never written (as
    :func:`~cascade_ray.models.weights.load_numpy_state`); the rest is scattered to the shards.
    """
    shared = getattr(model, SHARED_KEYS_ATTR, frozenset()) & set(state)
    load_numpy_state(model, {k: state[k] for k in shared}, strict=False)  # compares only
    tensors = {k: torch.from_numpy(np.array(v)) for k, v in state.items() if k not in shared}
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, tensors, options=_options(full_state_dict=True, strict=False))  # every rank: full state


def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load :func:`full_optimizer_state` output into the sharded optimizer, on every rank."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=_options(full_state_dict=True))


@contextlib.contextmanager
def unsharded(model: nn.Module) -> Iterator[None]:
    """Hold every FSDP unit unsharded (one all-gather each, on every rank) until the block ends.

    Evaluation runs inside: each rank's share of a split may have a different number of batches,
    and sharded forwards would all-gather per batch and wait for each other.
    """
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(True, recurse=False)
