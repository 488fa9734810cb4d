"""``cascade-ray ls`` / ``cp``: the configs and search spaces shipped with the project."""

from __future__ import annotations

import shutil
from pathlib import Path

from cascade_ray.errors import CascadeError

# Shipped files live next to the package in a checkout (pipelines/configs, tune_spaces).
ROOT = Path(__file__).resolve().parents[2]
SHIPPED = {"config": ROOT / "pipelines" / "configs", "space": ROOT / "tune_spaces"}


def shipped_files() -> dict[str, tuple[str, Path]]:
    """Name (file stem; spaces prefixed ``space/``) -> (kind, path)."""
    out: dict[str, tuple[str, Path]] = {}
    for kind, folder in SHIPPED.items():
        for path in sorted(folder.glob("*.yaml")):
            out[path.stem if kind == "config" else f"space/{path.stem}"] = (kind, path)
    return out


def _summary(path: Path) -> str:
    for line in path.read_text().splitlines():
        if line.startswith("#") and line.strip("# ").strip():
            return line.strip("# ").strip()
    return ""


def list_shipped() -> str:
    """One line per shipped file: name, kind, path, first comment line."""
    files = shipped_files()
    if not files:
        return f"no shipped configs found under {ROOT} (they come with a source checkout)"
    width = max(map(len, files))
    return "\n".join(
        f"{name:<{width}}  {kind:<6}  {path.relative_to(ROOT)}  {_summary(path)}"
        for name, (kind, path) in files.items()
    )


def copy_shipped(name: str, dest: str | Path) -> Path:
    """Copy a shipped file to `dest` (a file or folder) to edit it; never overwrites."""
    from cascade_ray.text import did_you_mean

    files = shipped_files()
    if name not in files:
        raise CascadeError(f"no shipped config or space {name!r}{did_you_mean(name, files)} (see `cascade-ray ls`)")
    src = files[name][1]
    target = Path(dest)
    if target.is_dir():
        target = target / src.name
    if target.exists():
        raise CascadeError(f"{target} exists; choose another destination")
    shutil.copyfile(src, target)
    return target
