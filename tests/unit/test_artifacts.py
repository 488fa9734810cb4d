"""Artifacts: safetensors + manifest, atomic, verified on load."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from run_records import manifest_fields

from cascade_ray.errors import ArtifactError
from cascade_ray.pipeline.artifacts import MANIFEST, WEIGHTS, frozen_changes, read_artifact, write_artifact


def _state():
    rng = np.random.default_rng(0)
    return {
        "blocks.a.w": rng.standard_normal((4, 3)).astype(np.float32),
        "blocks.a.bn.running_mean": np.zeros(3, np.float32),
        "n": np.array(7, np.int64),
    }


def test_round_trip_is_bit_exact_and_manifest_complete(tmp_path):
    art = write_artifact(tmp_path / "stage", _state(), manifest_fields("a"))
    loaded_art, loaded = read_artifact(tmp_path / "stage")
    assert not frozen_changes(_state(), loaded)
    manifest = json.loads((tmp_path / "stage" / MANIFEST).read_text())
    assert manifest["stage"] == "a" and set(manifest["tensor_digests"]) == set(_state())
    assert manifest["weights_sha256"] == art.manifest.weights_sha256 == loaded_art.manifest.weights_sha256
    assert not list(tmp_path.glob(".*tmp*")), "no temp folder left behind"


def test_rewrite_replaces_atomically(tmp_path):
    write_artifact(tmp_path / "stage", _state(), manifest_fields("a"))
    newer = {k: v + 1 for k, v in _state().items()}
    write_artifact(tmp_path / "stage", newer, manifest_fields("a"))
    _, loaded = read_artifact(tmp_path / "stage")
    assert not frozen_changes(newer, loaded)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stage"]


@pytest.mark.parametrize("damage", ["truncate", "flip", "manifest"])
def test_damaged_artifact_is_an_error_naming_the_file(tmp_path, damage):
    write_artifact(tmp_path / "stage", _state(), manifest_fields("a"))
    weights = tmp_path / "stage" / WEIGHTS
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:-10])
    elif damage == "flip":
        data = bytearray(weights.read_bytes())
        data[-1] ^= 0xFF
        weights.write_bytes(bytes(data))
    else:
        (tmp_path / "stage" / MANIFEST).write_text("{not json")
    with pytest.raises(ArtifactError, match="stage") as info:
        read_artifact(tmp_path / "stage")
    assert "retrain" in str(info.value)


def test_frozen_changes_sees_a_single_bit():
    a = _state()
    b = {k: v.copy() for k, v in a.items()}
    b["blocks.a.w"].view(np.uint32)[0, 0] ^= 1
    assert frozen_changes(a, b) == ["blocks.a.w"]


@pytest.mark.parametrize("damage", ["header-length", "header-json", "data-bit"])
def test_a_weights_file_changed_since_written_is_named_as_changed_whatever_broke_in_it(tmp_path, damage):
    """One read hashes and parses the file; when the parse fails too, the sha256 mismatch is what
    is reported (the file changed), not the parser's complaint about what the change broke."""
    write_artifact(tmp_path / "stage", _state(), manifest_fields("a"))
    weights = tmp_path / "stage" / WEIGHTS
    data = bytearray(weights.read_bytes())
    if damage == "header-length":
        data[:8] = (2**40).to_bytes(8, "little")
    elif damage == "header-json":
        data[8] = ord("[")
    else:
        data[-1] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=f"{WEIGHTS} does not match its sha256 in {MANIFEST}; delete the folder"):
        read_artifact(tmp_path / "stage")


def test_an_artifact_on_s3_is_read_into_one_block_with_no_local_copy(s3, monkeypatch):
    """The object is read straight into the state's block and hashed as it arrives; no temporary
    download is made (local_copy is not reached), and a bit changed in it is still refused."""
    import uuid

    from cascade_ray.models.packed import PackedState
    from cascade_ray.pipeline import artifacts
    from cascade_ray.storage import as_storage

    uri = s3.uri("unit", uuid.uuid4().hex[:8], "stage")
    written = write_artifact(uri, _state(), manifest_fields("a"))

    def no_copy(path):
        raise AssertionError(f"downloaded {path}")

    monkeypatch.setattr(artifacts, "local_copy", no_copy)
    artifact, state = read_artifact(uri)
    assert type(state) is PackedState and not frozen_changes(_state(), state)
    assert artifact.manifest.weights_sha256 == written.manifest.weights_sha256
    weights = as_storage(uri) / WEIGHTS
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=f"{WEIGHTS} does not match its sha256 in {MANIFEST}"):
        read_artifact(uri)


def test_an_s3_file_the_block_cannot_view_is_downloaded_and_read_by_safetensors(s3, tmp_path):
    """A consistent artifact whose weights file is misaligned (not written by cascade-ray): the
    block reader declines it and the download goes through safetensors' reader, still verified."""
    import uuid

    from cascade_ray.models.weights import state_digests
    from cascade_ray.pipeline.records import Manifest, manifest_text, seal_manifest
    from cascade_ray.storage import as_storage

    header = (
        b'{"b":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"w":{"dtype":"F32","shape":[2],"data_offsets":[1,9]}}'
    )
    header += b" " * (-len(header) % 8)
    raw = len(header).to_bytes(8, "little") + header + bytes([3]) + np.array([1.5, -2.0], "<f4").tobytes()
    state = {"b": np.array([3], np.uint8), "w": np.array([1.5, -2.0], np.float32)}
    uri = s3.uri("unit", uuid.uuid4().hex[:8], "stage")
    write_artifact(uri, state, manifest_fields("a"))
    stage = as_storage(uri)
    (stage / WEIGHTS).write_bytes(raw)
    fields = json.loads((stage / MANIFEST).read_text())
    fields["weights_sha256"] = hashlib.sha256(raw).hexdigest()
    fields["tensor_digests"] = state_digests(state)
    (stage / MANIFEST).write_text(manifest_text(seal_manifest(Manifest.model_validate(fields))))
    _, got = read_artifact(uri)
    assert type(got) is dict and got["w"].tolist() == [1.5, -2.0] and got["b"].tolist() == [3]


def test_known_digests_are_taken_instead_of_hashing_those_entries_again(tmp_path, monkeypatch):
    from cascade_ray.pipeline import artifacts

    state = _state()
    plain = write_artifact(tmp_path / "plain", state, manifest_fields("a")).manifest
    hashed: list[list[str]] = []
    real = artifacts.state_digests
    monkeypatch.setattr(
        artifacts,
        "state_digests",
        lambda s, keys=None: hashed.append(sorted(s if keys is None else keys)) or real(s, keys),
    )
    known = {"blocks.a.w": plain.tensor_digests["blocks.a.w"], "not-in-the-state": "0" * 64}
    written = write_artifact(tmp_path / "known", state, manifest_fields("a"), known=known).manifest
    assert hashed == [["blocks.a.bn.running_mean", "n"]]  # only what was not known
    assert written.tensor_digests == plain.tensor_digests and list(written.tensor_digests) == sorted(state)
    assert written.weights_sha256 == plain.weights_sha256
    read_artifact(tmp_path / "known")  # verifies
    # a wrong digest handed in is not trusted silently: the artifact does not verify
    write_artifact(tmp_path / "wrong", state, manifest_fields("a"), known={"n": "0" * 64})
    with pytest.raises(ArtifactError, match="tensor digests differ"):
        read_artifact(tmp_path / "wrong")
