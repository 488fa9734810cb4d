"""One storage layer for every path: credentials kept out of text, files resolved on URIs, and the
reachability probe that `validate` and every run do before Ray. The S3 cases use the moto fixture."""

from __future__ import annotations

import numpy as np
import pytest
from paths import CONFIGS

from cascade_ray.checks import load_config
from cascade_ray.checks.reach import reach_issues
from cascade_ray.data.parquet import write_parquet
from cascade_ray.errors import ConfigError
from cascade_ray.storage import as_storage, full_uri, parse_uri, redact, resolve_files


@pytest.mark.parametrize(
    ("uri", "shown"),
    [
        ("s3://AKIA:s3cr3t@bucket/runs", "s3://bucket/runs"),
        ("s3://bucket/runs?access_key=AKIA&secret_key=s3cr3t&region=eu-west-1", "s3://bucket/runs?region=eu-west-1"),
        (
            "s3://bucket/runs?endpoint_override=minio:9000&session_token=tok",
            "s3://bucket/runs?endpoint_override=minio:9000",
        ),
        ("gs://bucket/runs?access_token=tok", "gs://bucket/runs"),
    ],
)
def test_credentials_stay_in_the_uri_for_pyarrow_and_out_of_its_text(uri, shown):
    path = parse_uri(uri)
    assert str(path) == shown and str(path / "a") == f"{shown.split('?')[0]}/a" + shown[len(shown.split("?")[0]) :]
    assert full_uri(path) == uri, "pyarrow and Ray get the credentials"
    assert full_uri(path / "stages").startswith(uri.split("?")[0] + "/stages"), "joined paths keep them"
    for secret in ("s3cr3t", "AKIA", "tok"):
        assert secret not in str(path / "x") and secret not in repr(path)
    assert redact(f"error: cannot read '{uri}' now") == f"error: cannot read '{shown}' now"


def test_a_bad_uri_names_the_key_it_came_from():
    with pytest.raises(ConfigError, match=r"data\.path: unsupported URI scheme 'ftp'"):
        as_storage("ftp://h/x", "data.path")


def _digits(n=20):
    rng = np.random.default_rng(0)
    return rng.random((n, 1, 8, 8), dtype=np.float32), rng.integers(0, 10, n)


@pytest.fixture(scope="module")
def parts(s3):
    x, y = _digits()
    for name in ("d/train/part-0.parquet", "d/train/sub/part-1.parquet", "d/test.parquet", "d/train/notes.txt"):
        if name.endswith(".parquet"):
            write_parquet(s3.uri("unit", name), x, y)
        else:
            as_storage(s3.uri("unit", name)).write_text("not data")
    return s3


@pytest.mark.parametrize(
    ("spec", "found"),
    [
        ("d/train", ["d/train/part-0.parquet", "d/train/sub/part-1.parquet"]),  # a prefix: every *.parquet below
        ("d/train/part-*.parquet", ["d/train/part-0.parquet"]),
        ("d/train/**/*.parquet", ["d/train/sub/part-1.parquet"]),
        ("d/test.parquet", ["d/test.parquet"]),
        ("d/none", []),
    ],
)
def test_files_resolve_the_same_way_on_s3(parts, spec, found):
    s3 = parts
    files = resolve_files(s3.uri("unit", spec))
    assert [str(f) for f in files] == [s3.uri("unit", f) for f in found]


def test_the_same_forms_resolve_locally(tmp_path):
    x, y = _digits()
    for name in ("train/part-0.parquet", "train/sub/part-1.parquet"):
        write_parquet(tmp_path / name, x, y)
    assert [p.name for p in resolve_files(tmp_path / "train")] == ["part-0.parquet", "part-1.parquet"]
    assert [p.name for p in resolve_files(f"{tmp_path}/train/**/*.parquet")] == ["part-0.parquet", "part-1.parquet"]
    assert [p.name for p in resolve_files(f"file://{tmp_path}/train/part-*.parquet")] == ["part-0.parquet"]


def _cfg(s3, *extra):
    return load_config(CONFIGS / "debug.yaml", [f"storage_path={s3.uri('probe')}", *extra])


