"""docs/reliability.md's counts are the matrices' own sizes, counted from the test files.

Each count row of the document's table names its sources (``path::NAME`` for a module-level
list/dict literal, ``path/*.yaml`` for a folder of case files, ``path::TABLE`` for the
faults covered elsewhere and listed in test_faults.py's docstring); this test recounts them and
checks every test the faults table names exists.
"""

from __future__ import annotations

import ast
import re

from paths import ROOT

DOC = ROOT / "docs" / "reliability.md"
# | category | cases | sources | (the sources cell: comma-separated `...` references)
_ROW = re.compile(r"^\| \*\*(?P<category>[^*]+)\*\* \| (?P<count>\d+) \| (?P<sources>.+?) \|", re.M)
_REF = re.compile(r"`([^`]+)`")
_TABLE_TEST = re.compile(r"^\S.*?\s{2,}(tests/\S+\.py)::(test_\w+)$", re.M)


def _literal_size(path: str, name: str) -> int:
    tree = ast.parse((ROOT / path).read_text())
    for node in tree.body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            value = node.value
            if isinstance(value, (ast.List, ast.Tuple)):
                return len(value.elts)
            if isinstance(value, ast.Dict):
                return len(value.keys)
            raise AssertionError(f"{path}::{name} is not a list, tuple or dict literal")
    raise AssertionError(f"{path} has no module-level {name}")


def _elsewhere(path: str) -> list[tuple[str, str]]:
    """(file, test) of every fault row in a module docstring's table that points to another file."""
    return _TABLE_TEST.findall(ast.get_docstring(ast.parse((ROOT / path).read_text())) or "")


def _count(ref: str) -> int:
    if ref.endswith("/*.yaml"):
        return len(list((ROOT / ref[: -len("/*.yaml")]).glob("*.yaml")))
    path, _, name = ref.partition("::")
    if name == "TABLE":
        return len(_elsewhere(path))
    return _literal_size(path, name)


def _rows() -> list[tuple[str, int, list[str]]]:
    rows = [(m["category"], int(m["count"]), _REF.findall(m["sources"])) for m in _ROW.finditer(DOC.read_text())]
    assert rows, "docs/reliability.md has no count table"
    return rows


def test_every_count_in_the_document_is_the_size_of_its_matrix():
    for category, count, sources in _rows():
        assert sources, category
        measured = sum(_count(ref) for ref in sources)
        assert measured == count, f"{category}: the document says {count}, the tests hold {measured} ({sources})"


def test_the_matrix_reaches_the_sizes_the_issue_asks_for():
    counts = {category: count for category, count, _ in _rows()}
    assert counts["Malformed configs"] >= 100
    assert counts["Malformed data"] >= 30
    assert counts["Tampered artifacts, caches and manifests"] >= 15
    assert counts["Faults"] >= 6


def test_the_faults_covered_elsewhere_are_real_tests():
    listed = _elsewhere("tests/e2e/test_faults.py")
    assert listed
    for path, test in listed:
        assert re.search(rf"^def {test}\(", (ROOT / path).read_text(), re.M), f"{path}::{test} does not exist"
