"""The package's layers hold: every internal import points down (or within its layer), and no
import cycle exists. Function-level imports count like module-level ones.

The order, bottom to top, is written at the top of docs/architecture.md; this test is its
source of truth. A new module lands in the layer of the longest prefix below.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "cascade_ray"

# bottom to top; a module may import its own layer or any layer below it
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "leaves",
        (
            "cascade_ray",
            "cascade_ray.errors",
            "cascade_ray.constants",
            "cascade_ray.text",
            "cascade_ray.options",
            "cascade_ray.hardware",
            "cascade_ray.ray_compat",
            "cascade_ray.logs",
        ),
    ),
    ("config", ("cascade_ray.config",)),
    (
        "models, data, storage",
        ("cascade_ray.models", "cascade_ray.data", "cascade_ray.storage", "cascade_ray.storage_lock"),
    ),
    ("solver", ("cascade_ray.solver",)),
    ("tracking", ("cascade_ray.tracking",)),
    ("checks", ("cascade_ray.checks",)),
    ("stage", ("cascade_ray.stage",)),
    ("pipeline", ("cascade_ray.pipeline",)),
    ("tune", ("cascade_ray.tune",)),
    ("tools", ("cascade_ray.tools",)),
    ("api", ("cascade_ray.api",)),
    ("cli", ("cascade_ray.cli",)),
]

# (importer, imported): why this upward or cyclic import is allowed. Keep it short.
EXCEPTIONS: dict[tuple[str, str], str] = {}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def internal_imports(path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """Every ``cascade_ray`` module this file imports (at any depth, functions included), with its line."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "cascade_ray"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "cascade_ray":
                continue
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{target}.{alias.name}"
                found.append((sub if sub in modules else target, node.lineno))
    return found


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            exact_only = prefix == "cascade_ray"
            hit = module == prefix or (not exact_only and module.startswith(prefix + "."))
            if hit and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add its prefix to LAYERS in {__file__}")
    return best


def import_graph() -> dict[str, list[tuple[str, int]]]:
    modules = all_modules()
    return {name: internal_imports(path, modules) for name, path in modules.items()}


def upward_imports(graph: dict[str, list[tuple[str, int]]]) -> list[str]:
    out: list[str] = []
    for importer, targets in graph.items():
        for target, line in dict(reversed(targets)).items():  # one line per imported module (its first)
            if (importer, target) in EXCEPTIONS:
                continue
            low, high = layer_of(importer), layer_of(target)
            if high > low:
                out.append(
                    f"{importer} (line {line}, layer {LAYERS[low][0]!r}) imports {target} "
                    f"(layer {LAYERS[high][0]!r}, above it)"
                )
    return sorted(out)


def import_cycles(graph: dict[str, list[tuple[str, int]]]) -> list[list[str]]:
    """Every elementary cycle found by a depth-first search (each reported once, by its smallest rotation)."""
    edges = {
        m: sorted({t for t, _ in ts if t in graph and t != m and (m, t) not in EXCEPTIONS}) for m, ts in graph.items()
    }
    cycles: set[tuple[str, ...]] = set()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in edges[node]:
            if state.get(nxt) == 1:
                cyc = stack[stack.index(nxt) :]
                k = cyc.index(min(cyc))
                cycles.add(tuple(cyc[k:] + cyc[:k]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    return [list(c) for c in sorted(cycles)]


def test_every_module_has_a_layer():
    for name in all_modules():
        layer_of(name)


def test_no_import_points_up():
    problems = upward_imports(import_graph())
    assert not problems, "imports against the layer order (docs/architecture.md):\n" + "\n".join(problems)


def test_no_import_cycle():
    cycles = import_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c + [c[0]]) for c in cycles)


def test_exceptions_are_still_needed():
    graph = import_graph()
    edges = {(m, t) for m, ts in graph.items() for t, _ in ts}
    stale = [f"{a} -> {b}" for a, b in EXCEPTIONS if (a, b) not in edges]
    assert not stale, "EXCEPTIONS lists imports that no longer exist: " + ", ".join(stale)


@pytest.mark.parametrize(
    "importer, target, kind",
    [
        ("cascade_ray.solver.optim", "cascade_ray.checks", "up"),
        ("cascade_ray.config.loader", "cascade_ray.config.yaml_io", "cycle"),
    ],
)
def test_the_checks_catch_a_planted_violation(importer, target, kind):
    """The detectors themselves work: an upward import and a cycle planted into the real graph are found."""
    graph = import_graph()
    graph[importer] = [*graph[importer], (target, 0)]
    if kind == "up":
        assert any(p.startswith(importer) and target in p for p in upward_imports(graph))
    else:
        graph[target] = [*graph[target], (importer, 0)]
        assert any(importer in c and target in c for c in import_cycles(graph))
