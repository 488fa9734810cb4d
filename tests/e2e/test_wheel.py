"""The package as a wheel: built offline from a copy of this checkout, installed into a folder
outside it, and used from a folder where the checkout is not importable. The shipped configs
and search spaces must come with the wheel (package data), not from the source tree.

The other dependencies (torch, Ray, pydantic) come from the test's own interpreter; the
install folder goes first on sys.path (PYTHONPATH), ahead of the venv's editable install of
the checkout, and every run checks where ``cascade_ray`` was imported from.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from paths import ROOT

pytestmark = pytest.mark.slow

_NOT_SOURCE = (".git", ".venv", "venv", "build", "dist", "*.egg-info", "__pycache__", "runs", ".*_cache")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, dict[str, str], Path]:
    """(install folder, env with only it on PYTHONPATH, a working folder outside every tree)."""
    tmp = tmp_path_factory.mktemp("wheel")
    # build from a copy (symlinks kept as symlinks, like a clone): setuptools writes build/ and
    # *.egg-info into the tree it builds
    src = tmp / "src"
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(*_NOT_SOURCE))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    build = subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", tmp / "dist", src],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, (build.stdout + build.stderr)[-3000:]
    (wheel,) = (tmp / "dist").glob("cascade_ray-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "cascade_ray/shipped/configs/debug.yaml" in names and "cascade_ray/shipped/tune_spaces/encoder.yaml" in names
    site = tmp / "site"
    install = subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", "--target", site, wheel],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, (install.stdout + install.stderr)[-3000:]
    work = tmp / "work"
    (work / "home").mkdir(parents=True)
    # PYTHONPATH is the install folder alone (the test run's own points at the checkout);
    # HOME: the configs' ~/cascade-ray-runs storage probe lands in the temp folder
    env = {**os.environ, "PYTHONPATH": str(site), "HOME": str(work / "home")}
    env.pop("RAY_ADDRESS", None)
    return site, env, work


def _cli(installed, *args: str, script: bool = False) -> subprocess.CompletedProcess:
    site, env, work = installed
    cmd = [str(site / "bin" / "cascade-ray")] if script else [sys.executable, "-m", "cascade_ray.cli"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, env=env, cwd=work, timeout=300)


def test_the_installed_wheel_is_what_gets_imported(installed):
    site, env, work = installed
    where = subprocess.run(
        [sys.executable, "-c", "import cascade_ray, sys; print(cascade_ray.__file__)"],
        capture_output=True,
        text=True,
        env=env,
        cwd=work,
        timeout=120,
    )
    assert where.returncode == 0, where.stderr
    imported = Path(where.stdout.strip())
    assert imported.is_relative_to(site), f"cascade_ray imported from {imported}, not the wheel in {site}"
    assert not imported.is_relative_to(ROOT)


def test_ls_cp_validate_from_the_wheel_outside_the_checkout(installed):
    site, _, work = installed
    listed = _cli(installed, "ls")
    assert listed.returncode == 0, listed.stderr
    names = {line.split()[0]: line for line in listed.stdout.splitlines() if line and not line.startswith("(")}
    assert {"debug", "three_stage", "space/encoder", "space/classifier"} <= set(names), listed.stdout
    assert "cascade_ray/shipped/tune_spaces/encoder.yaml" in names["space/encoder"]
    assert f"(in {site};" in listed.stdout, "ls says where the installed files are"

    copied = _cli(installed, "cp", "debug", "./my.yaml")
    assert copied.returncode == 0, copied.stderr
    assert (work / "my.yaml").read_bytes() == (site / "cascade_ray" / "shipped" / "configs" / "debug.yaml").read_bytes()
    checked = _cli(installed, "validate", "./my.yaml")
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.startswith("./my.yaml: OK (3 stages: features, encoder, classifier)"), checked.stdout

    # the console script pip wrote, and a shipped name where no such file exists
    by_name = _cli(installed, "validate", "debug_joint", script=True)
    assert by_name.returncode == 0, by_name.stderr
    assert by_name.stdout.startswith(f"{site / 'cascade_ray' / 'shipped' / 'configs' / 'debug_joint.yaml'}: OK")
    unknown = _cli(installed, "validate", "debug_jiont")
    assert unknown.returncode == 2 and "did you mean 'debug_joint'?" in unknown.stderr, unknown.stderr
