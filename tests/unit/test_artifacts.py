"""Artifacts: safetensors + manifest, atomic, verified on load."""

from __future__ import annotations

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