def test_a_reachable_bucket_and_data_pass_the_probe_and_leave_nothing(parts):
    s3 = parts
    cfg = _cfg(
        s3,
        "data.source=parquet",
        f"data.path={s3.uri('unit', 'd/train')}",
        f"data.test_path={s3.uri('unit', 'd/test.parquet')}",
    )
    assert reach_issues(cfg) == []
    assert s3.keys("probe") == []


def test_a_missing_bucket_fails_naming_the_key_and_the_env_to_set(s3):
    cfg = load_config(CONFIGS / "debug.yaml", ["storage_path=s3://no-such-bucket/runs"])
    (issue,) = reach_issues(cfg)
    assert issue.path == "storage_path" and "s3://no-such-bucket/runs/debug" in issue.message
    assert "AWS_ENDPOINT_URL" in issue.fix and "AWS_ACCESS_KEY_ID" in issue.fix


def test_missing_and_unreadable_data_fail_naming_their_keys(parts):
    s3 = parts
    cfg = _cfg(
        s3,
        "data.source=parquet",
        f"data.path={s3.uri('unit', 'd/nothing')}",
        f"data.test_path={s3.uri('unit', 'd/train/notes.txt')}",
    )
    issues = {i.path: i for i in reach_issues(cfg)}
    assert "no parquet file matches" in issues["data.path"].message
    assert "cannot read" in issues["data.test_path"].message


def test_an_unreachable_endpoint_fails_without_the_secret(s3, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
    cfg = load_config(CONFIGS / "debug.yaml", [f"storage_path=s3://AKIA:s3cr3t@{s3.bucket}/runs"])
    (issue,) = reach_issues(cfg)
    assert issue.path == "storage_path" and "cannot write" in issue.message
    assert "s3cr3t" not in issue.render() and "AKIA" not in issue.render()


def test_a_local_storage_path_under_a_read_only_folder_fails(tmp_path):
    locked = tmp_path / "ro"
    locked.mkdir(mode=0o500)
    cfg = load_config(CONFIGS / "debug.yaml", [f"storage_path={locked}/runs"])
    import os

    if os.access(locked, os.W_OK):  # root ignores permissions: the probe cannot be refused here
        assert reach_issues(cfg) == []
        return
    (issue,) = reach_issues(cfg)
    assert issue.path == "storage_path" and "not writable" in issue.message


def test_doctor_probes_a_bucket_and_fails_a_missing_one(s3):
    from cascade_ray.tools.doctor import check_storage

    ((level, _, text),) = check_storage(s3.uri("doctor"))
    assert level == "ok" and "written, read back and deleted" in text and s3.keys("doctor") == []
    ((level, _, text),) = check_storage("s3://no-such-bucket/x")
    assert level == "FAIL" and "storage_path" in text and "AWS_ENDPOINT_URL" in text


def test_credentials_of_any_uri_are_left_out_of_text_and_the_command_line_as_quoted():
    """An MLflow tracking URI with user:password on the command line is quoted in error messages and in a
    sweep's best.yaml: the credentials never are (storage URIs kept their own rules above)."""
    from cascade_ray.cli import as_typed

    assert redact("at https://me:pw@mlflow.internal:5000/x now") == "at https://mlflow.internal:5000/x now"
    assert redact("http://mlflow.internal:5000") == "http://mlflow.internal:5000"
    typed = as_typed("debug", ["loggers.mlflow.tracking_uri=https://me:pw@h/x", "storage_path=s3://AK:SK@b/r"])
    assert "pw" not in typed and "SK" not in typed and typed.startswith("debug loggers.mlflow.tracking_uri=https://h/x")
    assert as_typed("debug", ["seed=3"]) == "debug seed=3"


def test_the_runs_config_yaml_holds_no_credential_of_any_uri(tmp_path):
    from cascade_ray.checks import load_config
    from cascade_ray.pipeline.outputs import CONFIG_FILE, write_config

    cfg = load_config(
        CONFIGS / "debug.yaml",
        [
            "storage_path=s3://AKIA:s3cr3t@bucket/runs",
            "loggers.mlflow={tracking_uri: 'https://me:pw0rd@mlflow.internal/', experiment: x}",
        ],
    )
    write_config(tmp_path, cfg)
    text = (tmp_path / CONFIG_FILE).read_text()
    assert "s3://bucket/runs" in text and "https://mlflow.internal/" in text
    assert not any(secret in text for secret in ("s3cr3t", "AKIA", "pw0rd"))
