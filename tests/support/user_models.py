"""A user model reached as ``user_models:tiny_cnn`` (tests/support is on sys.path)."""

import os

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


class _FaultProbe(nn.Module):
    """A small linear stage that lets a test fault it at one training step (see :func:`fault_probe`)."""

    def __init__(self, in_features: int, width: int, kill_flag: str, pause_flag: str, step: int):
        super().__init__()
        self.proj = nn.Linear(in_features, width)
        self.kill_flag, self.pause_flag, self.step = kill_flag, pause_flag, step
        self.calls = 0  # training forwards in this process (a plain attribute: not in the weights)

    def forward(self, x):
        if self.training and torch.is_grad_enabled() and x.device.type != "meta":
            self.calls += 1
            if self.calls == self.step:
                _fault(self.kill_flag, self.pause_flag)
        return torch.relu(self.proj(x.flatten(1)))


def _fault(kill_flag: str, pause_flag: str) -> None:
    import os
    import signal
    import time
    from pathlib import Path

    kill, pause = Path(kill_flag), Path(pause_flag)
    if kill.exists():  # the kernel's OOM killer sends SIGKILL: no exception, no cleanup
        kill.unlink()
        os.kill(os.getpid(), signal.SIGKILL)
    if pause.exists():  # hold still until the test has done its fault (or 60 s), then go on
        pause.unlink()
        go = Path(f"{pause_flag}.go")
        Path(f"{pause_flag}.pid").write_text(str(os.getpid()))
        deadline = time.monotonic() + 60
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.05)


def fault_probe(in_features: int, width: int, kill_flag: str, pause_flag: str, step: int = 5) -> nn.Module:
    """A stage whose process, at training step `step`, SIGKILLs itself if `kill_flag` exists, or, if
    `pause_flag` exists, writes its pid to ``<pause_flag>.pid`` and waits for ``<pause_flag>.go``.
    Each flag is removed when it fires: a restarted worker runs through. Without flags it is a
    plain linear layer, so the same config trains the reference run."""
    return _FaultProbe(in_features, width, kill_flag, pause_flag, step)


class _BlockCNN(nn.Module):
    """A user CNN that lists its blocks (``cascade_layers``), with BatchNorm and dropout inside them."""

    def __init__(self, in_channels: int, width: int):
        super().__init__()
        self.first = nn.Sequential(nn.Conv2d(in_channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU())
        self.second = nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.Dropout(0.3), nn.ReLU())

    def forward(self, x):
        return self.second(self.first(x))

    def cascade_layers(self):
        return [self.first, self.second]


def block_cnn(in_channels: int = 1, width: int = 8) -> nn.Module:
    """(B, C, H, W) -> (B, width, H, W) in two listed blocks."""
    return _BlockCNN(in_channels, width)


class _Counted(nn.Module):
    """A 1x1 convolution that appends the id of the process building it to `log`: which processes built it."""

    def __init__(self, in_channels: int, width: int, log: str):
        super().__init__()
        self.in_width = in_channels
        self.proj = nn.Conv2d(in_channels, width, 1)
        with open(log, "a") as out:
            out.write(f"{os.getpid()}\n")

    def forward(self, x):
        return self.proj(x)


def counted(in_channels: int = 16, width: int = 16, log: str = os.devnull) -> nn.Module:
    """A stage module on (B, C, H, W) maps whose every build is listed in `log` (one pid per line)."""
    return _Counted(in_channels, width, log)


class _RaisesInTraining(nn.Module):
    """A 1x1 convolution (or a linear layer on the last dim) whose forward raises a plain ValueError once it
    trains (a bug in a user's module)."""

    def __init__(self, in_channels: int, width: int, layer: str):
        super().__init__()
        self.in_width = in_channels
        self.proj = nn.Conv2d(in_channels, width, 1) if layer == "conv" else nn.Linear(in_channels, width)

    def forward(self, x):
        if self.training and x.device.type != "meta":  # the shape check (on meta) passes
            raise ValueError(f"user module bug: cannot take a batch of {x.shape[0]}")
        return self.proj(x)


def raises_in_training(in_channels: int = 16, width: int = 16, layer: str = "conv") -> nn.Module:
    """A stage module on (B, C, H, W) maps (`layer: linear`: on (B, ..., D)) that plans and validates, then
    raises in its first training step."""
    return _RaisesInTraining(in_channels, width, layer)


class _ShapedOutput(nn.Module):
    """A 1x1 convolution whose output is made wrong on purpose: a tuple, (B,) or a 5-D tensor."""

    def __init__(self, in_channels: int, width: int, kind: str):
        super().__init__()
        self.in_width, self.kind = in_channels, kind
        self.proj = nn.Conv2d(in_channels, width, 1)

    def forward(self, x):
        y = self.proj(x)
        if self.kind == "tuple":
            return y, y.mean()
        return y.mean(dim=(1, 2, 3)) if self.kind == "scalar" else y.unsqueeze(1)


def shaped_output(in_channels: int = 1, width: int = 8, kind: str = "tuple") -> nn.Module:
    """A first-stage module on (B, C, H, W) whose output is of the wrong kind (`kind`: tuple | scalar | 5d)."""
    return _ShapedOutput(in_channels, width, kind)


class _Gated(nn.Module):
    """A 1x1 convolution with data-dependent control flow: ordinary PyTorch that meta tensors cannot run."""

    def __init__(self, in_channels: int, width: int):
        super().__init__()
        self.in_width = in_channels
        self.proj = nn.Conv2d(in_channels, width, 1)

    def forward(self, x):
        y = self.proj(x)
        return y if y.mean() > 0 else -y  # bool() of a tensor needs its value


def gated(in_channels: int = 1, width: int = 8) -> nn.Module:
    """A first-stage module on (B, C, H, W) whose forward branches on its activations' values."""
    return _Gated(in_channels, width)
