"""Paths tests share (tests/support is on sys.path via tests/conftest.py)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "pipelines" / "configs"
