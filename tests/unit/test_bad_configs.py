"""The bad-config matrix (issue 6): every file in tests/bad_configs/ is rejected with exit 2
and its key path, before any Ray process starts and before anything is written.

Each file is ``pipelines/configs/debug.yaml`` with one mistake, and starts with what must be
reported, one line per issue the mistake causes (and no other issue may appear)::

    # expect: stages[0].solver.type | did you mean 'AdamW'

``key path | a substring of that issue's rendered text (message and fix)``; the path
``(document)`` stands for a whole-file problem (YAML syntax, top level not a mapping).
``{FIXTURES}`` inside a file is replaced by the absolute path of tests/bad_configs/fixtures/
(pretrained files must be absolute), writing the result to tmp_path.

    pytest tests/unit/test_bad_configs.py
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import ray
from paths import ROOT

from cascade_ray.checks import load_config
from cascade_ray.cli import main as cli_main
from cascade_ray.errors import ConfigError

BAD = ROOT / "tests" / "bad_configs"
FIXTURES = BAD / "fixtures"
FILES = sorted(BAD.glob("*.yaml"))
_EXPECT = re.compile(r"^# expect: (.*?) \| (.+)$", re.M)
_DOCUMENT = "(document)"
# A few kinds of mistake, run through the real entry point in a fresh interpreter.
SUBPROCESS_FILES = ("optimizer-miscased", "shape-mismatch", "pretrained-wrong-keys")


def expectations(text: str) -> list[tuple[str, str]]:
    """``[(key path, substring), ...]`` from a file's ``# expect:`` lines."""
    return [("" if path == _DOCUMENT else path, needle) for path, needle in _EXPECT.findall(text)]


def materialize(src: Path, tmp_path: Path) -> Path:
    """The file to validate: `src` itself, or a copy in tmp_path with ``{FIXTURES}`` filled in."""
    text = src.read_text()
    if "{FIXTURES}" not in text:
        return src
    out = tmp_path / src.name
    out.write_text(text.replace("{FIXTURES}", str(FIXTURES)))
    return out


def run_args(src: Path, path: Path, runs: Path) -> list[str]:
    """``run`` arguments, redirecting storage_path to `runs` unless that would repair the mistake."""
    repairs = any(p == "storage_path" for p, _ in expectations(src.read_text()))
    return ["run", str(path)] + ([] if repairs else [f"storage_path={runs}"])


@pytest.fixture
def no_ray(monkeypatch):
    """Make any attempt to start or join Ray fail the test, instead of starting it."""

    def refuse(*args, **kwargs):
        raise AssertionError("ray.init was called for a config that should have been rejected")

    monkeypatch.setattr(ray, "init", refuse)


def test_the_matrix_is_complete():
    assert len(FILES) >= 40, f"issue 6 asks for at least 40 malformed configs, found {len(FILES)}"
    names = [f.name for f in FILES]
    assert all(re.fullmatch(r"\d{2,3}-[a-z0-9-]+\.yaml", n) for n in names), names
    assert len({n.split("-")[0] for n in names}) == len(names), "duplicate NN- prefixes"
    for f in FILES:
        assert f.read_text().startswith("# expect: "), f"{f.name}: the first line must be an `# expect:` header"
        assert expectations(f.read_text()), f.name
    assert all(p.stat().st_size < 4096 for p in FIXTURES.iterdir()), "keep fixtures tiny"


@pytest.mark.parametrize("src", FILES, ids=lambda p: p.stem)
def test_rejected_with_its_key_path(src, tmp_path, capsys):
    path = materialize(src, tmp_path)
    expected = expectations(src.read_text())
    with pytest.raises(ConfigError) as info:
        load_config(path)
    found: dict[str, list[str]] = {}
    for issue in info.value.issues:
        found.setdefault(issue.path, []).append(issue.render())
    for key, needle in expected:
        assert key in found, f"{src.name}: no issue at {key or _DOCUMENT!r}; got {found}"
        assert any(needle in text for text in found[key]), f"{src.name}: {needle!r} not in {found[key]}"
    # one mistake, no follow-on noise (a dropped key reported again as missing, a bogus shape error)
    assert set(found) == {key for key, _ in expected}, f"{src.name}: unexpected issues {found}"

    capsys.readouterr()
    assert cli_main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    for key, needle in expected:
        assert (f"{key}: " if key else needle) in err, err


@pytest.mark.parametrize("src", FILES, ids=lambda p: p.stem)
def test_run_starts_no_ray_and_writes_nothing(src, tmp_path, monkeypatch, no_ray):
    path = materialize(src, tmp_path)
    runs, cwd = tmp_path / "runs", tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # a relative or empty storage_path would land here
    assert cli_main(run_args(src, path, runs)) == 2
    assert not ray.is_initialized()
    assert not runs.exists()
    assert not any(cwd.iterdir())


@pytest.mark.parametrize("stem", SUBPROCESS_FILES)
def test_cli_subprocess_exits_2_and_leaves_ray_tmpdir_empty(stem, tmp_path):
    (src,) = [f for f in FILES if f.stem.split("-", 1)[1] == stem]
    path = materialize(src, tmp_path)
    with pytest.raises(ConfigError):  # never hand a config that validates to a process that would start Ray
        load_config(path)
    ray_tmp = tempfile.mkdtemp(prefix="cr-", dir="/tmp")  # Ray's socket paths must stay < 108 bytes
    runs = tmp_path / "runs"
    try:
        env = {**os.environ, "RAY_TMPDIR": ray_tmp}
        env.pop("RAY_ADDRESS", None)
        proc = subprocess.run(
            [sys.executable, "-m", "cascade_ray.cli", *run_args(src, path, runs)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2, proc.stderr
        for key, needle in expectations(src.read_text()):
            assert f"{key}: " in proc.stderr and needle in proc.stderr, proc.stderr
        assert os.listdir(ray_tmp) == []
        assert not runs.exists()
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
