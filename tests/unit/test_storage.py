"""storage_path: local paths and pyarrow.fs URIs, artifacts on both, the multi-node rule. No network, no Ray."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pytest
from run_records import manifest_fields

from cascade_ray.errors import ArtifactError, ConfigError
from cascade_ray.pipeline.artifacts import MANIFEST, WEIGHTS, frozen_changes, read_artifact, write_artifact
from cascade_ray.pipeline.fit import unique_run_name
from cascade_ray.storage import UriPath, check_shared_storage, filesystem_type, parse_uri, storage_root


def _state():
    rng = np.random.default_rng(1)
    return {"blocks.a.w": rng.standard_normal((5, 2)).astype(np.float32), "n": np.array(3, np.int64)}


@pytest.mark.parametrize(
    ("uri", "scheme", "path", "text"),
    [
        ("s3://bucket/runs/x", "s3", "bucket/runs/x", "s3://bucket/runs/x"),
        ("gs://bucket/runs/", "gs", "bucket/runs", "gs://bucket/runs"),
        (
            "s3://bucket/runs?endpoint_override=minio:9000&scheme=http",
            "s3",
            "bucket/runs",
            "s3://bucket/runs?endpoint_override=minio:9000&scheme=http",
        ),
        ("file:///tmp/a/../runs", "file", "/tmp/runs", "file:///tmp/runs"),
        ("file://localhost/srv/runs", "file", "/srv/runs", "file:///srv/runs"),
    ],
)
def test_uris_parse_without_touching_the_network(uri, scheme, path, text):
    parsed = parse_uri(uri)
    assert (parsed.scheme, parsed.path, str(parsed)) == (scheme, path, text)
    child = parsed / "debug" / "ray"
    assert str(child).startswith(f"{scheme}://{path}/debug/ray")
    assert child.name == "ray" and child.parent.name == "debug"
    assert ("?" in text) == (child.query != ""), "query options (endpoint, region) follow every child path"


@pytest.mark.parametrize(
    ("uri", "says"),
    [("ftp://host/x", "unsupported URI scheme"), ("file://relative/x", "three slashes"), ("s3://", "names no bucket")],
)
def test_bad_uris_are_config_errors_naming_storage_path(uri, says):
    with pytest.raises(ConfigError, match="storage_path") as info:
        storage_root(uri)
    assert says in str(info.value) and info.value.exit_code == 2


def test_local_paths_become_absolute_and_plain_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    assert storage_root("runs") == tmp_path.resolve() / "runs"
    assert storage_root("~/x") == Path.home().resolve() / "x"
    assert parse_uri("/abs/path") is None and parse_uri("relative") is None


def test_relative_path_inside_a_ray_job_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")
    with pytest.raises(ConfigError, match="temporary copy of the working dir") as info:
        storage_root("runs")
    assert "absolute path" in str(info.value)
    assert storage_root(str(tmp_path / "runs")) == tmp_path / "runs"


def test_uri_path_does_what_the_pipeline_asks_of_a_folder(tmp_path):
    root = parse_uri(f"file://{tmp_path}") / "debug"
    assert not root.exists()
    (root / "summary.json").write_text('{"a": 1}')
    assert root.is_dir() and (root / "summary.json").is_file()
    assert json.loads((root / "summary.json").read_text()) == {"a": 1}
    for name in ("00-features-abc-a1", "00-features-abc-a2", "01-encoder-def-a1"):
        (root / "ray" / name).mkdir(parents=True, exist_ok=True)
    assert sorted(p.name for p in (root / "ray").glob("00-features-*")) == ["00-features-abc-a1", "00-features-abc-a2"]
    assert list((parse_uri(f"file://{tmp_path}") / "nowhere").iterdir()) == [], (
        "a missing folder lists as empty, like a fresh bucket prefix"
    )
    (root / "summary.json").unlink()
    (root / "summary.json").unlink(missing_ok=True)
    assert not (root / "summary.json").exists()


def test_unique_run_name_counts_attempts_on_uri_storage(tmp_path):
    from cascade_ray.config.schema import StageConfig

    stage = StageConfig(name="features", model={"type": "mlp", "in_features": 4, "hidden": [4]})
    ray_dir = parse_uri(f"file://{tmp_path}") / "ray"
    assert unique_run_name(ray_dir, stage, 0, "f" * 64).endswith("-a1")
    (ray_dir / f"00-features-{'f' * 12}-a1").mkdir(parents=True, exist_ok=True)
    assert unique_run_name(ray_dir, stage, 0, "f" * 64).endswith("-a2")


@pytest.fixture(params=["file", "mock"])
def uri_root(request, tmp_path):
    """A UriPath on the local filesystem via file://, and on pyarrow's in-memory mock filesystem
    (the generic, non-local code path an s3:// or gs:// run takes)."""
    if request.param == "file":
        return parse_uri(f"file://{tmp_path}")
    return UriPath("s3", "bucket/runs", fs=pafs._MockFileSystem())


def test_artifact_round_trip_on_uri_storage(uri_root):
    art = write_artifact(uri_root / "stages" / "a", _state(), manifest_fields("a"))
    assert str(art.path) == str(uri_root / "stages" / "a")
    loaded_art, loaded = read_artifact(uri_root / "stages" / "a")
    assert not frozen_changes(_state(), loaded)
    assert loaded_art.manifest.weights_sha256 == art.manifest.weights_sha256
    newer = {k: v + 1 for k, v in _state().items()}
    write_artifact(uri_root / "stages" / "a", newer, manifest_fields("a"))
    assert not frozen_changes(newer, read_artifact(uri_root / "stages" / "a")[1])
    assert sorted(p.name for p in (uri_root / "stages" / "a").iterdir()) == sorted([MANIFEST, WEIGHTS])


def test_damaged_or_half_written_uri_artifact_is_an_error(uri_root):
    path = uri_root / "stages" / "a"
    write_artifact(path, _state(), manifest_fields("a"))
    data = bytearray((path / WEIGHTS).read_bytes())
    data[-1] ^= 0xFF
    (path / WEIGHTS).write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="sha256"):
        read_artifact(path)
    (path / MANIFEST).unlink()  # what an interrupted write leaves: weights without a manifest
    with pytest.raises(ArtifactError, match="manifest.json does not exist"):
        read_artifact(path)


