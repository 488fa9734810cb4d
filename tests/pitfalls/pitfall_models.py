"""Stage modules with the bugs of the seed's field reports (reached as ``pitfall_models:<name>``)."""

from __future__ import annotations

import torch
from torch import nn


class _CutOff(nn.Module):
    """A CNN whose first conv is detached from the loss: its weights never get a gradient."""

    def __init__(self, in_channels: int, width: int):
        super().__init__()
        self.in_width = in_channels
        self.stem = nn.Conv2d(in_channels, width, 3, padding=1)
        self.body = nn.Conv2d(width, width, 3, padding=1)

    def forward(self, x):
        h = torch.relu(self.stem(x)).detach()  # the bug: a .detach() left in from debugging
        return torch.relu(self.body(h))


def cut_off(in_channels: int = 1, width: int = 8) -> nn.Module:
    """A stage module with a part cut off from the loss."""
    return _CutOff(in_channels, width)


class _NanAfter(nn.Module):
    """A CNN whose output turns NaN after `after` training forwards (a bad input, a log(0), ...)."""

    def __init__(self, in_channels: int, width: int, after: int):
        super().__init__()
        self.in_width = in_channels
        self.conv = nn.Conv2d(in_channels, width, 3, padding=1)
        self.after, self.calls = after, 0

    def forward(self, x):
        out = torch.relu(self.conv(x))
        if self.training:
            self.calls += 1
            if self.calls > self.after:
                out = out * float("nan")
        return out


def nan_after(in_channels: int = 1, width: int = 8, after: int = 5) -> nn.Module:
    """A stage module that injects NaN into the loss after `after` training steps."""
    return _NanAfter(in_channels, width, after)
