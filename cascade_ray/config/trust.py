"""Which ``package.module:Callable`` import paths a config may name, decided from the string alone.

A config that names a callable (``stages[i].model.type``, ``stages[i].loss.type``) makes
cascade-ray import a module and call something in it: a config is code. So an import path is
allowed only when its module is cascade-ray's own (``cascade_ray...``) or lies inside a
package the user trusts (``trusted_modules`` in the config, ``--trust MODULE`` on the command
line; trusting ``mypkg`` allows ``mypkg.models``). The standard library and ``builtins`` are
never allowed, even when listed: ``os:system``, ``subprocess:run``, ``builtins:eval`` would
otherwise run shell commands from a YAML file. Nothing here imports anything; the registry
asks :func:`import_refusal` before it calls ``importlib``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

OWN_PACKAGE = "cascade_ray"
# sys.stdlib_module_names lists top-level names only (os, posix, importlib, builtins, ...)
_STDLIB = frozenset(sys.stdlib_module_names) | {"builtins", "__main__"}


def trust_fix(type_name: str) -> str:
    """How to allow the import path `type_name` (or why it cannot be): the fix of a refused one."""
    top = type_name.partition(":")[0].split(".")[0]
    if top in _STDLIB or not top.isidentifier():
        return "name a factory in your own package (mypkg.models:Net) and trust that package"
    return f"add '{top}' to trusted_modules or pass --trust {top} (only for a package you trust: its callables run)"


def module_refusal(name: object) -> str | None:
    """Why `name` cannot be a ``trusted_modules`` / ``--trust`` entry, or None when it can.

    An entry is a dotted module name (``mypkg`` or ``mypkg.models``) outside the standard library.
    """
    if not isinstance(name, str) or not name:
        return f"{name!r} is not a module name (a dotted name such as 'mypkg' or 'mypkg.models')"
    if not all(part.isidentifier() for part in name.split(".")):
        return f"{name[:80]!r} is not a dotted module name (such as 'mypkg' or 'mypkg.models')"
    if name.split(".")[0] in _STDLIB:
        return (
            f"'{name}' is in the Python standard library, which a config may never import from "
            "(its callables run shell commands, evaluate code, delete files)"
        )
    return None


def is_trusted(module: str, trusted: Iterable[str]) -> bool:
    """Whether `module` is cascade-ray's own or inside a trusted package (dotted prefix match)."""
    allowed = (OWN_PACKAGE, *trusted)
    return any(module == t or module.startswith(t + ".") for t in allowed)


def import_refusal(type_name: str, trusted: Iterable[str]) -> str | None:
    """Why the import path `type_name` (``package.module:Callable``) may not be imported, or None.

    Decided from the string alone, before anything is imported: the module must be a dotted
    name that is not in the standard library and lies inside cascade-ray or a trusted package;
    the attribute path must be plain names (no private ``_`` parts, which reach a module's
    imports such as ``mypkg:_os``).
    """
    module, _, attr = type_name.partition(":")
    shown = type_name if len(type_name) <= 120 else type_name[:117] + "..."
    if not module or not attr:
        return f"{shown!r} must look like 'package.module:Callable'"
    if not all(part.isidentifier() for part in module.split(".")):
        return f"{shown!r}: '{module[:80]}' is not a dotted module name"
    if not all(part.isidentifier() for part in attr.split(".")):
        return f"{shown!r}: '{attr[:80]}' is not a dotted attribute name"
    if any(part.startswith("_") for part in attr.split(".")):
        return f"{shown!r}: private attributes ('_...') are not importable from a config"
    if module.split(".")[0] in _STDLIB:
        return f"{shown!r}: the Python standard library is never importable from a config"
    if not is_trusted(module, tuple(trusted)):
        from cascade_ray.text import did_you_mean

        top = module.split(".")[0]
        others = [t for t in trusted if t.split(".")[0] != top]  # `mypkg.sub` trusts only a part: no misspelling
        near = did_you_mean(top, others).replace("did you mean", "trusted_modules lists")
        return f"{shown!r}: module '{module}' is not trusted (not cascade_ray, not in trusted_modules or --trust)" + (
            f"{near[:-1]}, a misspelling?" if near else ""
        )
    return None
