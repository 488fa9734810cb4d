"""YAML reading with YAML 1.2 numbers, and `key=value` overrides.

PyYAML implements YAML 1.1, where ``1e-3`` (no dot) is a *string*; a learning rate
silently becoming a string is exactly the kind of failure this project exists to
prevent, so the loader here resolves every YAML 1.2 float form to a float.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from cascade_ray.errors import ConfigError, ConfigIssue

_FLOAT_12 = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 float resolution (``1e-3`` is 0.001, not a string)."""


_Loader.yaml_implicit_resolvers = {
    key: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:float"]
    for key, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_12, list("-+0123456789."))


def parse_yaml(text: str, source: str = "<string>") -> Any:
    """Parse YAML text with YAML 1.2 floats.

    Raises:
        ConfigError: the text is not valid YAML (with line and column).
    """
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        raise ConfigError([ConfigIssue("", f"not valid YAML: {exc}")], source) from None


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping from a file.

    Raises:
        ConfigError: the file is missing, unreadable, not YAML, or not a mapping.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(
            [ConfigIssue("", f"cannot read config file: {exc.strerror}", "check the path")], str(p)
        ) from None
    data = parse_yaml(text, str(p))
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([ConfigIssue("", f"top level must be a mapping, got {type(data).__name__}")], str(p))
    return data


_TOKEN = re.compile(r"([^.\[\]]+)|\[(-?\d+)\]")
_KEY = re.compile(r"^[^.\[\]]+(\[-?\d+\])*(\.[^.\[\]]+(\[-?\d+\])*)*$")


def split_key(key: str) -> list[str | int]:
    """Split ``stages[1].solver.lr`` into ``['stages', 1, 'solver', 'lr']``."""
    if not _KEY.match(key):
        raise ValueError(key)
    return [m.group(1) if m.group(1) is not None else int(m.group(2)) for m in _TOKEN.finditer(key)]


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> list[ConfigIssue]:
    """Apply ``key=value`` overrides in place; values are parsed as YAML.

    A stage may be addressed by index (``stages[1].solver.lr``) or by name
    (``stages.encoder.solver.lr``). An item naming a ``.yaml`` file applies every
    ``key: value`` in it (e.g. a sweep's ``best.yaml``). Returns the overrides that
    could not be applied; the values themselves are checked later by the schema like
    any file value.
    """
    issues: list[ConfigIssue] = []
    for item in overrides:
        if "=" not in item and item.endswith((".yaml", ".yml")):
            try:
                pairs = read_yaml(item)
            except ConfigError as exc:
                issues += [ConfigIssue(item, issue.render()) for issue in exc.issues]
                continue
            for key, value in pairs.items():
                problem = _set_path(raw, split_key(str(key)), value) if _KEY.match(str(key)) else f"bad key {key!r}"
                if problem:
                    issues.append(ConfigIssue(f"{item}: {key}", problem))
            continue
        key, sep, text = item.partition("=")
        if not sep or not key:
            issues.append(ConfigIssue(item, "override is not key=value", "write e.g. stages[0].solver.lr=3e-4"))
            continue
        try:
            parts = split_key(key.strip())
            value = parse_yaml(text, f"override {item!r}")
        except (ValueError, ConfigError):
            issues.append(ConfigIssue(key, f"cannot parse override {item!r}", "write e.g. stages[0].solver.lr=3e-4"))
            continue
        problem = _set_path(raw, parts, value)
        if problem:
            issues.append(ConfigIssue(key, problem))
    return issues


def _set_path(root: dict[str, Any], parts: list[str | int], value: Any) -> str:
    node: Any = root
    for i, part in enumerate(parts[:-1]):
        nxt = parts[i + 1]
        if isinstance(node, list) and isinstance(part, str):
            # stages.<name>: address a list item by its `name`
            named = [item for item in node if isinstance(item, dict) and item.get("name") == part]
            if not named:
                names = [item.get("name") for item in node if isinstance(item, dict)]
                return f"no stage named {part!r} (stages: {', '.join(map(str, names))})"
            node = named[0]
            continue
        if isinstance(node, list):
            if not -len(node) <= part < len(node):  # type: ignore[operator]
                return f"index {part} out of range (list has {len(node)} items)"
            node = node[part]  # type: ignore[index]
            continue
        if not isinstance(node, dict):
            return f"cannot descend into {type(node).__name__} at {part!r}"
        if part not in node or node[part] is None:
            node[part] = [] if isinstance(nxt, int) else {}
        node = node[part]
    last = parts[-1]
    if isinstance(node, list):
        if not isinstance(last, int) or not -len(node) <= last < len(node):
            return f"index {last!r} not valid for a list of {len(node)} items"
    elif not isinstance(node, dict):
        return f"cannot set {last!r} inside a {type(node).__name__}"
    node[last] = value  # type: ignore[index]
    return ""
