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


def digit_features(in_channels: int = 1, width: int = 16) -> nn.Module:
    """A small CNN feature extractor for 8x8 digits: (B, C, 8, 8) -> (B, 2 * width)."""
    return nn.Sequential(
        nn.Conv2d(in_channels, width, 3, padding=1),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1, stride=2),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
    )


class DigitNet(nn.Module):
    """A whole network as another package publishes it: state-dict keys ``features.*`` and ``classifier.*``."""

    def __init__(self, classes: int = 10, width: int = 16):
        super().__init__()
        self.features = digit_features(1, width)
        self.classifier = nn.Linear(2 * width, classes)

    def forward(self, x):
        return self.classifier(self.features(x))
