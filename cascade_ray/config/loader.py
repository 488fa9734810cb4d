"""Raw mapping -> :class:`PipelineConfig`, reporting every problem at once.

Validation runs in three passes and collects all issues before raising once:

1. the schema (unknown keys, wrong types, ranges), translated into key paths with a
   did-you-mean;
2. the offending keys are dropped (defaults take their place) so that the rest of
   the file can still be checked: cross-field rules (:mod:`.checks`);
3. the meta-device shape preflight of the whole chain (:mod:`cascade_ray.preflight`).

So a file with a typo'd optimizer, a string ``betas``, an unknown key *and* a shape
mismatch yields one error with four entries.
"""

from __future__ import annotations

import copy
import re
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from cascade_ray.config.schema import PipelineConfig
from cascade_ray.config.yaml_io import apply_overrides, read_yaml
from cascade_ray.errors import ConfigError, ConfigIssue

_MAX_REPAIRS = 8


def did_you_mean(word: str, choices: typing.Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the closest choice (case-insensitive), or ``""``."""
    options = list(choices)
    lowered = {c.lower(): c for c in options}
    if word.lower() in lowered and lowered[word.lower()] != word:
        return f"; did you mean {lowered[word.lower()]!r}?"
    close = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=0.6)
    return f"; did you mean {lowered[close[0]]!r}?" if close else ""


def format_path(loc: typing.Sequence[str | int]) -> str:
    """``('stages', 1, 'solver')`` -> ``stages[1].solver``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def load_config(path: str | Path, overrides: typing.Sequence[str] = (), *, preflight: bool = True) -> PipelineConfig:
    """Read a YAML config, apply ``key=value`` overrides and validate everything.

    Raises:
        ConfigError: listing every problem found, each with its key path.
    """
    raw = read_yaml(path)
    issues = apply_overrides(raw, list(overrides))
    return validate_config(raw, source=str(path), preflight=preflight, issues=issues)


def validate_config(
    raw: dict[str, Any],
    *,
    source: str = "",
    preflight: bool = True,
    issues: list[ConfigIssue] | None = None,
) -> PipelineConfig:
    """Validate a raw mapping (from YAML, overrides or a Tune-sampled dict).

    Raises:
        ConfigError: listing every problem found.
    """
    issues = list(issues or [])
    work = copy.deepcopy(raw)
    cfg: PipelineConfig | None = None
    for _ in range(_MAX_REPAIRS):
        try:
            cfg = PipelineConfig.model_validate(work)
            break
        except ValidationError as exc:
            errors = exc.errors(include_url=False)
            issues += [_translate(err) for err in errors]
            dropped = [_drop(work, tuple(err["loc"])) for err in errors if err["type"] != "missing"]
            if not all(dropped) or len(dropped) < len(errors):
                break  # a missing key or an undroppable value: nothing more can be learned
    if cfg is not None:
        from cascade_ray.config.checks import semantic_issues

        semantic = semantic_issues(cfg)
        issues += semantic
        if preflight:
            from cascade_ray.preflight import shape_issues

            # a stage whose model spec is already reported cannot be built: don't report it twice
            unbuildable = {issue.path.split(".")[0] for issue in semantic if ".model" in issue.path}
            reported = {issue.path for issue in semantic}
            issues += [i for i in shape_issues(cfg) if i.path.split(".")[0] not in unbuildable and i.path not in reported]
    if issues:
        raise ConfigError(sorted(_dedupe(issues), key=_path_key), source)
    assert cfg is not None  # a failed parse always records an issue
    return cfg


def _dedupe(issues: list[ConfigIssue]) -> list[ConfigIssue]:
    seen: dict[tuple[str, str], ConfigIssue] = {}
    for issue in issues:
        seen.setdefault((issue.path, issue.message), issue)
    return list(seen.values())


def _path_key(issue: ConfigIssue) -> list[tuple[int, int | str]]:
    """Sort key: stages[2] before stages[10], top-level keys first."""
    return [(0, int(tok)) if tok.isdigit() else (1, tok) for tok in re.split(r"[.\[\]]+", issue.path) if tok]


def _drop(raw: Any, loc: tuple[str | int, ...]) -> bool:
    """Delete the deepest mapping key on `loc` so defaults replace a bad value."""
    node, target = raw, None
    for part in loc:
        if isinstance(node, dict) and isinstance(part, str) and part in node:
            target = (node, part)
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and -len(node) <= part < len(node):
            node = node[part]
        else:
            break
    if target is None:
        return False
    del target[0][target[1]]
    return True


def _translate(err: dict[str, Any]) -> ConfigIssue:
    loc = tuple(err["loc"])
    path = format_path(loc)
    kind, value = err["type"], err.get("input")
    if kind == "extra_forbidden":
        fields = _fields_at(loc[:-1])
        key = str(loc[-1])
        hint = did_you_mean(key, fields)
        return ConfigIssue(path, f"unknown key {key!r}{hint} (valid: {', '.join(sorted(fields))})")
    if kind == "literal_error":
        choices = _literal_choices(loc)
        hint = did_you_mean(str(value), choices) if isinstance(value, str) else ""
        return ConfigIssue(path, f"{value!r} is not allowed{hint} (valid: {', '.join(choices)})")
    if kind == "missing":
        return ConfigIssue(path, "required key is missing")
    got = f"got {type(value).__name__} {value!r}"
    fix = ""
    if isinstance(value, str) and kind in ("float_type", "int_type", "list_type", "tuple_type"):
        fix = "write the value unquoted as a YAML number or list, e.g. betas: [0.9, 0.999], lr: 3.0e-4"
    return ConfigIssue(path, f"{err['msg'][0].lower()}{err['msg'][1:]}, {got}", fix)


def _strip_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def _walk(loc: tuple[str | int, ...]) -> tuple[type[BaseModel] | None, Any]:
    """The model class and field annotation that a schema location points at."""
    model: type[BaseModel] | None = PipelineConfig
    annotation: Any = PipelineConfig
    for part in loc:
        current = _strip_optional(annotation)
        if isinstance(part, str) and model is not None and part in model.model_fields:
            annotation = model.model_fields[part].annotation
        elif isinstance(part, int) and typing.get_origin(current) is list:
            annotation = typing.get_args(current)[0]
        elif isinstance(part, str) and typing.get_origin(current) is dict:
            annotation = typing.get_args(current)[1]
        else:
            return None, None
        inner = _strip_optional(annotation)
        model = inner if isinstance(inner, type) and issubclass(inner, BaseModel) else None
    return model, annotation


def _fields_at(loc: tuple[str | int, ...]) -> list[str]:
    model = PipelineConfig if not loc else _walk(loc)[0]
    return list(model.model_fields) if model else []


def _literal_choices(loc: tuple[str | int, ...]) -> list[str]:
    annotation = _strip_optional(_walk(loc)[1])
    return [str(a) for a in typing.get_args(annotation)] if typing.get_origin(annotation) is Literal else []
