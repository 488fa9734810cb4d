"""Raw mapping -> :class:`PipelineConfig`: the schema pass, with every problem reported.

Schema errors (unknown keys, wrong types, ranges) are translated into key paths with a
did-you-mean; the offending keys are dropped (defaults take their place) and the rest is
parsed again, so later passes still see the rest of the file. Full validation (cross-field
rules and the shape preflight) composes this with checks that need models and solvers:
:mod:`cascade_ray.checks`.
"""

from __future__ import annotations

import copy
import re
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from cascade_ray.config.schema import STAGE_NAME_PATTERN, PipelineConfig
from cascade_ray.errors import ConfigIssue
from cascade_ray.text import did_you_mean, format_path, short_repr

_MAX_REPAIRS = 8


def parse_config(raw: dict[str, Any], issues: list[ConfigIssue]) -> tuple[PipelineConfig | None, set[str]]:
    """The schema pass: parse ``raw``, dropping each offending key and parsing again.

    Every schema problem is appended to ``issues`` (translated into key paths with a
    did-you-mean). Returns the parsed config (``None`` when a required key is missing or a
    value cannot be dropped) and the key paths that were dropped, whose consequences later
    passes should not report again.
    """
    work = copy.deepcopy(raw)
    cfg: PipelineConfig | None = None
    dropped_paths: set[str] = set()  # keys removed after a schema error; their consequences are not news
    for _ in range(_MAX_REPAIRS):
        try:
            cfg = PipelineConfig.model_validate(work)
            break
        except ValidationError as exc:
            errors = _merge_union_errors(exc.errors(include_url=False))
            # a required key dropped in an earlier pass comes back as "missing": already reported
            errors = [e for e in errors if not (e["type"] == "missing" and format_path(e["loc"]) in dropped_paths)]
            issues += [_translate(err) for err in errors]
            dropped = [_drop(work, tuple(err["loc"])) for err in errors if err["type"] != "missing"]
            dropped_paths |= {format_path(loc) for loc in dropped if loc}
            if not errors or not all(dropped) or len(dropped) < len(errors):
                break  # a missing key or an undroppable value: nothing more can be learned
    return cfg, dropped_paths


def schema_issues(exc: ValidationError, root: type[BaseModel]) -> list[ConfigIssue]:
    """`exc` (from ``root.model_validate``, any strict model of this package, e.g. a space file's) as
    issues the way a config's are reported: key paths, a did-you-mean for unknown keys and choices,
    the value found and a fix."""
    return [_translate(err, root) for err in _merge_union_errors(exc.errors(include_url=False), root)]


def sorted_issues(issues: list[ConfigIssue]) -> list[ConfigIssue]:
    """Issues without duplicates, in key-path order (``stages[2]`` before ``stages[10]``)."""
    return sorted(_dedupe(issues), key=_path_key)


def _dedupe(issues: list[ConfigIssue]) -> list[ConfigIssue]:
    seen: dict[tuple[str, str], ConfigIssue] = {}
    for issue in issues:
        seen.setdefault((issue.path, issue.message), issue)
    return list(seen.values())


def _path_key(issue: ConfigIssue) -> list[tuple[int, int | str]]:
    """Sort key: stages[2] before stages[10], top-level keys first."""
    return [(0, int(tok)) if tok.isdigit() else (1, tok) for tok in re.split(r"[.\[\]]+", issue.path) if tok]


def _drop(raw: Any, loc: tuple[str | int, ...]) -> tuple[str | int, ...] | None:
    """Delete the deepest mapping key on `loc` so defaults replace a bad value; its location, or None."""
    node, target, at = raw, None, 0
    for i, part in enumerate(loc):
        if isinstance(node, dict) and isinstance(part, str) and part in node:
            target, at = (node, part), i + 1
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and -len(node) <= part < len(node):
            node = node[part]
        else:
            break
    if target is None:
        return None
    del target[0][target[1]]
    return loc[:at]


def _union_tag_at(loc: tuple[str | int, ...], root: type[BaseModel] = PipelineConfig) -> int | None:
    """Index of the union-member tag pydantic appends to a location (``use_gpu.bool``), or None."""
    for k in range(1, len(loc)):
        annotation = _strip_optional(_walk(loc[:k], root)[1])
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):
            return k
    return None


