"""Activation checkpointing per block (``stages[i].train.activation_checkpointing``).

Each block a module lists in ``cascade_layers()`` runs under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: its activations are dropped
after the forward and recomputed in the backward pass. The block's ``forward`` is replaced on
the instance, so parameter names, state-dict keys, freeze plans and FSDP's per-layer hooks
(which run around ``forward``, outside the checkpoint) are all unchanged.

The recompute would run every BatchNorm a second time in training mode and move its running
statistics twice; the recompute therefore restores the block's BatchNorm buffers to what the
real forward left, so the statistics are bit-identical to a run without checkpointing.
Dropout masks are the same in both passes (the checkpoint replays the RNG state).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

CHECKPOINTED_ATTR = "_cascade_checkpointed"  # set on a block whose forward is checkpointed


def block_list(module: nn.Module) -> list[nn.Module] | None:
    """The module's blocks from its ``cascade_layers()``, or None when it defines none."""
    layers = getattr(module, "cascade_layers", None)
    return list(layers()) if callable(layers) else None


def checkpoint_blocks(module: nn.Module) -> int:
    """Checkpoint the activations of every block of `module`, in place; return how many blocks.

    Raises:
        ValueError: the module has no ``cascade_layers()`` (validation reports this before Ray).
    """
    blocks = block_list(module)
    if blocks is None:
        raise ValueError(f"{type(module).__name__} defines no cascade_layers(): no blocks to checkpoint")
    for block in blocks:
        if not getattr(block, CHECKPOINTED_ATTR, False):
            block.forward = _checkpointed(block, block.forward)
            setattr(block, CHECKPOINTED_ATTR, True)
    return len(blocks)


def _checkpointed(block: nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing to save, nothing to recompute
            return forward(*args, **kwargs)
        # only BatchNorms in training mode move their statistics (frozen ones are pinned to eval and
        # may be read-only views of the upstream hand-off: never written)
        norms = [m for m in block.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training]
        return checkpoint(
            forward,
            *args,
            use_reentrant=False,
            context_fn=lambda: (contextlib.nullcontext(), _statistics_kept(norms)),
            **kwargs,
        )

    return run


@contextlib.contextmanager
def _statistics_kept(norms: list[nn.Module]) -> Iterator[None]:
    """Around the recompute: the BatchNorm buffers come out as they went in."""
    saved = [{k: b.clone() for k, b in m.named_buffers(recurse=False) if b is not None} for m in norms]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, buffers in zip(norms, saved):
                for k, value in buffers.items():
                    getattr(m, k).copy_(value)
