"""A user model reached as ``user_models:tiny_cnn`` (tests/support is on sys.path)."""

import torch
from torch import nn


def tiny_cnn(in_channels: int = 1, width: int = 8) -> nn.Module:
    """A two-layer CNN without cascade-ray's `in_width` convention (a foreign module)."""
    return nn.Sequential(nn.Conv2d(in_channels, width, 3, padding=1), nn.ReLU(), nn.Conv2d(width, width, 3, padding=1))


class _Drifting(nn.Module):
    """Counts its calls in a buffer even in eval mode: a module that breaks "frozen"."""

    def __init__(self, in_features: int, width: int):
        super().__init__()
        self.proj = nn.Linear(in_features, width)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return self.proj(x.flatten(1))


def drifting(in_features: int = 64, width: int = 16) -> nn.Module:
    """A stage module (flattening its input) whose state changes on every forward, frozen or not."""
    return _Drifting(in_features, width)