def _merge_union_errors(errors: list[dict[str, Any]], root: type[BaseModel] = PipelineConfig) -> list[dict[str, Any]]:
    """One ``union_error`` per union-typed key instead of one error per member type (and tagged paths)."""
    out: list[dict[str, Any]] = []
    merged: set[tuple[str | int, ...]] = set()
    for err in errors:
        loc = tuple(err["loc"])
        k = _union_tag_at(loc, root)
        if k is None:
            out.append(err)
        elif loc[:k] not in merged:
            merged.add(loc[:k])
            out.append({"type": "union_error", "loc": loc[:k], "input": err.get("input"), "msg": err["msg"]})
    return out


def _describe(annotation: Any) -> list[str]:
    """What a value of a union member type looks like in YAML."""
    if typing.get_origin(annotation) is Literal:
        return [repr(a) for a in typing.get_args(annotation)]
    names = {bool: ["true", "false"], int: ["an integer"], float: ["a number"], str: ["a string"], type(None): ["null"]}
    origin = typing.get_origin(annotation) or annotation
    return names.get(origin) or (
        ["a list"]
        if origin is list
        else ["a mapping"]
        if origin is dict
        else [getattr(origin, "__name__", str(origin))]
    )


_SEXAGESIMAL = re.compile(r"^[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?$")
_BASE_PREFIXED = re.compile(r"^[-+]?0(?:x[0-9a-fA-F_]+|o[0-7_]+|b[01_]+)$")
_LEADING_ZERO = re.compile(r"^[-+]?0[0-9_]+$")
_YAML11_BOOLS = {
    w: w.lower() in ("yes", "on")
    for w in ("yes", "Yes", "YES", "no", "No", "NO", "on", "On", "ON", "off", "Off", "OFF")
}


def yaml11_fix(value: str, want: str = "number") -> str:
    """The fix for a plain scalar that YAML 1.1 reads as a number or bool and YAML 1.2 (this reader) as a string.

    `want` is what the key takes (``number`` or ``bool``). Empty when `value` is no such scalar.
    """
    if len(value) > 64:  # no mistyped number is this long (and a huge int has no str())
        return ""
    text = value.replace("_", "")
    sign = -1 if text.startswith("-") else 1
    digits = text.lstrip("+-")
    if _SEXAGESIMAL.match(value):
        total = 0.0
        for part in digits.split(":"):
            total = total * 60 + float(part)
        number = sign * (int(total) if total.is_integer() and "." not in digits else total)
        return f"{short_repr(value)} is YAML 1.1 base 60 ({number}), a string in YAML 1.2 as read here: write {number}"
    if _BASE_PREFIXED.match(value):
        number = sign * int(digits, 0)
        return f"{short_repr(value)}: YAML 1.2 (as read here) allows no sign or '_' in hex/octal/binary: write {number}"
    if _LEADING_ZERO.match(value):
        decimal = sign * int(digits)
        if set(digits) <= set("01234567"):
            octal = sign * int(digits, 8)
            return f"{short_repr(value)} is octal {octal} in YAML 1.1 and {decimal} in YAML 1.2: write {decimal} (or 0o{digits.lstrip('0')})"
        return f"{short_repr(value)} has a leading zero: write {decimal}"
    if value in _YAML11_BOOLS:
        meaning = "true" if _YAML11_BOOLS[value] else "false"
        if want == "bool":
            return f"{short_repr(value)} is a string in YAML 1.2 (YAML 1.1 read it as {meaning}): write true/false, unquoted"
        return f"{short_repr(value)} is a word, not a number (YAML 1.1 read it as {meaning}): write a number"
    return ""


# Fixes for schema errors whose message alone says what is wrong but not what to write instead.
_TYPE_FIXES = {
    "dict_type": "write a mapping of `key: value` pairs (one per line, or {key: value, ...})",
    "model_type": "write a mapping of `key: value` pairs (one per line, or {key: value, ...})",
    "list_type": "write a YAML list: [a, b], or one `- item` line per entry",
    "string_type": "write a string; quote it if YAML would read it as a number or bool",
    "bool_type": "write true or false, unquoted",
}


# what Ray Train / Tune, Lightning and torch call keys this schema names otherwise: unknown key -> its name here
OTHER_NAMES = {
    "num_to_keep": "top_k",
    "checkpoint_score_attribute": "metric",
    "checkpoint_score_order": "mode",
    "max_epochs": "epochs",
    "num_epochs": "epochs",
    "learning_rate": "lr",
    "optimizer": "solver",
    "gradient_clip_val": "grad_clip",
    "accumulate_grad_batches": "accumulation_steps",
    "gradient_accumulation_steps": "accumulation_steps",
}


