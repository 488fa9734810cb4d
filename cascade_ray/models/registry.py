"""Resolve a config's ``model.type`` to a factory and build stage modules from it.

A type is a builtin name (``resnet``, ``transformer``, ``mlp``) or an import path
``package.module:Callable`` whose callable returns an ``nn.Module``. Nothing else is
accepted: an unknown name is an error, never a file path or a fallback. An import path is
checked against the trust rule (:mod:`cascade_ray.config.trust`: cascade-ray's own package
or a trusted one, never the standard library) before anything is imported.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from torch import nn

from cascade_ray.config.trust import import_refusal, is_trusted, module_refusal
from cascade_ray.errors import CascadeError
from cascade_ray.models.mlp import mlp
from cascade_ray.models.resnet import resnet
from cascade_ray.models.transformer import transformer

BUILTIN_MODELS: dict[str, Callable[..., nn.Module]] = {
    "resnet": resnet,
    "transformer": transformer,
    "mlp": mlp,
}


class ModelSpecError(CascadeError, ValueError):
    """A model type or its arguments are invalid. Picklable via :class:`CascadeError`."""

    exit_code = 2


def _did_you_mean(name: str, options: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


def _import_callable(type_name: str, trusted: Iterable[str] = ()) -> Callable[..., Any]:
    """Import ``package.module:Callable`` after the trust rule allows the string (refused: nothing imported).

    Raises:
        ModelSpecError: refused by the trust rule, not importable, no such attribute, the
            attribute path runs through a module that is not trusted, or not callable.
    """
    trusted = tuple(trusted)
    refusal = import_refusal(type_name, trusted)
    if refusal is not None:
        raise ModelSpecError(refusal)
    module_name, _, attr_path = type_name.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # the user's module may fail with anything while importing
        raise ModelSpecError(
            f"model type {type_name!r}: cannot import module '{module_name}': {type(exc).__name__}: {exc}"
        ) from exc
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(obj) if not n.startswith("_"))
            raise ModelSpecError(
                f"model type {type_name!r}: '{module_name}' has no attribute '{attr_path}'{_did_you_mean(part, public)}"
            )
        obj = getattr(obj, part)
        # `mypkg:os.system`: a trusted module's own imports are not trusted with it
        if inspect.ismodule(obj) and (module_refusal(obj.__name__) or not is_trusted(obj.__name__, trusted)):
            raise ModelSpecError(
                f"model type {type_name!r}: '{part}' is the module '{obj.__name__}', which is not trusted"
            )
    # `mypkg:system` after `from os import system`; only functions and classes say where they were defined
    owner = getattr(obj, "__module__", None) if inspect.isroutine(obj) or inspect.isclass(obj) else None
    if isinstance(owner, str) and module_refusal(owner) is not None:
        raise ModelSpecError(
            f"model type {type_name!r}: '{attr_path}' comes from the standard library ('{owner}'), "
            "which is never importable from a config"
        )
    if not callable(obj):
        raise ModelSpecError(
            f"model type {type_name!r}: '{attr_path}' is a {type(obj).__name__}, not a callable returning an nn.Module"
        )
    return obj


def resolve_factory(type_name: str, trusted: Iterable[str] = ()) -> Callable[..., nn.Module]:
    """Return the factory for a model type.

    Args:
        type_name: a builtin name or ``"package.module:Callable"``.
        trusted: the config's ``trusted_modules``: packages whose callables an import path
            may name, besides cascade-ray's own.

    Returns:
        The callable; call it with the config's keyword arguments.

    Raises:
        ModelSpecError: unknown builtin (with the nearest name), refused by the trust rule
            (before anything is imported), module not importable, attribute missing, or not callable.
    """
    if not isinstance(type_name, str) or not type_name:
        raise ModelSpecError(f"model type must be a non-empty string, got {type_name!r}")
    if ":" in type_name:
        return _import_callable(type_name, trusted)
    if type_name in BUILTIN_MODELS:
        return BUILTIN_MODELS[type_name]
    module, dot, attr = type_name.rpartition(".")
    if dot and attr.isidentifier() and all(part.isidentifier() for part in module.split(".")):  # `pkg.mod.f`
        hint = f"; did you mean '{module}:{attr}'? (a colon before the factory's name)"
    else:
        hint = _did_you_mean(type_name, list(BUILTIN_MODELS))
    raise ModelSpecError(
        f"unknown model type '{type_name}'{hint} "
        f"(builtins: {', '.join(sorted(BUILTIN_MODELS))}; or 'package.module:Callable')"
    )


def _factory_name(factory: Callable[..., Any]) -> str:
    for name, builtin in BUILTIN_MODELS.items():
        if factory is builtin:
            return name
    return getattr(factory, "__qualname__", None) or repr(factory)


def check_kwargs(factory: Callable[..., Any], kwargs: Mapping[str, Any], *, name: str | None = None) -> list[str]:
    """List the problems with calling ``factory(**kwargs)``, without calling it.

    Args:
        factory: the model factory (e.g. from :func:`resolve_factory`).
        kwargs: the keyword arguments from the config.
        name: how to name the model in messages; defaults to the builtin name or the
            factory's qualified name.

    Returns:
        One message per unknown argument (with the nearest accepted name) or missing
        required argument; empty when the call looks fine, or when the signature cannot
        be inspected (some C-implemented callables).
    """
    label = name or _factory_name(factory)
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return []
    accepted = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    problems: list[str] = []
    if not takes_any:
        for key in kwargs:
            if key not in accepted:
                problems.append(
                    f"unknown argument '{key}' for model '{label}'{_did_you_mean(str(key), accepted)} "
                    f"(accepted: {', '.join(accepted) or 'none'})"
                )
    for p in params:
        if p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.kind is p.POSITIONAL_ONLY:
            problems.append(f"model '{label}' needs positional argument '{p.name}', which a config cannot pass")
        elif p.name not in kwargs:
            problems.append(f"missing required argument '{p.name}' for model '{label}'")
    return problems


def build_module(type_name: str, kwargs: Mapping[str, Any], trusted: Iterable[str] = ()) -> nn.Module:
    """Resolve ``type_name`` (``trusted``: the config's ``trusted_modules``), check ``kwargs`` against it
    and build the module.

    Raises:
        ModelSpecError: the type cannot be resolved, the arguments do not fit, the
            factory rejects them (its ValueError/TypeError is chained), or it does not
            return an ``nn.Module``.
    """
    factory = resolve_factory(type_name, trusted)
    problems = check_kwargs(factory, kwargs, name=type_name)
    if problems:
        raise ModelSpecError("\n".join(problems))
    try:
        module = factory(**kwargs)
    except ModelSpecError:
        raise
    except (TypeError, ValueError) as exc:
        # Builtin messages already start with the model name; user ones get the type prefixed.
        text = str(exc) if type_name in BUILTIN_MODELS else f"model '{type_name}': {type(exc).__name__}: {exc}"
        raise ModelSpecError(text) from exc
    if not isinstance(module, nn.Module):
        raise ModelSpecError(f"model '{type_name}' returned {type(module).__name__}, not an nn.Module")
    return module


def module_layers(module: nn.Module) -> list[nn.Module]:
    """The module's layers in forward order, for "unfreeze the last N layers".

    Uses ``module.cascade_layers()`` when defined. Otherwise the direct children; a
    module without children, or with parameters of its own (which no child would
    cover), counts as one layer.
    """
    layers = getattr(module, "cascade_layers", None)
    if callable(layers):
        return list(layers())
    children = list(module.children())
    if not children or any(True for _ in module.parameters(recurse=False)):
        return [module]
    return children


def module_in_width(module: nn.Module) -> int | None:
    """The module's ``in_width`` attribute, or None when it has none (user modules)."""
    width = getattr(module, "in_width", None)
    return width if isinstance(width, int) and not isinstance(width, bool) else None


def tensor_width(shape: Sequence[int]) -> int:
    """The width of a tensor shape: channels (dim 1) for 4-D, last dim for 2-D / 3-D.

    Raises:
        ValueError: the shape is not 2-, 3- or 4-D.
    """
    rank = len(shape)
    if rank == 4:
        return int(shape[1])
    if rank in (2, 3):
        return int(shape[-1])
    raise ValueError(f"tensor_width: expected a 2-D, 3-D or 4-D shape, got {tuple(shape)} ({rank}-D)")
