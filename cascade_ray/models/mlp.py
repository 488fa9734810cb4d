"""Multi-layer perceptron head, optionally pooling a feature map or token sequence first.

``mlp(in_features=64, hidden=[128, 10])`` maps ``(B, 64, H, W)``, ``(B, T, 64)`` or
``(B, 64)`` to ``(B, 10)``.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence

import torch
from torch import nn

from cascade_ray.models.dropout import Dropout

_ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "gelu": nn.GELU,
    "relu": nn.ReLU,
    "silu": nn.SiLU,
    "tanh": nn.Tanh,
}
_POOLS = ("mean", "flatten", "none")


def _choice(kwarg: str, value: object, valid: Sequence[str]) -> str:
    if isinstance(value, str) and value in valid:
        return value
    close = difflib.get_close_matches(str(value), valid, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    raise ValueError(f"mlp: unknown {kwarg} {value!r}{hint} (valid: {', '.join(valid)})")


def _positive_int(kwarg: str, value: object) -> int:
    # bool is an int subclass, but `True` as a width is always a config mistake.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"mlp: {kwarg} must be a positive integer, got {value!r}")
    return value


class MLP(nn.Module):
    """Pooling followed by ``Linear -> activation -> Dropout`` blocks; see :func:`mlp`."""

    def __init__(self, in_features: int, hidden: list[int], dropout: float, pool: str, activation: str) -> None:
        super().__init__()
        self.in_features = in_features
        # `in_width` is the channel width the shape preflight and adapters match against the
        # upstream output; a flattening MLP takes C*H*W, which no channel width equals, so it
        # has none (its own check in forward names the size to set)
        self.in_width = in_features if pool != "flatten" else None
        self.out_channels = hidden[-1]
        self.pool = pool
        widths = [in_features, *hidden]
        self.blocks = nn.Sequential(
            *(
                nn.Sequential(nn.Linear(a, b), _ACTIVATIONS[activation](), Dropout(dropout))
                for a, b in zip(widths[:-1], widths[1:])
            )
        )

    def _pooled(self, x: torch.Tensor) -> torch.Tensor:
        if self.pool == "flatten":
            return x.flatten(1)
        if self.pool == "none":
            return x
        if x.dim() == 4:
            return x.mean(dim=(2, 3))
        if x.dim() == 3:
            return x.mean(dim=1)
        if x.dim() == 2:
            return x
        raise ValueError(f"mlp: pool='mean' needs a 2-D, 3-D or 4-D input, got shape {tuple(x.shape)}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = tuple(x.shape)
        x = self._pooled(x)
        if x.dim() < 2 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"mlp: input of shape {shape} gives {tuple(x.shape)} after pool={self.pool!r}, "
                f"but in_features={self.in_features}; set in_features to {x.shape[-1] if x.dim() else 1}"
            )
        return self.blocks(x)

    def cascade_layers(self) -> list[nn.Module]:
        """Layers in forward order: one ``Linear + activation + Dropout`` group each."""
        return list(self.blocks)


def mlp(
    *,
    in_features: int,
    hidden: Sequence[int] = (128,),
    dropout: float = 0.0,
    pool: str = "mean",
    activation: str = "gelu",
) -> nn.Module:
    """Build an MLP head.

    Args:
        in_features: input width after pooling. With ``pool="flatten"`` this is the
            flattened size ``C*H*W`` (or ``T*D``), not the channel count, so it differs
            from :func:`~cascade_ray.models.registry.tensor_width` of the input.
        hidden: output width of each ``Linear`` block; the last one is the output width
            (e.g. the number of classes).
        dropout: dropout probability after each activation, in ``[0, 1)``.
        pool: ``"mean"`` averages a ``(B, C, H, W)`` map over H, W and a ``(B, T, D)``
            sequence over T (2-D input passes through); ``"flatten"`` flattens all but the
            batch dim; ``"none"`` applies the MLP to the last dim of any input.
        activation: one of ``gelu``, ``relu``, ``silu``, ``tanh``. It is applied after the
            last block too, so put a final size-``num_classes`` layer in a later stage or
            treat the output as features.

    Returns:
        A module mapping the input to ``(B, hidden[-1])`` (``(..., hidden[-1])`` for
        ``pool="none"``), with attributes ``in_width`` and ``out_channels``.

    Raises:
        ValueError: an argument is out of range; the message names the argument.
    """
    in_features = _positive_int("in_features", in_features)
    if not isinstance(hidden, (list, tuple)) or not hidden:
        raise ValueError(f"mlp: hidden must be a non-empty list of positive integers, got {hidden!r}")
    hidden_l = [_positive_int(f"hidden[{i}]", h) for i, h in enumerate(hidden)]
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"mlp: dropout must be in [0, 1), got {dropout!r}")
    pool = _choice("pool", pool, _POOLS)
    activation = _choice("activation", activation, tuple(_ACTIVATIONS))
    return MLP(in_features, hidden_l, float(dropout), pool, activation)
