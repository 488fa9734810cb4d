"""Strict YAML reading, and `key=value` overrides.

A config is data that decides what trains, so this reader refuses what PyYAML would
silently reinterpret. Plain scalars are resolved with **YAML 1.2 core-schema semantics**
(not PyYAML's YAML 1.1): ``1e-3`` is a float (1.1 reads a string); ``yes/no/on/off`` are
strings, only ``true/false`` are booleans; ``1:30`` (1.1 sexagesimal 90), ``0x1_F`` and
``0o1_7`` (1.1 underscores in hex/octal), ``010`` (1.1 octal 8, 1.2 decimal 10) and dates
stay strings. ``_`` separators are kept in decimal numbers only (``1_000``), as in Python.
Where the schema wants a number or a bool, such a string is an error whose fix says what
to write (``write 90``, ``quote it or write true/false``): see
:func:`cascade_ray.config.loader.yaml11_fix`.

Also refused, each as a :class:`ConfigError` within milliseconds:

- a duplicate mapping key anywhere (naming the key path and both lines; YAML keeps the last);
- input over :data:`MAX_CONFIG_BYTES`, checked before parsing;
- alias expansion beyond :data:`MAX_YAML_NODES` nodes (a "billion laughs" bomb) and recursive
  aliases, counted on the composed node graph before anything is constructed;
- bytes that are not UTF-8 (naming the byte offset).

The same reader parses config files, ``key=value`` override values and ``best.yaml`` files.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from cascade_ray.errors import ConfigError, ConfigIssue
from cascade_ray.text import format_path, short_repr

# A config is a few KiB; anything this large is a wrong file (a dataset, a log), not a config.
MAX_CONFIG_BYTES = 1 << 20
# Nodes a document may hold once aliases are expanded; real configs have a few hundred.
MAX_YAML_NODES = 100_000
# Nesting deeper than this is not a config (and would exhaust the parser's recursion).
MAX_YAML_DEPTH = 64

_FLOAT_12 = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)
# YAML 1.2 core ints (no leading zeros: `010` is 8 in 1.1 and 10 in 1.2, so it stays a string)
_INT_12 = re.compile(r"^(?:[-+]?(?:0|[1-9][0-9_]*)|0o[0-7]+|0x[0-9a-fA-F]+)$")
_BOOL_12 = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_DROPPED_TAGS = {f"tag:yaml.org,2002:{t}" for t in ("bool", "int", "float", "timestamp", "value")}


class _Loader(yaml.SafeLoader):
    """SafeLoader resolving plain scalars by the YAML 1.2 core schema (see the module docstring)."""


_Loader.yaml_implicit_resolvers = {
    key: [(tag, rx) for tag, rx in resolvers if tag not in _DROPPED_TAGS]
    for key, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", _BOOL_12, list("tTfF"))
_Loader.add_implicit_resolver("tag:yaml.org,2002:int", _INT_12, list("-+0123456789"))
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_12, list("-+0123456789."))


def _issue(path: str, message: str, fix: str = "") -> ConfigIssue:
    return ConfigIssue(path, message, fix)


def _check_graph(root: yaml.Node, prefix: tuple[str | int, ...]) -> list[ConfigIssue]:
    """Duplicate keys, alias expansion and nesting of a composed document, before construction.

    An alias is a shared node in the composed graph, so each distinct node is checked once and
    its expanded size (itself plus its children's expanded sizes) is summed: an alias bomb's
    expansion is known from its few dozen distinct nodes, without expanding it.
    """
    issues: list[ConfigIssue] = []
    sizes: dict[int, int] = {}  # id(node) -> nodes it expands to
    active: set[int] = set()  # nodes on the current path: an alias back into one is recursive

    def size(node: yaml.Node, path: tuple[str | int, ...], depth: int) -> int | None:
        if id(node) in sizes:
            return sizes[id(node)]
        where = format_path(path)
        if depth > MAX_YAML_DEPTH:
            line, under = node.start_mark.line + 1, format_path(path[:4]) or "the top level"
            message = f"nested deeper than {MAX_YAML_DEPTH} levels at line {line} (under {short_repr(under)[1:-1]})"
            issues.append(_issue("", message, "flatten the structure: a config is a few levels deep"))
            return None
        if id(node) in active:
            line = node.start_mark.line + 1
            issues.append(_issue(where, f"recursive alias at line {line}", "remove the alias to its own parent"))
            return None
        children: list[tuple[yaml.Node, tuple[str | int, ...]]] = []
        if isinstance(node, yaml.SequenceNode):
            children = [(item, (*path, i)) for i, item in enumerate(node.value)]
        elif isinstance(node, yaml.MappingNode):
            _duplicate_keys(node, path, issues)
            for key_node, value_node in node.value:
                merge = key_node.tag == "tag:yaml.org,2002:merge"
                key = key_node.value if isinstance(key_node, yaml.ScalarNode) else "?"
                children += [(key_node, path), (value_node, path if merge else (*path, key))]
        active.add(id(node))
        total = 1
        for child, child_path in children:
            n = size(child, child_path, depth + 1)
            if n is None:
                return None
            total += n
            if total > MAX_YAML_NODES:
                issues.append(
                    _issue(
                        "",
                        f"the document expands to more than {MAX_YAML_NODES} YAML nodes through its aliases "
                        f"(&anchor / *alias), at line {node.start_mark.line + 1}: an alias bomb, or not a config",
                        "write the values out instead of nesting aliases",
                    )
                )
                return None
        active.discard(id(node))
        sizes[id(node)] = total
        return total

    size(root, prefix, 0)
    return issues


def _duplicate_keys(node: yaml.MappingNode, path: tuple[str | int, ...], issues: list[ConfigIssue]) -> None:
    """A key given twice in one mapping (merged `<<` keys may be overridden: that is what they are for)."""
    seen: dict[tuple[str, str], yaml.Node] = {}
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
            continue
        ident = (key_node.tag, key_node.value)
        if ident in seen:
            first, again = seen[ident].start_mark, key_node.start_mark
            lines = (
                f"lines {first.line + 1} and {again.line + 1}"
                if first.line != again.line
                else f"line {first.line + 1}, columns {first.column + 1} and {again.column + 1}"
            )
            issues.append(
                _issue(
                    format_path((*path, key_node.value)),
                    f"duplicate key {short_repr(key_node.value)} ({lines}); YAML would silently keep the last",
                    "keep one of them",
                )
            )
        seen.setdefault(ident, key_node)


def parse_yaml(text: str, source: str = "<string>", *, prefix: tuple[str | int, ...] = ()) -> Any:
    """Parse YAML text strictly (YAML 1.2 core scalars, no duplicate keys, bounded size and aliases).

    Args:
        text: the YAML document.
        source: where it came from, for the error.
        prefix: the key path the document sits at (an override ``stages[0].solver={...}``), so a
            duplicate key is reported at its full path.

    Raises:
        ConfigError: not valid YAML (with line and column), a duplicate key, too large, or
            too many nodes once aliases are expanded.
    """
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError([_size_issue(len(text), "characters")], source)
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        issues = _check_graph(node, prefix)
        if issues:
            raise ConfigError(issues, source)
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        message = str(exc)[:600]  # PyYAML's own text: its snippets are already cut to a line's width
        raise ConfigError([_issue("", f"not valid YAML: {message}")], source) from None
    except RecursionError:
        raise ConfigError([_issue("", f"not valid YAML: nested deeper than {MAX_YAML_DEPTH} levels")], source) from None
    except ValueError as exc:  # a constructor's conversion failed, e.g. an int past Python's 4300-digit limit
        raise ConfigError([_issue("", f"not valid YAML: {str(exc)[:200]}")], source) from None
    finally:
        loader.dispose()


def _size_issue(size: int, unit: str) -> ConfigIssue:
    return _issue(
        "",
        f"{size} {unit}, over the {MAX_CONFIG_BYTES} byte limit for a config (MAX_CONFIG_BYTES): not a config file",
        "check the path; a config is a few KiB of YAML",
    )


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping from a file: at most :data:`MAX_CONFIG_BYTES`, UTF-8, strict YAML.

    Raises:
        ConfigError: the file is missing, unreadable, too large, not UTF-8, not YAML, or not a mapping.
    """
    p = Path(path)
    try:
        with p.open("rb") as f:  # bounded read: the size is checked before anything is parsed
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(
            [ConfigIssue("", f"cannot read config file: {exc.strerror}", "check the path")], str(p)
        ) from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError([_size_issue(len(data), "bytes or more")], str(p))
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ConfigError(
            [
                _issue(
                    "",
                    f"not UTF-8: byte 0x{data[exc.start]:02x} at byte offset {exc.start} (line {line}) is {exc.reason}",
                    "save the file as UTF-8",
                )
            ],
            str(p),
        ) from None
    parsed = parse_yaml(text, str(p))
    if parsed is None:
        parsed = {}
    if not isinstance(parsed, dict):
        raise ConfigError([ConfigIssue("", f"top level must be a mapping, got {type(parsed).__name__}")], str(p))
    return parsed


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
                problem = (
                    _set_path(raw, split_key(str(key)), value) if _KEY.match(str(key)) else f"bad key {short_repr(key)}"
                )
                if problem:
                    issues.append(ConfigIssue(f"{item}: {key}", problem))
            continue
        key, sep, text = item.partition("=")
        if not sep or not key:
            issues.append(ConfigIssue(item, "override is not key=value", "write e.g. stages[0].solver.lr=3e-4"))
            continue
        try:
            parts = split_key(key.strip())
        except ValueError:
            issues.append(
                ConfigIssue(
                    short_repr(key)[1:-1],
                    f"cannot parse override {short_repr(item)}",
                    "write e.g. stages[0].solver.lr=3e-4",
                )
            )
            continue
        try:
            value = parse_yaml(text, f"override {short_repr(item)}", prefix=tuple(parts))
        except ConfigError as exc:  # a duplicate key, bad syntax, an alias bomb: at the override's key path
            issues += [
                ConfigIssue(
                    issue.path or key.strip(),
                    f"override: {issue.message}",
                    issue.fix or "write e.g. stages[0].solver.lr=3e-4",
                )
                for issue in exc.issues
            ]
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
                return f"no stage named {short_repr(part)} (stages: {short_repr(', '.join(map(str, names)))[1:-1]})"
            node = named[0]
            continue
        if isinstance(node, list):
            if not -len(node) <= part < len(node):  # type: ignore[operator]
                return f"index {part} out of range (list has {len(node)} items)"
            node = node[part]  # type: ignore[index]
            continue
        if not isinstance(node, dict):
            return f"cannot descend into {type(node).__name__} at {short_repr(part)}"
        if part not in node or node[part] is None:
            node[part] = [] if isinstance(nxt, int) else {}
        node = node[part]
    last = parts[-1]
    if isinstance(node, list):
        if not isinstance(last, int) or not -len(node) <= last < len(node):
            return f"index {short_repr(last)} not valid for a list of {len(node)} items"
    elif not isinstance(node, dict):
        return f"cannot set {short_repr(last)} inside a {type(node).__name__}"
    node[last] = value  # type: ignore[index]
    return ""
