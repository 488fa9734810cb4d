"""Dropout with a cheaper random mask on CPU.

On CPU, ``torch.nn.Dropout`` draws one random number per element (``bernoulli_``), and on
the small models of a cascade's downstream stages that draw is most of the step: a head
dropout over a flattened 49 x 128 map of a 128-sample batch costs more than the linear
layer after it. :class:`Dropout` draws 64 random bits per four elements instead and keeps
an element when its 15-bit lane is at or above ``round(p * 32768)``, so the drop
probability is ``p`` to within 1/65536. Kept elements are scaled by ``1 / (1 - p)`` as in
``nn.Dropout``. About 3x faster forward + backward on 2 cores
(``benchmarks/bench_dropout.py``).

Elsewhere (GPU tensors, ``inplace=True``, non-float input) it is ``nn.Dropout`` itself, and
in eval mode it is the identity, so exported and traced models are unchanged. It uses
torch's default generator: seeded runs repeat exactly, and the checkpointed RNG state
resumes the same mask sequence.

Inside :func:`shared_masks` (a batched sweep's batch, ``cascade_ray.stage.batched``), a mask
drawn from a generator state that an earlier draw of the block started from (same state, same
shape, ``p`` and dtype) is that draw's mask, and the generator is left where that draw left
it: exactly what drawing again would give. Replicas that share a seed then draw each batch's
masks once instead of once each.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

_LANE_BITS = 15  # of each int16 lane: the top bit is dropped (random_ leaves an int64's sign bit 0)
_LANE_VALUES = 1 << _LANE_BITS

# (generator state, shape, p, dtype) -> (scaled keep mask, generator state after the draw);
# None outside shared_masks(). One process trains the replicas one after another.
_SHARED: dict[tuple, tuple[torch.Tensor, torch.Tensor]] | None = None


@contextmanager
def shared_masks() -> Iterator[None]:
    """Within the block, a dropout draw that repeats an earlier one (same generator state, shape,
    ``p`` and dtype) reuses its mask and moves the generator to where that draw left it."""
    global _SHARED
    outer, _SHARED = _SHARED, {}
    try:
        yield
    finally:
        _SHARED = outer


def _mask(x: torch.Tensor, p: float) -> torch.Tensor:
    """A fresh keep mask for `x`, already scaled by 1/(1-p), in `x`'s dtype."""
    n = x.numel()
    words = torch.empty((n + 3) // 4, dtype=torch.int64).random_()
    lanes = words.view(torch.int16)[:n].view(x.shape)
    keep = (lanes & (_LANE_VALUES - 1)) >= int(round(p * _LANE_VALUES))
    # the same 0/1 bytes read as uint8: torch casts uint8 to a float dtype ~7x faster than bool
    # (a 0.8M-element mask on 2 cores: bool -> bf16 0.66 ms, uint8 -> bf16 0.09 ms; docs/benchmarks.md)
    return keep.view(torch.uint8).to(x.dtype).mul_(1.0 / (1.0 - p))


def keep_mask(x: torch.Tensor, p: float) -> torch.Tensor:
    """The scaled keep mask :func:`fast_dropout` multiplies `x` by (shape and dtype of `x`), drawn
    from torch's default generator, or inside :func:`shared_masks` the earlier draw it repeats."""
    if _SHARED is None:
        return _mask(x, p)
    key = (torch.get_rng_state().numpy().tobytes(), tuple(x.shape), p, x.dtype)
    hit = _SHARED.get(key)
    if hit is None:
        mask = _mask(x, p)
        _SHARED[key] = (mask, torch.get_rng_state())
    else:
        mask, after = hit
        torch.set_rng_state(after)
    return mask


def fast_dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """``x`` with each element zeroed with probability ``p`` (to 1/65536), the rest scaled by 1/(1-p)."""
    return x * keep_mask(x, p)


class Dropout(nn.Dropout):
    """``nn.Dropout`` with :func:`fast_dropout` for float CPU tensors in training mode."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.inplace or x.device.type != "cpu" or not x.is_floating_point() or self.p >= 1.0:
            return super().forward(x)
        return fast_dropout(x, self.p)


def use_fast_dropout(module: nn.Module) -> nn.Module:
    """Swap every plain ``nn.Dropout`` child of `module` (recursively) for :class:`Dropout`, in place."""
    for name, child in module.named_children():
        if type(child) is nn.Dropout:
            setattr(module, name, Dropout(child.p, child.inplace))
        else:
            use_fast_dropout(child)
    return module
