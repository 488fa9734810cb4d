"""The serving rules that need no Ray: request parsing before the model, reload compatibility,
the replica config's strictness, the pinned deployment version, pointers and run paths."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

pytest.importorskip("ray.serve")  # the `serve` extra; CI installs it with `test`

from cascade_ray.errors import CascadeError
from cascade_ray.tools.inference import InputError
from cascade_ray.tools.serve import ServeConfig, build_app, incompatibility, parse_inputs
from cascade_ray.tools.serve_control import read_pointer, run_location

SERVING = {"run": "/runs/a", "pipeline": "debug", "input_shape": [1, 8, 8], "target_kind": "class", "out_width": 10}


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"[1, 2]", "JSON object"),
        (b"\xff\xfe", "not JSON"),
        (b'{"input": [[1]]}', "did you mean 'inputs'"),
        (b'{"inputs": "abc"}', "non-empty list"),
        (json.dumps({"inputs": [[0]] * 9}).encode(), "at most 8"),
    ],
)
def test_a_body_is_refused_before_the_model_sees_it(body, reason):
    with pytest.raises(InputError, match=reason):
        parse_inputs(body, cascade=None, max_rows=8)  # never reaches the model's own checks


def test_one_flat_row_is_one_row_however_small_max_rows_is():
    """``{"inputs": [64 numbers]}`` is one row of the (1, 8, 8) model, not 64 rows over --max-rows."""
    from types import SimpleNamespace

    import torch

    cascade = SimpleNamespace(
        spec=SimpleNamespace(input_shape=(1, 8, 8)), check_inputs=lambda v: torch.zeros(len(v) // 64, 1, 8, 8)
    )
    assert parse_inputs(json.dumps({"inputs": [0.5] * 64}).encode(), cascade, max_rows=1).shape == (1, 1, 8, 8)
    with pytest.raises(InputError, match="a list of 130 numbers; one flat row takes exactly 64"):
        parse_inputs(json.dumps({"inputs": [0.5] * 130}).encode(), cascade, max_rows=2)


def test_only_a_newer_run_of_the_same_pipeline_and_spec_may_replace_the_served_one():
    assert incompatibility(SERVING, {**SERVING, "run": "/runs/b", "fingerprint": "x"}) is None
    for key, value in [("pipeline", "tabular"), ("input_shape", [30]), ("target_kind", "regression"), ("out_width", 2)]:
        why = incompatibility(SERVING, {**SERVING, "run": "/runs/b", key: value})
        assert why and key in why and "/runs/b" in why and "--name" in why


def test_the_replica_config_is_strict():
    with pytest.raises(ValidationError, match="max_batch"):
        ServeConfig.model_validate({"run": "/r", "max_batch": 3})
    with pytest.raises(ValidationError, match="max_batch_size"):
        ServeConfig.model_validate({"run": "/r", "max_batch_size": "32"})
    with pytest.raises(ValidationError, match="max_rows"):
        ServeConfig.model_validate({"run": "/r", "max_rows": 0})
    assert ServeConfig.model_validate(ServeConfig(run="/r").model_dump()) == ServeConfig(run="/r")


def test_every_deploy_of_the_app_has_the_same_version_so_a_reload_reconfigures():
    first = build_app(ServeConfig(run="/a", replicas=2, max_batch_size=50))
    second = build_app(ServeConfig(run="/b", replicas=2, max_batch_size=50))
    a, b = first._bound_deployment, second._bound_deployment
    assert a.version == b.version and a.version.startswith("cascade-ray-serve-")
    assert a.user_config["run"] == "/a" and b.user_config["run"] == "/b"
    assert a.num_replicas == 2 and a.max_ongoing_requests == 100  # room for batches to fill


def test_a_pointer_names_a_run_and_local_runs_become_absolute(tmp_path, monkeypatch):
    pointer = tmp_path / "LATEST"
    pointer.write_text("\n  s3://bucket/runs/v2  \n")
    assert read_pointer(str(pointer)) == "s3://bucket/runs/v2"
    pointer.write_text("\n")
    with pytest.raises(CascadeError, match="empty"):
        read_pointer(str(pointer))
    monkeypatch.chdir(tmp_path)
    assert run_location("runs/debug") == str(tmp_path / "runs" / "debug")
    assert run_location("s3://bucket/runs/debug") == "s3://bucket/runs/debug"


def test_the_serve_command_parses_its_flags():
    from cascade_ray.cli import build_parser, parse_args

    args = parse_args(build_parser(), ["serve", "/runs/a", "--port", "9000", "--replicas", "2"])
    assert (args.run, args.port, args.replicas, args.host, args.reload) == ("/runs/a", 9000, 2, "127.0.0.1", None)
    args = parse_args(build_parser(), ["serve", "--reload", "/runs/b", "--address", "127.0.0.1:6379"])
    assert args.run is None and args.reload == "/runs/b"


def test_the_printed_reload_line_carries_what_a_token_auth_cluster_needs():
    """A client joins a cluster with token auth only with RAY_AUTH_MODE=token (and finds the token where
    the server found it): the reload line serve prints says so, so it runs as printed in another shell."""
    from cascade_ray.tools.serve_control import Serving, token_auth

    assert token_auth(True, {}) and token_auth(True, {"RAY_AUTH_MODE": "token"})  # Ray's default for ray.init()
    assert not token_auth(True, {"RAY_AUTH_MODE": "disabled"}) and not token_auth(False, {})
    assert token_auth(False, {"RAY_AUTH_MODE": "TOKEN"})  # joined a cluster with auth: it has it
    on = Serving("http://127.0.0.1:8000", "cascade", "127.0.0.1:6379", True, {}, token_auth=True)
    assert on.reload_command({}) == (
        "RAY_AUTH_MODE=token cascade-ray serve --reload NEW_RUN --name cascade --address 127.0.0.1:6379"
    )
    assert on.reload_command({"RAY_AUTH_TOKEN_PATH": "/my tokens/t"}).startswith(
        "RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH='/my tokens/t' cascade-ray serve --reload"
    )
    assert on.reload_command({"RAY_AUTH_TOKEN": "s3cret"}).endswith("# with this shell's RAY_AUTH_TOKEN")
    assert "s3cret" not in on.reload_command({"RAY_AUTH_TOKEN": "s3cret"})
    off = Serving("http://127.0.0.1:8000", "cascade", "127.0.0.1:6379", False, {}, token_auth=False)
    assert off.reload_command({}).startswith("cascade-ray serve --reload NEW_RUN")


def test_a_busy_port_fails_before_ray_and_the_run(monkeypatch, tmp_path):
    """Told with the option and the fix before the run is read or a Ray starts (it was ~100 lines of
    Serve's controller and proxy tracebacks)."""
    import socket

    import ray

    from cascade_ray.errors import ConfigError
    from cascade_ray.tools.serve_control import start_serving

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(
            ConfigError, match=rf"--port: 127\.0\.0\.1:{port} cannot be listened on(.|\n)*fix: pass --port"
        ):
            start_serving(str(tmp_path / "no-run"), port=port)  # no run there: the port is checked first


def test_a_cluster_that_cannot_be_joined_names_token_auth_or_the_address():
    from cascade_ray.pipeline.ray_token import unreachable_cluster

    plain = unreachable_cluster("10.0.0.1:6379", ConnectionError("Failed to connect"), {}).render()
    assert "no Ray cluster could be joined at 10.0.0.1:6379 (Failed to connect)" in plain
    assert "set RAY_AUTH_MODE=token here" in plain and "ray status --address 10.0.0.1:6379" in plain
    token = unreachable_cluster("10.0.0.1:6379", ConnectionError("x"), {"RAY_AUTH_MODE": "token"}).render()
    assert "set RAY_AUTH_MODE" not in token and "has its token" in token
