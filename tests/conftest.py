"""Shared test fixtures. Tests import helpers from tests/support (put on sys.path here)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "support"))

from paths import CONFIGS  # noqa: E402


@pytest.fixture
def debug_raw():
    """The debug config as a raw mapping (a fresh copy per test)."""
    from cascade_ray.config.yaml_io import read_yaml

    return read_yaml(CONFIGS / "debug.yaml")
