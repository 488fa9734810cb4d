"""Residual CNN backbone for small images (MNIST 28x28, digits 8x8) and ImageNet-style inputs.

Build one from a config with ``resnet(widths=[32, 64], blocks=[1, 1])``; it maps
``(B, in_channels, H, W)`` to a feature map ``(B, out_channels, H', W')``.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

import torch
from torch import nn

_BLOCKS = ("basic", "bottleneck")
_STEMS = ("small", "imagenet")
# Bottleneck blocks widen their output by this factor (He et al., 2016).
_BOTTLENECK_EXPANSION = 4


def _choice(kwarg: str, value: object, valid: Sequence[str]) -> str:
    if isinstance(value, str) and value in valid:
        return value
    close = difflib.get_close_matches(str(value), valid, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    raise ValueError(f"resnet: unknown {kwarg} {value!r}{hint} (valid: {', '.join(valid)})")


def _positive_int(kwarg: str, value: object) -> int:
    # bool is an int subclass, but `True` as a channel count is always a config mistake.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"resnet: {kwarg} must be a positive integer, got {value!r}")
    return value


def _int_list(kwarg: str, value: object) -> list[int]:
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"resnet: {kwarg} must be a non-empty list of positive integers, got {value!r}")
    return [_positive_int(f"{kwarg}[{i}]", v) for i, v in enumerate(value)]


def _conv_bn(in_ch: int, out_ch: int, kernel: int, stride: int = 1) -> list[nn.Module]:
    # No conv bias: the following BatchNorm's shift makes it redundant.
    conv = nn.Conv2d(in_ch, out_ch, kernel, stride=stride, padding=kernel // 2, bias=False)
    return [conv, nn.BatchNorm2d(out_ch)]


def _shortcut(in_ch: int, out_ch: int, stride: int) -> nn.Module:
    if stride == 1 and in_ch == out_ch:
        return nn.Identity()
    return nn.Sequential(*_conv_bn(in_ch, out_ch, 1, stride))


class ResidualBlock(nn.Module):
    """One residual block: ``relu(body(x) + shortcut(x))``.

    ``body`` is two 3x3 convs ("basic") or 1x1-3x3-1x1 ("bottleneck"), each followed by
    BatchNorm, with ReLU between them; the shortcut projects with a 1x1 conv + BN when the
    stride or channel count changes.
    """

    def __init__(self, in_ch: int, width: int, stride: int, kind: str) -> None:
        super().__init__()
        if kind == "basic":
            out_ch = width
            body = [*_conv_bn(in_ch, width, 3, stride), nn.ReLU(inplace=True), *_conv_bn(width, width, 3)]
        else:
            out_ch = width * _BOTTLENECK_EXPANSION
            # Stride on the 3x3 conv (ResNet v1.5): the 1x1 would otherwise skip 3/4 of the pixels.
            body = [
                *_conv_bn(in_ch, width, 1),
                nn.ReLU(inplace=True),
                *_conv_bn(width, width, 3, stride),
                nn.ReLU(inplace=True),
                *_conv_bn(width, out_ch, 1),
            ]
        self.body = nn.Sequential(*body)
        self.shortcut = _shortcut(in_ch, out_ch, stride)
        self.out_channels = out_ch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


class ResNet(nn.Module):
    """A stem followed by residual stages; see :func:`resnet`."""

    def __init__(
        self, in_channels: int, widths: list[int], blocks: list[int], block: str, stem: str, stem_channels: int
    ) -> None:
        super().__init__()
        self.in_width = in_channels
        if stem == "small":
            # Stride 1: a 28x28 or 8x8 image has no resolution to spare.
            self.stem = nn.Sequential(*_conv_bn(in_channels, stem_channels, 3), nn.ReLU(inplace=True))
        else:
            self.stem = nn.Sequential(
                *_conv_bn(in_channels, stem_channels, 7, stride=2),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
            )
        layers: list[nn.Module] = []
        ch = stem_channels
        for j, (width, count) in enumerate(zip(widths, blocks)):
            for i in range(count):
                stride = 2 if j > 0 and i == 0 else 1
                layers.append(ResidualBlock(ch, width, stride, block))
                ch = layers[-1].out_channels
        self.blocks = nn.Sequential(*layers)
        self.out_channels = ch
        self._init_weights()

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[1] != self.in_width:
            raise ValueError(
                f"resnet: expected input (B, {self.in_width}, H, W), got {tuple(x.shape)}; "
                f"set in_channels to the input's channel count"
            )
        return self.blocks(self.stem(x))

    def cascade_layers(self) -> list[nn.Module]:
        """Layers in forward order: the stem, then every residual block."""
        return [self.stem, *self.blocks]


def resnet(
    *,
    in_channels: int = 1,
    widths: Sequence[int] = (32, 64),
    blocks: Sequence[int] = (1, 1),
    block: str = "basic",
    stem: str = "small",
    stem_channels: int | None = None,
) -> nn.Module:
    """Build a residual CNN feature extractor.

    Args:
        in_channels: channels of the input image.
        widths: base width of each stage; stage ``j > 0`` halves the resolution in its
            first block.
        blocks: number of residual blocks per stage, same length as ``widths``.
        block: ``"basic"`` (two 3x3 convs) or ``"bottleneck"`` (1x1, 3x3, 1x1; output
            channels are 4x the stage width).
        stem: ``"small"`` (3x3 conv, stride 1, for 28x28 / 8x8 inputs) or ``"imagenet"``
            (7x7 conv stride 2 + 3x3 max-pool stride 2).
        stem_channels: stem output channels; defaults to ``widths[0]``.

    Returns:
        A module mapping ``(B, in_channels, H, W)`` to ``(B, out_channels, H', W')``, with
        attributes ``in_width`` (= ``in_channels``) and ``out_channels``.

    Raises:
        ValueError: an argument is out of range; the message names the argument.
    """
    in_channels = _positive_int("in_channels", in_channels)
    widths_l = _int_list("widths", widths)
    blocks_l = _int_list("blocks", blocks)
    if len(widths_l) != len(blocks_l):
        raise ValueError(
            f"resnet: widths and blocks must have the same length, got {len(widths_l)} and {len(blocks_l)}"
        )
    block = _choice("block", block, _BLOCKS)
    stem = _choice("stem", stem, _STEMS)
    stem_ch = widths_l[0] if stem_channels is None else _positive_int("stem_channels", stem_channels)
    return ResNet(in_channels, widths_l, blocks_l, block, stem, stem_ch)
