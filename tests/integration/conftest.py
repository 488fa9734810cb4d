"""One Ray instance per integration-test module, 2 CPUs, tests/support importable on workers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SUPPORT = str(Path(__file__).resolve().parents[1] / "support")


@pytest.fixture(scope="module")
def ray_session():
    import ray

    from cascade_ray.constants import apply_ray_env_defaults
    from cascade_ray.pipeline.ray_token import ensure_private_token

    env = apply_ray_env_defaults()
    # workers import test-only user models (tests/support) by `module:Callable`
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [SUPPORT, os.environ.get("PYTHONPATH")]))
    # the S3 fixture's endpoint and keys, when a module uses it (workers read storage too)
    aws = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    ensure_private_token()  # as the pipeline's embedded ray.init does: no token file readable by others
    ray.init(num_cpus=2, runtime_env={"env_vars": env | aws | {"PYTHONPATH": os.environ["PYTHONPATH"]}})
    yield ray
    ray.shutdown()
