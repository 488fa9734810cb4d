"""The configuration reference (docs/config.md), generated from the schema.

Every knob is documented once, on its pydantic field; this renders those descriptions,
so the reference cannot drift (a test compares the committed file with a fresh render).

    python -m cascade_ray.config.reference > docs/config.md
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from cascade_ray.config.schema import PipelineConfig

PIPE = "\\|"  # a literal | inside a markdown table cell
HEADER = """# Configuration reference

Generated from `cascade_ray/config/schema.py` by `python -m cascade_ray.config.reference`;
do not edit by hand (a test fails when this file is stale). Unknown keys and wrong types
are errors; `stages[i]` keys below apply to every stage. A `model` section also takes the
keyword arguments of its model type (builtins: `resnet`, `transformer`, `mlp` in
`cascade_ray/models/`). The keys of a Tune space file (`--space`) are in `docs/tune_spaces.md`.
"""


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is typing.Literal:
        return " | ".join(f"`{a}`" for a in typing.get_args(annotation))
    if origin in (list, dict, tuple):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in typing.get_args(annotation))}]"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside X, X | None, list[X] or dict[str, X], if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        inner = _model_in(arg)
        if inner is not None:
            return inner
    return None


def _default(field: Any) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    if field.default_factory is not None:
        value = field.default_factory()
        return "see below" if isinstance(value, BaseModel) else f"`{value!r}`"
    return f"`{field.default!r}`" if field.default is not None else "`null`"


def _section(model: type[BaseModel], prefix: str, out: list[str], seen: set[str], top: str = "top level") -> None:
    title = prefix or top
    out += [
        f"## `{title}`",
        "",
        (model.__doc__ or "").strip().splitlines()[0],
        "",
        "| key | type | default | description |",
        "|---|---|---|---|",
    ]
    nested = []
    for name, field in model.model_fields.items():
        key = f"{prefix}.{name}" if prefix else name
        description = (field.description or "").replace("|", PIPE)
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        # doc_type: what a file may hold where a validator accepts more than the annotation
        kind = str(extra.get("doc_type") or _type_name(field.annotation)).replace("|", PIPE)
        out.append(f"| `{key}` | {kind} | {_default(field)} | {description} |")
        sub = _model_in(field.annotation)
        if sub is not None:
            origin = typing.get_origin(field.annotation)
            nested.append((sub, key + ("[i]" if origin is list else ".<key>" if origin is dict else "")))
    out.append("")
    for sub, key in nested:
        if key not in seen:
            seen.add(key)
            _section(sub, key, out, seen)


def render_model(model: type[BaseModel], header: str, top: str = "top level") -> str:
    """`model`'s fields and those of the models inside it, as markdown tables after `header`."""
    out = [header]
    _section(model, "", out, set(), top)
    return "\n".join(out).rstrip() + "\n"


def render() -> str:
    """The whole reference as markdown."""
    return render_model(PipelineConfig, HEADER)


if __name__ == "__main__":
    print(render(), end="")