def test_staged_dir_lands_local_writers_files_on_any_storage(uri_root, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from cascade_ray.storage import staged_dir

    with staged_dir(uri_root / "debug") as local:
        (local / "metrics").mkdir()
        pq.write_table(pa.table({"epoch": [1, 2]}), local / "metrics" / "features.parquet")
        (local / "config.yaml").write_text("name: debug\n")
    assert (uri_root / "debug" / "config.yaml").read_text() == "name: debug\n"
    assert pq.read_table(
        pa.BufferReader((uri_root / "debug" / "metrics" / "features.parquet").read_bytes())
    ).to_pylist() == [{"epoch": 1}, {"epoch": 2}]
    with staged_dir(tmp_path / "plain") as local:
        assert local == tmp_path / "plain" and local.is_dir()


def test_artifact_accepts_a_uri_string(tmp_path):
    write_artifact(f"file://{tmp_path}/stage", _state(), manifest_fields("a"))
    assert (tmp_path / "stage" / WEIGHTS).is_file()
    assert not frozen_changes(_state(), read_artifact(f"file://{tmp_path}/stage")[1])


MOUNTS = """\
overlay / overlay rw 0 0
/dev/sda1 /home ext4 rw 0 0
server:/export /shared nfs4 rw 0 0
server:/export/deep /shared/with\\040space nfs rw 0 0
tmpfs /dev/shm tmpfs rw 0 0
/dev/fuse /mnt/odd fuse.unknownfs rw 0 0
"""


@pytest.fixture
def mounts(tmp_path):
    path = tmp_path / "mounts"
    path.write_text(MOUNTS)
    return str(path)


def test_filesystem_type_is_the_longest_matching_mount(mounts):
    assert filesystem_type(Path("/home/u/runs/not/yet"), mounts) == "ext4"
    assert filesystem_type(Path("/shared/runs"), mounts) == "nfs4"
    assert filesystem_type(Path("/shared/with space/runs"), mounts) == "nfs"
    assert filesystem_type(Path("/sharedx"), mounts) == "overlay"


def test_node_local_storage_on_a_multi_node_cluster_is_an_error_with_the_fix(mounts):
    with pytest.raises(ConfigError, match="storage_path") as info:
        check_shared_storage(Path("/home/u/runs"), hosts=3, may_add_nodes=False, mounts_file=mounts)
    text = str(info.value)
    assert "ext4" in text and "3 machines" in text and "s3://" in text and "gs://" in text
    with pytest.raises(ConfigError, match="autoscaler"):
        check_shared_storage(parse_uri("file:///home/u/runs"), hosts=1, may_add_nodes=True, mounts_file=mounts)


def test_shared_remote_or_single_node_storage_passes(mounts):
    lines = []
    check_shared_storage(Path("/shared/runs"), hosts=3, may_add_nodes=True, log=lines.append, mounts_file=mounts)
    check_shared_storage(
        parse_uri("s3://bucket/runs"), hosts=3, may_add_nodes=True, log=lines.append, mounts_file=mounts
    )
    check_shared_storage(Path("/home/u/runs"), hosts=1, may_add_nodes=False, log=lines.append, mounts_file=mounts)
    assert lines == []


def test_unknown_filesystem_on_a_multi_node_cluster_is_a_loud_warning(mounts):
    lines = []
    check_shared_storage(Path("/mnt/odd/runs"), hosts=2, may_add_nodes=False, log=lines.append, mounts_file=mounts)
    assert len(lines) == 1 and lines[0].startswith("WARNING: storage_path") and "fix:" in lines[0]


def test_several_nodes_on_one_host_are_one_machine_for_the_local_storage_check(mounts):
    from cascade_ray.pipeline.fit import count_hosts, is_local_address

    here = {"127.0.0.1", "192.0.2.2"}.__contains__  # this host's addresses, as a fake
    # local_head.sh start + add-node x2: every node reports the host's address (or loopback)
    assert count_hosts(["192.0.2.2"] * 3, here) == 1
    assert count_hosts(["192.0.2.2", "127.0.0.1", "127.0.0.1"], here) == 1
    check_shared_storage(
        Path("/home/u/runs"), hosts=count_hosts(["192.0.2.2"] * 3, here), may_add_nodes=False, mounts_file=mounts
    )
    # three machines (the driver's and two others): node-local storage is refused
    hosts = count_hosts(["192.0.2.2", "10.0.0.7", "10.0.0.8", "10.0.0.8"], here)
    assert hosts == 3
    with pytest.raises(ConfigError, match="3 machines"):
        check_shared_storage(Path("/home/u/runs"), hosts=hosts, may_add_nodes=False, mounts_file=mounts)
    # a driver on none of the nodes' machines (Ray Client): every distinct address is a machine
    assert count_hosts(["10.0.0.7", "10.0.0.8"], here) == 2
    # the real probe: loopback is this machine; TEST-NET-3 and an unparsable name are not
    assert is_local_address("127.0.0.1") and is_local_address("::1")
    assert not is_local_address("203.0.113.77") and not is_local_address("not-an-ip") and not is_local_address("")
