"""``cascade-ray ls`` / ``cp`` and shipped names as configs: the files that come with the package.

The example configs and Tune search spaces are package data, ``cascade_ray/shipped/configs/``
and ``cascade_ray/shipped/tune_spaces/``, found with :func:`importlib.resources.files`, so a
wheel, an editable install and a checkout all have them. A checkout also reaches them as
``pipelines/configs/`` and ``tune_spaces/`` (relative symlinks into the package), the paths
the docs and tests use.

    cascade-ray ls
    cascade-ray cp debug my.yaml
    cascade-ray validate debug      # a shipped name where no file of that name exists
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from cascade_ray.errors import CascadeError, ConfigError, ConfigIssue
from cascade_ray.text import did_you_mean

# files() of a package on disk (every pip install, editable or not, and a checkout) is a
# Path; `--tune` needs a real folder, so the shipped files are used as paths.
PACKAGE_DIR = Path(str(files("cascade_ray")))
SHIPPED = {"config": PACKAGE_DIR / "shipped" / "configs", "space": PACKAGE_DIR / "shipped" / "tune_spaces"}
_SPACE_PREFIX = "space/"


def shipped_files() -> dict[str, tuple[str, Path]]:
    """Name (file stem; spaces prefixed ``space/``) -> (kind, path)."""
    out: dict[str, tuple[str, Path]] = {}
    for kind, folder in SHIPPED.items():
        for path in sorted(folder.glob("*.yaml")):
            out[path.stem if kind == "config" else f"{_SPACE_PREFIX}{path.stem}"] = (kind, path)
    return out


def _summary(path: Path) -> str:
    for line in path.read_text().splitlines():
        if line.startswith("#") and line.strip("# ").strip():
            return line.strip("# ").strip()
    return ""


def list_shipped() -> str:
    """One line per shipped file: name, kind, path (``cascade_ray/shipped/...``), first comment line."""
    found = shipped_files()
    if not found:  # only a broken install gets here: the wheel carries them as package data
        return f"no shipped configs found under {PACKAGE_DIR / 'shipped'}; reinstall cascade-ray"
    shown = {name: path.relative_to(PACKAGE_DIR.parent).as_posix() for name, (_, path) in found.items()}
    width, path_width = max(map(len, found)), max(map(len, shown.values()))
    lines = [
        f"{name:<{width}}  {kind:<6}  {shown[name]:<{path_width}}  {_summary(path)}"
        for name, (kind, path) in found.items()
    ]
    lines.append(
        f"(in {PACKAGE_DIR.parent}; `cascade-ray cp NAME DEST` copies one to edit, "
        "`cascade-ray validate NAME` / `run NAME` use a config by name, `tune CONFIG --space space/NAME` a space)"
    )
    return "\n".join(lines)


def resolve_config(config: str | Path) -> str:
    """The path of a pipeline config argument: the file itself when it exists (a path always
    wins), else the shipped config of that name (``debug``, see ``cascade-ray ls``).

    Raises:
        ConfigError: no such file and no shipped config of that name (with a did-you-mean).
    """
    if Path(config).exists():
        return str(config)
    configs = {name: path for name, (kind, path) in shipped_files().items() if kind == "config"}
    if str(config) in configs:
        return str(configs[str(config)])
    raise ConfigError(
        [
            ConfigIssue(
                "config",
                f"{str(config)!r} does not exist and is not a shipped config{did_you_mean(Path(config).stem, configs)}",
                f"give the path of a YAML file, or one of the shipped names: {', '.join(configs)} (`cascade-ray ls`)",
            )
        ],
        source=str(config),
    )


def resolve_space(space: str | Path) -> str:
    """The path of a ``--space`` argument: the file itself when it exists (a path always wins), else the
    shipped space of that name (``space/classifier``, as ``cascade-ray ls`` lists it; ``classifier`` too).

    Raises:
        ConfigError: no such file and no shipped space of that name (with a did-you-mean).
    """
    if Path(space).exists():
        return str(space)
    spaces = {name: path for name, (kind, path) in shipped_files().items() if kind == "space"}
    name = str(space) if str(space).startswith(_SPACE_PREFIX) else f"{_SPACE_PREFIX}{space}"
    if name in spaces:
        return str(spaces[name])
    raise ConfigError(
        [
            ConfigIssue(
                "--space",
                f"{str(space)!r} does not exist and is not a shipped space{did_you_mean(name, spaces)}",
                f"give the path of a space file, or one of the shipped names: {', '.join(spaces)} (`cascade-ray ls`)",
            )
        ],
        source=str(space),
    )


def copy_shipped(name: str, dest: str | Path) -> Path:
    """Copy a shipped file to `dest` (a file or folder) to edit it; never overwrites.

    Raises:
        CascadeError: unknown name, the destination exists (or is a symlink, dangling or not:
            copying would write through it), or its folder does not exist.
    """
    found = shipped_files()
    if name not in found:
        raise CascadeError(f"no shipped config or space {name!r}{did_you_mean(name, found)} (see `cascade-ray ls`)")
    src = found[name][1]
    target = Path(dest)
    if target.is_dir():
        target = target / src.name
    if target.is_symlink():  # exists() is False for a dangling link, and a copy would create its target
        raise CascadeError(
            f"{target} is a symlink (to {target.readlink()}); copying would write through it; "
            "remove it or choose another destination"
        )
    if target.exists():
        raise CascadeError(f"{target} exists; choose another destination")
    if not target.parent.is_dir():
        raise CascadeError(f"{target.parent} is not a folder; create it or choose another destination")
    # "x": exclusive create, which also refuses a symlink that appeared since the checks above
    with target.open("xb") as out:
        out.write(src.read_bytes())
    return target
