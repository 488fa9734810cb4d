"""Shared test fixtures. Tests import helpers from tests/support (put on sys.path here)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "support"))

from paths import CONFIGS

SLOW_DIRS = ("integration", "e2e")  # they start Ray, clusters or servers and run pipelines


def pytest_collection_modifyitems(items):
    """Every test under tests/integration and tests/e2e is ``slow``: ``pytest -m 'not slow' tests``
    runs the unit and pitfall suites only (a few minutes); CI runs everything."""
    for item in items:
        if Path(str(item.fspath)).relative_to(Path(__file__).parent).parts[0] in SLOW_DIRS:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: one intra-op thread is fastest, and stays fast on a busy shared CPU."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def digits():
    """scikit-learn's digits, split like the debug config."""
    from cascade_ray.data import load_digits

    return load_digits(train_size=None, val_fraction=0.2, seed=0)


@pytest.fixture
def debug_raw():
    """The debug config as a raw mapping (a fresh copy per test)."""
    from cascade_ray.config.yaml_io import read_yaml

    return read_yaml(CONFIGS / "debug.yaml")


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """moto's S3 server on loopback with bucket ``cascade``; its endpoint and keys are set in
    this process's environment (restored afterwards), where pyarrow, boto and the Ray
    sessions started after it pick them up."""
    from s3 import s3_in_env

    with s3_in_env(tmp_path_factory.mktemp("s3")) as server:
        yield server


@pytest.fixture(scope="session")
def script_run(tmp_path_factory):
    """The debug cascade run once, uninterrupted, by the pipeline script (``runs.DEBUG_OVERRIDES``:
    1 epoch for features and classifier, 6 for the encoder) with its own embedded Ray, which exits
    before the modules' own Ray sessions start. Shared: tests/e2e/test_scripts.py checks the run
    itself; it is the reference of the kill-and-resume tests and the `trained_run` of the tools."""
    from runs import run_debug_script

    return run_debug_script(tmp_path_factory.mktemp("script"))


@pytest.fixture(scope="session")
def trained_run(script_run):
    """A finished debug run for the tools that use one (predict, serve, export, load_cascade):
    `script_run`'s run folder (tests copy it before they write into it)."""
    return script_run.run


@pytest.fixture
def trained_run_s3(s3, trained_run):
    """`trained_run` copied to the moto S3 server: ``s3://cascade/runs/<n>/debug`` (a fresh prefix per test)."""
    import uuid

    import pyarrow.fs as pafs

    uri = f"s3://{s3.bucket}/runs/{uuid.uuid4().hex[:8]}/debug"
    pafs.copy_files(str(trained_run), uri.removeprefix("s3://"), destination_filesystem=s3.filesystem())
    return uri
