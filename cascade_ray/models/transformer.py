"""Pre-norm Transformer encoder over tokens or over the pixels of a feature map.

``transformer(in_channels=64)`` maps ``(B, 64, H, W)`` (each pixel one token) or
``(B, T, 64)`` to ``(B, T, d_model)``, so it chains after :func:`resnet`.
"""

from __future__ import annotations

import torch
from torch import nn

from cascade_ray.models.dropout import use_fast_dropout


def _check(kwarg: str, value: object, *, minimum: int = 1) -> int:
    # bool is an int subclass, but `True` as a width is always a config mistake.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"transformer: {kwarg} must be an integer >= {minimum}, got {value!r}")
    return value


class TokenEmbed(nn.Module):
    """Project each token to ``d_model`` and add a learned position embedding."""

    def __init__(self, in_channels: int, d_model: int, max_tokens: int) -> None:
        super().__init__()
        self.in_channels = in_channels
        self.max_tokens = max_tokens
        self.proj = nn.Linear(in_channels, d_model)
        self.pos = nn.Parameter(torch.empty(max_tokens, d_model))
        # Small init (as in GPT-2/ViT) so positions start as a perturbation, not the signal.
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 4:
            x = x.flatten(2).transpose(1, 2)  # (B, C, H, W) -> (B, H*W, C)
        elif x.dim() != 3:
            raise ValueError(f"transformer: expected (B, C, H, W) or (B, T, C) input, got shape {tuple(x.shape)}")
        tokens, width = x.shape[1], x.shape[2]
        if width != self.in_channels:
            raise ValueError(
                f"transformer: input has {width} channels per token but in_channels={self.in_channels} "
                f"(input shape after tokenizing: {tuple(x.shape)})"
            )
        if tokens > self.max_tokens:
            raise ValueError(
                f"transformer: input has {tokens} tokens but max_tokens={self.max_tokens}; "
                f"raise max_tokens to at least {tokens} or downsample the input"
            )
        return self.proj(x) + self.pos[:tokens]


class Transformer(nn.Module):
    """Token embedding, ``depth`` pre-norm encoder layers, final LayerNorm; see :func:`transformer`."""

    def __init__(
        self,
        in_channels: int,
        d_model: int,
        depth: int,
        heads: int,
        mlp_ratio: float,
        dropout: float,
        max_tokens: int,
    ) -> None:
        super().__init__()
        self.in_width = in_channels
        self.out_channels = d_model
        self.embed = TokenEmbed(in_channels, d_model, max_tokens)
        # A plain ModuleList instead of nn.TransformerEncoder: each layer must be its own
        # cascade layer, and it sidesteps the encoder's nested-tensor conversion.
        # Their nn.Dropout modules become the cheaper CPU Dropout (models/dropout.py); the
        # attention-weight dropout inside MultiheadAttention stays torch's own.
        self.layers = nn.ModuleList(
            use_fast_dropout(
                nn.TransformerEncoderLayer(
                    d_model,
                    heads,
                    dim_feedforward=int(d_model * mlp_ratio),
                    dropout=dropout,
                    activation="gelu",
                    batch_first=True,
                    norm_first=True,
                )
            )
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)

    def cascade_layers(self) -> list[nn.Module]:
        """Layers in forward order: embedding, each encoder layer, final norm."""
        return [self.embed, *self.layers, self.norm]


def transformer(
    *,
    in_channels: int,
    d_model: int = 64,
    depth: int = 2,
    heads: int = 4,
    mlp_ratio: float = 2.0,
    dropout: float = 0.0,
    max_tokens: int = 256,
) -> nn.Module:
    """Build a pre-norm Transformer encoder.

    Args:
        in_channels: width of each input token (channels of a feature map, or the last
            dim of a ``(B, T, C)`` input).
        d_model: model width; must be divisible by ``heads``.
        depth: number of encoder layers.
        heads: attention heads per layer.
        mlp_ratio: feed-forward width as a multiple of ``d_model``.
        dropout: dropout probability inside each encoder layer, in ``[0, 1)``.
        max_tokens: size of the learned position table; longer inputs are rejected at
            forward time (a 28x28 map is 784 tokens, a 14x14 map is 196).

    Returns:
        A module mapping ``(B, C, H, W)`` or ``(B, T, C)`` to ``(B, T, d_model)`` with
        ``T = H * W`` for feature maps, and attributes ``in_width`` and ``out_channels``.

    Raises:
        ValueError: an argument is out of range; the message names the argument.
    """
    in_channels = _check("in_channels", in_channels)
    d_model = _check("d_model", d_model)
    depth = _check("depth", depth)
    heads = _check("heads", heads)
    max_tokens = _check("max_tokens", max_tokens)
    if d_model % heads != 0:
        raise ValueError(f"transformer: d_model ({d_model}) must be divisible by heads ({heads})")
    if isinstance(mlp_ratio, bool) or not isinstance(mlp_ratio, (int, float)) or int(d_model * mlp_ratio) < 1:
        raise ValueError(f"transformer: mlp_ratio must be a number with d_model * mlp_ratio >= 1, got {mlp_ratio!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"transformer: dropout must be in [0, 1), got {dropout!r}")
    return Transformer(in_channels, d_model, depth, heads, float(mlp_ratio), float(dropout), max_tokens)