def _translate(err: dict[str, Any], root: type[BaseModel] = PipelineConfig) -> ConfigIssue:
    loc = tuple(err["loc"])
    path = format_path(loc)
    kind, value = err["type"], err.get("input")
    if kind == "extra_forbidden":
        fields = _fields_at(loc[:-1], root)
        key = str(loc[-1])
        hint = did_you_mean(key, fields)
        if not hint and OTHER_NAMES.get(key) in fields:
            hint = f"; did you mean {OTHER_NAMES[key]!r}? (cascade-ray's name for it)"
        return ConfigIssue(path, f"unknown key {short_repr(key)}{hint} (valid: {', '.join(sorted(fields))})")
    if kind == "literal_error":
        choices = _literal_choices(loc, root)
        hint = did_you_mean(str(value), choices) if isinstance(value, str) else ""
        return ConfigIssue(path, f"{short_repr(value)} is not allowed{hint} (valid: {', '.join(choices)})")
    if kind == "missing":
        return ConfigIssue(path, "required key is missing", f"add {loc[-1]}: ..." if loc else "")
    if kind == "union_error":
        choices = [d for arg in typing.get_args(_strip_optional(_walk(loc, root)[1])) for d in _describe(arg)]
        quirk = yaml11_fix(value, "bool" if "true" in choices else "number") if isinstance(value, str) else ""
        fix = f"write {', '.join(choices[:-1])} or {choices[-1]}" if len(choices) > 1 else ""
        return ConfigIssue(path, f"{short_repr(value)} is not valid here", f"{quirk}; {fix}" if quirk else fix)
    got = f"got {type(value).__name__} {short_repr(value)}"
    fix = _TYPE_FIXES.get(kind, "")
    quirk = yaml11_fix(value, "bool" if kind == "bool_type" else "number") if isinstance(value, str) else ""
    if quirk and kind in ("float_type", "int_type", "bool_type"):
        fix = f"{quirk}; or quote it if you meant the text"
    elif isinstance(value, str) and kind in ("float_type", "int_type", "list_type", "tuple_type"):
        fix = "write the value unquoted as a YAML number or list, e.g. betas: [0.9, 0.999], lr: 3.0e-4"
    elif kind == "int_type" and isinstance(value, bool):
        fix = "write a whole number, not true/false"
    elif kind == "int_type" and isinstance(value, float) and value.is_integer():
        fix = f"write it without the decimal point: {int(value)}"
    elif kind == "string_pattern_mismatch" and err.get("ctx", {}).get("pattern") == STAGE_NAME_PATTERN:
        fix = "start with a letter and use only letters, digits, '_' and '-' (at most 64 characters)"
    elif kind == "less_than_equal" and isinstance(value, int) and not isinstance(value, bool):
        fix = f"use at most {err.get('ctx', {}).get('le')}: a larger value is taken for a typo, not a big job"
    elif kind == "too_short" and loc == ("stages",):
        fix = "add at least one stage: - name: ..., model: {type: ...}"
    # pydantic's model_type message names the internal class ("... or instance of StageConfig")
    message = "input should be a mapping" if kind == "model_type" else f"{err['msg'][0].lower()}{err['msg'][1:]}"
    return ConfigIssue(path, f"{message}, {got}", fix)


def _strip_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def _walk(loc: tuple[str | int, ...], root: type[BaseModel] = PipelineConfig) -> tuple[type[BaseModel] | None, Any]:
    """The model class and field annotation that a schema location points at (from `root`)."""
    model: type[BaseModel] | None = root
    annotation: Any = root
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


def _fields_at(loc: tuple[str | int, ...], root: type[BaseModel] = PipelineConfig) -> list[str]:
    model = root if not loc else _walk(loc, root)[0]
    return list(model.model_fields) if model else []


def _literal_choices(loc: tuple[str | int, ...], root: type[BaseModel] = PipelineConfig) -> list[str]:
    annotation = _strip_optional(_walk(loc, root)[1])
    return [str(a) for a in typing.get_args(annotation)] if typing.get_origin(annotation) is Literal else []
